"""Case C28's property: no generated body on any dialect, and no malformed HTTP request, gets a 5xx.

One simulator and gateway for the module (`tests.fuzz_bodies.fuzz_stack`). Per dialect (chat,
completions, responses, messages, count_tokens) hypothesis sends valid-shaped bodies with
random values at random paths, random JSON and random bytes (`tests.fuzz_bodies.bodies`);
every answer is < 500, has no traceback, has ``x-request-id``, an error is in the dialect's
envelope, a stream ends with its dialect's last event. Raw requests with random bytes in the
path, the query and header values get a JSON error with a request id, never aiohttp's pages.
Each test is bounded by ``max_examples`` (``QWEN38_FUZZ_EXAMPLES``, default 60: about 5 s a
dialect here); ``python -m tests.fuzz_bodies --examples 2000`` is the large run by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import KEY_A, Gateway
from tests.fuzz_bodies import DIALECTS, bodies, fuzz_stack, judge, post

EXAMPLES = int(os.environ.get("QWEN38_FUZZ_EXAMPLES", "60"))
BOUNDED = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Gateway]:
    """A simulator that parses tool calls and a gateway with stored responses, for the module."""
    with fuzz_stack() as gateway:
        yield gateway


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    """One HTTP client for the module (keep-alive: the fuzz is not bounded by connects)."""
    with httpx.Client() as http:
        yield http


@pytest.mark.parametrize("dialect", DIALECTS)
@BOUNDED
@given(data=st.data())
def test_c28_generated_bodies_never_5xx(
    fuzzed: Gateway, client: httpx.Client, dialect: str, data: st.DataObject
) -> None:
    """Generated bodies of each dialect get < 500, no traceback, a request id, the dialect's error envelope, complete streams."""
    body = data.draw(bodies(dialect), label="body")
    verdict = judge(dialect, body, post(client, fuzzed.base_url, KEY_A, dialect, body))
    assert not verdict.problems, (verdict.status, verdict.problems, body[:500])


_NASTY = st.sampled_from(
    [
        b"\xed\xb2\x80",
        b"%ED%B2%80",
        b'"\xed\xa0\x80"',
        b"\\udc80",
        b"\xff",
        b"\xc0\x80",
        b"%",
        b"%00",
        b"\x80abc",
        b'W/"\xed\xb2\x80"',
    ]
)
_SEGMENT = st.one_of(_NASTY, st.binary(min_size=1, max_size=12))
_HEADERS = st.sampled_from(
    [
        b"Expect",
        b"Authorization",
        b"x-api-key",
        b"X-Request-Id",
        b"Content-Type",
        b"Content-Encoding",
        b"Accept",
        b"Cookie",
        b"Forwarded",
        b"If-None-Match",
        b"Range",
        b"Transfer-Encoding",
        b"Host",
        b"Idempotency-Key",
    ]
)
_TARGETS = st.sampled_from(
    [
        (b"POST", b"/v1/chat/completions"),
        (b"POST", b"/v1/messages"),
        (b"POST", b"/v1/messages/count_tokens"),
        (b"POST", b"/v1/responses"),
        (b"GET", b"/v1/responses/X"),
        (b"GET", b"/v1/models"),
        (b"GET", b"/v1/models/X"),
        (b"GET", b"/v1/usage?since=X"),
        (b"GET", b"/health"),
        (b"DELETE", b"/v1/messages/X"),
        (b"PUT", b"/X"),
    ]
)


def _exchange(url: str, raw: bytes) -> bytes:
    """Send ``raw`` on a fresh connection; everything answered until close or 5 s."""
    parsed = urlparse(url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=5) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(raw)
        chunks = []
        while True:
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks)


