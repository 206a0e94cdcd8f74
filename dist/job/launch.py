"""`poseidon train ... --workers P1 --servers P2` (local) or `--coordinator ... --rank R` (multi-host).

Local mode starts all P1 + P2 roles as child processes of this one (`python -m poseidon.dist.job.process`),
on a free loopback port, and:
- prefixes every line a child prints with its role (`[worker 0] ...`, `[server 1] ...`);
- when a child fails or is killed, writes the reason where the others' SIGTERM handlers read it,
  gives them a moment to stop on their own (the coordinator aborts the job), then SIGTERMs and
  after a grace period SIGKILLs the rest, and exits non-zero naming the lost role and rank;
- names the cause, not the first process to exit because of it: a child killed by a signal, else
  a child that is stopped (SIGSTOP, a debugger: state T in /proc), else the ranks the coordinator
  blamed when it stopped the job (worker 0 writes its verdict to a file), else the lowest rank
  that exited with an error;
- watches that no child stays stopped: one stopped for --heartbeat-timeout seconds is lost, even
  before it registered (the coordinator, which cannot know of a rank that never spoke, would wait
  out --start-timeout), and the job stops naming it;
- runs each child in its own process group, kills them all when it exits (or on SIGTERM, or a
  second SIGINT), and the children die with it if it is SIGKILLed (parent-death signal), so none
  is orphaned;
- with --resume auto, starts from the newest complete snapshot (dist/job/resume.py) and, when a
  process is lost, stops everyone and starts the whole job again from the newest complete
  snapshot, up to --max-restarts times, then fails naming the cause;
- turns SIGINT / SIGHUP into Caffe's effect (--sigint_effect, --sighup_effect): SIGUSR2 (stop) or
  SIGUSR1 (snapshot) to worker 0, whose coordinator has every worker act at the same iteration.
Multi-host mode runs the one role of this process in-process (mpirun/srun start the others);
there a re-run of the same command with --resume auto is the restart (worker 0 picks the
snapshot).
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

from poseidon.engine.errors import PoseidonError

from .options import DistOptions
from .roles import Roles, rank_from_environment
from .security import make_keys, resolve_keys
from .spawn import module_command
from ..transport import free_port, split_address

SETTLE_S = 0.5          # after a failure: time the others get to stop by themselves
# ... when the failed process exited with an error status rather than by a signal: it told the
# coordinator first, whose ABORT carries the real cause to the others; on a loaded machine that
# can take longer than SETTLE_S, and a SIGTERM from here would replace the cause with "exited"
SETTLE_AFTER_ERROR_S = 2.0
GRACE_S = 5.0           # after SIGTERM: time before SIGKILL
STOPPED_STATES = {"T": "SIGSTOP or a job-control stop", "t": "held by a debugger"}


def process_state(pid):
    """The one-letter state of a process from /proc/PID/stat (R, S, D, T, t, Z, ...), or None
    where there is no /proc or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    rest = text.rpartition(")")[2].split()     # the name, in parentheses, may hold spaces
    return rest[0] if rest else None


def job_from_args(args, options):
    snapshot = getattr(args, "snapshot", None)
    if getattr(args, "resume", None) == "auto":
        snapshot = "auto"                   # rank 0 (worker 0 or this launcher) looks it up
    elif snapshot:
        snapshot = os.path.abspath(snapshot)
    return {"solver": os.path.abspath(args.solver) if args.solver else None,
            "weights": ",".join(os.path.abspath(p) for p in args.weights.split(","))
            if getattr(args, "weights", None) else None,
            "snapshot": snapshot, "gpu": getattr(args, "gpu", None), "options": options.as_dict(),
            "sigint_effect": getattr(args, "sigint_effect", "stop"),
            "sighup_effect": getattr(args, "sighup_effect", "snapshot")}


