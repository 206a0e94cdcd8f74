"""The stall inspector's server side: which workers a KV-store server still waits for.

A server waits in arrival order for whatever comes next, so no single wait names a late worker;
instead a daemon thread looks at the pairs every half second, and when some pairs of an iteration
have pushes from some workers but not all for longer than --stall-warning seconds it logs one line
per interval naming the missing workers (a SIGSTOPped or deadlocked worker is then named by the
server as well as by its peers and the coordinator). The other waits report themselves:
`Mailbox.take` (replies, factors, cursors) and the coordinator (barriers, allreduces, gathers).
"""
import threading
import time

POLL_S = 0.5


def watch_server(server, interval, name, namer, warn, stop):
    """Start the thread; it ends when `stop` (an Event) is set. Returns the thread, or None."""
    if not interval:
        return None

    def loop():
        since = {}                   # iteration -> when a partial pair of it was first seen
        warned = {}
        while not stop.wait(POLL_S):
            partial = {}             # iteration -> (missing workers, pairs partially pushed)
            for pair in list(server.pairs.values()):
                if 0 < pair.count < server.workers and pair.iteration is not None:
                    missing, n = partial.get(pair.iteration, (set(), 0))
                    missing |= {w for w, have in enumerate(pair.have) if not have}
                    partial[pair.iteration] = (missing, n + 1)
            now = time.monotonic()
            for it in list(since):
                if it not in partial:
                    since.pop(it)
                    warned.pop(it, None)
            for it, (missing, n) in partial.items():
                first = since.setdefault(it, now)
                if now - first >= interval and now - warned.get(it, first) >= interval:
                    warned[it] = now
                    warn(f"{name}: iteration {it}: waiting {now - first:.0f} s for pushes from "
                         f"{', '.join(namer(w) for w in sorted(missing))}; {n} of "
                         f"{len(server.pairs)} KV pairs have some of the {server.workers} pushes")

    thread = threading.Thread(target=loop, name="stall-inspector", daemon=True)
    thread.start()
    return thread
