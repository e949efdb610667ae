"""Gateway errors in Anthropic's shape, for ``/v1/messages`` and ``/v1/messages/count_tokens``.

Anthropic API reference, "Errors": the body is ``{"type": "error", "error": {"type", "message"}}``
and the types are ``invalid_request_error`` (400), ``authentication_error`` (401),
``permission_error`` (403), ``not_found_error`` (404), ``request_too_large`` (413),
``rate_limit_error`` (429), ``api_error`` (500), ``timeout_error`` (504) and
``overloaded_error`` (529). Rate-limit answers carry ``retry-after`` and Anthropic's
``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`` headers ("Rate limits"; reset
as an RFC 3339 time). A prompt over the context is worded ``prompt is too long: N tokens > M
maximum``, the wording Claude Code acts on (it compacts the conversation).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

from gateway.errors import EngineUnavailable, GatewayError
from gateway.translate.common import overflow_of

OVERLOADED_STATUS = 529
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_HEADER_MAP = {
    "x-ratelimit-limit-requests": "anthropic-ratelimit-requests-limit",
    "x-ratelimit-remaining-requests": "anthropic-ratelimit-requests-remaining",
    "x-ratelimit-limit-tokens": "anthropic-ratelimit-tokens-limit",
    "x-ratelimit-remaining-tokens": "anthropic-ratelimit-tokens-remaining",
}
_RESET_MAP = {
    "x-ratelimit-reset-requests": "anthropic-ratelimit-requests-reset",
    "x-ratelimit-reset-tokens": "anthropic-ratelimit-tokens-reset",
}


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (``api_error`` for other statuses)."""
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def anthropic_error(exc: GatewayError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for ``exc`` on an Anthropic route.

    A full queue or an unavailable engine (`EngineUnavailable`, 503) becomes 529
    ``overloaded_error`` with its ``retry-after``; the engine's prompt-too-long 400 is reworded.
    """
    status = exc.status
    if isinstance(exc, EngineUnavailable):
        status = OVERLOADED_STATUS
    message = exc.message
    overflow = overflow_of(exc)
    if overflow is not None:
        message = overflow.anthropic_message()
    body = {"type": "error", "error": {"type": error_type(status), "message": message}}
    return status, body, anthropic_headers(exc.headers)


def anthropic_headers(headers: dict[str, str]) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers as Anthropic's ``anthropic-ratelimit-*`` (resets as
    RFC 3339 times); ``Retry-After`` and other headers are kept."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        lower = name.lower()
        if lower in _HEADER_MAP:
            out[_HEADER_MAP[lower]] = value
        elif lower in _RESET_MAP:
            out[_RESET_MAP[lower]] = _reset_time(value)
        else:
            out[name] = value
    return out


def _reset_time(duration: str) -> str:
    """An OpenAI reset duration (``"120ms"``, ``"6m0s"``, ``"1h2m3.5s"``) as the RFC 3339 time
    it ends at."""
    seconds = 0.0
    number = ""
    rest = duration
    while rest:
        char = rest[0]
        if char.isdigit() or char == ".":
            number += char
            rest = rest[1:]
            continue
        unit = "ms" if rest.startswith("ms") else char
        rest = rest[len(unit) :]
        value = float(number or 0)
        number = ""
        seconds += value * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}.get(unit, 0)
    at = datetime.fromtimestamp(time.time() + seconds, tz=timezone.utc)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def anthropic_error_bytes(exc: GatewayError) -> bytes:
    """The Anthropic error body of ``exc`` as compact JSON."""
    return json.dumps(anthropic_error(exc)[1], ensure_ascii=False, separators=(",", ":")).encode()
