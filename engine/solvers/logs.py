"""The solver's log in glog's line format, so that Caffe's log parsers (tools/extra/parse_log.py)
and `poseidon plot` read it; `log_to_stderr()` installs the handler."""
import datetime
import logging
import sys

log = logging.getLogger("poseidon")


class GlogFormatter(logging.Formatter):
    """`I1123 10:00:00.123456 <pid> solver.py:123] message`, as glog writes Caffe's lines."""

    LETTERS = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E",
               logging.CRITICAL: "F"}

    def format(self, record):
        t = datetime.datetime.fromtimestamp(record.created)
        letter = self.LETTERS.get(record.levelno, "I")
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return (f"{letter}{t:%m%d %H:%M:%S}.{t.microsecond:06d} {record.process} "
                f"{record.filename}:{record.lineno}] {message}")


def final_accuracy_lines(solver):
    """'Final test accuracy (net #i): x' for each accuracy output of the solver's last test."""
    return [f"Final test {name} (net #{i}): {float(value):.4f}"
            for i, results in enumerate(getattr(solver, "last_test_results", None) or [])
            for name, value in results.items() if "accuracy" in name]


def log_to_stderr(level=logging.INFO, stream=None):
    """Send the "poseidon" logger to stderr (or `stream`) in glog format; idempotent."""
    for handler in log.handlers:
        if isinstance(handler.formatter, GlogFormatter):
            break
    else:
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(GlogFormatter())
        log.addHandler(handler)
    log.setLevel(level)
    return handler


def logging_configured():
    return bool(log.handlers or logging.getLogger().handlers)


def g(x):
    """A number as C++'s ostream prints a float (6 significant digits, %g)."""
    return f"{float(x):.6g}"
