"""The measured convolution routes kept between processes: one JSON file per user, per machine.

Where: $POSEIDON_CACHE_DIR/conv-routes.json when that is set, else the XDG cache folder
($XDG_CACHE_HOME/poseidon/, by default ~/.cache/poseidon/). The file keeps one section per machine
(the CPU model and core count, `machine_key`), each mapping a layer shape's key (routes.LayerShape,
which names the device: the CPU threads or the GPU's name) to the route measured fastest and the
times behind it. Routes measured on another machine are never used here: a home folder shared
between hosts, or a cache copied from one, only holds other sections, and the routes are measured
again (with a warning line).

A file that cannot be read is ignored with a warning line and rewritten; one that cannot be
written leaves the routes measured for this process only. Writes go to a temporary file in the
same folder, then replace the old one in one rename, so a reader never sees half a file; two
processes measuring at once may each lose the other's newest entry, which costs one measurement
again later, never a wrong route.
"""
import json
import logging
import os
import platform
import tempfile

log = logging.getLogger("poseidon")

FILE_NAME = "conv-routes.json"
FORMAT = 1

_warned = set()   # (path, what) already warned about in this process: one line each


def cache_dir():
    """The folder of the route cache: POSEIDON_CACHE_DIR, else $XDG_CACHE_HOME/poseidon, else
    ~/.cache/poseidon."""
    folder = os.environ.get("POSEIDON_CACHE_DIR", "").strip()
    if folder:
        return os.path.expanduser(folder)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "poseidon")


def cache_path():
    return os.path.join(cache_dir(), FILE_NAME)


def cpu_model():
    """The CPU's model name (/proc/cpuinfo on Linux; what the platform module says elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                field, _, value = line.partition(":")
                if field.strip() in ("model name", "Hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_key():
    """What a measurement is only valid on: the CPU model and its core count."""
    return f"{cpu_model()}, {os.cpu_count() or 1} cores"


def _warn_once(path, what, message):
    if (path, what) not in _warned:
        _warned.add((path, what))
        log.warning(message)


def _load(path):
    """The whole file as a dict ({"format": 1, "machines": {...}}), or None when there is none
    or it cannot be read (warned about once)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn_once(path, "read", f"{path}: cannot read the convolution route cache ({e}); "
                                 f"routes are measured again")
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT or \
                not isinstance(data.get("machines"), dict):
            raise ValueError(f"not format {FORMAT} with a 'machines' table")
    except ValueError as e:
        _warn_once(path, "corrupt", f"{path}: not a convolution route cache this engine can "
                                    f"read ({e}); ignoring it: routes are measured again and "
                                    f"the file rewritten")
        return None
    return data


def read_routes(path, machine):
    """{shape key: route} measured on `machine`, from the file at `path` ({} when it has none)."""
    data = _load(path)
    if data is None:
        return {}
    mine = data["machines"].get(machine)
    if not isinstance(mine, dict):
        others = ", ".join(sorted(map(str, data["machines"]))) or "none"
        if data["machines"]:
            _warn_once(path, "foreign", f"{path}: holds convolution routes measured on other "
                                        f"machines ({others}), not on this one ({machine}); "
                                        f"ignoring them: routes are measured again here")
        return {}
    return {key: entry["route"] for key, entry in mine.items()
            if isinstance(entry, dict) and isinstance(entry.get("route"), str)}


def write_route(path, machine, key, route, seconds):
    """Add (or replace) one measured route of `machine`, keeping every other entry in the file,
    in one atomic replace. `seconds`: {route: seconds} behind the choice, kept for people
    reading the file."""
    data = _load(path) or {"format": FORMAT, "machines": {}}
    data["machines"].setdefault(machine, {})
    if not isinstance(data["machines"][machine], dict):
        data["machines"][machine] = {}
    data["machines"][machine][key] = {
        "route": route, "ms": {r: round(s * 1e3, 4) for r, s in sorted(seconds.items())}}
    folder = os.path.dirname(path) or "."
    temp = None
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=folder, prefix=".conv-routes.",
                                         suffix=".tmp", delete=False) as f:
            temp = f.name
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(temp, path)
    except OSError as e:
        if temp is not None and os.path.exists(temp):
            os.unlink(temp)
        _warn_once(path, "write", f"{path}: cannot write the convolution route cache ({e}); "
                                  f"the routes measured now hold for this process only (set "
                                  f"POSEIDON_CACHE_DIR to a writable folder)")
