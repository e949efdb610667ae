"""The exception tree: two families, the OpenAI error shape, errors that carry their data."""

from __future__ import annotations

import json

import pytest

from gateway import errors
from gateway.errors import (
    BadRequest,
    ClientError,
    EngineBadResponse,
    EngineBusy,
    EngineDisconnected,
    EngineFailed,
    EngineRejected,
    EngineUnavailable,
    EngineUnreachable,
    GatewayError,
    GatewayTimeout,
    HttpError,
    InvalidApiKey,
    ModelNotFound,
    RateLimited,
    UpstreamError,
    retry_after_header,
)

pytestmark = pytest.mark.fast

LEAVES = [
    cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, GatewayError) and cls is not GatewayError
]


@pytest.mark.parametrize("cls", LEAVES, ids=lambda cls: cls.__name__)
def test_each_error_is_in_one_family_by_its_status(cls: type[GatewayError]) -> None:
    """4xx errors are `ClientError`s, 502/503/504 `UpstreamError`s; nothing else under the root."""
    if issubclass(cls, ClientError):
        assert 400 <= cls.status < 500 and not issubclass(cls, UpstreamError)
    else:
        assert issubclass(cls, UpstreamError) and cls.status in (502, 503, 504)


def test_the_body_is_openai_shaped_compact_json() -> None:
    """``json_bytes`` is ``{"error": {message, type, param, code}}``, compact UTF-8."""
    error = BadRequest("Bad «field».", param="messages")
    raw = error.json_bytes()
    assert json.loads(raw) == {
        "error": {
            "message": "Bad «field».",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "invalid_request",
        }
    }
    assert b": " not in raw and "«".encode() in raw


def test_the_sse_event_is_one_data_event() -> None:
    """After a stream's headers an error is one ``data:`` event ending in a blank line."""
    event = GatewayTimeout().sse_event()
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and event.count(b"\n") == 2
    assert json.loads(event[6:])["error"]["code"] == "upstream_timeout"


def test_engine_rejected_carries_the_engine_status_and_message() -> None:
    """The engine's 4xx keeps its status (a plain attribute), message and param."""
    error = EngineRejected(422, "max_tokens is too large", param="max_tokens")
    assert (error.status, error.message, error.param) == (
        422,
        "max_tokens is too large",
        "max_tokens",
    )
    assert error.reason == "engine_4xx" and EngineRejected.status == 400


def test_model_not_found_carries_the_name_and_hides_credentials() -> None:
    """`ModelNotFound` keeps the name sent; a key or JWT pasted as the model is not echoed."""
    error = ModelNotFound("gpt-4")
    assert error.name == "gpt-4" and "`gpt-4`" in error.message
    assert error.code == "model_not_found" and error.param == "model"
    secret = ModelNotFound("sk-q38-" + "A" * 32)
    assert "sk-q38" not in secret.message and "<redacted>" in secret.message


def test_http_error_takes_its_status() -> None:
    """aiohttp's other 4xx answers become `HttpError` with that status, a client error."""
    error = HttpError(431, "Request Header Fields Too Large")
    assert error.status == 431 and isinstance(error, ClientError)


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (EngineUnreachable(), 503, "connect"),
        (EngineBusy(), 503, "status_5xx"),
        (EngineDisconnected(), 502, "disconnect"),
        (EngineBadResponse(), 502, "bad_response"),
        (EngineFailed(), 502, "status_5xx"),
        (GatewayTimeout(), 504, "timeout"),
    ],
)
def test_upstream_errors_name_their_metric_kind(
    error: UpstreamError, status: int, kind: str
) -> None:
    """Each engine failure is chosen by type; its type fixes its status and counted kind."""
    assert (error.status, error.kind) == (status, kind)


@pytest.mark.parametrize(
    ("seconds", "header"), [(0.0, 1), (0.2, 1), (1.0, 1), (1.01, 2), (59.5, 60)]
)
def test_retry_after_is_whole_seconds_rounded_up(seconds: float, header: int) -> None:
    """Retry-After is ``ceil(seconds)``, at least 1 (RFC 9110 section 10.2.3)."""
    assert retry_after_header(seconds) == header


def test_rate_limited_and_unavailable_send_retry_after() -> None:
    """429 and 503 carry ``Retry-After`` and their real wait; 401 carries ``WWW-Authenticate``."""
    limited = RateLimited("tokens", "Too many tokens.", 2.5, headers={"x-extra": "1"})
    assert limited.headers == {"x-extra": "1", "Retry-After": "3"} and limited.type == "tokens"
    unavailable = EngineUnavailable("Later.", 10.0, code="shutting_down", reason="shutdown")
    assert unavailable.headers["Retry-After"] == "10" and unavailable.code == "shutting_down"
    assert "WWW-Authenticate" in InvalidApiKey("expired").headers
