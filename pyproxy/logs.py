"""Logging with structlog, always on stderr: standard output belongs to the commands' answers
(`pyproxy render -f F | nft -f -` must never receive a log line).

The format is the one asked for, whatever stderr is: `json` is JSON lines; `text` (kube-proxy's
default) is key=value lines (logfmt) that journald and container log collectors keep as they
are, with colours and aligned columns only on a terminal.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

# kube-proxy's -v levels: 0-1 info, 2-3 info with more detail, ≥4 debug.
_LEVELS = {0: logging.INFO, 1: logging.INFO, 2: logging.INFO, 3: logging.INFO}
FORMATS = ("text", "json")


class _Stderr:
    """sys.stderr as it is when a line is written, not when logging was set up: a test's
    captured stream (or a redirected one) may be replaced after `setup_logging`."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def renderer(fmt: str, terminal: bool) -> structlog.typing.Processor:
    """The last processor: what a line looks like for `fmt` on a terminal or elsewhere."""
    if fmt == "json":
        return structlog.processors.JSONRenderer()
    if terminal:
        return structlog.dev.ConsoleRenderer(colors=True)
    return structlog.processors.LogfmtRenderer(
        key_order=["timestamp", "level", "event"], drop_missing=True, bool_as_flag=False)


def setup_logging(fmt: str = "text", verbosity: int = 0, *, stream: TextIO | None = None,
                  cache: bool = True) -> None:
    """fmt "json": JSON lines; "text": key=value lines (readable columns on a terminal).
    `stream` (default stderr, looked up at every write) is for tests. `cache` binds loggers
    at first use (the daemon's hot path); the one-shot commands leave it off so that a later
    configuration (a test's capture) still reaches their module-level loggers."""
    if fmt not in FORMATS:
        raise ValueError(f"logging format must be text or json, got {fmt!r}")
    level = _LEVELS.get(verbosity, logging.DEBUG)
    out: TextIO | _Stderr = stream if stream is not None else _Stderr()
    terminal = (stream if stream is not None else sys.stderr).isatty()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer(fmt, terminal),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=out),  # type: ignore[arg-type]
        cache_logger_on_first_use=cache,
    )
