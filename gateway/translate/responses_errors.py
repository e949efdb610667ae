"""Gateway errors on ``/v1/responses``: OpenAI's envelope with string codes.

OpenAI API reference, "Error codes": ``{"error": {"message", "type", "param", "code"}}`` with
``code`` a string. The gateway's errors already carry string codes (``invalid_api_key``,
``rate_limit_exceeded``, ...); the engine's prompt-too-long 400 (an integer ``code`` from vLLM)
becomes ``context_length_exceeded``, the code Codex recognises as a full context window.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import GatewayError
from gateway.translate.common import context_overflow

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def responses_error(exc: GatewayError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for ``exc`` on ``/v1/responses``."""
    body = exc.body()
    if context_overflow(exc) is not None:
        body["error"]["code"] = CONTEXT_LENGTH_EXCEEDED
        body["error"]["param"] = "input"
    return exc.status, body, dict(exc.headers)


def failure_code(exc: GatewayError) -> str:
    """The ``response.failed`` ``error.code`` for a failure after the stream started.

    The Responses API's codes for a failed response are ``server_error``,
    ``rate_limit_exceeded`` and a few input ones; a refusal by the gateway keeps its own code.
    """
    if context_overflow(exc) is not None:
        return CONTEXT_LENGTH_EXCEEDED
    if exc.status == 429:
        return "rate_limit_exceeded"
    if exc.status >= 500:
        return "server_error"
    return exc.code or "invalid_request"


def responses_error_bytes(exc: GatewayError) -> bytes:
    """The OpenAI error body of ``exc`` as compact JSON."""
    return json.dumps(responses_error(exc)[1], ensure_ascii=False, separators=(",", ":")).encode()
