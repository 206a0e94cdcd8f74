"""Hosts emulated in network namespaces on one Linux bridge, and everything started in them.

Why: processes of one machine share one network stack, so a job on loopback never crosses a link.
Here each host is a namespace of its own whose traffic crosses a veth pair that can be capped,
counted, cut or impaired, with no second machine: the emulated-host tests (tests/hosts/) and
`poseidon bench`'s part g (tools/bench/hosts_part.py) run their jobs on it.

Layout: one namespace holds the bridge; each host is a namespace with one interface, `eth0`, at
10.77.0.(i+1)/24, joined to the bridge by a veth pair, or (an impaired host) by two tap devices
that forwarder.py copies frames between, dropping, delaying and reordering them. Nothing is
configured in the machine's own network namespace beyond creating these: the addresses and routes
exist only inside them, so no traffic started here can leave them. IPv6 is off on every link, so
the counters see the job's IPv4 traffic and nothing else.

Counters: every link has a root qdisc on both ends, `pfifo` (counting only) or `tbf` (a rate cap),
so `tc -s` gives what a host sent (its eth0) and what it received (the bridge port's egress) in
bytes and packets. tc counts a segmentation-offloaded skb as its segments, with each segment's
headers, so bytes minus packets times the per-packet headers is the TCP payload that crossed
(`ip -s link` counts such an skb as one packet, which is why its counts are not used).

Clean-up (close(), the `with` block's end, and atexit as a last resort): every process started
here is killed by process group, then anything still inside a namespace of this network (mpirun's
daemons, a child that left its group) by pid, the forwarders are told to stop, and every
namespace is deleted, which deletes its links and the bridge. Namespaces left by a run that was
itself killed are swept at the next start (their names carry the pid that made them).

Needs root and iproute2 (`why_unavailable()` says what is missing). Every wait here is bounded in
time; every loop in count or time.
"""
import atexit
import contextlib
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "pzh"                 # namespaces made here: pzh<pid>n<k>-..., swept when pid is dead
SUBNET = "10.77.0"             # a /24 that exists only inside the namespaces
DEV = "eth0"                   # each host's one interface
COMMAND_TIMEOUT_S = 20.0       # one ip / tc command
READY_TIMEOUT_S = 20.0         # a forwarder creating its tap devices
STOP_TIMEOUT_S = 10.0          # a process told to stop
FORWARDER = Path(__file__).with_name("forwarder.py")
_counter = itertools.count()
_open = set()                  # networks not yet closed (atexit closes them)


def sh(argv, check=True, timeout=COMMAND_TIMEOUT_S):
    """Run a command; its stdout, or RuntimeError with its stderr when it fails and check."""
    r = subprocess.run([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))}: {r.stderr.decode().strip()}")
    return r.stdout.decode()


def why_unavailable():
    """None when this machine can make the namespaces, else why not (the skip reason)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulated hosts need root to create network namespaces (CI runs as root)"
    missing = [t for t in ("ip", "tc", "ss") if shutil.which(t) is None]
    if missing:
        return f"emulated hosts need iproute2 ({', '.join(missing)} not found)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        sh(["ip", "netns", "add", probe])
        sh(["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"cannot create a network namespace with a veth pair here: {e}"
    finally:
        sh(["ip", "netns", "del", probe], check=False)
    return None


def sweep_stale():
    """Delete namespaces (and kill what runs in them) left by runs whose process is gone."""
    for name in _namespaces():
        m = re.match(rf"{PREFIX}(\d+)", name)
        if m and not _alive(int(m.group(1))):
            _kill_inside(name)
            sh(["ip", "netns", "del", name], check=False)


def _namespaces():
    out = sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:                                   # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def pids_in(namespace):
    """The living processes inside a namespace (`ip netns pids`)."""
    out = sh(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in out.split() if p.isdigit() and _alive(int(p))]


def _kill_inside(namespace, rounds=5):
    for _ in range(rounds):
        pids = pids_in(namespace)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def tcp_payload(counter, header):
    """The TCP payload in a tc counter (bytes, segments) whose segments carry `header` bytes of
    headers each (Network.tcp_header_bytes); pure ACKs count as headers alone."""
    total, segments = counter
    return total - segments * header


def tbf_rate(bytes_per_second):
    """tc's text for a rate given in bytes per second ('125000000bit' for 1 Gbit/s): whole bits,
    so that a cap read by dist/transport/bandwidth.parse_bandwidth reaches tc unchanged."""
    return f"{int(round(bytes_per_second * 8))}bit"


def available_qdiscs(namespace, dev):
    """{kind: bool} for tbf, htb and netem: whether this kernel lets us add it (tried on dev)."""
    tries = {"tbf": ["tbf", "rate", "1gbit", "burst", "64kb", "latency", "50ms"],
             "htb": ["handle", "1:", "htb"], "netem": ["netem", "delay", "1ms"]}
    found = {}
    for kind, args in tries.items():
        r = subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", dev,
                            "root", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=COMMAND_TIMEOUT_S)
        found[kind] = r.returncode == 0
        sh(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", dev, "root"],
           check=False)
    return found


@dataclass
class Impairment:
    """What forwarder.py does to an impaired host's frames, in each direction."""
    loss: float = 0.0          # probability an IPv4 frame is dropped
    delay_ms: float = 0.0      # every frame
    jitter_ms: float = 0.0     # plus a uniform 0..jitter
    reorder: float = 0.0       # probability a frame is held hold_ms more (later ones overtake it)
    hold_ms: float = 0.0
    seed: int = 1

    def args(self):
        return ["--loss", self.loss, "--delay-ms", self.delay_ms, "--jitter-ms", self.jitter_ms,
                "--reorder", self.reorder, "--hold-ms", self.hold_ms, "--seed", self.seed]


