"""The gateway's one exception tree; each leaf carries its HTTP status and OpenAI error fields.

Handlers and helpers raise these; one middleware (`gateway.app`) turns them into the OpenAI
error shape ``{"error": {"message", "type", "param", "code"}}`` (OpenAI API reference, "Error
codes"). Messages are client-safe: they never contain a key, a token or a server path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar


class GatewayError(Exception):
    """Base of every error the gateway answers with.

    Attributes:
        status: HTTP status code.
        type: OpenAI error ``type`` (e.g. ``invalid_request_error``).
        code: OpenAI error ``code`` (e.g. ``invalid_api_key``) or None.
        param: the request field at fault, or None.
        headers: extra response headers (e.g. ``Retry-After``).
        reason: a short bounded label for logs and metrics (never client-chosen).
    """

    status: ClassVar[int] = 500
    type: str = "server_error"
    code: str | None = "internal_error"
    reason: str = "internal"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        type: str | None = None,
        code: str | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})
        if type is not None:
            self.type = type
        if code is not None:
            self.code = code
        if reason is not None:
            self.reason = reason

    def body(self) -> dict[str, Any]:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def json_bytes(self) -> bytes:
        """The error object serialised as compact UTF-8 JSON."""
        return json.dumps(self.body(), separators=(",", ":"), ensure_ascii=False).encode()

    def sse_event(self) -> bytes:
        """The error as one SSE ``data:`` event, for errors after a stream's headers went out."""
        return b"data: " + self.json_bytes() + b"\n\n"


class BadRequest(GatewayError):
    """400: malformed JSON or an invalid field (``param`` names the field)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    reason = "bad_request"


class InvalidApiKey(GatewayError):
    """401: missing, malformed, unknown, expired or revoked credential.

    The message is the same for every cause so that probing learns nothing; ``reason`` (bounded:
    missing, malformed, unknown, expired, revoked, bad_signature, ...) goes to logs and metrics.
    """

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    reason = "unknown"

    def __init__(self, reason: str = "unknown") -> None:
        super().__init__(
            "Incorrect API key provided. Send a valid key as 'Authorization: Bearer <key>'.",
            reason=reason,
            headers={"WWW-Authenticate": 'Bearer realm="qwen38-gateway"'},
        )


class PermissionDenied(GatewayError):
    """403: a valid tenant asked for something its policy forbids."""

    status = 403
    type = "invalid_request_error"
    code = "permission_denied"
    reason = "policy"


class NotFound(GatewayError):
    """404: unknown route (``code`` ``not_found``) or unknown model (``model_not_found``)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"
    reason = "not_found"


class MethodNotAllowed(GatewayError):
    """405: a known route with the wrong method; ``Allow`` lists the right ones."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"
    reason = "method_not_allowed"


class RequestTimeout(GatewayError):
    """408: the client paused its upload longer than ``server.body_timeout_s``."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    reason = "body_timeout"


class PayloadTooLarge(GatewayError):
    """413: the body exceeds ``server.max_body_bytes``; it was read no further than the limit."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    reason = "too_large"


class RateLimited(GatewayError):
    """429 ``rate_limit_exceeded``; ``type`` names the limit (requests, tokens, concurrency, queue).

    ``retry_after_s`` is the real time until that limit frees; it is sent as ``Retry-After`` in whole
    seconds, rounded up and at least 1 (RFC 9110 section 10.2.3 allows only whole seconds).
    """

    status = 429
    code = "rate_limit_exceeded"
    reason = "rate_limited"

    def __init__(
        self,
        limit: str,
        message: str,
        retry_after_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        merged = dict(headers or {})
        merged["Retry-After"] = str(retry_after_header(retry_after_s))
        super().__init__(message, headers=merged, type=limit, reason=limit)
        self.limit = limit
        self.retry_after_s = retry_after_s


class EngineUnavailable(GatewayError):
    """503: the engine is down, starting or warming up, or the gateway is saturated overall."""

    status = 503
    type = "server_error"
    code = "engine_unavailable"
    reason = "engine_unavailable"

    def __init__(self, message: str, retry_after_s: float, **kwargs: Any) -> None:
        headers = dict(kwargs.pop("headers", None) or {})
        headers["Retry-After"] = str(retry_after_header(retry_after_s))
        super().__init__(message, headers=headers, **kwargs)


class BadGateway(GatewayError):
    """502: the engine answered something unusable or dropped the connection."""

    status = 502
    type = "server_error"
    code = "upstream_error"
    reason = "upstream_error"


class GatewayTimeout(GatewayError):
    """504: the engine stayed silent longer than ``engine.read_timeout_s``."""

    status = 504
    type = "server_error"
    code = "upstream_timeout"
    reason = "upstream_timeout"


def retry_after_header(seconds: float) -> int:
    """Whole seconds for ``Retry-After``: ``ceil(seconds)``, at least 1."""
    whole = int(seconds)
    if whole < seconds:
        whole += 1
    return max(1, whole)
