"""The distributed flags of `poseidon train`, and the options object every role is built from.

`add_dist_options(parser)` adds the flags; `DistOptions.from_args(args)` (or `DistOptions(**kw)`
from Python) holds them. `shared()` is the part every process of a job must agree on; the
coordinator compares it across ranks at registration and names the first difference.
"""
import argparse
import os

from ..coord.placement import DEFAULT_PAIR_BYTES, parse_bytes
from ..schemes import hybrid_members, sync_choices
from ..transport import MIN_SLICE_BYTES, parse_bandwidth

IPC_CHOICES = ("auto", "links", "zmq", "off")
PRIORITY_CHOICES = ("auto", "on", "off")
COST_MODELS = ("auto", "static", "measured")
MIN_PIECE_BYTES = 64
DEFAULT_COST_REFRESH = 20


def parse_count(text, least):
    """A whole number >= `least` from a flag's text (or an int from Python); the ValueError's
    message states the same bound the value is held to, whatever side of it the value is."""
    try:
        if isinstance(text, bool) or isinstance(text, float):
            raise ValueError
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"expected a whole number >= {least}, got '{text}'") from None
    if value < least:
        raise ValueError(f"expected a number >= {least}, got '{text}'")
    return value


def check_count(flag, value, least):
    """parse_count for an option given from Python: one DistError line naming the flag."""
    try:
        return parse_count(value, least)
    except ValueError as e:
        from ..errors import DistError
        raise DistError(f"{flag}: {e}") from None


