"""Structured logs: structlog, one JSON object per line on stdout, ``request_id`` bound per request.

Never log keys, tokens, prompts or completions: the access line carries only the fields of
DESIGN section 7 and a bounded reason.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Route structlog to ``stream`` (stdout) as JSON lines, filtered at ``level``.

    Each line has ``timestamp`` (ISO 8601 UTC), ``level``, ``logger``, ``event`` and the bound
    context (``request_id`` inside a request). aiohttp's own access log is not used.
    """
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(sort_keys=False),
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stdout),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("aiohttp.access").disabled = True
