"""Authenticated cluster traffic: strangers get nothing and change nothing; the key file; binding.

- A job runs (roles as threads, CURVE with the job's keys); clients without the keys (a plain
  socket, and a CURVE client with another key pair that knows the job's public key) connect to
  EVERY port of it (the coordinator and each inbox) and send well-formed messages (registration,
  push, abort, heartbeat, sufficient factors): no message is accepted (the transports' counters by
  type are exactly those of the job itself), every stranger's handshake is refused, and the
  trained parameters are bitwise those of an undisturbed run.
- `poseidon keys FILE` writes a 0600 file; a missing, open, malformed or mixed key file, and a
  multi-host job without keys, give one clear line.
- A local job (the launcher) listens on 127.0.0.1 only.

Run: python -m pytest tests/dist/test_security.py -q -s
"""
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy
import pytest
import zmq
import zmq.utils.monitor  # noqa: F401  (recv_monitor_message)

from poseidon.dist.job import security
from poseidon.dist.errors import DistError

from .gated import run_gated
from .strangers import Stranger
from .helpers import fc_net, make_lmdb, solver_param

ROOT = Path(__file__).resolve().parents[2]
P1, P2, CHUNKS = 2, 1, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("sec") / "train_lmdb", n=64)


def initial_weights(param, path):
    from poseidon.engine.solvers import get_solver
    solver = get_solver(param, dtype=numpy.float64)
    solver.net.save(str(path))
    solver.net.shutdown()
    return str(path)


def test_strangers_connect_to_every_port_and_nothing_is_accepted(data, tmp_path):
    param = solver_param(fc_net(data, 8), max_iter=8)
    weights = initial_weights(param, tmp_path / "init.caffemodel")
    keys = security.make_keys()
    want, quiet = run_gated(param, P1, P2, CHUNKS, keys=keys, weights=weights)

    stranger = Stranger(keys.public)
    left = []

    def gate(chunk, sessions):
        """Worker 0, after the first chunk (the job is live, worker 1 waits on it): attack."""
        if chunk != 1 or threading.current_thread().name != "role-0":
            return
        ports = [(sessions[0].options.coordinator, True)]
        ports += [(s.transport.address, False) for s in sessions.values()]
        for address, coordinator in ports:
            stranger.connect(address, coordinator)
            stranger.raw(address)
        stranger.send_all()
        left.extend(stranger.refused_everywhere())
        stranger.send_all()

    try:
        got, sessions_ = run_gated(param, P1, P2, CHUNKS, gate=gate, keys=keys, weights=weights)
    finally:
        stranger.close()
    assert not left, f"no refused handshake seen on: {left}"
    ports = 1 + P1 + P2
    assert len(stranger.sockets) == 2 * ports

    # nothing accepted: the counts by type are exactly those of the undisturbed run
    for rank, s in sessions_.items():
        c, q = s.transport.counters(), quiet[rank].transport.counters()
        for name in ("ABORT", "KV_PUSH", "SF", "REGISTER", "KV_VALUE", "BOOK"):
            assert c["received_by_type"].get(name, 0) == q["received_by_type"].get(name, 0), \
                (rank, name, c["received_by_type"], q["received_by_type"])
        assert c["refused_connections"] >= 1, (rank, c)      # the other-key client, refused
        assert c["dropped_messages"] == 0
    coord = sessions_[0].coordinator.transport.counters()
    coord_quiet = quiet[0].coordinator.transport.counters()
    assert coord["received_by_type"].get("REGISTER") == P1 + P2
    assert coord["received_by_type"].get("ABORT", 0) == 0
    assert coord["received_by_type"].get("KV_PUSH", 0) == 0
    assert coord["refused_connections"] >= 1
    assert coord["dropped_messages"] == coord_quiet["dropped_messages"] == 0
    server = sessions_[P1].transport.counters()["received_by_type"]
    pushes = P1 * len(sessions_[0].book.bundles_on_server(0)) * param.max_iter
    assert server.get("KV_PUSH") == pushes
    for a, b in zip(got, want):
        numpy.testing.assert_array_equal(a, b)
    refused = sum(s.transport.counters()["refused_connections"] for s in sessions_.values())
    assert stranger.raw_closed == ports
    print(f"\n{len(stranger.sockets)} stranger ZeroMQ sockets (plain, other keys) and {ports} raw "
          f"TCP clients on {ports} ports (coordinator + {P1 + P2} inboxes), "
          f"{stranger.attempted} well-formed messages tried: 0 accepted, every raw connection "
          f"closed by the job; {refused + coord['refused_connections']} CURVE handshakes refused by the "
          f"ZAP handler; server took exactly {pushes} KV_PUSH (its workers'); parameters bitwise "
          f"equal to the undisturbed run")


