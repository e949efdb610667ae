"""The gateway's one exception tree; each leaf carries its HTTP status and OpenAI error fields.

Two families under the root `GatewayError`: `ClientError` (4xx, the request is refused) and
`UpstreamError` (502, 503, 504, the engine failed or is not available). Handlers and helpers
raise these; one middleware (`gateway.middleware`) turns them into the OpenAI error shape
``{"error": {"message", "type", "param", "code"}}`` (OpenAI API reference, "Error codes").
Messages are client-safe: they never contain a key, a token or a server path.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, TypeGuard

from gateway.framing import data_event
from gateway.secret_scan import looks_like_credential

# Seconds a client should wait before retrying while the engine loads or restarts: a V100 takes
# minutes to load and warm up the 23 GB checkpoint, a crash restart about as long.
RETRY_AFTER_STARTING_S = 30.0
RETRY_AFTER_DOWN_S = 10.0

# Every credential the gateway accepts is at least this long (API keys: 16 characters, JWTs far
# more), so a client string shorter than it can be quoted back without echoing one.
QUOTABLE_MAX_CHARS = 15
# Of a longer quoted value in an engine's message, at most this much is kept.
QUOTED_PREFIX_CHARS = 24


def quotable(text: Any) -> str:
    """``text`` as an error message may quote it: short plain strings as they are; anything that
    could be a credential (16 characters or more, whatever its prefix or padding, one that
    starts like a key, a JWT or an ``Authorization`` value as sent or percent- or
    base64-decoded, or not a string at all) as ``<redacted>``. Every client value an error
    names goes through here, so no error quotes more than 15 characters of one."""
    if (
        isinstance(text, str)
        and len(text) <= QUOTABLE_MAX_CHARS
        and text.isprintable()
        and not looks_like_credential(text)
    ):
        return text
    return "<redacted>"


# The one rule for a name an error states whole although it is longer than `quotable` allows:
# snake_case in lowercase letters only, one ``_`` at least, at most FIELD_NAME_MAX_CHARS
# (``previous_response_id``, ``include_stop_str_in_output``). No generated key or JWT has this
# shape, nor a hand-written secret with a digit in it (``team_alpha_prod_secret_42``). A body's
# keys (`quotable_name`), the names in an engine's message (`scrub_credentials`) and in its
# ``param`` (`gateway.upstream.stated_param`), and tool names (`gateway.translate.common.label`)
# are all judged by it.
FIELD_NAME = r"[a-z]+(?:_[a-z]+)+"
FIELD_NAME_MAX_CHARS = 48
_FIELD_NAME_RE = re.compile(FIELD_NAME)


def is_field_name(name: Any) -> TypeGuard[str]:
    """True when ``name`` has the shape of a field's name that errors state whole (`FIELD_NAME`,
    at most `FIELD_NAME_MAX_CHARS` characters)."""
    return (
        isinstance(name, str)
        and len(name) <= FIELD_NAME_MAX_CHARS
        and _FIELD_NAME_RE.fullmatch(name) is not None
    )


def quotable_name(name: Any) -> str:
    """A body's field name as an error may quote it: whole when `is_field_name`, so the field
    at fault is named whatever the API; else as `quotable` shows it (a key of 16 characters or
    more that is not such a name reads ``<redacted>``)."""
    if is_field_name(name):
        return name
    return quotable(name)


# What may be a credential inside a text the gateway did not write (an engine's error message
# that quotes the request): a Bearer value, an ``sk-`` key, a JWT; then (`_RUN_RE`) any run of
# 16+ characters, the shortest credential the gateway accepts.
_CREDENTIAL_RE = re.compile(
    r"(?i:\bbearer\s+\S+)"
    r"|sk-[A-Za-z0-9._~+/=-]+"
    r"|eyJ[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]*){0,2}"
)


# A quoted stretch of a text the gateway did not write, long enough to be a client value worth
# shortening (vLLM's and pydantic's messages quote the value they refuse).
# The opening quote follows a space, an opening bracket, ``=``, ``:`` or ``,`` (or starts the
# text), so the words between two quoted names (`` `tool_choice` does not match `tools` ``) are
# not taken for a quoted value.
_QUOTED_RE = re.compile(
    r"(?<![^\s(\[{=:,])(['\"`])([^'\"`]{" + str(QUOTED_PREFIX_CHARS + 1) + r",})\1"
)
# An engine message is cut here (vLLM's longest own messages are about 300 characters).
ENGINE_MESSAGE_MAX_CHARS = 400
# A run of 16+ characters without a space or quote, quoted or not: vLLM and pydantic also name
# a refused value unquoted (``Invalid value for `tool_choice`: <value>``).
_RUN_RE = re.compile(r"[^\s'\"`]{" + str(QUOTABLE_MAX_CHARS + 1) + r",}")
# Runs an engine's message keeps whole (at most FIELD_NAME_MAX_CHARS), with their punctuation:
# field names (`FIELD_NAME`: ``continuous_usage_stats``), settings with values
# (``max_completion_tokens=32768``, ``max_model_len=max_total_tokens=4096.``,
# ``(parameter=input_tokens,``) and command-line flags (``--trust-request-chat-template``, the
# same shape with ``-``).
_NAME = FIELD_NAME + r"|--[a-z]+(?:-[a-z]+)+"
_NAMED_RUN_RE = re.compile(
    r"[(\[]?(?:[a-z]+=)?(?:" + _NAME + r")(?:=(?:" + _NAME + r"|\d+))*[.,:;)\]]*"
)


def _long_run(match: re.Match[str]) -> str:
    run = match[0]
    if len(run) <= FIELD_NAME_MAX_CHARS and _NAMED_RUN_RE.fullmatch(run):
        return run
    return "<redacted>"


def scrub_credentials(text: str) -> str:
    """``text`` with everything that could be a credential replaced by ``<redacted>`` (the
    shapes of keys, JWTs and ``Bearer`` values, and any run of 16 characters or more without a
    space, quoted or not, but a field's snake_case name), every quoted stretch longer than
    `QUOTED_PREFIX_CHARS` cut to that prefix, and the whole cut to `ENGINE_MESSAGE_MAX_CHARS`:
    what an engine's message may say about a client value (case C29: a key without its prefix,
    or hex-, base64- or percent-encoded, is such a run)."""
    text = _CREDENTIAL_RE.sub("<redacted>", text)
    text = _RUN_RE.sub(_long_run, text)
    text = _QUOTED_RE.sub(lambda m: f"{m[1]}{m[2][:QUOTED_PREFIX_CHARS]}...{m[1]}", text)
    if len(text) > ENGINE_MESSAGE_MAX_CHARS:
        text = text[:ENGINE_MESSAGE_MAX_CHARS] + "..."
    return text


_SURROGATE_RE = re.compile("[\\ud800-\\udfff]")


def safe_text(text: str) -> str:
    """``text`` with anything UTF-8 cannot carry (a lone surrogate decoded from the client's
    bytes or escapes) replaced by U+FFFD, so an error message always serialises."""
    return _SURROGATE_RE.sub("\ufffd", text)


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

    status: int = 500
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
        message = safe_text(message)
        super().__init__(message)
        self.message = message
        self.param = safe_text(param) if param is not None else None
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
        return data_event(self.json_bytes())


class ClientError(GatewayError):
    """4xx: the request is refused as sent (RFC 9110 section 15.5, "Client Error 4xx")."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    reason = "bad_request"


