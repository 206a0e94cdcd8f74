"""The coordinator's collectives in progress (barriers, allreduces, gathers): who has arrived, and
when an unfinished one is given up.

Why apart from the service: a collective is filed by (kind, key, call) when its first member
arrives and completes when the last does. A buggy member can send calls that never complete (a
key no other worker uses, a call far ahead, a repeat of a call already done), and before this
bookkeeping each one stayed in the coordinator's maps for ever. Here:
- a call already completed for its (kind, key), one more than FUTURE_CALLS ahead of the last
  completed, a second arrival of a member, a member outside the collective's group, and a gather
  to another root than its first member's are refused (the caller drops the message, logs and
  counts it);
- a completed collective is removed at once;
- `expire()` gives up the ones behind the last completed call of their key (every member has gone
  past them, so they can never complete) and the ones older than the longest a member waits on a
  collective; and at most MOST_OPEN are kept (the oldest goes first), so no member can grow the
  coordinator's memory by sending collectives that never complete.
Members send the calls of one key in order and each waits for its own, so the calls of a key
complete in order: a legitimate collective is never behind the last completed call of its key.
"""
import time

FUTURE_CALLS = 1000        # calls of a key a member may be ahead of the last completed one
MOST_OPEN = 1024           # unfinished collectives kept at once
MOST_KEYS = 4096           # (kind, key)s whose last completed call is remembered
LOGGED = 20                # give-ups logged one batch a line; then when the count passes 100, ...


class Open:
    """One unfinished collective: its members' contributions so far, and since when it waits."""

    __slots__ = ("kind", "key", "call", "tag", "label", "group", "arrived", "since", "warned",
                 "root")

    def __init__(self, kind, key, call, tag, label, group, now):
        self.kind, self.key, self.call, self.tag, self.label = kind, key, call, tag, label
        self.group, self.arrived = group, {}
        self.since = self.warned = now
        self.root = None

    @property
    def complete(self):
        return len(self.arrived) == len(self.group)


class Collectives:
    """The open collectives of a coordinator, bounded in number and in age."""

    def __init__(self, expire_after, log=None):
        self.expire_after = expire_after
        self.log = log or (lambda line: None)
        self.open = {}                 # (kind, key, call, tag) -> Open
        self._last = {}                # (kind, key, tag) -> the last completed call
        self.given_up = 0

    def arrive(self, kind, msg, group, value, tag=None, root=None, name=None):
        """File msg's contribution `value`; returns (the Open collective, None) or (None, why the
        message is refused)."""
        if msg.sender not in group:
            return None, f"{kind} '{name}' from a rank that is not one of its members"
        last = self._last.get((kind, msg.key, tag), -1)
        if msg.iteration <= last:
            return None, f"{kind} '{name}' call {msg.iteration}, already completed (call {last})"
        if msg.iteration > last + FUTURE_CALLS:
            return None, (f"{kind} '{name}' call {msg.iteration}, more than {FUTURE_CALLS} ahead "
                          f"of the last completed ({last})")
        k = (kind, msg.key, msg.iteration, tag)
        entry = self.open.get(k)
        if entry is None:
            entry = Open(kind, msg.key, msg.iteration, tag, f"{kind} '{name}' (call {msg.iteration})",
                         group, time.monotonic())
            entry.root = root
        elif msg.sender in entry.arrived:
            return None, f"{kind} '{name}' call {msg.iteration} again from the same sender"
        elif root != entry.root:
            return None, (f"{kind} '{name}' call {msg.iteration} to rank {root}, where the others "
                          f"went to rank {entry.root}")
        entry.arrived[msg.sender] = value
        if k not in self.open:
            self.open[k] = entry
            self._bound()
        return entry, None

    def finish(self, entry):
        """A completed collective: forget it, remember its call as its key's last."""
        self.open.pop((entry.kind, entry.key, entry.call, entry.tag), None)
        last = (entry.kind, entry.key, entry.tag)
        if last in self._last or len(self._last) < MOST_KEYS:
            self._last[last] = max(entry.call, self._last.get(last, -1))

    def expire(self, now=None):
        """Give up the collectives that can no longer complete or have waited too long; one log
        line names them. Returns how many were given up."""
        now = time.monotonic() if now is None else now
        gone = [e for e in self.open.values()
                if e.call < self._last.get((e.kind, e.key, e.tag), -1)
                or now - e.since > self.expire_after]
        self._give_up(gone, f"behind their key's last completed call or older than "
                            f"{self.expire_after:g} s")
        return len(gone)

    def _bound(self):
        if len(self.open) > MOST_OPEN:      # the dict keeps arrival order: the first is oldest
            oldest = list(self.open.values())[:len(self.open) - MOST_OPEN]
            self._give_up(oldest, f"more than {MOST_OPEN} unfinished at once")

    def _give_up(self, entries, why):
        for e in entries:
            del self.open[(e.kind, e.key, e.call, e.tag)]
        before, self.given_up = self.given_up, self.given_up + len(entries)
        # one line a batch for the first LOGGED, then when the count passes 100, 1000, ...
        if entries and (self.given_up <= LOGGED or len(str(self.given_up)) > len(str(before))):
            names = ", ".join(e.label for e in entries[:3])
            more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
            self.log(f"the coordinator: gave up {len(entries)} unfinished collective(s) ({why}): "
                     f"{names}{more}; {self.given_up} so far")