# ----- the key file ----------------------------------------------------------------------------------
def _cli(*args, env=None, timeout=120):
    e = dict(os.environ, PYTHONPATH=str(ROOT))
    e.pop("POSEIDON_KEYS", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "poseidon.tools.cli", *map(str, args)], env=e,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                          cwd=ROOT)


def test_poseidon_keys_writes_a_private_file(tmp_path):
    path = tmp_path / "job.keys"
    r = _cli("keys", path)
    assert r.returncode == 0, r.stdout.decode()
    mode = stat.S_IMODE(os.stat(path).st_mode)
    assert mode == 0o600
    keys = security.read_key_file(path)
    assert zmq.curve_public(keys.secret) == keys.public
    assert keys.secret.decode() not in r.stdout.decode()           # never printed
    again = _cli("keys", path)                                       # no silent overwrite
    lines = again.stdout.decode().strip().splitlines()
    assert again.returncode == 1 and len(lines) == 1 and "--force" in lines[0], lines
    assert security.read_key_file(path).secret == keys.secret
    print(f"\nposeidon keys: {path.name} mode {mode:04o}; second run: {lines[0]}")


def test_bad_key_files_give_one_clear_line(tmp_path):
    good = security.write_key_file(tmp_path / "good.keys")
    other = security.make_keys()
    cases = {"missing": (tmp_path / "nope.keys", "does not exist: make one with `poseidon keys"),
             "open": (tmp_path / "open.keys", "can be read by other users"),
             "malformed": (tmp_path / "bad.keys", "bad.keys:2: expected 'public = KEY'"),
             "short": (tmp_path / "short.keys", "must be 40 Z85 characters"),
             "mixed": (tmp_path / "mixed.keys", "does not belong to the secret key"),
             "binary": (tmp_path / "bin.keys", "is not a Poseidon key file")}
    text = good.text()
    for name, content in (("open", text), ("malformed", "# x\nhello world\n"),
                          ("short", "public = abc\n"),
                          ("mixed", f"public = {other.public.decode()}\n"
                                    f"secret = {good.secret.decode()}\n"),
                          ("binary", None)):
        path = cases[name][0]
        if content is None:
            path.write_bytes(bytes(range(256)))
        else:
            path.write_text(content)
        os.chmod(path, 0o644 if name == "open" else 0o600)
    for name, (path, expected) in cases.items():
        with pytest.raises(DistError) as err:
            security.read_key_file(path)
        line = str(err.value)
        assert expected in line and "\n" not in line and str(path) in line, (name, line)
        print(f"\n{name}: {line}", end="")
    print()


@pytest.mark.slow
def test_cli_refuses_a_missing_key_file_and_a_multi_host_job_without_keys(data, tmp_path):
    solver = tmp_path / "solver.prototxt"
    (tmp_path / "net.prototxt").write_text(fc_net(data, 4))
    solver.write_text('net: "net.prototxt"\nbase_lr: 0.01\nmax_iter: 1\nlr_policy: "fixed"\n')
    r = _cli("train", "--solver", solver, "--workers", 1, "--servers", 1, "--coordinator",
             "tcp://192.0.2.1:5555", "--rank", 1, "--start-timeout", 5)
    out = r.stdout.decode().strip().splitlines()
    assert r.returncode == 1 and len(out) == 1, out
    assert "needs the job's keys: run `poseidon keys" in out[0] and "--insecure" in out[0], out
    r2 = _cli("train", "--solver", solver, "--workers", 1, "--servers", 1,
              "--keys", tmp_path / "missing.keys")
    out2 = r2.stdout.decode().strip().splitlines()
    assert r2.returncode == 1 and len(out2) == 1 and "does not exist" in out2[0], out2
    print(f"\nmulti-host without keys: {out[0]}\nlocal with a missing file: {out2[0]}")


