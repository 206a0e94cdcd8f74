"""The engine's settings: the convolution route, its timing, the CPU threads, CUDA graphs, TF32.

    from poseidon.engine import settings
    settings.configure(conv="im2col", threads=2)     # this process, over the environment
    settings.current().threads                       # 2

Why one object: the command line, a user's script and each process of a distributed job set the
same things, and a bad value must fail the same way (one line naming the variable or keyword and
what to write) wherever it is first needed. So the six variables of VARIABLES are read here and
nowhere else; the modules that act on a setting ask `current()`.

What wins: a value given to `configure`, else the environment, else the default. The command line
calls `configure` for its flags; the processes of a job it starts are fresh interpreters, so
`environ()` gives the variables that carry those values to them.

The environment is parsed when first asked and again only when one of these variables changes
(the bench and the tests switch them between two runs in one process); otherwise `current()`
returns the same Settings.
"""
import os
from dataclasses import dataclass, replace

from .errors import PoseidonError

CONV_ROUTES = ("im2col", "fourier", "winograd")
CONV_CHOICES = ("auto",) + CONV_ROUTES
_ON = ("1", "on", "yes", "true")
_OFF = ("0", "off", "no", "false")


class SettingsError(PoseidonError, ValueError):
    """A setting the engine cannot use: the message names where it came from and what to write.
    A ValueError too, as a layer that meets one while choosing its route reports it as such."""


@dataclass(frozen=True)
class Settings:
    """What the engine is set to do; the variable of each field is in VARIABLES."""
    conv: str = "auto"          # 'auto': time the routes per layer shape; a route's name pins it
    conv_measure: bool = True   # whether 'auto' may time routes (else the fallback rules)
    conv_refresh: bool = False  # time again instead of reading this machine's route cache
    threads: int = None         # the engine's CPU threads (None: one per core, at most 8)
    cuda_graphs: bool = False   # replay a GPU step's stretches between GEMMs as CUDA graphs
    tf32: bool = False          # float32 GEMMs on TF32 tensor cores (GPU)


def _switch(text):
    value = text.strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError


def _conv(text):
    value = text.strip().lower()
    if value not in CONV_CHOICES:
        raise ValueError
    return value


def _threads(text):
    value = int(text.strip())
    if value < 1:
        raise ValueError
    return value


# field: (variable, reading of its text, what to write instead of a bad one, how it is written)
_FIELDS = {
    "conv": ("POSEIDON_CONV", _conv, f"use one of {', '.join(CONV_CHOICES)}", str),
    "conv_measure": ("POSEIDON_CONV_MEASURE", _switch, "use 1 or 0", lambda v: "1" if v else "0"),
    "conv_refresh": ("POSEIDON_CONV_REFRESH", _switch, "use 1 or 0", lambda v: "1" if v else "0"),
    "threads": ("POSEIDON_THREADS", _threads,
                "use a positive whole number of threads, e.g. 4 (unset: one per core, at most 8)",
                str),
    "cuda_graphs": ("POSEIDON_CUDA_GRAPHS", _switch, "use on or off",
                    lambda v: "on" if v else "off"),
    "tf32": ("POSEIDON_TF32", _switch, "use 1 or 0", lambda v: "1" if v else "0"),
}
VARIABLES = {name: spec[0] for name, spec in _FIELDS.items()}

_given = {}                 # configure()'s values, by field
_cache = (None, None)       # (what it was made from, Settings)


def _read(name, text, where):
    """The field's value from text; `where` names its source in the error, as in
    "POSEIDON_THREADS='abc'"."""
    try:
        return _FIELDS[name][1](text)
    except ValueError:
        raise SettingsError(f"{where}: {_FIELDS[name][2]}") from None


def current():
    """The Settings in force: configure()'s values over the environment's over the defaults.
    Raises SettingsError for a variable that cannot be read (and not overridden)."""
    global _cache
    texts = tuple(os.environ.get(VARIABLES[name], "") for name in _FIELDS)
    key = (texts, tuple(sorted(_given.items())))
    made_from, settings = _cache
    if made_from != key:
        values = {name: _read(name, text, f"{VARIABLES[name]}={text.strip()!r}")
                  for name, text in zip(_FIELDS, texts) if text.strip() and name not in _given}
        settings = replace(Settings(), **values, **_given)
        _cache = (key, settings)
    return settings


def configure(**values):
    """Set settings for this process, over the environment (a keyword per field of Settings;
    text is read as the variable's would be). None gives a field back to the environment.
    Returns the Settings now in force; an unknown name or a bad value raises SettingsError."""
    checked = {}
    for name, value in values.items():
        if name not in _FIELDS:
            raise SettingsError(f"settings.configure: no setting '{name}' (the settings: "
                                f"{', '.join(_FIELDS)})")
        if value is not None:
            checked[name] = _checked(name, value)
    for name, value in values.items():
        if value is None:
            _given.pop(name, None)
        else:
            _given[name] = checked[name]
    return current()


def _checked(name, value):
    where = f"settings.configure({name}={value!r})"
    if isinstance(value, str) and value.strip():
        return _read(name, value, where)
    if name == "threads":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    else:
        ok = not isinstance(value, str) and isinstance(value, type(getattr(Settings(), name)))
    if not ok:
        switch = _FIELDS[name][1] is _switch and not isinstance(value, str)
        raise SettingsError(f"{where}: {'use True or False' if switch else _FIELDS[name][2]}")
    return value


def reset():
    """Forget every configure() value: the environment and the defaults again."""
    _given.clear()


def environ():
    """{variable: text} of the configured values, for the environment of processes this one
    starts (they read the same settings from it)."""
    return {VARIABLES[name]: _FIELDS[name][3](value) for name, value in _given.items()}
