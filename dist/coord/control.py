"""What the fields of a control message must be for a process to act on it; anything else is dropped.

Why: the control messages (registration, collectives, queries, failures, aborts) carry a JSON object
that the coordinator and the ranks read field by field. A member of the job can be buggy, and before
these schemas one GATHER without its object, or a QUERY whose index was a list, raised inside the
coordinator's loop and stopped the whole job. So every field a handler reads is described here
(type and range), once per message type, and checks.WireRules asks `field_reason(msg, roles)` in the
receive thread: a reason string means the message is dropped, logged and counted there, like any
other refused message, and the handlers can read the fields without guarding each one.

What is checked here depends only on the message and the job's roles; what depends on the
coordinator's state (a call already completed, a vector of the wrong length, a collective's root)
is checked in dist/coord/collectives.py.

The cost reports (COSTS) are the exception to "dropped in the receive thread": each worker waits
for the schemes the coordinator publishes once every worker's report of a call is in, so a report
dropped there would leave every worker waiting out its timeout for an answer that cannot come.
Their schema is the same kind of description, but the coordinator's handler asks for it
(`costs_reason`), knowing whether the call is one the workers wait on: if it is, a bad report
stops the job naming its sender; if not, it is dropped like any other.
"""
import math

from ..transport import Msg

TEXT = 1 << 16            # the longest string field (a failure's reason may quote a traceback)
NAME = 256                # a collective's name, a host name
INDEX = 1 << 31           # layer, parameter and server indices are below this
SCHEME_NAME = 64          # a synchronisation scheme's name


class Int:
    """A JSON integer (not a boolean) in [least, most)."""

    def __init__(self, least=0, most=INDEX):
        self.least, self.most = least, most

    def __call__(self, value):
        if isinstance(value, bool) or not isinstance(value, int):
            return f"is {_kind(value)}, not an integer"
        if not self.least <= value < self.most:
            return f"is {value}, outside {self.least}..{self.most - 1}"
        return None


class Text:
    """A JSON string of at most `most` characters."""

    def __init__(self, most=TEXT):
        self.most = most

    def __call__(self, value):
        if not isinstance(value, str):
            return f"is {_kind(value)}, not a string"
        if len(value) > self.most:
            return f"is {len(value)} characters long (at most {self.most})"
        return None


class OneOf:
    def __init__(self, *values):
        self.values = values

    def __call__(self, value):
        if isinstance(value, str) and value in self.values:
            return None
        return f"is {str(value)[:40]!r}, not one of {', '.join(map(repr, self.values))}"


class Number:
    """A finite JSON number (not a boolean): above 0 when `positive`, else at least 0."""

    def __init__(self, positive=False):
        self.positive = positive

    def __call__(self, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"is {_kind(value)}, not a number"
        try:
            x = float(value)
        except OverflowError:            # an integer of hundreds of digits
            return "is a number too large for a float"
        if not math.isfinite(x):         # JSON as Python writes it may hold NaN and Infinity
            return f"is {x}, not a finite number"
        if self.positive and not x > 0:
            return f"is {x:g}, not a positive number"
        if x < 0:
            return f"is {x:g}, below 0"
        return None


class OrNull:
    """What `check` takes, or null."""

    def __init__(self, check):
        self.check = check

    def __call__(self, value):
        return None if value is None else self.check(value)


def _inside(path, why):
    """The reason of a field inside another: (its path from the outer field, why)."""
    if isinstance(why, tuple):
        return path + why[0], why[1]
    return path, why


def _field(name, field, why):
    """One line for a field's reason (a nested one names the whole path, 'report.links.2')."""
    if isinstance(why, tuple):
        field, why = field + why[0], why[1]
    return f"{name}: the field '{field}' {why}"


def whole_number(key):
    """A key that is a layer index or a rank: a whole number written in decimal, as Python's
    str(int) writes it (so two keys never name the same number)."""
    if (isinstance(key, str) and 0 < len(key) <= 10 and key.isascii() and key.isdigit()
            and (key == "0" or key[0] != "0") and int(key) < INDEX):
        return None
    return "not a whole number"


def scheme_name(key):
    if not isinstance(key, str) or len(key) > SCHEME_NAME:
        return f"not a scheme's name (a string of at most {SCHEME_NAME} characters)"
    return None


class Map:
    """A JSON object of any number of entries, each key passing `keys` (a reason after the key)
    and each value passing `values`."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def __call__(self, value):
        if not isinstance(value, dict):
            return f"is {_kind(value)}, not an object"
        for k, v in value.items():
            why = self.keys(k)
            if why is not None:
                return f"has the key {str(k)[:40]!r}, {why}"
            why = self.values(v)
            if why is not None:
                return _inside(f".{k}", why)
        return None


class Fields:
    """A JSON object inside a message's object, checked field by field as a Schema does."""

    def __init__(self, required=None, optional=None):
        self.required, self.optional = required or {}, optional or {}

    def __call__(self, value):
        if not isinstance(value, dict):
            return f"is {_kind(value)}, not an object"
        for field, check in self.required.items():
            why = "is missing" if field not in value else check(value[field])
            if why is not None:
                return _inside(f".{field}", why)
        for field, check in self.optional.items():
            why = None if field not in value else check(value[field])
            if why is not None:
                return _inside(f".{field}", why)
        return None


def an_object(value):
    return None if isinstance(value, dict) else f"is {_kind(value)}, not an object"


def a_boolean(value):
    return None if isinstance(value, bool) else f"is {_kind(value)}, not a boolean"


def a_list(value):
    return None if isinstance(value, list) else f"is {_kind(value)}, not a list"


def anything(value):
    return None


def _kind(value):
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value), "a value")


