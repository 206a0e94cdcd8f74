"""Per-worker event records and the one Chrome trace of a run (`--timeline FILE`).

Each worker records complete events ('X') for the forward, the backward of each layer (on the main
thread) and the sync of each layer (on its pool thread; the last one to start on the training
thread), with the scheme and bytes as arguments, and, with --priority, each slice the worker
hands to a peer (a row per peer, "send to rank 2"), named by the layer whose sync sent it, so the
order the scheduler chose can be seen against the syncs.
At the end of the run the workers' events are gathered to worker 0, which writes one JSON file that
chrome://tracing and Perfetto open: a process row per worker, a thread row per worker thread.
Timestamps are wall-clock microseconds, so rows of processes on one machine line up; across
machines they are as good as the hosts' clock synchronisation.
"""
import json
import threading
import time


class Timeline:
    def __init__(self, rank, enabled=True, max_events=200_000):
        self.rank = rank
        self.enabled = enabled
        self.max_events = max_events
        self._events = []
        self._lock = threading.Lock()
        self.dropped = 0

    def event(self, name, cat, start, end, thread=None, args=None):
        if not self.enabled:
            return
        with self._lock:
            if len(self._events) >= self.max_events:
                self.dropped += 1
                return
            self._events.append([name, cat, start, end, thread or threading.current_thread().name,
                                 args or {}])

    def span(self, name, cat, args=None):
        """Context manager recording one event around a block."""
        return _Span(self, name, cat, args)

    def events(self):
        with self._lock:
            return list(self._events)


class _Span:
    def __init__(self, timeline, name, cat, args):
        self.t, self.name, self.cat, self.args = timeline, name, cat, args

    def __enter__(self):
        self.start = time.time()
        return self

    def __exit__(self, *exc):
        self.t.event(self.name, self.cat, self.start, time.time(), args=self.args)
        return False


def slice_recorder(timeline, layer_names):
    """fn(peer, slice, start, end) recording one slice's send (the transport's `slice_log`):
    'send ip1' on the row 'send to rank 2', or 'send (control)' for a message of no layer's
    sync."""
    from ..transport import URGENT, Msg

    def record(peer, item, start, end):
        layer = item.level
        what = layer_names[layer] if URGENT < layer < len(layer_names) else "(control)"
        try:
            kind = Msg(item.mtype).name
        except ValueError:
            kind = item.mtype
        timeline.event(f"send {what}", "slice", start, end, thread=f"send to {peer}",
                       args={"layer": layer, "type": kind, "key": item.key,
                             "iter": item.iteration,
                             "slice": f"{item.index + 1}/{item.count}", "bytes": item.nbytes})
    return record


def chrome_trace(per_worker):
    """[(rank, events)] -> the Chrome trace dict (one pid per worker, one tid per thread)."""
    trace = []
    for rank, events in per_worker:
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                      "args": {"name": f"worker {rank}"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                      "args": {"sort_index": rank}})
        tids = {}
        for name, cat, start, end, thread, args in events:
            if thread not in tids:
                tids[thread] = len(tids) + 1
                label = "compute (forward, backward)" if thread == "compute" else thread
                trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tids[thread],
                              "args": {"name": label}})
                trace.append({"name": "thread_sort_index", "ph": "M", "pid": rank,
                              "tid": tids[thread], "args": {"sort_index": tids[thread]}})
            trace.append({"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": tids[thread],
                          "ts": round(start * 1e6, 1), "dur": round(max(end - start, 0) * 1e6, 1),
                          "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_trace(path, per_worker):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(per_worker), f)


def role_path(path, role, index):
    """'run/stats.jsonl' -> 'run/stats.worker-0.jsonl' (role and rank in the file name)."""
    import os
    head, tail = os.path.split(path)
    stem, dot, ext = tail.rpartition(".")
    if not dot or not stem:
        return os.path.join(head, f"{tail}.{role}-{index}")
    return os.path.join(head, f"{stem}.{role}-{index}.{ext}")
