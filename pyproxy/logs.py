"""Logging with structlog: key=value lines on a terminal, JSON lines otherwise (journald and
container log collectors parse them)."""

from __future__ import annotations

import logging
import sys

import structlog

# kube-proxy's -v levels: 0-1 info, 2-3 info with more detail, ≥4 debug.
_LEVELS = {0: logging.INFO, 1: logging.INFO, 2: logging.INFO, 3: logging.INFO}


def setup_logging(fmt: str = "text", verbosity: int = 0) -> None:
    """fmt "json": JSON lines. "text" (kube-proxy's default): readable lines on a terminal,
    JSON lines elsewhere, because a daemon's stderr is read by a log collector."""
    level = _LEVELS.get(verbosity, logging.DEBUG)
    as_json = fmt == "json" or not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