class HttpError(ClientError):
    """A 4xx that aiohttp decided (routing, HTTP parser) with no more specific leaf here.

    Args:
        status: the HTTP status, 400..499.
        message: client-safe text (the status phrase).
    """

    def __init__(self, status: int, message: str, *, reason: str = "http") -> None:
        super().__init__(message, reason=reason)
        self.status = status


class BadRequest(ClientError):
    """400: malformed JSON or an invalid field (``param`` names the field)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    reason = "bad_request"


class InvalidApiKey(ClientError):
    """401: missing, malformed, unknown, expired or revoked credential.

    The message names the header the client sent its credential in (``sent_in``:
    ``Authorization`` or the dialect's key header, Anthropic's ``x-api-key``) and otherwise is
    the same for every cause, so that probing learns nothing; without a credential it lists the
    headers this API takes (``key_header``). ``reason`` (bounded: missing, malformed, unknown,
    expired, revoked, bad_signature, ...) goes to logs and metrics.

    ``x-should-retry: false``: the Stainless SDKs (``openai``, ``anthropic``) and Claude Code obey
    it before their own rules, and Claude Code otherwise retries a 401 up to ten times with
    backoff (minutes) before it reports the key as wrong.
    """

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    reason = "unknown"

    def __init__(
        self, reason: str = "unknown", *, sent_in: str | None = None, key_header: str | None = None
    ) -> None:
        bearer = "'Authorization: Bearer <key>'"
        if sent_in is not None and sent_in.lower() != "authorization":
            message = f"Incorrect API key provided in '{sent_in}'. Send a valid key as '{sent_in}: <key>'."
        elif sent_in is not None:
            message = f"Incorrect API key provided. Send a valid key as {bearer}."
        elif key_header is not None:
            message = f"No API key provided. Send one as '{key_header}: <key>' or as {bearer}."
        else:
            message = f"No API key provided. Send one as {bearer}."
        super().__init__(
            message,
            reason=reason,
            headers={
                "WWW-Authenticate": 'Bearer realm="qwen38-gateway"',
                "x-should-retry": "false",
            },
        )
        self.key_header = key_header

    def sent_in(self, header: str | None, key_header: str | None) -> InvalidApiKey:
        """The same refusal, its message naming ``header`` (None: no credential was sent)."""
        return InvalidApiKey(self.reason, sent_in=header, key_header=key_header)


class PermissionDenied(ClientError):
    """403: a valid tenant asked for something its policy forbids."""

    status = 403
    type = "invalid_request_error"
    code = "permission_denied"
    reason = "policy"


class NotFound(ClientError):
    """404: unknown route (``code`` ``not_found``) or unknown model (``model_not_found``)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"
    reason = "not_found"


