"""How results.md writes a figure, shared by its sections (report.py and the modules it draws its
sections from), so that every table reads the same way."""


def mm(s, fmt="{:.0f}", scale=1.0):
    """A stats dict (tools/bench/env.stats) as 'median (min–max)', '-' when there is none."""
    if not s:
        return "-"
    return (fmt.format(s["median"] * scale) + " (" + fmt.format(s["min"] * scale) + "–"
            + fmt.format(s["max"] * scale) + ")")


def why(part):
    """A part that was not measured, as its status and reason."""
    if not part:
        return "not measured"
    return f"{part.get('status', 'not measured')}: {part.get('reason', '')}".strip()
