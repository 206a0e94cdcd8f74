"""Reading what a distributed job wrote about worker 0: its per-iteration wall times from the stats
records (`--stats`), and from the timeline (`--timeline`) how much of its sync the backward pass
hid. Parts e, g and h read their jobs through these."""
from .env import stats


def iteration_times(records, skip):
    """Per-iteration wall time of worker 0 from consecutive stats records (after `skip`)."""
    times = [r["time"] for r in records]
    return [b - a for a, b in zip(times[skip:], times[skip + 1:])]


def hidden_share(timeline, skip):
    """Share of worker 0's sync time (union of its layers' sync intervals) that falls inside its
    backward pass, per iteration: 1.0 = all communication hidden under backward."""
    if not timeline:
        return None
    per_iter = {}
    for ev in timeline.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("pid") != 0:
            continue
        it = (ev.get("args") or {}).get("iter")
        if it is None:
            continue
        cat = ev.get("cat", "")
        span = (ev["ts"], ev["ts"] + ev["dur"])
        slot = per_iter.setdefault(it, {"backward": [], "sync": []})
        if cat == "backward":
            slot["backward"].append(span)
        elif cat.startswith("sync"):
            slot["sync"].append(span)
    shares = []
    for it in sorted(per_iter)[skip:]:
        slot = per_iter[it]
        if not slot["sync"] or not slot["backward"]:
            continue
        b0 = min(s for s, _ in slot["backward"])
        b1 = max(e for _, e in slot["backward"])
        union = _union(slot["sync"])
        total = sum(e - s for s, e in union)
        inside = sum(max(0.0, min(e, b1) - max(s, b0)) for s, e in union)
        if total > 0:
            shares.append(inside / total)
    return stats(shares) if shares else None


def _union(spans):
    """The spans merged where they overlap, in order: the time covered by any of them."""
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out
