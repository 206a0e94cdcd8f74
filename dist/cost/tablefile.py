"""Reading a --cost-table file (the JSON the measured cost model takes instead of its probe) safely.

The path comes from the command line or POSEIDON_COST_TABLE and is read by the launcher before any
process starts, so nothing in the file may hang it, exhaust its memory or end it in a traceback:

- only a regular file is opened (a FIFO would block the open until a writer came; /dev/zero and
  other devices never end), checked with stat() before the open and with fstat() after it (the
  open is non-blocking, so a path swapped for a FIFO in between cannot block it either);
- at most MAX_COST_TABLE_BYTES are read (a real table is a few KB);
- the text must be UTF-8 (a byte-order mark is allowed), the JSON no deeper than the decoder's
  recursion allows;
- the shape is checked where dist/cost/links.py's checks would not give one short line: link
  keys are 'RANK->RANK' in ASCII digits, `links` is an object, every number slot holds a JSON
  number and `encrypted` true or false. The ranges (positive, finite) are dist/cost/links.py's
  to check.

Every fault is one DistError line naming the file, what is wrong and what to give instead.
"""
import json
import os
import re
import stat

from ..errors import DistError

MAX_COST_TABLE_BYTES = 4 << 20
# a link's key: two ranks of at most 9 ASCII digits each ('²', '١' or '２' are digits to Python)
LINK_KEY = re.compile(r"[0-9]{1,9}->[0-9]{1,9}")
NUMBER_KEYS = ("flops", "encrypt_cost")
LINK_NUMBERS = ("alpha", "beta")
KINDS = ("default", "peers", "servers")
ADVICE = "give a JSON file of link costs to --cost-table (docs/distributed.md)"

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def _kind(mode):
    return next((name for test, name in _FILE_KINDS if test(mode)), "a special file")


def _fail(path, what):
    raise DistError(f"cost table {path}: {what}")


def _check_regular(path, st):
    if not stat.S_ISREG(st.st_mode):
        _fail(path, f"is {_kind(st.st_mode)}, not a regular file; {ADVICE}")
    if st.st_size > MAX_COST_TABLE_BYTES:
        _too_big(path)


def _too_big(path):
    _fail(path, f"holds more than {MAX_COST_TABLE_BYTES >> 20} MB, far more than a table of link "
                f"costs needs (a few KB); {ADVICE}")


def read_bytes(path):
    """The file's bytes: a regular file of at most MAX_COST_TABLE_BYTES, else one DistError."""
    try:
        _check_regular(path, os.stat(path))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        _fail(path, f"cannot be read ({e.strerror or e}); {ADVICE}")
    with os.fdopen(fd, "rb") as f:
        try:
            _check_regular(path, os.fstat(f.fileno()))      # the file that was opened
            data = f.read(MAX_COST_TABLE_BYTES + 1)
        except OSError as e:
            _fail(path, f"cannot be read ({e.strerror or e}); {ADVICE}")
    if len(data) > MAX_COST_TABLE_BYTES:
        _too_big(path)
    return data


def read_cost_file(path):
    """The file's JSON value, read safely and with the shape checks of the module docstring."""
    data = read_bytes(path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        _fail(path, f"is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save it "
                    f"as UTF-8 JSON, or {ADVICE}")
    try:
        value = json.loads(text)
    except RecursionError:
        _fail(path, f"its JSON is nested too deep to read (a cost table is at most 4 levels "
                    f"deep: a list of tables of links of numbers); {ADVICE}")
    except ValueError as e:
        _fail(path, f"not JSON ({_short(str(e))}); see docs/distributed.md, 'The measured cost "
                    f"model'")
    check_shape(path, value)
    return value


def _short(text, limit=120):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _shown(key):
    """A key as JSON writes it (ASCII, escapes for anything else, one line), cut short."""
    return _short(json.dumps(key), 60)


def _json_type(value):
    """What a JSON value is, in a few words: null, true, a string, a list, ..., or the number."""
    if isinstance(value, (str, list, dict)):
        return {str: "a string", list: "a list", dict: "an object"}[type(value)]
    return _short(json.dumps(value), 40)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number_slot(path, where, value):
    if not _is_number(value):
        _fail(path, f"{where} is {_json_type(value)}, expected a number; {ADVICE}")


def _link_shape(path, where, spec):
    if not isinstance(spec, dict):
        return                                  # links.py names the object a link must be
    for key in LINK_NUMBERS:
        if key in spec:
            _number_slot(path, f"{where}.{key}", spec[key])
    if "encrypted" in spec and not isinstance(spec["encrypted"], bool):
        _fail(path, f"{where}.encrypted is {_json_type(spec['encrypted'])}, expected true or "
                    f"false; {ADVICE}")


def check_shape(path, value):
    """The checks of the module docstring's last point, on the decoded JSON value."""
    specs = value if isinstance(value, list) else [value]
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            continue                            # links.py: "must be an object"
        where = f"table {i}" if isinstance(value, list) else "the table"
        if "from_iteration" in spec and not (isinstance(spec["from_iteration"], int)
                                             and not isinstance(spec["from_iteration"], bool)):
            _fail(path, f"{where}.from_iteration is {_json_type(spec['from_iteration'])}, expected "
                        f"an iteration (a whole number >= 0); {ADVICE}")
        for key in NUMBER_KEYS:
            if key in spec:
                _number_slot(path, f"{where}.{key}", spec[key])
        for kind in KINDS:
            if kind in spec:
                _link_shape(path, f"{where}.{kind}", spec[kind])
        links = spec.get("links")
        if links is None:
            continue
        if not isinstance(links, dict):
            _fail(path, f"{where}.links is {_json_type(links)}, expected an object of links by "
                        f"'RANK->RANK' such as {{\"0->2\": {{\"alpha\": 1e-4, \"beta\": 1e9}}}}; "
                        f"{ADVICE}")
        for key, spec_of_link in links.items():
            if not LINK_KEY.fullmatch(key):
                _fail(path, f"{where}.links has the key {_shown(key)}, expected 'RANK->RANK' "
                            f"in ASCII digits such as '0->2' (a worker's rank, then another "
                            f"rank); fix the key")
            _link_shape(path, f"{where}.links['{key}']", spec_of_link)
