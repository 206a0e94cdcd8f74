"""Errors a user can act on. The command line prints them as one line, without a traceback."""


class PoseidonError(Exception):
    """Base of every error whose message tells the user what is wrong and what to do."""


class ModelError(PoseidonError):
    """A model, solver or weights file that cannot be used as written (names the file, line or layer)."""


class LayerError(ModelError):
    """A layer refuses its parameters or its inputs; the message names the layer and its type."""

    def __init__(self, layer, message=None):
        if message is None:  # already a full message (e.g. re-raised with a file:line prefix)
            super().__init__(layer)
            return
        name = getattr(layer, "name", layer)
        kind = getattr(layer, "type", "")
        prefix = f"layer '{name}'" + (f" (type {kind})" if kind else "")
        super().__init__(f"{prefix}: {message}")


class DataError(PoseidonError):
    """A data source that is missing, empty or holds records the net cannot use."""


class DiskFullError(PoseidonError, OSError):
    """A file could not be written because its disk (or the user's quota) is full. An OSError
    too, so code that cleans up after a failed write still sees one."""
