"""Errors of a distributed run. They are PoseidonErrors, so the command line prints one line."""
from poseidon.engine.errors import PoseidonError


class DistError(PoseidonError):
    """A distributed run cannot go on: a peer is lost, a message did not come in time, or the
    processes of one job disagree about the model or the options. The message says which role and
    rank, and what was awaited or what differs."""


class DeadlineError(DistError):
    """A message awaited by a sync thread (or a barrier) did not arrive before the deadline."""


class AbortError(DistError):
    """The job is being stopped because another process failed (the reason names it)."""