def _nonneg_int(text):
    try:
        return parse_count(text, 0)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text):
    try:
        return parse_count(text, 1)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _argument(parse):
    """An argparse type from a parser that raises ValueError."""
    def argument(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return argument


def _size(**how):
    """An argparse type for a size in bytes ('2MB'); `how` goes to parse_bytes."""
    return _argument(lambda text: parse_bytes(text, **how))


def parse_bucket_bytes(value):
    """--bucket-bytes: 'auto' or a size in bytes (0: each layer alone)."""
    if str(value).strip().lower() == "auto":
        return "auto"
    try:
        return parse_bytes(value or 0, allow_zero=True, what="the bucket size")
    except ValueError as e:
        raise ValueError(f"{e} (or auto)") from None


_bytes = _size()


def _bytes_between(value, low, what):
    """A size in bytes from `low` to 1GB, or a ValueError naming `what`."""
    size = parse_bytes(value, what=what)
    if not low <= size <= 1 << 30:
        raise ValueError(f"{what} must be between {low} bytes and 1GB, got '{value}'")
    return size


def parse_slice_bytes(value):
    """--slice-bytes: a size in bytes, at least MIN_SLICE_BYTES (so a message is not thousands of
    slices, each with its header) and at most 1GB."""
    return _bytes_between(value, MIN_SLICE_BYTES, "the slice size")


_slice_bytes = _argument(parse_slice_bytes)
_fusion_bytes = _size(allow_zero=True, what="the fusion size")
_bucket_bytes = _argument(parse_bucket_bytes)
_credit_bytes = _size(what="the credit")


def parse_piece_bytes(value):
    """--piece-bytes: the largest piece of a ring all-reduce, in bytes (None: the scheme's
    default); at least MIN_PIECE_BYTES, at most 1GB."""
    return None if value is None else _bytes_between(value, MIN_PIECE_BYTES,
                                                     "the ring's piece size")


_piece_bytes = _argument(parse_piece_bytes)


def _bandwidth(text):
    try:
        return parse_bandwidth(text) and text
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got '{text}'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got '{text}'")
    return value


def _seconds_or_zero(text):
    return 0.0 if text.strip() in ("0", "0.0") else _seconds(text)


def add_dist_options(parser):
    g = parser.add_argument_group(
        "distributed training",
        "Poseidon's WFBP + hybrid PS/SFB over ZeroMQ (see docs/distributed.md). --workers/--servers "
        "start every process on this machine; --coordinator with --rank (or mpirun/srun's rank) "
        "runs one process of a multi-host job.")
    actions = []

    def add(*flags, **kw):
        actions.append(g.add_argument(*flags, **kw))
    # in this order: it is the order of --help
    for topic in (_job_flags, _scheme_flags, _record_flags, _message_flags, _patience_flags,
                  _network_flags):
        topic(add)
    parser.set_defaults(dist_flag_defaults={a.dest: (a.option_strings[0], a.default)
                                            for a in actions})
    return parser


def _job_flags(add):
    """Who is in the job, and which process this one is."""
    add("--workers", type=_positive_int, help="P1: worker processes (batch_size in the "
        "model is per worker; the global batch is P1 x batch_size)")
    add("--servers", type=_nonneg_int, help="P2: KV-store server processes (default 1; "
        "0 only when every layer with parameters can use SFB)")
    add("--coordinator", metavar="tcp://HOST:PORT",
        help="the job's coordinator address (it runs beside worker 0, which binds it)")
    add("--rank", type=_nonneg_int, help="this process's global rank: 0..P1-1 are "
        "workers, P1..P1+P2-1 servers (default: OMPI_COMM_WORLD_RANK, PMI_RANK or "
        "SLURM_PROCID)")


def _scheme_flags(add):
    """How each layer's scheme is chosen, and whether syncs overlap the backward."""
    add("--sync", default="hybrid", metavar="|".join(sync_choices()) + "|A+B",
        help="hybrid: BestScheme per layer, the cheapest registered scheme (default); A+B: "
        "BestScheme among the named schemes alone (ps+sfb: the paper's Algorithm 1); a "
        "scheme's name (ps, sfb, allreduce, ...) forces it where the layer allows it, PS "
        "elsewhere (SFB takes only InnerProducts; the ring all-reduce every layer)")
    add("--cost-model", choices=COST_MODELS, default="auto",
        help="what BestScheme compares (with --sync hybrid): static: Table 1's floats on the "
        "busiest node; measured: predicted seconds from link costs each worker probes at "
        "start, refreshed from observed sync times, so a layer may change scheme during the "
        "run; auto (default): measured when the job spans several hosts, else static")
    add("--cost-refresh", type=_positive_int, default=DEFAULT_COST_REFRESH, metavar="N",
        help="with the measured cost model: the workers report their sync times every N "
        f"iterations, and new choices take effect N iterations later (default "
        f"{DEFAULT_COST_REFRESH})")
    add("--cost-table", metavar="FILE",
        help="with the measured cost model: take the link costs from this JSON file (a "
        "regular file of at most 4MB) instead of probing (docs/distributed.md; default: "
        "POSEIDON_COST_TABLE); checked before any process starts, read by worker 0")
    add("--no-overlap", action="store_true",
        help="sync after the whole backward instead of layer by layer (no WFBP)")


def _record_flags(add):
    """What each process writes down about its iterations."""
    add("--stats", metavar="FILE", help="each process writes one JSON object per "
        "iteration to FILE with its role and rank in the name (stats.worker-0.jsonl)")
    add("--timeline", metavar="FILE", help="one Chrome trace of all workers "
        "(forward, backward and sync of each layer), written by worker 0")


def _message_flags(add):
    """How the syncs' messages are cut, grouped, summed, paced and ordered."""
    add("--kv-pair-bytes", type=_bytes, default=DEFAULT_PAIR_BYTES, metavar="BYTES",
        help="largest KV pair (default 2MB)")
    add("--slice-bytes", type=_slice_bytes, metavar="BYTES",
        help="every message larger than BYTES travels in slices of BYTES (default: "
        "--kv-pair-bytes), and no process takes a frame much larger (a stranger's claimed "
        "512 MB frame is refused before any memory is taken); at least 4KB")
    add("--fusion-bytes", type=_fusion_bytes, metavar="BYTES",
        help="a layer's KV pairs on one server go as one message while it stays "
        "within BYTES (default: --kv-pair-bytes, so a bias rides with its weight); 0: "
        "one message per pair")
    add("--bucket-bytes", type=_bucket_bytes, metavar="BYTES",
        help="consecutive small PS layers share one sync (one message per server) "
        "while their parameters add up to at most BYTES; it starts when the lowest "
        "of them is back (as DDP's buckets: fewer messages, less overlap); 0: each "
        "layer alone (the paper's WFBP); default auto: 1MB when every process of the "
        "job is on one host (no network to overlap), else 0")
    add("--piece-bytes", type=_piece_bytes, metavar="BYTES",
        help="the ring all-reduce cuts each worker's chunk of a layer into pieces of at most "
        "BYTES, each passed on as soon as it is summed (default: 256K floats); at least 64")
    add("--sum-gradients", action="store_true", help="servers and SFB sum the workers' "
        "gradients (the paper) instead of averaging them (one process on P1 x batch)")
    add("--bandwidth", type=_bandwidth, metavar="RATE",
        help="cap each process's send rate (e.g. 1Gbit, 100Mbit) for experiments")
    add("--priority", choices=PRIORITY_CHOICES, default="auto",
        help="on: each peer's messages go out lower layer first (the next forward needs "
        "them first), preempting at slice boundaries, at most --credit-bytes in flight; "
        "off: the same sender, in arrival order; auto: on with --bandwidth or between "
        "hosts, else no sender threads (one host: the direct links) (default auto)")
    add("--credit-bytes", type=_credit_bytes, metavar="BYTES",
        help="with --priority: bytes of one peer's slices handed to ZeroMQ and not yet "
        "written out, at most (default: 4 slices)")


def _patience_flags(add):
    """How long the job waits for its processes, when it stops or restarts, and how far a late
    worker may fall behind."""
    add("--timeout", type=_seconds, default=30.0, metavar="S",
        help="seconds a sync waits for a peer's message before failing (default 30)")
    add("--heartbeat-timeout", type=_seconds, default=10.0, metavar="S",
        help="a process silent this long is declared lost and the job stops (default 10)")
    add("--start-timeout", type=_seconds, default=120.0, metavar="S",
        help="seconds to wait for every process to register (default 120)")
    add("--stall-warning", type=_seconds_or_zero, default=10.0, metavar="S",
        help="log which ranks a wait is still waiting for every S seconds (default 10; "
        "0: never)")
    add("--max-restarts", type=_nonneg_int, default=3, metavar="N",
        help="with --resume auto, the local launcher restarts the whole job from the "
        "newest complete snapshot at most N times when a process is lost (default 3)")
    add("--straggler-timeout", type=_seconds, metavar="S", help="BSP with drop: a "
        "server waits at most S s after a KV pair's first push of an iteration, then "
        "averages the gradients that came (every layer goes by PS)")
    add("--staleness", type=_nonneg_int, default=0, metavar="s", help="SSP: a worker "
        "may run s iterations ahead of the slowest (0: BSP; >0: every layer by PS)")


def _network_flags(add):
    """Which interface, keys and local paths the processes talk over."""
    add("--interface", metavar="NAME|ADDR",
        help="network interface (eth0) or address to use for this process's sockets "
        "in a multi-host job (default: the one on the route to the coordinator)")
    add("--keys", metavar="FILE", help="the job's key file from `poseidon keys FILE` "
        "(default: POSEIDON_KEYS); a multi-host job needs it, a local one makes its own")
    add("--insecure", action="store_true", help="no CURVE authentication or "
        "encryption: any process that reaches a port of the job (on a local job, any user of "
        "this machine) can push gradients into it or abort it; refused with a coordinator on a "
        "routable address unless --trusted-network is given too")
    add("--trusted-network", action="store_true", help="with --insecure: the network between "
        "the job's hosts is trusted (a private cluster), so a coordinator on a routable address "
        "may run without CURVE")
    add("--ipc", choices=IPC_CHOICES, default="auto",
        help="auto: processes of the job on one host talk over Unix sockets in "
        "private folders, without CURVE (only this user can reach them), and a "
        "worker's KV pushes and their answers go on direct links that the waiting "
        "thread reads itself, their arrays in the server's shared memory; links: "
        "the same, the arrays on the links; zmq: the same Unix sockets, every "
        "message through "
        "ZeroMQ; off: TCP between every pair, as between hosts (default auto)")


def dist_flags_given(args):
    """The distributed-only flags set on a command line (their option strings), so that a run in one
    process can refuse them instead of ignoring them."""
    defaults = getattr(args, "dist_flag_defaults", {})
    return [flag for dest, (flag, default) in defaults.items()
            if getattr(args, dest, default) != default]


def shared_kv_memory(opts):
    """Whether KV pushes and answers on one host keep their arrays in the server's shared memory
    (dist/transport/onehost/kvshm.py): with --ipc auto, under BSP, and without the bandwidth cap
    (whose experiments emulate a network the bytes must cross)."""
    return (opts.ipc == "auto" and not opts.bandwidth and opts.straggler_timeout is None
            and not opts.staleness)


def send_order(opts, one_host):
    """The transport's `priority` for --priority: 'on', 'off', or None (no sender threads). auto
    is on where a network is shared (--bandwidth emulates one; a job across hosts has one) and
    None on one host, whose processes keep the direct links, which the scheduler cannot order."""
    if opts.priority == "auto":
        return "on" if opts.bandwidth or not one_host else None
    return opts.priority


def check_send_order(priority, credit_bytes):
    """--priority one of PRIORITY_CHOICES, and --credit-bytes (None: the default) as bytes, at
    least one."""
    from ..errors import DistError
    if priority not in PRIORITY_CHOICES:
        raise DistError(f"priority={priority!r}: use {' or '.join(map(repr, PRIORITY_CHOICES))}")
    if credit_bytes is None:
        return None
    value = parse_bytes(credit_bytes, what="the credit")
    if value < 1:
        raise DistError(f"credit_bytes={credit_bytes}: give at least one byte")
    return value


def check_consistency(opts):
    """--straggler-timeout and --staleness: one at a time, and the drop deadline under --timeout."""
    from ..errors import DistError
    if opts.straggler_timeout is not None and opts.staleness:
        raise DistError("--straggler-timeout and --staleness cannot be combined: pick BSP with "
                        "drop (--straggler-timeout S) or bounded staleness (--staleness s)")
    if opts.straggler_timeout is not None and not 0 < opts.straggler_timeout < opts.timeout:
        raise DistError(f"--straggler-timeout {opts.straggler_timeout:g} must be above 0 and "
                        f"below --timeout {opts.timeout:g} (the workers wait --timeout for the "
                        f"server's answer)")


def check_sync(value):
    """--sync: hybrid, a registered scheme, or schemes joined by '+', exactly as written: a value
    holding white space is refused (rather than read one way here and another where the scheme is
    built). Returns the value; an unknown name is one DistError line."""
    from ..errors import DistError
    if not isinstance(value, str) or not value:
        raise DistError(f"--sync {value!r}: give hybrid, one scheme or several joined by '+'")
    if any(c.isspace() for c in value):
        meant = "".join(value.split())
        try:
            hybrid_members(meant)
        except DistError:
            meant = None
        raise DistError(f"--sync {value!r} holds white space: give "
                        + (f"--sync {meant}" if meant else "the names without it") +
                        " (hybrid, one scheme, or schemes joined by '+' with no spaces)")
    hybrid_members(value)               # one line for an unknown name
    return value


def check_devices_per_node(value, gpu=None, on_this_machine=False):
    """G, the replicas (devices) of each worker: a whole number >= 1 (engine/replicas.py). With
    `on_this_machine` (the command line, before anything starts), also no more replicas than the
    devices they run on: with a --gpu list, one replica per listed GPU (engine/replicas.py's
    plan_devices says so); on the CPU, or several replicas sharing one --gpu id, at most the CPU
    cores (os.cpu_count()): each replica needs threads of its own (its compute on the CPU, its
    data's prefetch), and far more than the cores only time-share them, or cannot be started."""
    from ..errors import DistError
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DistError(f"--devices-per-node {value}: give a whole number of replicas per node, "
                        f"at least 1")
    if not on_this_machine:
        return value
    from poseidon.engine import backend
    ids = backend.gpu_ids(gpu)
    if ids is not None and len(ids) > 1:
        return value                    # the list's length is G (checked with the list)
    cores = os.cpu_count() or 1
    if value > cores:
        if ids is None:
            raise DistError(f"--devices-per-node {value}: more CPU replicas than this machine's "
                            f"{cores} CPU cores (each computes on threads of its own); give at "
                            f"most {cores}")
        raise DistError(f"--devices-per-node {value}: more replicas on --gpu {gpu} than this "
                        f"machine's {cores} CPU cores (replicas sharing one GPU each need a core "
                        f"for their host work); give at most {cores}, or list one GPU per "
                        f"replica (--gpu 0,1,...)")
    return value


class DistOptions:
    """Everything a role needs besides its rank. Build from parsed args or keywords."""

    FIELDS = {"workers": 1, "servers": None, "coordinator": None, "rank": None,
              "sync": "hybrid", "no_overlap": False, "stats": None, "timeline": None,
              "kv_pair_bytes": DEFAULT_PAIR_BYTES, "slice_bytes": None, "fusion_bytes": None,
              "bucket_bytes": "auto", "piece_bytes": None, "priority": "auto",
              "credit_bytes": None,
              "sum_gradients": False, "bandwidth": None, "timeout": 30.0,
              "heartbeat_timeout": 10.0, "start_timeout": 120.0, "stall_warning": 10.0,
              "dtype": "float32", "interface": None, "local": False,
              "keys": None, "insecure": False, "trusted_network": False,
              "straggler_timeout": None, "staleness": 0, "ipc": "auto",
              "devices_per_node": 1,
              "cost_model": "auto", "cost_refresh": DEFAULT_COST_REFRESH, "cost_table": None}

    def __init__(self, **kw):
        unknown = set(kw) - set(self.FIELDS)
        if unknown:
            raise TypeError(f"unknown distributed option(s): {', '.join(sorted(unknown))}")
        for name, default in self.FIELDS.items():
            setattr(self, name, kw.get(name, default))
        if self.servers is None:
            self.servers = 1
        self.kv_pair_bytes = parse_bytes(self.kv_pair_bytes)
        self.slice_bytes = parse_slice_bytes(self.slice_bytes or
                                             max(self.kv_pair_bytes, MIN_SLICE_BYTES))
        if self.fusion_bytes is not None:
            self.fusion_bytes = parse_bytes(self.fusion_bytes, allow_zero=True,
                                            what="the fusion size")
        self.bucket_bytes = parse_bucket_bytes(self.bucket_bytes)
        self.piece_bytes = parse_piece_bytes(self.piece_bytes)
        self.credit_bytes = check_send_order(self.priority, self.credit_bytes)
        self.workers = check_count("--workers", self.workers, 1)
        self.servers = check_count("--servers", self.servers, 0)
        self.cost_refresh = check_count("--cost-refresh", self.cost_refresh, 1)
        check_sync(self.sync)
        check_consistency(self)
        check_devices_per_node(self.devices_per_node)
        if self.cost_model not in COST_MODELS:
            from ..errors import DistError
            raise DistError(f"--cost-model {self.cost_model}: give one of "
                            f"{', '.join(COST_MODELS)}")
        if self.cost_table is None and os.environ.get("POSEIDON_COST_TABLE"):
            self.cost_table = os.environ["POSEIDON_COST_TABLE"]
        if self.ipc not in IPC_CHOICES:
            from ..errors import DistError
            raise DistError(f"ipc={self.ipc!r}: use {' or '.join(map(repr, IPC_CHOICES))}")

    @classmethod
    def from_args(cls, args):
        kw = {name: getattr(args, name) for name in cls.FIELDS if getattr(args, name, None) is not None}
        if kw.get("workers") is None:
            kw["workers"] = 1
        return cls(**kw)

    @classmethod
    def from_environment(cls, **kw):
        """Options for the Python API: keywords, else POSEIDON_WORKERS / POSEIDON_SERVERS /
        POSEIDON_COORDINATOR / POSEIDON_SYNC / POSEIDON_TIMEOUT from the environment."""
        env = os.environ
        for name, var, conv in (("workers", "POSEIDON_WORKERS", int),
                                ("servers", "POSEIDON_SERVERS", int),
                                ("coordinator", "POSEIDON_COORDINATOR", str),
                                ("sync", "POSEIDON_SYNC", str),
                                ("timeout", "POSEIDON_TIMEOUT", float),
                                ("rank", "POSEIDON_RANK", int)):
            if kw.get(name) is None and env.get(var):
                kw[name] = conv(env[var])
        return cls(**kw)

    def as_dict(self):
        return {name: getattr(self, name) for name in self.FIELDS}

    def shared(self):
        """The options every process of one job must agree on."""
        return {"workers": self.workers, "servers": self.servers, "sync": self.sync,
                "kv_pair_bytes": self.kv_pair_bytes, "slice_bytes": self.slice_bytes,
                "fusion_bytes": self.fusion_bytes,
                "bucket_bytes": self.bucket_bytes, "piece_bytes": self.piece_bytes,
                "sum_gradients": bool(self.sum_gradients),
                "dtype": self.dtype, "straggler_timeout": self.straggler_timeout,
                "staleness": int(self.staleness or 0),
                "devices_per_node": int(self.devices_per_node), "cost_model": self.cost_model,
                "cost_refresh": int(self.cost_refresh)}

    def bandwidth_bytes(self):
        return parse_bandwidth(self.bandwidth) if self.bandwidth else None