@BOUNDED
@given(
    target=_TARGETS,
    where=st.sampled_from(["path", "query", "header"]),
    header=_HEADERS,
    value=_SEGMENT,
)
def test_c28_malformed_http_is_answered_in_json_with_a_request_id(
    fuzzed: Gateway, target: tuple[bytes, bytes], where: str, header: bytes, value: bytes
) -> None:
    """Random bytes in a path, a query or a header value: never 5xx, always JSON with x-request-id, never the credential echoed."""
    method, path = target
    if where == "path":
        path = path.replace(b"X", value) if b"X" in path else path + b"/" + value
    elif where == "query":
        path += (b"&" if b"?" in path else b"?") + b"q=" + value
    headers = [b"Host: gw", b"Connection: close", f"Authorization: Bearer {KEY_A}".encode()]
    if where == "header":
        headers = [h for h in headers if not h.lower().startswith(header.lower() + b":")]
        headers.append(header + b": " + value)
    raw = (
        method + b" " + path + b" HTTP/1.1\r\n" + b"\r\n".join(headers)
        + b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )  # fmt: skip
    answer = _exchange(fuzzed.base_url, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines and len(lines[0]) >= 12, answer[:200]
    status = int(lines[0][9:12])
    fields = {
        name.strip().lower(): rest.strip()
        for name, _, rest in (line.partition(b":") for line in lines[1:])
    }
    assert status < 500, answer[:300]
    assert fields.get(b"x-request-id"), answer[:300]
    if status >= 400:
        assert fields.get(b"content-type", b"").startswith(b"application/json"), answer[:300]
        payload: Any = json.loads(body)
        assert "error" in payload
    assert KEY_A.encode() not in answer


_UNPARSEABLE = {
    "control byte in a header value": b"X-Note: a\x7fb\r\n",
    "header line without a colon": b"X-Note\r\n",
    "Content-Length not a number": b"Content-Length: abc\r\n",
    "Transfer-Encoding and Content-Length": b"Transfer-Encoding: chunked\r\n",
}


@pytest.mark.parametrize("fault", sorted(_UNPARSEABLE))
@pytest.mark.parametrize(
    "path", ["/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"]
)
def test_c28_a_request_the_server_cannot_parse_gets_its_routes_error_shape(
    fuzzed: Gateway, fault: str, path: str
) -> None:
    """A request aiohttp's parser refuses before any route is matched is still answered in its
    path's API shape: Anthropic's under ``/v1/messages``, OpenAI's elsewhere; 400, JSON, with
    ``x-request-id``, quoting nothing of the request."""
    length = b"" if fault == "Content-Length not a number" else b"Content-Length: 2\r\n"
    raw = (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n".encode()
        + f"x-api-key: {KEY_A}\r\nContent-Type: application/json\r\n".encode()
        + _UNPARSEABLE[fault] + length + b"\r\n{}"
    )  # fmt: skip
    answer = _exchange(fuzzed.base_url, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head[9:12] == b"400", answer[:300]
    assert b"\r\nx-request-id:" in head.lower(), head
    payload = json.loads(body)
    if path.startswith("/v1/messages"):
        assert payload["type"] == "error", payload
        assert payload["error"]["type"] == "invalid_request_error", payload
    else:
        assert payload["error"]["code"] == "invalid_request", payload
    assert KEY_A.encode() not in answer and b"X-Note" not in answer


def test_c28_fuzz_left_no_traceback_and_nothing_held(fuzzed: Gateway) -> None:
    """After the fuzz: no 5xx in the access log, no traceback or error-level line, nothing in flight or queued."""
    ready = httpx.get(fuzzed.url("/ready"), timeout=5).json()
    assert ready["in_flight"] == 0 and ready["queue_depth"] == 0
    logs = fuzzed.logs()
    assert not [e for e in logs if e.get("event") == "request" and e.get("status", 0) >= 500]
    bad = [e for e in logs if e.get("exception") or e.get("level") in ("error", "critical")]
    assert not bad, json.dumps(bad[:2])[:2000]
    assert not [e for e in logs if e.get("event") in ("plan_failed", "unhandled_error")]


def test_c28_a_path_byte_past_ascii_under_messages_gets_anthropics_shape(
    fuzzed: Gateway,
) -> None:
    """A request line whose path holds a byte past ASCII, which no parser accepts, is answered
    in the API shape of the path's prefix: Anthropic's under ``/v1/messages``."""
    raw = b"GET /v1/messages/\xff HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"
    answer = _exchange(fuzzed.base_url, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head[9:12] == b"400", answer[:300]
    payload = json.loads(body)
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("where", "status"), [("url", b"414"), ("header", b"431")], ids=["url", "header"]
)
def test_c28_a_line_past_the_parsers_limit_gets_414_or_431(
    fuzzed: Gateway, where: str, status: bytes
) -> None:
    """A URL or a header longer than the HTTP parser takes: 414 (RFC 9110 section 15.5.15) or
    431 (RFC 6585 section 5) in JSON with ``x-request-id``, quoting none of it, not a 400 that
    does not say why."""
    long = b"a" * 70_000
    target = b"/v1/models?q=" + long if where == "url" else b"/v1/models"
    extra = b"X-Note: " + long + b"\r\n" if where == "header" else b""
    raw = b"GET " + target + b" HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n" + extra + b"\r\n"
    answer = _exchange(fuzzed.base_url, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head[9:12] == status, answer[:300]
    assert b"\r\nx-request-id:" in head.lower(), head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert b"aaaaaaaa" not in answer