class ModelNotFound(NotFound):
    """404 ``model_not_found`` in vLLM's wording for a ``model`` that is not the alias.

    The name is quoted only when it cannot be a credential (`quotable`): an API key or a JWT
    pasted into the wrong field, with or without a prefix, padded or inside a list, is never
    echoed back.

    Attributes:
        name: the model name the client sent, as sent.
    """

    code = "model_not_found"

    def __init__(self, name: Any) -> None:
        super().__init__(f"The model `{quotable(name)}` does not exist.", param="model")
        self.name = name


class EngineRejected(ClientError):
    """The engine refused the request with a 4xx; its status and message pass through.

    They describe the request (a prompt longer than the context, a bad field), so the client
    sees what the engine said (vLLM's OpenAI-compatible error body).

    Attributes:
        status: the engine's HTTP status (400..499, not 401, 403 or 404).
        message: the engine's ``error.message``, or a generic sentence.
        param: the engine's ``error.param`` when a string.
    """

    reason = "engine_4xx"

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.status = status


class MethodNotAllowed(ClientError):
    """405: a known route with the wrong method; ``Allow`` lists the right ones."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"
    reason = "method_not_allowed"


class RequestTimeout(ClientError):
    """408: the client paused its upload longer than ``server.body_timeout_s``."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    reason = "body_timeout"


class UnsupportedContentEncoding(ClientError):
    """415: the body's ``Content-Encoding`` is not one the gateway undoes; ``Accept-Encoding``
    names those it does (RFC 9110 section 15.5.16). Read as they are, such bytes would be
    answered as malformed JSON at best, or parsed as a body the client never meant."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"
    reason = "bad_request"


class PayloadTooLarge(ClientError):
    """413: the body exceeds ``server.max_body_bytes``; it was read no further than the limit."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    reason = "too_large"


class RateLimited(ClientError):
    """429 ``rate_limit_exceeded``; ``type`` names the limit (requests, tokens, concurrency, queue).

    ``retry_after_s`` is the real time until that limit frees; it is sent as ``Retry-After`` in whole
    seconds, rounded up and at least 1 (RFC 9110 section 10.2.3 allows only whole seconds).
    Infinite means the request can never pass as it is (more tokens than the whole limit, a
    limit of 0): no ``Retry-After`` then, and ``x-should-retry: false``, which the Stainless SDKs
    (``openai``, ``anthropic``) obey before retrying a 429 (their default: twice, with backoff
    and the server's ``Retry-After``; two minutes lost on a 60 s one before the error showed).
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
        if math.isinf(retry_after_s):
            merged["x-should-retry"] = "false"
        else:
            merged["Retry-After"] = str(retry_after_header(retry_after_s))
        super().__init__(message, headers=merged, type=limit, reason=limit)
        self.limit = limit
        self.retry_after_s = retry_after_s


class RequestQuarantined(ClientError):
    """422 ``request_quarantined``: this exact request was at the engine each time it died
    (`gateway.quarantine`), so it is not sent again until the quarantine ends or is cleared.

    422 (RFC 9110 section 15.5.21, Unprocessable Content) rather than 400: the request is well
    formed and valid, this server cannot process it; OpenAI's and Anthropic's SDKs raise it as
    ``UnprocessableEntityError`` and, like every 4xx but 408, 409 and 429, never retry it.
    ``Retry-After`` gives the seconds until the quarantine ends. The message names the
    fingerprint (a keyed hash, not the content) for the operator's ``quarantine clear``.
    """

    status = 422
    type = "invalid_request_error"
    code = "request_quarantined"
    reason = "quarantined"

    def __init__(self, fingerprint: str, remaining_s: float, deaths: int) -> None:
        super().__init__(
            f"This request was being processed each of the last {deaths} times the model "
            f"engine failed, so it is refused for about {retry_after_header(remaining_s)} s "
            f"(request fingerprint {fingerprint}). Change the request, or ask the operator "
            "to clear it if it is not the cause.",
            headers={"Retry-After": str(retry_after_header(remaining_s))},
        )
        self.fingerprint = fingerprint


class UpstreamError(GatewayError):
    """502, 503 or 504: the engine failed, timed out or is not available.

    ``kind`` is the label counted in ``gateway_upstream_errors_total`` when the engine boundary
    (`gateway.upstream`) raises one (`gateway.metrics.UPSTREAM_ERROR_KINDS`).
    """

    status = 502
    type = "server_error"
    code = "upstream_error"
    reason = "upstream_error"
    kind = "bad_response"


class PlanWorkerFailed(UpstreamError):
    """503: the worker process that plans large request bodies (`gateway.plan_worker`) died or
    broke its protocol; a retry starts another (``Retry-After: 1``). An upstream of the gateway
    like its engines, raised outside the engine boundary, so not counted as the engine's."""

    status = 503
    type = "server_error"
    code = "service_unavailable"
    reason = "plan_worker_failed"

    def __init__(self, what: str = "read this large request body") -> None:
        super().__init__(f"The gateway failed to {what}; retry it.", headers={"Retry-After": "1"})


