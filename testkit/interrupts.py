"""How a command-line run of the test kit (`make demo`, `make cluster`) stops: whatever stops
it, it tears down what it made first.

- Ctrl-C, SIGTERM and SIGHUP (its terminal closed) raise KeyboardInterrupt in the main thread
  (`stop_on_signals`), so the run's `finally` blocks tear down; `stopped_by()` is then the exit
  code a shell reports for that signal (128 + its number). SIGINT is set too: a shell may have
  started the run with it ignored.
- Its reader going away (`make demo | head`): SIGPIPE stays ignored (Python's default), so the
  next line written fails with EPIPE; `say` turns that into `OutputClosed`, and every later
  line (the cleanup's report) goes nowhere. Exit with `SIGPIPE_CODE`, as a shell reports a
  process killed by SIGPIPE.
- `hold_off_signals()` before the teardown: a second Ctrl-C must not stop it half-way.
"""

from __future__ import annotations

import os
import signal
import sys

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SIGPIPE_CODE = 128 + signal.SIGPIPE


class OutputClosed(Exception):
    """Whoever read the run's output went away (`make demo | head`): stop, and clean up."""


_output_closed = [False]
_signal_code = [128 + signal.SIGINT]  # the exit code of a run stopped by a signal


def say(text: str = "") -> None:
    """One line to stdout. Once the reader is gone the first failed write raises
    OutputClosed, and every later one goes nowhere. EIO (a terminal hung up) counts as gone
    too."""
    if _output_closed[0]:
        return
    try:
        print(text, flush=True)
    except OSError:
        _output_closed[0] = True
        # Python's recipe: stdout to /dev/null, or the flush at exit fails once more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        raise OutputClosed from None


def output_closed() -> bool:
    return _output_closed[0]


def _interrupt(signum: int, frame: object) -> None:
    _signal_code[0] = 128 + signum
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt (main thread only)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)


def hold_off_signals() -> None:
    """Ignore them from now on: the teardown runs to its end."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stopped_by() -> int:
    """128 + the number of the last signal `stop_on_signals` caught (130 when none: a
    KeyboardInterrupt from Python's own Ctrl-C handler)."""
    return _signal_code[0]
