"""What a worker records of each iteration, apart from the algorithm: when forward and each
backward ran, the loss, and, once the iteration's syncs are done, the timeline's sync events and
the --stats line.

Why apart: the schedule of syncs (dist/worker/wfbp.py) reads beside the paper's Algorithm 2; the
figures a user reads (--stats, --timeline, the bench's exposed sync) are kept here, keyed by
iteration, since an iteration's syncs are settled while the next one already runs.
"""
import dataclasses
import json
import time


@dataclasses.dataclass
class IterationTimes:
    """One iteration's times (seconds since the epoch) and loss."""
    start: float
    forward_start: float = 0.0
    forward_end: float = 0.0
    mark: float = 0.0                   # the end of the last forward or backward step
    backward_end: float = 0.0
    backward_s: float = 0.0             # seconds of the layers' backward
    loss_sum: float = 0.0               # over the iter_size passes
    mean_loss: float = None             # over the workers


class IterationRecorder:
    """Times of the iterations whose syncs are not yet settled; writes a settled one's timeline
    events and --stats line (`stats`: an open file, or None)."""

    KEEP = 4                            # iterations kept at most (one settles while the next runs)

    def __init__(self, rank, timeline, layer_names, stats=None):
        self.rank, self.timeline, self.layer_names, self.stats = rank, timeline, layer_names, stats
        self._times = {}

    def begin(self, it):
        self._times[it] = times = IterationTimes(start=time.time())
        for old in sorted(self._times)[:-self.KEEP]:
            del self._times[old]
        return times

    def of(self, it):
        return self._times.get(it) or self.begin(it)

    def forward_started(self, it):
        self.of(it).forward_start = time.time()

    def forward_ended(self, it):
        self.of(it).forward_end = time.time()

    def loss_known(self, it, loss):
        """After a pass's forward (the loss of that pass): the forward's timeline event."""
        t, now = self.of(it), time.time()
        self.timeline.event("forward", "forward", t.forward_start, t.forward_end or now,
                            thread="compute", args={"iter": it})
        t.forward_end = 0.0
        t.mark = t.backward_end = now
        t.loss_sum += loss

    def backward_done(self, it, layer, ran):
        """Layer `layer`'s backward of iteration `it` is over (`ran`: it had one to run)."""
        t, now = self.of(it), time.time()
        if ran:
            t.backward_s += now - t.mark
            t.backward_end = now
            self.timeline.event(f"backward {self.layer_names[layer]}", "backward", t.mark, now,
                                thread="compute", args={"iter": it, "layer": layer})
        t.mark = now

    def settled(self, it, stats, barrier_s, exposed_s, extra_layer_fields=None, notes=None):
        """Iteration `it`'s syncs are done: their timeline events and its --stats line.
        extra_layer_fields(LayerStats) -> dict: more fields for a layer's entry; notes: the
        record's extra top-level fields."""
        for st in stats:
            self.timeline.event(f"sync {st.name}", f"sync {st.scheme}", st.start, st.end,
                                thread=st.thread,
                                args={"iter": it, "scheme": st.scheme, "layer": st.layer,
                                      "sent_payload": st.sent_payload,
                                      "recv_payload": st.recv_payload})
        t = self._times.pop(it, None) or IterationTimes(start=time.time())
        if self.stats is None:
            return
        layers = {st.name: st.as_dict() for st in sorted(stats, key=lambda x: -x.layer)}
        if extra_layer_fields is not None:
            for st in stats:
                layers[st.name].update(extra_layer_fields(st))
        record = {"iter": it, "role": "worker", "rank": self.rank, "time": time.time(),
                  "loss": t.mean_loss,
                  "forward_backward_s": round((t.backward_end or t.start) - t.start, 6),
                  "backward_s": round(t.backward_s, 6),
                  "barrier_wait_s": round(barrier_s, 6),
                  "exposed_sync_s": round(exposed_s, 6), "layers": layers}
        for key in ("sent_payload", "recv_payload", "sent_header", "recv_header"):
            record[key] = sum(v[key] for v in layers.values())
        record.update(notes or {})
        self.stats.write(json.dumps(record) + "\n")
        self.stats.flush()

    def close(self):
        if self.stats is not None:
            self.stats.close()