@pytest.mark.slow
def test_insecure_is_refused_on_a_routable_address_unless_the_network_is_trusted(data, tmp_path):
    """Without CURVE anyone who reaches a port can push gradients or abort the job: --insecure
    alone with a coordinator on a routable address stops with one line saying why and how;
    with --trusted-network it goes on (to wait for a coordinator that is not there)."""
    solver = tmp_path / "solver.prototxt"
    (tmp_path / "net.prototxt").write_text(fc_net(data, 4))
    solver.write_text('net: "net.prototxt"\nbase_lr: 0.01\nmax_iter: 1\nlr_policy: "fixed"\n')
    args = ("train", "--solver", solver, "--workers", 1, "--servers", 1, "--coordinator",
            "tcp://192.0.2.1:5555", "--rank", 1, "--start-timeout", 2, "--insecure")
    r = _cli(*args)
    out = r.stdout.decode().strip().splitlines()
    assert r.returncode == 1 and len(out) == 1, out
    assert "--insecure with a coordinator on a routable address" in out[0], out
    assert "--trusted-network" in out[0] and "--keys" in out[0], out
    trusted = _cli(*args, "--trusted-network").stdout.decode()
    assert "routable address" not in trusted and "coordinator" in trusted, trusted
    with pytest.raises(DistError, match="--trusted-network"):
        security.resolve_keys(None, True, loopback=False)
    assert security.resolve_keys(None, True, loopback=True) is None       # a local job
    assert security.resolve_keys(None, True, False, trusted_network=True) is None
    print(f"\n--insecure on a routable address: {out[0]}")


# ----- a local job listens on 127.0.0.1 only -----------------------------------------------------------
def _listening(pid):
    """(address, port) of the TCP sockets process pid listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        m = re.match(r"socket:\[(\d+)\]", link)
        if m:
            inodes.add(m.group(1))
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in inodes:          # LISTEN
                    addr, port = local.split(":")
                    if width == 8:
                        ip = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
                    else:
                        ip = "ipv6:" + addr
                    found.append((ip, int(port, 16)))
    return found


def _unix_inboxes(pid):
    """Paths of the Unix-socket inboxes (dist/transport/onehost/localipc.py) process pid listens
    on (/proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return [r[7] for r in rows if len(r) >= 8 and r[6] in inodes and r[5] == "01"
            and r[7].endswith("/inbox") and "/poseidon-" in r[7]]


@pytest.mark.slow
def test_a_local_job_listens_on_loopback_only(data, tmp_path):
    (tmp_path / "net.prototxt").write_text(fc_net(data, 4))
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.01\nmax_iter: 100000\nlr_policy: "fixed"\n')
    e = dict(os.environ, PYTHONPATH=str(ROOT))
    e.pop("POSEIDON_KEYS", None)
    launcher = subprocess.Popen([sys.executable, "-m", "poseidon.tools.cli", "train", "--solver",
                                 "solver.prototxt", "--workers", "2", "--servers", "1"],
                                env=e, cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
    try:
        pids, lines = None, []
        while pids is None:
            line = launcher.stdout.readline().decode()
            assert line, "".join(lines)
            lines.append(line)
            m = re.match(r"poseidon: worker 0 pid (\d+), worker 1 pid (\d+), server 0 pid (\d+)",
                         line)
            if m:
                pids = [int(x) for x in m.groups()]
        for pid in pids:                   # no key on any command line
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert b"secret" not in f.read()
        listening = {}
        deadline = time.monotonic() + 60
        want = {pid: 2 if pid == pids[0] else 1 for pid in pids}   # worker 0: + coordinator
        while time.monotonic() < deadline and any(len(listening.get(pid, ())) < n
                                                  for pid, n in want.items()):
            listening = {pid: _listening(pid) for pid in pids}
            time.sleep(0.2)
        unix = {pid: [(path, stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode))
                      for path in _unix_inboxes(pid)] for pid in pids}
    finally:
        launcher.terminate()
        launcher.communicate(timeout=60)
    assert len(listening[pids[0]]) == 2, listening          # coordinator + worker 0's inbox
    for pid in pids[1:]:
        assert len(listening[pid]) == 1, listening
    every = [a for socks in listening.values() for a in socks]
    assert all(ip == "127.0.0.1" for ip, _ in every), every
    for pid, inboxes in unix.items():    # and each one Unix-socket inbox in a private folder
        assert len(inboxes) == 1 and inboxes[0][1] == 0o700, unix
        assert not os.path.exists(os.path.dirname(inboxes[0][0]))   # removed when it stopped
    print(f"\nlocal job (2 workers, 1 server): listening sockets {sorted(every)}: all on "
          f"127.0.0.1; no key on any command line")
