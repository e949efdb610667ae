"""Structured logs: structlog, one JSON object per line on stdout, ``request_id`` bound per request.

Never log keys, tokens, prompts or completions: the access line carries only its fixed
fields (`gateway.middleware.finish_request`) and a bounded reason, and `redact_secrets` masks credential-shaped strings that
could still reach a line through an exception message.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from gateway.secret_scan import CREDENTIAL_SHAPE_RE

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
REDACTED = "[redacted]"
# Credential shapes (`gateway.secret_scan.CREDENTIAL_SHAPE_RE`): keys written by `keys add`
# (``sk-q38-`` + base62) and any other ``sk-`` style key, a Bearer header value, and a JWT.
_SECRET_RE = CREDENTIAL_SHAPE_RE


class NamedWriteLogger(structlog.WriteLogger):
    """`structlog.WriteLogger` that knows its name, so lines carry ``logger`` (the module)."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


def _logger_factory(stream: TextIO) -> Callable[..., NamedWriteLogger]:
    def factory(*args: Any) -> NamedWriteLogger:
        return NamedWriteLogger(stream, str(args[0]) if args else "gateway")

    return factory


class _AccessLine:
    """Where the access line goes: the stream and threshold `configure_logging` set, and
    the structlog processors it configured with them."""

    def __init__(self) -> None:
        self.writer: NamedWriteLogger | None = None
        self.threshold = logging.INFO
        self.chain: list[Processor] = []


_ACCESS = _AccessLine()
_LINE_JSON = json.JSONEncoder(default=repr)
"""The access line's encoder, made once (`json.dumps` with ``default`` makes one a call)."""


def access_line(fields: dict[str, Any], warning: bool = False) -> None:
    """Write the access line (event ``request``, logger ``gateway.access``) of one request:
    the line structlog's chain would write for ``log.info("request", **fields)`` (or
    ``warning``), with the bound context, level, logger, ISO 8601 UTC timestamp and
    `redact_secrets`, rendered here in one pass.

    It is the one line of every request, written at its end on a cache that the request's
    stream has gone cold on: structlog's chain of processors took 200 µs of it there, this
    90 µs (c=1, 256-token streams, `tests/perf/README.md`). Before `configure_logging`, or
    while structlog is configured otherwise (a test's capture), it goes through structlog.
    ``fields`` is changed (the line's keys are added to it).
    """
    writer = _ACCESS.writer
    if writer is None or structlog.get_config()["processors"] != _ACCESS.chain:
        logger = structlog.get_logger("gateway.access")
        (logger.warning if warning else logger.info)("request", **fields)
        return
    level = logging.WARNING if warning else logging.INFO
    if level < _ACCESS.threshold:
        return
    fields["event"] = "request"
    structlog.contextvars.merge_contextvars(writer, "info", fields)
    fields["level"] = "warning" if warning else "info"
    fields["logger"] = "gateway.access"
    fields["timestamp"] = dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")
    if _holds_secret(fields):
        redact_secrets(writer, "info", fields)
    writer.msg(_LINE_JSON.encode(fields))


def _holds_secret(fields: EventDict) -> bool:
    """True when a string value of ``fields`` (or of a list or tuple in it) holds a credential
    shape that `redact_secrets` replaces. One search over the values joined by NUL, which no
    pattern of `_SECRET_RE` matches or crosses and which is a word boundary as a value's start
    and end are: the same verdict as a search of each value, in one pass instead of one
    substitution per value."""
    texts: list[str] = []
    for value in fields.values():
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, (list, tuple)):
            texts.extend(item for item in value if isinstance(item, str))
    return _SECRET_RE.search("\0".join(texts)) is not None


def redact_secrets(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """Replace credential-shaped substrings of every string value by ``[redacted]``.

    A structlog processor. The gateway never passes a credential to a logger; this is the net
    under exception messages and tracebacks (``exception`` field), which quote what they like.
    """
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = _SECRET_RE.sub(REDACTED, value)
        elif isinstance(value, (list, tuple)):
            event_dict[key] = [
                _SECRET_RE.sub(REDACTED, item) if isinstance(item, str) else item for item in value
            ]
    return event_dict


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Route structlog and the standard library's logging to ``stream`` as JSON lines.

    Args:
        level: ``[logging] level`` (debug, info, warning, error); lines below it are dropped.
        stream: where lines go; stdout when None (systemd's journal, Docker's log driver).

    Each line has ``event``, ``level``, ``logger`` (the module that logged it), ``timestamp``
    (ISO 8601 UTC) and the bound context (``request_id`` inside a request). Records of the
    standard library (aiohttp's server errors, asyncio) become the same JSON lines, at
    ``warning`` and above unless ``level`` is lower. aiohttp's access log is off: the gateway
    writes its own access line (event ``request``).
    """
    out = stream or sys.stdout
    threshold = LEVELS.get(level, logging.INFO)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    render: list[Processor] = [
        structlog.processors.format_exc_info,
        redact_secrets,
        structlog.processors.JSONRenderer(sort_keys=False),
    ]
    processors = [*shared, *render]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=_logger_factory(out),
        cache_logger_on_first_use=False,
    )
    _ACCESS.writer = NamedWriteLogger(out, "gateway.access")
    _ACCESS.chain = list(processors)
    _ACCESS.threshold = threshold
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(_library_threshold(threshold))
    logging.getLogger("aiohttp.access").disabled = True


def set_level(level: str) -> None:
    """Change the threshold of the logging `configure_logging` set up, keeping everything else.

    For a reload of ``[logging] level``: takes effect for the next line, in flight or not.

    Raises:
        KeyError: ``level`` is not one of debug, info, warning, error (config validation
            rules that out).
    """
    threshold = LEVELS[level]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(threshold))
    _ACCESS.threshold = threshold
    logging.getLogger().setLevel(_library_threshold(threshold))


def _library_threshold(threshold: int) -> int:
    """Libraries are chatty at info: their lines show from warning up, or everything at debug."""
    return threshold if threshold == logging.DEBUG else max(threshold, logging.WARNING)