def launch(args):
    """Entry from `poseidon train` when distributed flags are given; returns the exit status."""
    from poseidon.engine.replicas import plan_devices
    # G from --devices-per-node, or from a --gpu list's length (Caffe's meaning); one line if
    # the two disagree
    G = len(plan_devices(getattr(args, "gpu", None), getattr(args, "devices_per_node", None)))
    options = DistOptions.from_args(args)
    options.devices_per_node = G
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
    fixed_port = bool(options.coordinator)
    if options.coordinator:
        host, port = split_address(options.coordinator)
        if host not in ("127.0.0.1", "localhost"):
            raise PoseidonError(f"--coordinator {options.coordinator} names another host but this "
                                f"process has no rank: give --rank, or start it with mpirun/srun")
        options.coordinator = f"tcp://127.0.0.1:{port}"
    else:
        options.coordinator = f"tcp://127.0.0.1:{free_port()}"
    options.local = True
    if options.cost_table:               # a fault in the file: one line now, before any child
        from ..cost.model import Planner, load_cost_table
        from .roles import Roles
        Planner(Roles(options.workers, options.servers), load_cost_table(options.cost_table))
    if options.insecure:
        keys = None
    elif options.keys or os.environ.get("POSEIDON_KEYS"):
        keys = resolve_keys(options.keys, False, False)          # the user's file
    else:
        keys = make_keys()                                       # fresh keys for this job
    options.keys = None                  # the children get the keys on their standard input
    job = LocalJob(job_from_args(args, options), options, keys,
                   max_restarts=getattr(args, "max_restarts", 3) or 0)
    job.fixed_port = fixed_port
    return job.run()