class Schema:
    """The JSON object of one message type: `json` is 'none' (it must carry none), 'maybe' or
    'object'; `required` and `optional` map a field to its check; `more(msg, roles)`, when given,
    checks what depends on the sender or on the header (a reason or None)."""

    def __init__(self, json="object", required=None, optional=None, more=None):
        self.json, self.more = json, more
        self.required, self.optional = required or {}, optional or {}

    def reason(self, msg, roles):
        obj, name = msg.obj, msg.type.name
        if obj is None:
            if self.json == "object":
                return f"{name} carries no JSON object"
        elif self.json == "none":
            return f"{name} carries a JSON object, which it never has"
        elif not isinstance(obj, dict):
            return f"{name} carries {_kind(obj)} where its JSON object should be"
        else:
            for field, check in self.required.items():
                if field not in obj:
                    return f"{name} lacks the field '{field}'"
                why = check(obj[field])
                if why is not None:
                    return _field(name, field, why)
            for field, check in self.optional.items():
                why = None if field not in obj else check(obj[field])
                if why is not None:
                    return _field(name, field, why)
        return None if self.more is None else self.more(msg, roles)


# ----- what depends on the sender or the header ---------------------------------------------------
def _register(msg, roles):
    rank = msg.obj["rank"]
    if rank != msg.sender:
        return f"REGISTER for rank {rank} sent by {roles.name(msg.sender)}"
    if msg.obj["role"] != roles.role(rank):
        return f"REGISTER from {roles.name(rank)} says it is a {msg.obj['role']}"
    if roles.is_worker(rank):
        for field, check in (("description", an_object), ("solver", Text(1 << 20))):
            why = "is missing" if field not in msg.obj else check(msg.obj[field])
            if why is not None:
                return f"REGISTER from {roles.name(rank)}: the field '{field}' {why}"
    return None


def _allreduce(msg, roles):
    if msg.aux not in (0, 1):
        return f"ALLREDUCE with operation {msg.aux} (0: mean, 1: sum)"
    return None


def _gather(msg, roles):
    if not roles.is_worker(msg.aux):
        return f"GATHER to rank {msg.aux}, which is not a worker"
    return None


QUERIES = {              # what a QUERY may ask, and the fields each needs
    "layer": {"index": Int()}, "best_scheme": {"index": Int()}, "costs": {"index": Int()},
    "pairs": {}, "cluster": {}, "server_bytes": {},
    "request_action": {"action": OneOf("snapshot", "stop")},
}


def _query(msg, roles):
    need = QUERIES.get(msg.obj["what"])
    if need is None:         # answered with an error naming the queries there are, not dropped
        return None
    for field, check in need.items():
        why = "is missing" if field not in msg.obj else check(msg.obj[field])
        if why is not None:
            return f"QUERY '{msg.obj['what']}': the field '{field}' {why}"
    if msg.obj["what"] == "pairs" and not ("param" in msg.obj or "server" in msg.obj):
        return "QUERY 'pairs' names neither 'param' nor 'server'"
    return None


def _query_reply(msg, roles):
    if "result" not in msg.obj and "error" not in msg.obj:
        return "QUERY_REPLY with neither a result nor an error"
    return None


def _gather_done(msg, roles):
    if len(msg.obj["items"]) != roles.workers:
        return f"GATHER_DONE with {len(msg.obj['items'])} items for {roles.workers} workers"
    return None


