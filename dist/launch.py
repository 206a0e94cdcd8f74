"""`poseidon train ... --workers P1 --servers P2` (local) or `--coordinator ... --rank R` (multi-host).

Local mode starts all P1 + P2 roles as child processes of this one (`python -m dist.process`),
on a free loopback port, and:
- prefixes every line a child prints with its role (`[worker 0] ...`, `[server 1] ...`);
- when a child fails or is killed, writes the reason where the others' SIGTERM handlers read it,
  gives them a moment to stop on their own (the coordinator aborts the job), then SIGTERMs and
  after a grace period SIGKILLs the rest, and exits non-zero naming the lost role and rank;
- runs each child in its own process group, kills them all when it exits or is signalled itself,
  and the children die with it if it is SIGKILLed (parent-death signal), so none is orphaned.
Multi-host mode runs the one role of this process in-process (mpirun/srun start the others).
"""
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from engine.errors import PoseidonError

from .options import DistOptions
from .roles import Roles, rank_from_environment
from .security import make_keys, resolve_keys
from .transport import free_port, split_address

ROOT = Path(__file__).resolve().parents[1]
SETTLE_S = 3.0          # after a failure: time the others get to stop by themselves
GRACE_S = 5.0           # after SIGTERM: time before SIGKILL


def job_from_args(args, options):
    return {"solver": os.path.abspath(args.solver) if args.solver else None,
            "weights": ",".join(os.path.abspath(p) for p in args.weights.split(","))
            if getattr(args, "weights", None) else None,
            "snapshot": os.path.abspath(args.snapshot) if getattr(args, "snapshot", None) else None,
            "gpu": getattr(args, "gpu", None), "options": options.as_dict()}


def launch(args):
    """Entry from `poseidon train` when distributed flags are given; returns the exit status."""
    options = DistOptions.from_args(args)
    rank = options.rank
    if rank is None and options.coordinator:
        rank, _ = rank_from_environment()
    if options.coordinator and rank is not None:
        from .process import run_main
        if not getattr(args, "workers", None):
            raise PoseidonError("a multi-host process needs --workers P1 (and --servers P2) as "
                                "given to every process of the job")
        options.rank = rank
        return run_main(job_from_args(args, options), rank)
    if options.coordinator:
        host, port = split_address(options.coordinator)
        if host not in ("127.0.0.1", "localhost"):
            raise PoseidonError(f"--coordinator {options.coordinator} names another host but this "
                                f"process has no rank: give --rank, or start it with mpirun/srun")
        options.coordinator = f"tcp://127.0.0.1:{port}"
    else:
        options.coordinator = f"tcp://127.0.0.1:{free_port()}"
    options.local = True
    if options.insecure:
        keys = None
    elif options.keys or os.environ.get("POSEIDON_KEYS"):
        keys = resolve_keys(options.keys, False, False)          # the user's file
    else:
        keys = make_keys()                                       # fresh keys for this job
    options.keys = None                  # the children get the keys on their standard input
    return LocalJob(job_from_args(args, options), options, keys).run()


class LocalJob:
    def __init__(self, job, options, keys=None):
        self.job = job
        self.keys = keys
        self.options = options
        self.roles = Roles(options.workers, options.servers)
        self.children = {}
        self._print_lock = threading.Lock()
        self._readers = []
        self._tmp = tempfile.mkdtemp(prefix="poseidon-job-")
        self.abort_file = os.path.join(self._tmp, "abort")
        self._stopping = False

    def _say(self, line):
        with self._print_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def _pump(self, rank, stream):
        prefix = f"[{self.roles.short(rank)}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            self._say(prefix + line)
        stream.close()

    def start(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "")
                                                           .split(os.pathsep) if p])
        env["PYTHONUNBUFFERED"] = "1"
        for rank in range(self.roles.size):
            job = dict(self.job, local_rank=rank)
            cmd = [sys.executable, "-m", "dist.process", "--job", json.dumps(job),
                   "--rank", str(rank), "--parent-pid", str(os.getpid()),
                   "--abort-file", self.abort_file] + (["--keys-on-stdin"] if self.keys else [])
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.PIPE if self.keys else subprocess.DEVNULL,
                                    env=env, start_new_session=True)
            if self.keys:                  # not argv or environment, which `ps` and /proc show
                try:
                    proc.stdin.write(self.keys.text().encode("ascii"))
                    proc.stdin.close()
                except OSError:
                    pass                   # it died at once: the monitor reports it
            self.children[rank] = proc
            t = threading.Thread(target=self._pump, args=(rank, proc.stdout), daemon=True)
            t.start()
            self._readers.append(t)

    def _describe_exit(self, rank, code):
        who = f"{self.roles.name(rank)} (pid {self.children[rank].pid})"
        if code < 0:
            try:
                sig = signal.Signals(-code).name
            except ValueError:
                sig = f"signal {-code}"
            return f"{who} was killed by {sig}"
        return f"{who} exited with status {code}"

    def stop_all(self, reason):
        """Tell the living children why (abort file), SIGTERM them, SIGKILL after GRACE_S."""
        if self._stopping:
            return
        self._stopping = True
        try:
            with open(self.abort_file, "w", encoding="utf-8") as f:
                f.write(reason)
        except OSError:
            pass
        alive = [p for p in self.children.values() if p.poll() is None]
        for p in alive:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.05)
        for p in alive:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
        for p in alive:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def _kill_quietly(self):
        for p in self.children.values():
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)

    def run(self):
        opts = self.options
        self._say(f"poseidon: {self.roles.workers} worker(s) and {self.roles.servers} server(s) "
                  f"on this machine, coordinator {opts.coordinator}, --sync {opts.sync}"
                  f"{', --no-overlap' if opts.no_overlap else ''}")
        previous = {}

        def on_signal(signum, frame):
            self._say(f"poseidon: {signal.Signals(signum).name}: stopping every process")
            self.stop_all(f"the launcher was stopped by {signal.Signals(signum).name}")
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                previous[sig] = signal.signal(sig, on_signal)
            except (ValueError, OSError):     # not the main thread
                pass
        atexit.register(self._kill_quietly)
        try:
            self.start()
            self._say("poseidon: " + ", ".join(f"{self.roles.short(r)} pid {p.pid}"
                                               for r, p in self.children.items()))
            return self._monitor()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._kill_quietly()
            for t in self._readers:
                t.join(2)
            atexit.unregister(self._kill_quietly)
            try:
                if os.path.exists(self.abort_file):
                    os.remove(self.abort_file)
                os.rmdir(self._tmp)
            except OSError:
                pass

    def _monitor(self):
        while True:
            codes = {r: p.poll() for r, p in self.children.items()}
            failed = [r for r, c in codes.items() if c not in (None, 0)]
            if failed:
                # several may be seen at once (the others abort quickly): a signal death is the
                # cause rather than a consequence; otherwise the lowest rank
                rank = min(failed, key=lambda r: (codes[r] > 0, r))
                reason = self._describe_exit(rank, codes[rank])
                self._say(f"poseidon: {reason}; stopping the other processes")
                deadline = time.monotonic() + SETTLE_S
                while time.monotonic() < deadline and any(
                        p.poll() is None for p in self.children.values()):
                    time.sleep(0.05)
                self.stop_all(reason)
                self._say(f"poseidon: the job failed: {reason}")
                return 1
            if all(c == 0 for c in codes.values()):
                self._say("poseidon: all processes finished")
                return 0
            time.sleep(0.1)


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