class LocalJob:
    """The P1 + P2 children of a local job, and (with --resume auto) the restarts after a loss."""

    def __init__(self, job, options, keys=None, max_restarts=0):
        self.job = job
        self.keys = keys
        self.options = options
        self.resume_auto = job.get("snapshot") == "auto"
        self.max_restarts = max_restarts if self.resume_auto else 0
        self.fixed_port = True
        self.roles = Roles(options.workers, options.servers)
        self.children = {}
        self.every_child = []
        self._print_lock = threading.Lock()
        self._readers = []
        self._tmp = tempfile.mkdtemp(prefix="poseidon-job-")
        self.abort_file = os.path.join(self._tmp, "abort")
        self.verdict_file = os.path.join(self._tmp, "verdict")     # written by the coordinator
        self._stopped_since = {}           # rank -> when its process was first seen stopped
        self._stopping = False
        self._stop_requested = False       # a graceful stop (SIGINT): no restart after it
        self._signalled = False

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

    def start(self, snapshot):
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        self.children = {}
        self._readers = []
        for rank in range(self.roles.size):
            job = dict(self.job, local_rank=rank, snapshot=snapshot,
                       options=self.options.as_dict())
            cmd = module_command("poseidon.dist.job.process", "--job", json.dumps(job),
                                 "--rank", rank, "--parent-pid", os.getpid(),
                                 "--abort-file", self.abort_file,
                                 "--verdict-file", self.verdict_file,
                                 *(["--keys-on-stdin"] if self.keys else []))
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
            self.every_child.append(proc)
            t = threading.Thread(target=self._pump, args=(rank, proc.stdout), daemon=True)
            t.start()
            self._readers.append(t)

    def _describe_exit(self, rank, code):
        who = self._who(rank)
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
            _signal_group(p, signal.SIGCONT)  # a stopped child acts on the SIGTERM (and says why)
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
        for p in self.every_child:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)

    def _on_signal(self, signum, frame):
        """SIGINT / SIGHUP: Caffe's effect, carried out by the whole job at one iteration (worker
        0 asks the coordinator, which tells every worker with the next iteration's loss); a
        second SIGINT after a stop request, SIGTERM, or no running worker 0: stop every process."""
        name = signal.Signals(signum).name
        effect = {signal.SIGINT: self.job.get("sigint_effect", "stop"),
                  signal.SIGHUP: self.job.get("sighup_effect", "snapshot")}.get(signum, "kill")
        worker0 = self.children.get(0)
        running = worker0 is not None and worker0.poll() is None and not self._stopping
        if effect == "none":
            self._say(f"poseidon: {name} ignored (--{name[3:].lower()}_effect none)")
            return
        if effect == "kill" or (effect == "stop" and self._stop_requested) or not running:
            self._say(f"poseidon: {name}: stopping every process")
            self._signalled = True
            self.stop_all(f"the launcher was stopped by {name}")
            raise SystemExit(128 + signum)
        if effect == "stop":
            self._stop_requested = True
        self._say(f"poseidon: {name}: the job will {effect} after the current iteration"
                  + (" (send it again to stop at once)" if effect == "stop" else ""))
        os.kill(worker0.pid, signal.SIGUSR2 if effect == "stop" else signal.SIGUSR1)

    def _newest_snapshot(self):
        from .resume import newest_complete, snapshot_settings
        prefix, interval = snapshot_settings(self.job["solver"])
        if not interval:
            self._say("poseidon: the solver sets no snapshot interval (snapshot: N), so --resume "
                      "auto can only restart from a snapshot of an earlier run or the beginning")
        state = newest_complete(prefix, self.roles.workers,
                                say=lambda line: self._say(f"poseidon: {line}"))
        if state is None:
            self._say(f"poseidon: no complete snapshot under {prefix}_iter_*: starting from the "
                      f"beginning")
        else:
            self._say(f"poseidon: resuming from the newest complete snapshot {state}")
        return state

    def run(self):
        opts = self.options
        self._say(f"poseidon: {self.roles.workers} worker(s) and {self.roles.servers} server(s) "
                  f"on this machine, coordinator {opts.coordinator}, --sync {opts.sync}"
                  f"{', --no-overlap' if opts.no_overlap else ''}")
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                previous[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):     # not the main thread
                pass
        atexit.register(self._kill_quietly)
        try:
            snapshot = self._newest_snapshot() if self.resume_auto else self.job.get("snapshot")
            restarts = 0
            while True:
                status, reason = self._attempt(snapshot)
                if status == 0 or not self.resume_auto or self._stop_requested:
                    return status
                if restarts >= self.max_restarts:
                    self._say(f"poseidon: the job failed after {restarts} restart(s) "
                              f"(--max-restarts {self.max_restarts}): {reason}")
                    return status
                restarts += 1
                self._say(f"poseidon: restart {restarts} of {self.max_restarts} after: {reason}")
                snapshot = self._newest_snapshot()
                if not self.fixed_port:
                    opts.coordinator = f"tcp://127.0.0.1:{free_port()}"
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._kill_quietly()
            for t in self._readers:
                t.join(2)
            atexit.unregister(self._kill_quietly)
            try:
                for path in (self.abort_file, self.verdict_file):
                    if os.path.exists(path):
                        os.remove(path)
                os.rmdir(self._tmp)
            except OSError:
                pass

    def _attempt(self, snapshot):
        """One start of every process; (exit status, reason of a failure or None)."""
        self._stopping = False
        self._stopped_since = {}
        for path in (self.abort_file, self.verdict_file):
            if os.path.exists(path):
                os.remove(path)
        try:
            self.start(snapshot)
            self._say("poseidon: " + ", ".join(f"{self.roles.short(r)} pid {p.pid}"
                                               for r, p in self.children.items()))
            return self._monitor()
        finally:
            for t in self._readers:
                t.join(2)

    def _monitor(self):
        lost_after = float(getattr(self.options, "heartbeat_timeout", 0) or 0)
        while True:
            codes = {r: p.poll() for r, p in self.children.items()}
            failed = [r for r, c in codes.items() if c not in (None, 0)]
            stopped = self._watch_stopped(codes)
            overdue = [r for r in stopped if lost_after
                       and time.monotonic() - self._stopped_since[r] >= lost_after]
            if failed:
                # several may be seen at once (the others abort quickly): say the first seen
                # now, and after the others had their moment, the cause (_cause)
                t0 = time.monotonic()
                rank = min(failed, key=lambda r: (codes[r] > 0, r))
                self._say(f"poseidon: {self._describe_exit(rank, codes[rank])}; stopping the "
                          f"other processes")
                deadline = time.monotonic() + (SETTLE_S if codes[rank] < 0 else
                                               SETTLE_AFTER_ERROR_S)
                while time.monotonic() < deadline and any(
                        p.poll() is None for p in self.children.values()):
                    time.sleep(0.05)
                reason = self._cause()
                return self._fail(reason, t0)
            if overdue:          # alive but silent as long as the coordinator lets any rank be
                t0 = time.monotonic()
                reason = self._cause()
                self._say(f"poseidon: {reason}; stopping the other processes")
                return self._fail(reason, t0)
            if all(c == 0 for c in codes.values()):
                self._say("poseidon: all processes finished")
                return 0, None
            time.sleep(0.1)

    def _fail(self, reason, t0):
        self.stop_all(reason)
        left = [p.pid for p in self.children.values() if p.poll() is None]
        self._say(f"poseidon: every process stopped {time.monotonic() - t0:.1f} s after "
                  f"the failure" if not left else
                  f"poseidon: pids {left} did not stop after SIGKILL")
        self._say(f"poseidon: the job failed: {reason}")
        return 1, reason

    def _watch_stopped(self, codes):
        """The ranks whose process is stopped now (state T or t); keeps since when."""
        now = time.monotonic()
        stopped = []
        for rank, code in codes.items():
            state = process_state(self.children[rank].pid) if code is None else None
            if state in STOPPED_STATES:
                self._stopped_since.setdefault(rank, now)
                stopped.append(rank)
            else:
                self._stopped_since.pop(rank, None)
        return stopped

    def _verdict(self):
        """What worker 0's coordinator wrote when it stopped the job: {"reason", "ranks"}, or
        None."""
        try:
            with open(self.verdict_file, "r", encoding="utf-8") as f:
                verdict = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(verdict, dict) or not isinstance(verdict.get("reason"), str):
            return None
        ranks = verdict.get("ranks")
        verdict["ranks"] = [r for r in ranks if isinstance(r, int) and r in self.children] \
            if isinstance(ranks, list) else []
        return verdict

    def _cause(self):
        """Why the job stops, naming the process at its root rather than the first to exit
        because of it (call before stop_all, which wakes stopped children):
        1. a child killed by a signal (not by this launcher: it has sent none yet);
        2. a child that is stopped (it answers nothing; the others lose it by heartbeat);
        3. the ranks the coordinator blamed (a rank lost by heartbeat, a FAILED, a rank that
           never registered), with the coordinator's words;
        4. the lowest rank that exited with an error status."""
        codes = {r: p.poll() for r, p in self.children.items()}
        verdict = self._verdict()
        killed = [r for r, c in codes.items() if c is not None and c < 0]
        if killed:
            return self._describe_exit(min(killed), codes[min(killed)])
        stopped = self._watch_stopped(codes)
        if stopped:
            now = time.monotonic()
            parts = []
            for rank in stopped:
                state = process_state(self.children[rank].pid) or "T"
                quiet = now - self._stopped_since[rank]
                parts.append(f"{self._who(rank)} is stopped ({STOPPED_STATES.get(state, '')}: "
                             f"process state {state})"
                             + (f" and has answered nothing for {quiet:.0f} s" if quiet >= 1
                                else ""))
            reason = "; ".join(parts)
            if verdict is not None and not set(verdict["ranks"]) <= set(stopped):
                reason += f" (the coordinator: {verdict['reason']})"
            return reason
        if verdict is not None and verdict["ranks"]:
            parts = []
            for rank in verdict["ranks"]:
                code = codes[rank]
                parts.append(f"{self._who(rank)}, still running" if code is None else
                             f"{self._who(rank)}, which had finished" if code == 0 else
                             self._describe_exit(rank, code))
            return f"{'; '.join(parts)}: {verdict['reason']}"
        if verdict is not None:          # the coordinator's words name no single rank
            return verdict["reason"]
        errors = [r for r, c in codes.items() if c not in (None, 0)]
        if errors:
            return self._describe_exit(min(errors), codes[min(errors)])
        return "a process was stopped and woke again before the job could be stopped"

    def _who(self, rank):
        return f"{self.roles.name(rank)} (pid {self.children[rank].pid})"


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