class EngineUnavailable(UpstreamError):
    """503: the engine is down, starting or warming up, or the gateway is saturated overall."""

    status = 503
    code = "engine_unavailable"
    reason = "engine_unavailable"
    kind = "connect"

    def __init__(
        self,
        message: str,
        retry_after_s: float,
        *,
        headers: Mapping[str, str] | None = None,
        code: str | None = None,
        reason: str | None = None,
    ) -> None:
        merged = dict(headers or {})
        merged["Retry-After"] = str(retry_after_header(retry_after_s))
        super().__init__(message, headers=merged, code=code, reason=reason)
        self.retry_after_s = retry_after_s


class EngineUnreachable(EngineUnavailable):
    """503: the engine's socket refuses or is gone (engine down or loading).

    ``sent``: the request had been sent on an open connection that then dropped with the engine
    (it reached the engine, which answered no byte); False when the connection was refused.
    """

    def __init__(self, *, sent: bool = False) -> None:
        super().__init__(
            "The model is not available right now (engine unreachable). Retry later.",
            retry_after_s=RETRY_AFTER_DOWN_S,
        )
        self.sent = sent


class EngineBusy(EngineUnavailable):
    """503: the engine itself answered 503 (busy or restarting)."""

    kind = "status_5xx"

    def __init__(self) -> None:
        super().__init__(
            "The model is not available right now (engine busy or restarting). Retry later.",
            retry_after_s=RETRY_AFTER_DOWN_S,
        )


class BadGateway(UpstreamError):
    """502: the engine answered something unusable or dropped the connection."""

    def __init__(self, message: str = "The engine failed while answering this request.") -> None:
        super().__init__(message)


class EngineDisconnected(BadGateway):
    """502: the engine dropped the connection while it was still up."""

    kind = "disconnect"


class EngineBadResponse(BadGateway):
    """502: the engine answered something outside its protocol (bad JSON, an odd status)."""

    kind = "bad_response"


class EngineFailed(BadGateway):
    """502: the engine answered with a 5xx status."""

    kind = "status_5xx"


class EngineAnswerTooLarge(BadGateway):
    """502: one engine answer (a non-streamed body) or one streamed event was larger than the
    gateway relays (``engine.max_answer_bytes``, ``engine.max_event_bytes``); the engine request
    is aborted."""

    kind = "too_large"

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(
            f"The engine's {what} was larger than this gateway relays ({limit} bytes)."
        )


class GatewayTimeout(UpstreamError):
    """504: the engine stayed silent longer than ``engine.read_timeout_s``."""

    status = 504
    code = "upstream_timeout"
    reason = "upstream_timeout"
    kind = "timeout"

    def __init__(self, message: str = "The engine did not answer in time.") -> None:
        super().__init__(message)


def retry_after_header(seconds: float) -> int:
    """Whole seconds for ``Retry-After``: ``ceil(seconds)``, at least 1."""
    whole = int(seconds)
    if whole < seconds:
        whole += 1
    return max(1, whole)