# a worker's cost report (dist/cost/probe.py's probe, or dist/cost/sync.py's sync times of a window)
LINK = Fields(required={"alpha": Number(), "beta": Number(positive=True)},
              optional={"encrypted": a_boolean})
PROBE = Fields(required={"links": Map(whole_number, LINK), "flops": Number(positive=True)},
               optional={"encrypt_cost": Number()})
SYNC_TIMES = Fields(required={"observed": Map(whole_number, Number())})


def _costs(msg, roles):
    """The report: a probe (a link to every other rank of the job, none to itself) or sync times,
    never both."""
    report, sender = msg.obj["report"], msg.sender
    kinds = [k for k in ("links", "observed") if k in report]
    if not kinds:
        return "COSTS: the field 'report' has neither 'links' (a probe) nor 'observed' (sync times)"
    if len(kinds) == 2:
        return "COSTS: the field 'report' has both 'links' and 'observed'"
    why = (PROBE if kinds == ["links"] else SYNC_TIMES)(report)
    if why is not None:
        return _field("COSTS", "report", why)
    if kinds == ["links"]:
        links = report["links"]
        for k in links:
            if int(k) >= roles.size:
                return (f"COSTS: the field 'report.links' has the key '{k}', not a rank of this "
                        f"job (0..{roles.size - 1})")
            if int(k) == sender:
                return (f"COSTS: the field 'report.links' has the key '{k}', the reporting "
                        f"worker itself")
        for rank in range(roles.size):
            if rank != sender and str(rank) not in links:
                return f"COSTS: the field 'report.links' lacks {roles.name(rank)}"
    return None


SCHEMAS = {
    # to the coordinator
    Msg.REGISTER: Schema(required={"rank": Int(0, 1 << 15), "address": Text(NAME * 2),
                                   "host": Text(NAME), "role": OneOf("worker", "server"),
                                   "options": an_object},
                         optional={"pid": Int(0, 1 << 31), "local": anything},
                         more=_register),
    Msg.BARRIER: Schema(required={"name": Text(NAME), "group": OneOf("workers", "all")}),
    Msg.ALLREDUCE: Schema(required={"name": Text(NAME)}, more=_allreduce),
    Msg.GATHER: Schema(required={"name": Text(NAME), "item": anything}, more=_gather),
    Msg.FAILED: Schema(required={"reason": Text()}),
    Msg.DONE: Schema(json="none"),
    Msg.QUERY: Schema(required={"what": Text(64)},
                      optional={"param": Int(), "server": Int()}, more=_query),
    Msg.HEARTBEAT: Schema(json="none"),
    # from the coordinator
    Msg.BARRIER_DONE: Schema(json="none"),
    Msg.ALLREDUCE_DONE: Schema(json="maybe", optional={"action": OneOf("snapshot", "stop")}),
    Msg.GATHER_DONE: Schema(required={"items": a_list}, more=_gather_done),
    Msg.QUERY_REPLY: Schema(optional={"error": Text()}, more=_query_reply),
    Msg.ABORT: Schema(required={"reason": Text()}),
    # the measured cost model
    Msg.COSTS: Schema(required={"report": an_object, "from": Int()}, more=_costs),
    Msg.SCHEMES: Schema(required={"from": Int(),
                                  "choices": Map(whole_number, Text(SCHEME_NAME))},
                        optional={"predicted": Map(whole_number,
                                                   Map(scheme_name, OrNull(Number()))),
                                  "table": an_object}),
}
CHECKED_BY_HANDLER = frozenset({Msg.COSTS})     # see the module's docstring


def field_reason(msg, roles):
    """None if the fields of msg are what its handler reads, else why not (one line). Asked in
    the receive thread, which leaves the types of CHECKED_BY_HANDLER to their handler."""
    schema = SCHEMAS.get(msg.type)
    if schema is None or msg.type in CHECKED_BY_HANDLER:
        return None
    return schema.reason(msg, roles)


def costs_reason(msg, roles, layers=None):
    """None if the cost report msg (COSTS) can be planned from, else why not: one line naming
    the field. `layers`: the book's layer indices, which sync times must be of."""
    why = SCHEMAS[Msg.COSTS].reason(msg, roles)
    if why is not None or layers is None:
        return why
    for k in msg.obj["report"].get("observed", ()):
        if int(k) not in layers:
            return f"COSTS: the field 'report.observed' has the key '{k}', not a layer of the book"
    return None