@dataclass
class Host:
    index: int
    name: str                  # its namespace
    address: str
    port: str                  # its link's end on the bridge (in the bridge's namespace)
    forwarder: object = None   # the forwarder's Popen for an impaired host


class Network:
    """N hosts on one bridge. Use as a context manager (or call close())."""

    def __init__(self, count, impaired=None, seconds=300):
        self.tag = f"{PREFIX}{os.getpid()}n{next(_counter)}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts = []
        self.processes = []                  # (host, Popen) of everything spawned
        self.seconds = seconds               # the forwarders' own deadline
        self.qdiscs = None
        self.closed = False
        _open.add(self)
        try:
            sweep_stale()
            self._make_bridge()
            for i in range(count):
                self.add_host((impaired or {}).get(i))
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----- building ------------------------------------------------------------------------------
    def _make_namespace(self, name):
        sh(["ip", "netns", "add", name])
        sh(["ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1"])
        sh(["ip", "-n", name, "link", "set", "lo", "up"])

    def _make_bridge(self):
        self._make_namespace(self.bridge_ns)
        sh(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
        sh(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
        self.qdiscs = available_qdiscs(self.bridge_ns, "br0")

    def add_host(self, impairment=None):
        """A new host on the bridge (an impaired one through a forwarder); returns its Host."""
        i = len(self.hosts)
        host = Host(i, f"{self.tag}-h{i}", f"{SUBNET}.{i + 1}", f"{self.tag}p{i}")
        self.hosts.append(host)
        self._make_namespace(host.name)
        if impairment is None:
            sh(["ip", "-n", host.name, "link", "add", DEV, "type", "veth", "peer", "name",
                host.port, "netns", self.bridge_ns])
        else:
            inner = f"{self.tag}i{i}"
            host.forwarder = self._forwarder(host.port, inner, impairment)
            sh(["ip", "-n", self.bridge_ns, "link", "set", inner, "netns", host.name])
            sh(["ip", "-n", host.name, "link", "set", inner, "name", DEV])
        sh(["ip", "-n", self.bridge_ns, "link", "set", host.port, "master", "br0"])
        sh(["ip", "-n", self.bridge_ns, "link", "set", host.port, "up"])
        sh(["ip", "-n", host.name, "addr", "add", f"{host.address}/24", "dev", DEV])
        sh(["ip", "-n", host.name, "link", "set", DEV, "up"])
        self.cap(host, None)
        return host

    def _forwarder(self, outer, inner, impairment):
        """Start forwarder.py in the bridge's namespace; it makes the two taps and says ready."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.bridge_ns, sys.executable,
                                 str(FORWARDER), "--outer", outer, "--inner", inner,
                                 "--seconds", str(self.seconds), *map(str, impairment.args())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
        line = proc.stdout.readline().decode() if ready else ""
        if line.strip() != "ready":
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
            raise RuntimeError(f"the forwarder did not start: {line or 'no answer'}"
                               f"{proc.stdout.read().decode()}")
        return proc

    def stop_forwarder(self, host):
        """Stop an impaired host's forwarder (its link then goes dead); its counts as a dict."""
        proc, host.forwarder = host.forwarder, None
        if proc is None:
            return None
        try:             # communicate() closes its input: the forwarder's signal to stop
            out = proc.communicate(timeout=STOP_TIMEOUT_S)[0].decode()
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out = proc.communicate()[0].decode()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else None

    # ----- links ---------------------------------------------------------------------------------
    def _tc(self, namespace, *args, check=True):
        return sh(["ip", "netns", "exec", namespace, "tc", *args], check=check)

    def _ends(self, host):
        """(namespace, device) of a link's two egresses: the host's and the bridge port's."""
        return [(host.name, DEV), (self.bridge_ns, host.port)]

    def cap(self, host, rate, burst="64kb", latency="200ms"):
        """Cap a host's link to `rate` ('100mbit') both ways with tbf; None: no cap (pfifo, which
        only counts). Counters start again from zero."""
        for namespace, dev in self._ends(host):
            args = (["tbf", "rate", rate, "burst", burst, "latency", latency] if rate else
                    ["pfifo", "limit", "10000"])
            self._tc(namespace, "qdisc", "replace", "dev", dev, "root", *args)

    def counters(self, host):
        """What crossed a host's link since its qdiscs were set, from `tc -s`: {'sent': (bytes,
        packets), 'received': (bytes, packets), 'drops': packets the qdiscs dropped}."""
        got = {"drops": 0}
        for (namespace, dev), way in zip(self._ends(host), ("sent", "received")):
            stats = json.loads(self._tc(namespace, "-s", "-j", "qdisc", "show", "dev", dev))
            root = [q for q in stats if q.get("root")][0]
            got[way] = (root["bytes"], root["packets"])
            got["drops"] += root.get("drops", 0)
        return got

    def payload(self, host):
        """The TCP payload that crossed a host's link each way since its qdiscs were set:
        {'sent': bytes, 'received': bytes} (counters() less every segment's headers)."""
        got, header = self.counters(host), self.tcp_header_bytes(host)
        return {way: tcp_payload(got[way], header) for way in ("sent", "received")}

    def tcp_retransmits(self, host):
        """Segments the host's TCP sent again (RetransSegs of its namespace's /proc/net/snmp)."""
        rows = [line.split() for line in sh(["ip", "netns", "exec", host.name, "cat",
                                             "/proc/net/snmp"]).splitlines()
                if line.startswith("Tcp:")]
        return int(rows[1][rows[0].index("RetransSegs")])

    def cut(self, host):
        sh(["ip", "-n", host.name, "link", "set", DEV, "down"])

    def restore(self, host):
        sh(["ip", "-n", host.name, "link", "set", DEV, "up"])

    def tcp_header_bytes(self, host):
        """Ethernet + IPv4 + TCP header bytes of a segment from this host (TCP timestamps add 12
        to the TCP header; Linux turns them on by default)."""
        stamps = sh(["ip", "netns", "exec", host.name, "sysctl", "-n", "net.ipv4.tcp_timestamps"])
        return 14 + 20 + 20 + (12 if stamps.strip() != "0" else 0)

    def listening(self, host):
        """The TCP ports listening in a host's namespace (`ss -ltn`), as tcp://ADDR:PORT."""
        out = sh(["ip", "netns", "exec", host.name, "ss", "-Hltn"])
        found = []
        for line in out.splitlines():
            cols = line.split()
            if len(cols) >= 4 and cols[3].startswith(host.address + ":"):
                found.append(f"tcp://{cols[3]}")
        return found

    # ----- processes -----------------------------------------------------------------------------
    def spawn(self, host, argv, log, env=None, cwd=None):
        """Start argv inside the host's namespace, in a process group of its own, its output to
        the file `log`. Returns the Popen (its pid is the program's: ip execs it)."""
        out = open(log, "wb")
        try:
            proc = subprocess.Popen(["ip", "netns", "exec", host.name, *map(str, argv)],
                                    stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                    start_new_session=True)
        finally:
            out.close()
        self.processes.append((host, proc))
        return proc

    def namespace_of(self, pid):
        """The host whose namespace process pid runs in (None: another one)."""
        try:
            mine = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return None
        for host in self.hosts:
            if os.stat(f"/run/netns/{host.name}").st_ino == mine:
                return host
        return None

    def leftover(self):
        """{host name: pids} of processes still running in any host's namespace."""
        return {h.name: pids_in(h.name) for h in self.hosts if pids_in(h.name)}

    def close(self):
        """Kill every process, stop the forwarders, delete every namespace. Idempotent."""
        if self.closed:
            return
        self.closed = True
        _open.discard(self)
        for _, proc in self.processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for _, proc in self.processes:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        for host in self.hosts:
            _kill_inside(host.name)
            if host.forwarder is not None:
                self.stop_forwarder(host)
        _kill_inside(self.bridge_ns)
        for name in [h.name for h in self.hosts] + [self.bridge_ns]:
            sh(["ip", "netns", "del", name], check=False)


@contextlib.contextmanager
def sigterm_as_exit():
    """Inside the block, SIGTERM (what `kill` and a CI's timeout send) raises SystemExit in the
    main thread, so the `with Network(...)` blocks it unwinds close their networks and atexit
    runs; its default action would end the process with no clean-up at all. A no-op off the
    main thread, where Python cannot set a handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@atexit.register
def _close_all():
    for network in list(_open):
        network.close()
