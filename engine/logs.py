"""JSON-lines logging for the launcher: structlog, one object per line on stdout."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog
from structlog.typing import FilteringBoundLogger


def configure_logging(stream: TextIO | None = None, level: int = logging.INFO) -> None:
    """Route structlog to ``stream`` (default stdout) as one JSON object per line.

    Each line carries ``timestamp`` (ISO 8601, UTC), ``level`` and ``event``; lines are flushed
    as written so they interleave cleanly with the engine's own output in the journal.
    """
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(file=stream or sys.stdout),
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: Any) -> FilteringBoundLogger:
    """A structlog logger bound with ``component="launcher"`` and ``bound``.

    The component key tells launcher lines from the engine's, which share stdout.
    """
    logger: FilteringBoundLogger = structlog.get_logger().bind(component="launcher", **bound)
    return logger
