"""Cases C28, C29, C31 and C32: what errors may be.

No 5xx from client input (a value of the wrong type, text JSON cannot carry, the web server's
own low-level errors); errors quote at most a short prefix of a client value and never a
credential in any encoding; errors state true numbers, and a request the gateway cannot honour
as asked is refused; ``check --keys-file`` checks the keys file. The generated-body property of
C28 is `tests/test_fuzz_dialects.py`.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

import httpx
import pytest
from openai.types.responses import Response

from gateway.errors import BadRequest, quotable, quotable_name, scrub_credentials
from gateway.translate.anthropic_errors import anthropic_error
from gateway.translate.anthropic_request import translate_messages
from gateway.translate.common import Overflow, label, overflow_of
from gateway.translate.responses_request import translate_responses
from gateway.upstream import stated_param
from tests.conftest import ALIAS, KEY_A, KEY_B, REPO, Gateway, write_keys
from tests.fuzz_bodies import ROUTES, fuzz_stack

if sys.version_info >= (3, 14):
    from compression import zstd
else:
    from backports import zstd

import brotli  # type: ignore[import-untyped]

AUTH = {"Authorization": f"Bearer {KEY_A}"}
ANTHROPIC = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
CHAT = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSES = {"model": ALIAS, "input": "hi", "max_output_tokens": 2}
MESSAGES = {"model": ALIAS, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}
CUSTOM = {"name": "f", "input_schema": {"type": "object"}}
HOSTED = {"type": "web_search_20250305", "name": "web_search"}


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    """A simulator that parses tool calls and a gateway with stored responses, for the module."""
    with fuzz_stack() as gateway:
        yield gateway


def send(gw: Gateway, dialect: str, body: dict[str, Any] | bytes, **headers: str) -> httpx.Response:
    """POST ``body`` (a dict as JSON with ASCII escapes, or bytes) to the dialect's route."""
    auth = ANTHROPIC if dialect in ("messages", "count_tokens") else AUTH
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        gw.url(ROUTES[dialect]),
        content=raw,
        headers={**auth, "Content-Type": "application/json", **headers},
        timeout=30,
    )


def engine_calls(gw: Gateway) -> int:
    """Requests the simulator received on its model and tokenize routes."""
    assert gw.sim is not None
    return len([r for r in gw.sim.records() if r.get("path") not in ("/health", "/metrics")])


def error_message(dialect: str, response: httpx.Response) -> str:
    """The error message of an answer in the dialect's envelope."""
    payload = response.json()
    if dialect in ("messages", "count_tokens"):
        assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    else:
        assert set(payload["error"]) == {"message", "type", "param", "code"}
    message = payload["error"]["message"]
    assert isinstance(message, str)
    return message


# ----------------------------------------------------------------------------------------- C28


@pytest.mark.parametrize("value", ["2", ["2"], {"n": 2}, 2.5, True], ids=repr)
@pytest.mark.parametrize("dialect", ["chat", "completions"])
def test_c28_best_of_of_any_type_is_a_400(gw: Gateway, dialect: str, value: Any) -> None:
    """best_of as a string, list, object, float or boolean is a 400 naming it on chat and completions alike, before the engine."""
    body = dict(CHAT) if dialect == "chat" else {"model": ALIAS, "prompt": "hi", "max_tokens": 2}
    body["best_of"] = value
    before = engine_calls(gw)
    r = send(gw, dialect, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "best_of"
    assert engine_calls(gw) == before


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "max_completion_tokens": "x", "min_tokens": 5},
        {"prompt": "hi", "n": "2", "best_of": 3},
        {"prompt": "hi", "max_tokens": 4, "min_tokens": [1]},
    ],
    ids=["max_completion_tokens", "n", "min_tokens"],
)
def test_c28_cross_field_rules_never_compare_unchecked_values(
    gw: Gateway, body: dict[str, Any]
) -> None:
    """A cross-field rule (min_tokens <= limit, best_of >= n) next to a value of the wrong type answers < 500."""
    r = send(gw, "completions", {"model": ALIAS, **body})
    assert r.status_code < 500, r.text


UNSENDABLE = "a\udc80b"
ECHOED = [
    ("responses", {**RESPONSES, "metadata": {"k": UNSENDABLE}}, "metadata"),
    ("responses", {**RESPONSES, "tools": [{"type": "web_search", "x": UNSENDABLE}]}, "tools"),
    ("responses", {**RESPONSES, "reasoning": {"summary": UNSENDABLE}}, "reasoning"),
    ("responses", {**RESPONSES, "text": {"format": {"type": "text"}, "v": UNSENDABLE}}, "text"),
    ("responses", {**RESPONSES, "instructions": UNSENDABLE}, "instructions"),
    ("messages", {**MESSAGES, "stop_sequences": [UNSENDABLE]}, "stop_sequences"),
    ("messages", {**MESSAGES, "metadata": {"user_id": UNSENDABLE}}, "metadata"),
    ("count_tokens", {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], UNSENDABLE: 1}, "body"),
    ("chat", {**CHAT, "user": UNSENDABLE}, "user"),
    ("completions", {"model": ALIAS, "prompt": "hi", "suffix": UNSENDABLE}, "suffix"),
]  # fmt: skip


ECHOED_CASES = [
    pytest.param(
        dialect, body, param, stream, id=f"{dialect}-{param}-{'stream' if stream else 'json'}"
    )
    for dialect, body, param in ECHOED
    for stream in (False, True)
    if not (stream and dialect == "count_tokens")  # count_tokens has no stream
]


@pytest.mark.parametrize(("dialect", "body", "param", "stream"), ECHOED_CASES)
def test_c28_text_json_cannot_carry_is_refused_before_the_engine(
    gw: Gateway, dialect: str, body: dict[str, Any], param: str, stream: bool
) -> None:
    """A lone surrogate in any field, echoed or not, streamed or not, is a 400 naming the field; the engine is never asked and nothing is charged."""
    if stream:
        body = {**body, "stream": True}
    before, tokens = engine_calls(gw), gw.metric("gateway_tokens_total")
    r = send(gw, dialect, body)
    assert r.status_code == 400, r.text[:300]
    assert "unpaired UTF-16 surrogate" in error_message(dialect, r)
    assert r.json()["error"].get("param", param) == param
    assert r.headers["x-request-id"]
    assert engine_calls(gw) == before
    assert gw.metric("gateway_tokens_total") == tokens


def raw_exchange(url: str, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; (status, headers, body) of the answer (read until the server closes)."""
    parsed = urlparse(url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=10) as sock:
        sock.sendall(raw)
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return int(lines[0][9:12]), headers, body


LOW_LEVEL = {
    "expect_surrogate_unknown_route": b"GET /v1/messages/batches HTTP/1.1\r\nHost: g\r\nExpect: \xed\xb2\x80\r\n",
    "expect_unknown_route": b"GET /nowhere HTTP/1.1\r\nHost: g\r\nExpect: sk-q38-leak\r\n",
    "bad_chunk": b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "bad_request_line": b"G\xed\xb2\x80T / HTTP/1.1\r\nHost: g\r\n",
    "raw_surrogate_in_path": b"GET /v1/models/\xed\xb2\x80 HTTP/1.1\r\nHost: g\r\n",
    "header_without_colon": b"GET /v1/models HTTP/1.1\r\nHost: g\r\nsk-q38-leak\r\n",
}  # fmt: skip


@pytest.mark.parametrize("name", list(LOW_LEVEL))
def test_c28_low_level_errors_answer_in_the_route_envelope(gw: Gateway, name: str) -> None:
    """The web server's own errors (Expect with a lone surrogate, bad chunks, malformed request lines) are JSON in the route's shape with x-request-id, logged once, never quoting the request."""
    request = LOW_LEVEL[name]
    if not request.endswith(b"\r\n\r\n") and b"chunked" not in request:
        request += f"Authorization: Bearer {KEY_A}\r\nConnection: close\r\n\r\n".encode()
    status, headers, body = raw_exchange(gw.base_url, request)
    assert 400 <= status < 500, (status, body[:200])
    assert status == (417 if name == "expect_unknown_route" else 400)
    assert headers["content-type"].startswith("application/json")
    request_id = headers["x-request-id"]
    payload = json.loads(body)
    if b"/v1/messages" in request:
        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    else:
        assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert b"sk-q38" not in body and b"\xed" not in body
    lines = [e for e in gw.access_logs() if e.get("request_id") == request_id]
    assert [e["status"] for e in lines] == [status]


@pytest.mark.parametrize("size", [15, 5_000_000], ids=["short", "5MB"])
@pytest.mark.parametrize("dialect", ["chat", "messages"])
def test_c28_a_body_that_fails_its_content_encoding_is_one_400_and_one_line(
    gw: Gateway, dialect: str, size: int
) -> None:
    """A body labelled gzip that is not, short or of 5 MB: a 400 in the route's shape (the
    client gets it, not a reset while it still sends), one access line and no error line or
    traceback; the rest of the body is read past as the bytes they are, so the connection
    serves the client's next request."""
    before = len(gw.logs())
    auth = ANTHROPIC if dialect == "messages" else AUTH
    body = {"chat": CHAT, "messages": MESSAGES}[dialect]
    with httpx.Client(timeout=30, headers={**auth, "Content-Type": "application/json"}) as client:
        r = client.post(
            gw.url(ROUTES[dialect]),
            content=b"n" * size,
            headers={"Content-Encoding": "gzip"},
        )
        assert r.status_code == 400
        assert "Content-Encoding" in error_message(dialect, r)
        assert r.headers.get("Connection") != "close"
        again = client.post(gw.url(ROUTES[dialect]), content=json.dumps(body).encode())
        assert again.status_code == 200, again.text[:300]
    time.sleep(0.5)  # the connection's own handling ends after the answer
    after = gw.logs()[before:]
    assert [e["status"] for e in after if e.get("event") == "request"] == [400, 200]
    assert not [e for e in after if e.get("level") == "error" or "exception" in e], after


def test_c28_a_truncated_compressed_body_is_a_400(gw: Gateway) -> None:
    """A compressed body cut short is a 400: a deflate stream named as not matching its coding
    (its end is checked); gzip and zstd ones as the JSON that does not parse (their decoders
    start afresh at each member's end, so a cut is seen only in what it leaves)."""
    whole = json.dumps(CHAT).encode()
    for coding, compressed in (
        ("deflate", zlib.compress(whole)[:-6]),
        ("gzip", gzip.compress(whole)[:-12]),
        ("zstd", zstd.compress(whole)[:-4]),
    ):
        r = send(gw, "chat", compressed, **{"Content-Encoding": coding})
        assert r.status_code == 400, (coding, r.text[:300])
        if coding == "deflate":
            assert "Content-Encoding" in error_message("chat", r)


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
@pytest.mark.parametrize("coding", ["compress", "x-zstd", "gzip, zstd", "gzip;q=1", "aes128gcm"])
def test_c28_a_body_in_a_coding_not_undone_is_a_415_naming_those_that_are(
    gw: Gateway, dialect: str, coding: str
) -> None:
    """A ``Content-Encoding`` the gateway does not undo (unknown, a list, a parameter) is a 415 in the route's shape with ``Accept-Encoding`` (RFC 9110
    section 15.5.16), before the engine is asked and before any byte is charged: its bytes are
    never read as the JSON they are not. One access line; the same body gzipped is served."""
    body = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}[dialect]
    raw = json.dumps(body).encode()
    calls = engine_calls(gw)
    r = send(gw, dialect, raw, **{"Content-Encoding": coding})
    assert r.status_code == 415, r.text[:300]
    assert "Content-Encoding" in error_message(dialect, r) and coding not in r.text
    assert set(r.headers["Accept-Encoding"].split(", ")) >= {"gzip", "deflate"}
    assert engine_calls(gw) == calls
    lines = [e for e in gw.access_logs() if e.get("request_id") == r.headers["x-request-id"]]
    assert [e["status"] for e in lines] == [415]
    r = send(gw, dialect, gzip.compress(raw), **{"Content-Encoding": "GZip"})
    assert r.status_code == 200, r.text[:300]


CODECS = {
    "gzip": gzip.compress,
    "X-GZip": gzip.compress,  # RFC 9110 section 8.4.1.3: x-gzip is gzip
    "deflate": zlib.compress,
    "zstd": lambda data: zstd.compress(data, level=3),
    "br": lambda data: brotli.compress(data, quality=1),
}


def _chat_request(body: bytes, *coding_lines: bytes) -> bytes:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY_A}\r\nContent-Length: {len(body)}\r\n".encode()
    )
    return (
        head
        + b"".join(b"Content-Encoding: " + line + b"\r\n" for line in coding_lines)
        + (b"\r\n" + body)
    )


@pytest.mark.parametrize(
    "lines",
    [[b"gzip", b"x-foo"], [b"gzip", b"gzip"], [b"\xc2\xa0gzip"], [b"gzip\xc2\xa0"]],
    ids=["two_lines", "gzip_twice", "nbsp_before", "nbsp_after"],
)
def test_c28_a_coding_is_judged_as_aiohttp_reads_it_and_a_415_ends_its_connection(
    gw: Gateway, lines: list[bytes]
) -> None:
    """Codings in two header lines (a list, RFC 9110 section 5.3) or with a non-ASCII space
    (which aiohttp does not read as HTTP whitespace) are 415, not a body read as they are; the
    415's ``Connection: close`` ends the connection, so a request pipelined behind it is not
    served (RFC 9112 section 9.6) and the engine is not asked."""
    plain = json.dumps(CHAT).encode()
    calls = engine_calls(gw)
    status, headers, body = raw_exchange(
        gw.base_url, _chat_request(plain, *lines) + _chat_request(plain)
    )
    assert status == 415 and headers["connection"] == "close"
    assert b"HTTP/1.1" not in body  # the pipelined request got no answer
    assert engine_calls(gw) == calls


@pytest.mark.parametrize("dialect", ["responses", "chat", "messages"])
@pytest.mark.parametrize("coding", list(CODECS))
def test_c28_compressed_bodies_are_read_within_the_limit(
    gw: Gateway, dialect: str, coding: str
) -> None:
    """Bodies in the codings the gateway undoes (zstd as Codex-style clients send their
    Responses bodies, gzip, deflate) are answered as the same body uncompressed; one that
    decompresses past ``server.max_body_bytes`` is a 413 read no further than the limit, and
    one that is not in its coding a 400, both in the route's shape."""
    body = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}[dialect]
    codec = CODECS[coding]
    r = send(gw, dialect, codec(json.dumps(body).encode()), **{"Content-Encoding": coding})
    assert r.status_code == 200, r.text[:300]
    bomb = codec(b'{"model": "' + b"a" * (64 * 1024 * 1024) + b'"}')
    assert len(bomb) < 1024 * 1024
    r = send(gw, dialect, bomb, **{"Content-Encoding": coding})
    assert r.status_code == 413 and "too large" in error_message(dialect, r)
    r = send(gw, dialect, b"\x28\xb5\x2f\xfd not really", **{"Content-Encoding": coding})
    assert r.status_code == 400 and "Content-Encoding" in error_message(dialect, r)


def first_answer(url: str, raw: bytes) -> tuple[bytes, bytes]:
    """Send raw bytes; the head and body of the first answer, its body read by its
    ``Content-Length`` (the connection may stay open: a client that waits for ``100 Continue``
    never sends its body)."""
    parsed = urlparse(url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=10) as sock:
        sock.sendall(raw)
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        head, _, body = received.partition(b"\r\n\r\n")
        length = int(
            next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(
                b":"
            )[1]
        )
        while len(body) < length:
            body += sock.recv(65536)
    return head, body


def test_c28_a_coding_not_undone_is_refused_before_the_body_is_sent(gw: Gateway) -> None:
    """With ``Expect: 100-continue``, a body in a coding the gateway does not undo is answered
    415 without ``100 Continue``: the client never uploads it."""
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY_A}\r\n".encode()
        + b"Content-Encoding: compress\r\nContent-Length: 10\r\nExpect: 100-continue\r\n"
        + b"Connection: close\r\n\r\n"
    )
    head, body = first_answer(gw.base_url, request)  # and never the body
    assert head.startswith(b"HTTP/1.1 415 ") and b"100 Continue" not in head
    assert b"\r\nAccept-Encoding: gzip" in head
    assert json.loads(body)["error"]["code"] == "unsupported_content_encoding"


OTHER_KEY = "sk-q38-unknownUUUUUUUUUUUUUUUUUUUUUUUUUUUU"
REPEATED = [
    ("chat", "Authorization", [f"Bearer {KEY_A}", f"Bearer {OTHER_KEY}"]),
    ("chat", "Authorization", [f"Bearer {OTHER_KEY}", f"Bearer {KEY_A}"]),
    ("chat", "Authorization", [f"Bearer {KEY_A}", f"Bearer {KEY_A}"]),
    ("responses", "authorization", [f"Bearer {KEY_A}", "Basic eDp5"]),
    ("messages", "x-api-key", [KEY_A, OTHER_KEY]),
    ("messages", "X-Api-Key", [OTHER_KEY, KEY_A]),
    ("messages", "Authorization", [f"Bearer {KEY_A}", f"Bearer {KEY_A}"]),
]


@pytest.mark.parametrize(("dialect", "name", "values"), REPEATED)
def test_a_credential_header_sent_twice_is_a_400_whatever_its_values(
    gw: Gateway, dialect: str, name: str, values: list[str]
) -> None:
    """A credential header sent on two lines (RFC 9110 section 5.3: it holds one value) is a 400
    in the route's shape, naming the header and quoting neither value, before anything is read
    or charged: a proxy before the gateway may act on one line and the gateway on the other. Also
    without ``100 Continue`` for a client that waits for it. One ``Authorization`` beside
    Anthropic's ``x-api-key`` is not a repetition (``Authorization`` is used)."""
    path = ROUTES[dialect]
    calls = engine_calls(gw)
    body = json.dumps({"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}[dialect])
    lines = "".join(f"{name}: {value}\r\n" for value in values)
    version = "anthropic-version: 2023-06-01\r\n" if dialect == "messages" else ""
    for expect in ("", "Expect: 100-continue\r\n"):
        request = (
            f"POST {path} HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n{lines}"
            f"{version}Content-Length: {len(body)}\r\n{expect}Connection: close\r\n\r\n"
        ).encode()
        head, answer = first_answer(gw.base_url, request if expect else request + body.encode())
        assert head.startswith(b"HTTP/1.1 400 ") and b"100 Continue" not in head, head
        assert b"\r\nx-request-id: " in head.lower()
        error = json.loads(answer)
        message = error_message(dialect, httpx.Response(400, content=answer))
        assert message.lower().startswith(f"the request sends more than one {name.lower()} header")
        if dialect == "messages":
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        else:
            assert error["error"]["type"] == "invalid_request_error"
        for value in values:
            assert value.split()[-1].encode() not in head + answer
    assert engine_calls(gw) == calls
    both = {**ANTHROPIC, "Authorization": f"Bearer {KEY_A}", "x-api-key": OTHER_KEY}
    r = httpx.post(gw.url(ROUTES["messages"]), json=MESSAGES, headers=both, timeout=30)
    assert r.status_code == 200, r.text[:300]


def test_c28_an_expectation_nobody_meets_is_ignored_on_every_route(gw: Gateway) -> None:
    """An Expect header other than 100-continue (a lone surrogate in it included) is ignored on the API's GET routes as on its POST routes: the request is answered."""
    request = (
        b"GET /v1/models HTTP/1.1\r\nHost: g\r\nExpect: \xed\xb2\x80\r\n"
        + f"Authorization: Bearer {KEY_A}\r\nConnection: close\r\n\r\n".encode()
    )
    status, headers, body = raw_exchange(gw.base_url, request)
    assert status == 200 and json.loads(body)["data"][0]["id"] == ALIAS
    assert headers["x-request-id"]


# ----------------------------------------------------------------------------------------- C29

LONG = "x" * 5000
QUOTING = [
    ("responses", {**RESPONSES, "input": [{"role": LONG, "content": "hi"}]}),
    ("responses", {**RESPONSES, "input": [{"type": LONG, "content": "hi"}]}),
    ("responses", {**RESPONSES, "input": [{"role": "user", "content": [{"type": LONG}]}]}),
    ("responses", {**RESPONSES, "text": {"format": {"type": LONG}}}),
    ("responses", {**RESPONSES, "tools": [{"type": LONG}]}),
    ("responses", {**RESPONSES, "reasoning": {"effort": LONG}}),
    ("messages", {**MESSAGES, "messages": [{"role": "user", "content": [{"type": LONG}]}]}),
    ("messages", {**MESSAGES, "messages": [{"role": "assistant", "content": [{"type": LONG}]}]}),
    ("messages", {**MESSAGES, "tools": [CUSTOM], "tool_choice": {"type": "tool", "name": LONG}}),
    ("chat", {**CHAT, "model": LONG}),
    ("chat", {**CHAT, LONG: UNSENDABLE}),
]


@pytest.mark.parametrize(("dialect", "body"), QUOTING)
def test_c29_errors_quote_at_most_a_short_prefix(
    gw: Gateway, dialect: str, body: dict[str, Any]
) -> None:
    """A 5,000-character value in an item's role or type, a block type, a tool name, a model or a key: the error names the field and quotes at most 15 characters of it."""
    r = send(gw, dialect, body)
    assert r.status_code in (400, 404), r.text[:300]
    message = error_message(dialect, r)
    assert "x" * 16 not in r.text and len(message) < 300, message[:400]


def test_c29_usage_query_is_not_quoted_whole(gw: Gateway) -> None:
    """A 5,000-character `since` on /v1/usage: a 400 naming `since` without quoting it."""
    r = httpx.get(gw.url("/v1/usage"), params={"since": LONG}, headers=AUTH, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "since" and "x" * 16 not in r.text


def _escaped(text: str) -> str:
    return "".join(f"\\u{ord(c):04x}" for c in text)


ENCODINGS = {
    "json_escapes": lambda key: _escaped(key),
    "first_char_escaped": lambda key: _escaped(key[0]) + key[1:],
    "percent": lambda key: quote(key, safe=""),
    "percent_every_char": lambda key: "".join(f"%{b:02X}" for b in key.encode()),
    "base64": lambda key: base64.b64encode(key.encode()).decode(),
    "base64_bearer": lambda key: base64.b64encode(f"Bearer {key}".encode()).decode(),
    "base64url_offset": lambda key: base64.urlsafe_b64encode(f"xy{key}".encode()).decode(),
    # The secret of a generated key without its public `sk-q38-` prefix.
    "without_prefix": lambda key: key[7:],
    "without_prefix_escaped": lambda key: _escaped(key[7:]),
    "without_prefix_percent": lambda key: "".join(f"%{b:02X}" for b in key[7:].encode()),
    "without_prefix_base64": lambda key: base64.b64encode(f"user:{key[7:]}".encode()).decode(),
}


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages", "count_tokens"])
@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_c29_own_credential_in_any_encoding_is_refused(
    gw: Gateway, dialect: str, encoding: str
) -> None:
    """The request's own key in its body as JSON escapes, percent-encoded or base64 (of the key or a Bearer value) is a 400 that quotes none of it, and never reaches the engine."""
    shown = ENCODINGS[encoding](KEY_A)
    text = "my key: " + shown
    if dialect == "responses":
        body = {**RESPONSES, "metadata": {"k": "v"}, "input": text}
    elif dialect in ("messages", "count_tokens"):
        body = {**MESSAGES, "messages": [{"role": "user", "content": text}]}
        if dialect == "count_tokens":
            body.pop("max_tokens")
    else:
        body = {**CHAT, "messages": [{"role": "user", "content": text}]}
    raw = json.dumps(body).replace(json.dumps(text)[1:-1], text).encode()
    before = engine_calls(gw)
    r = send(gw, dialect, raw)
    assert r.status_code == 400, (encoding, r.text[:300])
    assert "own API key" in error_message(dialect, r)
    for fragment in (KEY_A, KEY_A[7:27], shown[:24]):
        assert fragment not in r.text
    assert engine_calls(gw) == before


@pytest.mark.parametrize("dialect", ["chat", "messages"])
@pytest.mark.parametrize("charset", ["utf-16", "utf-16-be", "utf-32-le"])
def test_c29_own_credential_in_a_utf16_or_utf32_body_is_refused(
    gw: Gateway, dialect: str, charset: str
) -> None:
    """A body in UTF-16 or UTF-32 (read as JSON detects it, RFC 8259 section 8.1) with the request's own key in a message is a 400 too, and never reaches the engine."""
    base = MESSAGES if dialect == "messages" else CHAT
    body = {**base, "messages": [{"role": "user", "content": "my key: " + KEY_A}]}
    before = engine_calls(gw)
    r = send(gw, dialect, json.dumps(body).encode(charset))
    assert r.status_code == 400, (charset, r.text[:300])
    assert "own API key" in error_message(dialect, r) and KEY_A not in r.text
    assert engine_calls(gw) == before


@pytest.mark.parametrize(
    "supplied",
    [
        base64.urlsafe_b64encode(f"Bearer {KEY_A}".encode()).decode().rstrip("="),
        base64.b64encode(KEY_A.encode()).decode().rstrip("="),
        "ZXlKaGJHY2lPaUpJVXpJMU5pSjk",  # base64 of a JWT header
    ],
    ids=["base64url_bearer", "base64_key", "base64_jwt"],
)
def test_c29_request_ids_shaped_like_encoded_credentials_are_replaced(
    gw: Gateway, supplied: str
) -> None:
    """An X-Request-Id that decodes to a key, a Bearer value or a JWT is not echoed: the answer carries a generated id."""
    r = httpx.get(gw.url("/v1/models"), headers={**AUTH, "X-Request-Id": supplied}, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-request-id"] != supplied


# A key as `keys add` writes it, loaded beside KEY_A for another tenant.
KEY_D = "sk-q38-" + "D4x9" * 8
SECRET_D = KEY_D.removeprefix("sk-q38-")


def _b64u(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


# (id sent, what of it must show nowhere): a piece of the credential when it is sent plain, the
# encoded form itself when it is encoded.
HIDDEN_IN_IDS = {
    "other_key": (f"t_{KEY_D}", SECRET_D[:24]),
    "other_secret": (f"t_{SECRET_D}", SECRET_D[:24]),
    "other_secret_inside": (f"trace.{SECRET_D}.7", SECRET_D[:24]),
    "other_secret_base64url": (_b64u(SECRET_D), _b64u(SECRET_D)[:24]),
    "other_key_base64url_after_x": (_b64u("x" + KEY_D), _b64u("x" + KEY_D)[:24]),
    "other_secret_hex": (SECRET_D.encode().hex(), SECRET_D.encode().hex()[:24]),
    "own_secret_base64url": (_b64u(KEY_A.removeprefix("sk-q38-")), _b64u(KEY_A[7:])[:24]),
    "sk_after_underscore": ("trace_sk-proj-abcdefghijklmnopqrstuvwx", "abcdefghijklmnopqrstuvwx"),
    "upper_sk_after_dot": ("x.SK-proj-abcdefghijklmnop", "abcdefghijklmnop"),
    "jwt_after_prefix": ("id_eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl", "eyJzdWIiOiIxIn0"),
    "jwt_after_digits": ("a1eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0", "eyJzdWIiOiIxIn0"),
}


@pytest.mark.parametrize(("supplied", "hidden"), HIDDEN_IN_IDS.values(), ids=HIDDEN_IN_IDS.keys())
def test_c29_request_ids_holding_a_credential_further_in_are_replaced(
    sim_factory: Any, gateway_factory: Any, supplied: str, hidden: str
) -> None:
    """An X-Request-Id holding a credential after a prefix (another tenant's key, with or without
    its ``sk-q38-``, any ``sk-`` key, a JWT), or a loaded key's secret hex- or base64-encoded, is
    replaced by a generated id: it is in no header, answer, log line, ledger record or engine
    request."""
    keys = {"KEY_A": ("acme", KEY_A), "KEY_D": ("beta", KEY_D)}
    gw = gateway_factory(sim_factory(), keys=keys)
    answers = [
        httpx.post(
            gw.url("/v1/chat/completions"),
            json={
                "model": ALIAS,
                "max_tokens": 4,
                "stream": stream,
                "messages": [{"role": "user", "content": "hi"}],
            },
            headers={**AUTH, "X-Request-Id": supplied},
            timeout=30,
        )
        for stream in (False, True)
    ]
    for r in answers:
        assert r.status_code == 200, r.text[:300]
        generated = r.headers["x-request-id"]
        assert len(generated) == 32 and generated != supplied
        assert hidden not in r.text and all(hidden not in v for v in r.headers.values())
    assert gw.sim is not None and len(gw.sim.model_records()) == 2
    assert hidden not in json.dumps(gw.sim.model_records())
    gw.proc.terminate()  # a drain: the ledger's records are written before it exits
    gw.proc.wait(30)
    chats = [e for e in gw.access_logs() if e["route"] == "/v1/chat/completions"]
    assert len(chats) == 2 and all(e["request_id"] != supplied for e in chats)
    assert hidden not in gw.log_path.read_text()
    ledger = sorted(Path(gw.config_path).parent.glob("gw-usage.sqlite3*"))
    assert ledger and all(hidden.encode() not in path.read_bytes() for path in ledger)


@pytest.mark.parametrize(
    "supplied",
    [
        "surveyJob.123",
        "keyJar.v2",
        "trace-123",
        "req_abc.def:7",
        "0123456789abcdef" * 2,
        "D4x9" * 8,
    ],
)
def test_c29_ordinary_request_ids_are_kept(gw: Gateway, supplied: str) -> None:
    """Ids that only look a little like a credential (``eyJ`` inside a word, hex, a base62 run
    that is no loaded key) are echoed as sent."""
    r = httpx.get(gw.url("/v1/models"), headers={**AUTH, "X-Request-Id": supplied}, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-request-id"] == supplied


@pytest.mark.fast
def test_c29_quoting_rules() -> None:
    """`quotable` keeps short plain values only; engine messages keep a short prefix of what they quote and no credential."""
    assert quotable("user") == "user"
    for value in ("x" * 16, "c2stcTM4LXRl", "%73k-q38", "QmVhcmVyIHM=", "eyJhbGciOi", "a\udc80"):
        assert quotable(value) == "<redacted>"
    engine = f"Invalid role: '{'a b ' * 2000}' and '{KEY_A}' and `Bearer {KEY_A}`"
    scrubbed = scrub_credentials(engine)
    assert len(scrubbed) < 200 and KEY_A[7:27] not in scrubbed and "a b a b" in scrubbed
    # vLLM and pydantic also name a refused value unquoted: a key without its prefix, encoded,
    # or a long run of anything is not echoed; snake_case field names and numbers stay.
    secret = KEY_A[len("sk-q38-") :]
    for value in (
        secret,
        "Z" * 3000,
        KEY_A.encode().hex(),
        base64.b64encode(KEY_A.encode()).decode(),
        base64.urlsafe_b64encode(KEY_A.encode()).decode().rstrip("="),
        quote(KEY_A, safe=""),
        "".join(f"%{b:02X}" for b in KEY_A.encode()),
        f"x {secret} y " * 3,
        "team_alpha_prod_secret_42",
        "'team_alpha_prod_secret_42'",
    ):
        said = scrub_credentials(f"Invalid value for `tool_choice`: {value} (type=str)")
        assert secret[:16] not in said and "Z" * 16 not in said and len(said) < 400, said
        assert "prod_secret" not in said, said
        assert said.startswith("Invalid value for `tool_choice`: ")
    for kept in (
        "This model's maximum context length is 2048 tokens. However, you requested 3000 "
        "tokens (2900 in the messages, 100 in the completion).",
        "'continuous_usage_stats' and include_stop_str_in_output, chat_template_kwargs.",
        "Please reduce the length of the input prompt. (parameter=input_tokens, value=2049)",
        "max_completion_tokens=32768 cannot be greater than max_model_len=max_total_tokens=4096."
        " (parameter=max_completion_tokens, value=32768)",
        "Chat template is passed with request, but --trust-request-chat-template is not set.",
        "The tool specified in `tool_choice` does not match any of the specified `tools` "
        "(parameter=tool_choice)",
    ):
        assert scrub_credentials(kept) == kept


def test_c29_a_tool_choice_string_no_api_accepts_is_refused_unquoted(gw: Gateway) -> None:
    """A chat ``tool_choice`` string other than none/auto/required (3,000 characters, another
    tenant's key without its prefix) is a 400 naming the field before the engine, quoting none
    of it; the Responses route says which strings it takes."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for value in ("Z" * 3000, KEY_B[len("sk-q38-") :], "bogus"):
        body = {
            "model": ALIAS,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "tools": tools,
            "tool_choice": value,
        }
        r = send(gw, "chat", body)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["param"] == "tool_choice" and "'required'" in error["message"]
        assert value not in r.text and len(r.content) < 400
    body = {"model": ALIAS, "input": "hi", "tool_choice": "bogus"}
    r = send(gw, "responses", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "'required'" in r.json()["error"]["message"] and "bogus" not in r.text


def test_c29_a_long_field_name_at_fault_is_named(gw: Gateway) -> None:
    """A lone surrogate in a field whose name is longer than a quotable value
    (``previous_response_id``) is a 400 whose ``param`` names that field."""
    raw = b'{"model": "' + ALIAS.encode() + b'", "input": "hi", "previous_response_id": "\\udc80"}'
    r = send(gw, "responses", raw)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "previous_response_id" and "previous_response_id" in error["message"]


SECRET_NAME = "team_alpha_prod_secret_42"
# Where a key sits in the body of each route: at the top, or inside an object the route knows.
NESTED_IN = {"chat": "stream_options", "messages": "metadata"}
# Values JSON cannot carry on to the engine, as the client's bytes write them.
UNCARRIED = {"surrogate": '"a\\udc80b"', "infinite": "1e400", "long_int": "7" * 5000}
NAMED_KEYS = [
    (SECRET_NAME, False, False),
    (SECRET_NAME, True, False),
    ("previous_response_id", False, True),
    ("max_completion_tokens", False, True),
    ("continuous_usage_stats", True, True),
]


@pytest.mark.parametrize(("key", "nested", "named"), NAMED_KEYS, ids=lambda v: str(v))
@pytest.mark.parametrize("dialect", ["chat", "messages"])
def test_c29_a_key_is_named_only_when_shaped_like_a_field_name(
    gw: Gateway, dialect: str, key: str, nested: bool, named: bool
) -> None:
    """A key holding a value JSON cannot carry (a lone surrogate, 1e400, a 5,000-digit
    integer), at the top of the body or inside an object, is a 400 before the engine: a field's
    snake_case name (`previous_response_id`, `max_completion_tokens`, `continuous_usage_stats`)
    is named in the message and `param`, a name shaped like a hand-written secret with digits
    (`team_alpha_prod_secret_42`) nowhere in the answer."""
    base = CHAT if dialect == "chat" else MESSAGES
    for kind, literal in UNCARRIED.items():
        entry = f'"{key}": {literal}'
        if nested:
            entry = f'"{NESTED_IN[dialect]}": {{{entry}}}'
        raw = (json.dumps(base)[:-1] + ", " + entry + "}").encode()
        before = engine_calls(gw)
        r = send(gw, dialect, raw)
        assert r.status_code == 400, (kind, r.text[:300])
        message = error_message(dialect, r)
        assert engine_calls(gw) == before
        if not named:
            assert "prod_secret" not in r.text and "team_alpha" not in r.text, (kind, r.text)
            continue
        path = f"{NESTED_IN[dialect]}.{key}" if nested else key
        assert f"'{path}'" in message, (kind, message)
        if dialect == "chat":
            assert r.json()["error"]["param"] == (NESTED_IN[dialect] if nested else key)


def test_c29_a_tool_name_shaped_like_a_secret_is_not_echoed(gw: Gateway) -> None:
    """A tool_choice naming a function that is not in `tools` is a 400 that echoes a field-like
    name and not one shaped like a hand-written secret (Responses and Messages); a hosted
    tool's dated type is still named."""
    for name, echoed in ((SECRET_NAME, False), ("get_current_weather_in_city", True)):
        bodies = {
            "responses": {
                **RESPONSES,
                "tools": [FUNCTION],
                "tool_choice": {"type": "function", "name": name},
            },
            "messages": {
                **MESSAGES,
                "tools": [CUSTOM],
                "tool_choice": {"type": "tool", "name": name},
            },
        }
        for dialect, body in bodies.items():
            r = send(gw, dialect, body)
            assert r.status_code == 400, r.text[:300]
            assert (name in error_message(dialect, r)) is echoed, r.text
            assert echoed or "prod_secret" not in r.text
    body = {**MESSAGES, "tools": [{"type": "web_search_20250305"}], "tool_choice": {"type": "any"}}
    r = send(gw, "messages", body)
    assert r.status_code == 400 and "web_search_20250305" in error_message("messages", r)


@pytest.mark.fast
def test_c29_one_rule_says_which_names_an_error_states() -> None:
    """A body's key in `param`, a name in an engine's message, a name in an engine's `param`
    and a tool name in a message are kept or redacted alike: snake_case in letters up to 48
    characters is kept; digits in it, one long word, or a longer name is not."""
    for name, kept in {
        SECRET_NAME: False,
        "previous_response_id": True,
        "max_completion_tokens": True,
        "continuous_usage_stats": True,
        "include_stop_str_in_output": True,
        "abcdefghijklmnopqrstuvwxyz": False,
        "a_" + "b" * 60: False,
    }.items():
        said = f"Unknown field {name} in the request"
        assert (quotable_name(name) == name) is kept, name
        assert (scrub_credentials(said) == said) is kept, name
        assert (stated_param(f"logit_bias.{name}") is not None) is kept, name
        assert (label(name) == name) is kept, name


# ----------------------------------------------------------------------------------------- C31


@pytest.mark.parametrize("stream", [False, True])
def test_c31_prompt_too_long_states_the_counted_prompt(
    sim_factory: Any, gateway_factory: Any, stream: bool
) -> None:
    """Over the context on /v1/messages, the error states the prompt's real count (the engine's own, as count_tokens gives it) against the real context, never `N tokens > N maximum`."""
    sim = sim_factory("--max-model-len", "2048")
    gateway = gateway_factory(sim, {"engine": {"max_model_len": 2048}})
    messages = [{"role": "user", "content": "word " * 3000}]
    counted = httpx.post(
        gateway.url("/v1/messages/count_tokens"),
        json={"model": ALIAS, "messages": messages},
        headers=ANTHROPIC,
        timeout=30,
    )
    prompt = counted.json()["input_tokens"]
    assert prompt > 2048
    body = {"model": ALIAS, "max_tokens": 32000, "messages": messages, "stream": stream}
    r = httpx.post(gateway.url("/v1/messages"), json=body, headers=ANTHROPIC, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["message"] == f"prompt is too long: {prompt} tokens > 2047 maximum"


def test_c31_the_maximum_prompt_is_one_number_around_the_boundary(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """On /v1/messages with a 4,096-token context, prompts of 4,094 and 4,095 tokens are served
    (Claude Code's max_tokens cut to the room left) and prompts of 4,096, 4,097 and 4,200 tokens
    are each `prompt is too long: N tokens > 4095 maximum`, streamed or not: the maximum stated
    is the longest prompt served, the same whatever N."""
    sim = sim_factory("--max-model-len", "4096")
    gateway = gateway_factory(sim, {"engine": {"max_model_len": 4096}})

    def messages(tokens: int) -> list[dict[str, Any]]:
        text = "abcd" * (tokens - 7)  # the simulator: 3 + 4 + ceil(bytes / 4) for one message
        found = [{"role": "user", "content": text}]
        counted = httpx.post(
            gateway.url("/v1/messages/count_tokens"),
            json={"model": ALIAS, "messages": found},
            headers=ANTHROPIC,
            timeout=30,
        ).json()["input_tokens"]
        assert counted == tokens, (counted, tokens)
        return found

    for tokens in (4094, 4095):
        body = {"model": ALIAS, "max_tokens": 32000, "messages": messages(tokens)}
        r = httpx.post(gateway.url("/v1/messages"), json=body, headers=ANTHROPIC, timeout=30)
        assert r.status_code == 200, (tokens, r.text[:300])
    for tokens in (4096, 4097, 4200):
        for stream in (False, True):
            body = {
                "model": ALIAS,
                "max_tokens": 32000,
                "messages": messages(tokens),
                "stream": stream,
            }
            r = httpx.post(gateway.url("/v1/messages"), json=body, headers=ANTHROPIC, timeout=30)
            assert r.status_code == 400, (tokens, stream, r.text[:300])
            said = r.json()["error"]["message"]
            assert said == f"prompt is too long: {tokens} tokens > 4095 maximum", (tokens, said)


def _overflowing(sim_factory: Any, gateway_factory: Any) -> tuple[Gateway, str, int]:
    """A gateway before a 2,048-token context, a text over it and its count by the engine."""
    sim = sim_factory("--max-model-len", "2048")
    gateway = gateway_factory(sim, {"engine": {"max_model_len": 2048}})
    text = "word " * 3000
    counted = httpx.post(
        gateway.url("/v1/messages/count_tokens"),
        json={"model": ALIAS, "messages": [{"role": "user", "content": text}]},
        headers=ANTHROPIC,
        timeout=30,
    ).json()["input_tokens"]
    assert counted > 2048
    return gateway, text, counted


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_c31_an_overflow_of_the_servers_own_output_budget_says_so(
    sim_factory: Any, gateway_factory: Any, route: str
) -> None:
    """No output budget in the request and a prompt over the context: the 400 states the
    prompt's real count against the real context and does not say the client requested the
    output tokens this server set; one with the client's own max_tokens keeps vLLM's words."""
    gateway, text, counted = _overflowing(sim_factory, gateway_factory)
    if route == "/v1/responses":
        body: dict[str, Any] = {"model": ALIAS, "input": [{"role": "user", "content": text}]}
    else:
        body = {"model": ALIAS, "messages": [{"role": "user", "content": text}]}
    r = httpx.post(gateway.url(route), json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert "requested" not in message, message
    assert message.startswith("This model's maximum context length is 2048 tokens."), message
    assert f"prompt contains {counted} input tokens" in message, (message, counted)
    if route == "/v1/chat/completions":
        own = httpx.post(gateway.url(route), json={**body, "max_tokens": 100}, headers=AUTH)
        assert own.status_code == 400 and "2048" in own.json()["error"]["message"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_c31_an_overflow_with_the_clients_own_max_tokens_states_the_prompts_count(
    sim_factory: Any, gateway_factory: Any, route: str
) -> None:
    """A prompt over the context with the client's own `max_tokens`: the engine says "at
    least N" (its tokenizer stopped past the limit); the 400 states the prompt's exact count
    instead and that fewer output tokens cannot help, not a total to reduce."""
    gateway, text, counted = _overflowing(sim_factory, gateway_factory)
    if route == "/v1/completions":
        body: dict[str, Any] = {"model": ALIAS, "prompt": text, "max_tokens": 100}
    else:
        body = {"model": ALIAS, "messages": [{"role": "user", "content": text}], "max_tokens": 100}
    r = httpx.post(gateway.url(route), json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert message.startswith("This model's maximum context length is 2048 tokens."), message
    assert "at least" not in message, message
    assert "which exceeds this limit even without any output tokens" in message, message
    shown = int(message.split("prompt contains ")[1].split(" ")[0])
    # The chat template adds a few tokens to the text's count; the bare prompt has none.
    assert counted - 20 <= shown <= counted + 20, (message, counted)


def test_c31_a_token_id_prompt_over_the_context_says_fewer_output_tokens_cannot_help(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """A completions prompt of token ids over the context with the client's own `max_tokens`:
    the engine states the exact count but advises fewer output tokens; the 400 says the prompt
    alone is over the context."""
    sim = sim_factory("--max-model-len", "2048")
    gateway = gateway_factory(sim, {"engine": {"max_model_len": 2048}})
    body = {"model": ALIAS, "prompt": [1] * 3000, "max_tokens": 100}
    r = httpx.post(gateway.url("/v1/completions"), json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert "prompt contains 3000 input tokens" in message, message
    assert "which exceeds this limit even without any output tokens" in message, message
    assert "requested" not in message, message


@pytest.mark.fast
def test_c31_both_of_vllms_overflow_wordings_are_read() -> None:
    """vLLM's two prompt-too-long wordings are read into the same numbers: "prompt contains
    (at least) N input tokens", and "requested T tokens (N in the prompt, W for the
    completion)" (a prompt of token ids)."""
    total = BadRequest(
        "This model's maximum context length is 2048 tokens. However, you requested 3100 "
        "tokens (3000 in the prompt, 100 for the completion)."
    )
    assert overflow_of(total) == Overflow(3000, False, 100, 2048)
    bound = BadRequest(
        "This model's maximum context length is 2048 tokens. However, you requested 100 output "
        "tokens and your prompt contains at least 1949 input tokens, for a total of at least "
        "2049 tokens."
    )
    assert overflow_of(bound) == Overflow(1949, True, 100, 2048)
    assert overflow_of(BadRequest("'temperature' must be a number.")) is None


@pytest.mark.fast
def test_c31_an_overflow_of_the_clients_budget_states_true_numbers() -> None:
    """`Overflow.requested_message`: the prompt alone over the context says fewer output
    tokens cannot help; else vLLM's sentence with the exact prompt and the true total."""
    alone = Overflow(3000, False, 100, 2048).requested_message()
    assert "contains 3000 input tokens, which exceeds this limit even without" in alone
    assert "requested" not in alone
    total = Overflow(2000, False, 100, 2048).requested_message()
    assert total == (
        "This model's maximum context length is 2048 tokens. However, you requested 100 output "
        "tokens and your prompt contains 2000 input tokens, for a total of 2100 tokens. Please "
        "reduce the length of the input prompt or the number of requested output tokens."
    )


@pytest.mark.fast
def test_c31_restated_overflows_state_true_inequalities() -> None:
    """`Overflow.openai_message`: the prompt alone over the context, or the room it leaves
    below the budget the server set; a lower bound said as one; never "requested"."""
    cases = {
        Overflow(3000, False, 512, 2048): "contains 3000 input tokens, which exceeds this limit",
        Overflow(2049, True, 512, 2048): "contains at least 2049 input tokens, which exceeds",
        Overflow(2048, False, 512, 2048): "contains 2048 input tokens, which leaves no room for "
        "one output token.",
        Overflow(2000, False, 512, 2048): "leaves 48 tokens for the answer, fewer than the "
        "output budget of 512 tokens this server set for it; set max_tokens to at most 48.",
        Overflow(1900, True, 512, 2048): "leaves at most 148 tokens",
    }
    for overflow, expected in cases.items():
        message = overflow.openai_message()
        assert message.startswith("This model's maximum context length is 2048 tokens.")
        assert expected in message and "requested" not in message, message


@pytest.mark.fast
def test_c31_overflow_wordings_are_true() -> None:
    """Each overflow states an inequality that holds: the prompt alone over the context, the prompt plus the output budget over it, or a lower bound said as one."""
    cases = {
        Overflow(3000, False, 1, 2048): "prompt is too long: 3000 tokens > 2047 maximum",
        Overflow(2049, False, 1, 2048): "prompt is too long: 2049 tokens > 2047 maximum",
        Overflow(2048, False, 1, 2048): "prompt is too long: 2048 tokens > 2047 maximum",
        Overflow(2048, True, 1, 2048): "prompt is too long: at least 2048 tokens > 2047 maximum",
        Overflow(2049, True, None, 2048): "prompt is too long: at least 2049 tokens > 2047 maximum",
        Overflow(2000, False, 500, 2048): (
            "input length and `max_tokens` exceed context limit: 2000 + 500 > 2048, "
            "decrease input length or `max_tokens` and try again"
        ),
    }
    for overflow, wording in cases.items():
        assert overflow.anthropic_message() == wording
    engine = BadRequest(
        "This model's maximum context length is 2048 tokens. However, you requested 1 output "
        "tokens and your prompt contains at least 2048 input tokens, for a total of at least "
        "2049 tokens."
    )
    message = anthropic_error(engine)[1]["error"]["message"]
    assert message == "prompt is too long: at least 2048 tokens > 2047 maximum"


UNHONOURABLE = [
    ("responses", {**RESPONSES, "tools": [{"type": "web_search"}], "tool_choice": "required"}, "web_search"),
    ("responses", {**RESPONSES, "tool_choice": "required"}, "tool_choice"),
    ("responses", {**RESPONSES, "tools": [FUNCTION], "tool_choice": {"type": "web_search_preview"}}, "web_search_preview"),
    ("responses", {**RESPONSES, "tools": [FUNCTION], "tool_choice": {"type": "function", "name": "g"}}, "not in 'tools'"),
    ("responses", {**RESPONSES, "tools": [FUNCTION, {"type": "web_search"}], "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}]}}, "web_search"),
    ("responses", {**RESPONSES, "include": ["message.output_text.logprobs"]}, "include"),
    ("responses", {**RESPONSES, "top_logprobs": 3}, "top_logprobs"),
    ("responses", {**RESPONSES, "tools": [{"type": "function", "name": "f", "parameters": "{}"}]}, "parameters"),
    ("messages", {**MESSAGES, "tools": [HOSTED], "tool_choice": {"type": "any"}}, "web_search"),
    ("messages", {**MESSAGES, "tools": [CUSTOM, HOSTED], "tool_choice": {"type": "tool", "name": "web_search"}}, "web_search"),
    ("messages", {**MESSAGES, "tools": [{"name": "f"}]}, "input_schema"),
    ("messages", {**MESSAGES, "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("dialect", "body", "named"),
    UNHONOURABLE,
    ids=[f"{u[0]}-{index}-{u[2]}" for index, u in enumerate(UNHONOURABLE)],
)
def test_c31_requests_that_cannot_be_honoured_are_refused(
    gw: Gateway, dialect: str, body: dict[str, Any], named: str
) -> None:
    """tool_choice that needs a tool the model cannot call here, log probabilities, MCP servers, a tool without its schema: a 400 naming why, before the engine, never an answer that ignores them."""
    before = engine_calls(gw)
    r = send(gw, dialect, body)
    assert r.status_code == 400, r.text[:300]
    assert named in error_message(dialect, r) or named in r.text
    assert engine_calls(gw) == before


ECHOED_AS_ASKED = [
    ({}, {"truncation": "disabled", "max_tool_calls": None, "service_tier": None}),
    ({"truncation": "disabled", "max_tool_calls": 1}, {"truncation": "disabled", "max_tool_calls": 1}),
    ({"truncation": "auto", "max_tool_calls": 7}, {"truncation": "auto", "max_tool_calls": 7}),
    (
        {"top_logprobs": 0, "user": "u1", "safety_identifier": "s1", "prompt_cache_key": "k1", "service_tier": "auto"},
        {"top_logprobs": 0, "user": "u1", "safety_identifier": "s1", "prompt_cache_key": "k1", "service_tier": "default"},
    ),
    ({"service_tier": "flex"}, {"service_tier": "flex"}),  # served in the background line
    ({"service_tier": "priority"}, {"service_tier": "default"}),  # no such tier here
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(
    ("asked", "echoed"),
    ECHOED_AS_ASKED,
    ids=["none", "disabled", "auto", "ids", "flex", "priority"],
)
def test_c31_responses_echo_truncation_and_max_tool_calls_as_asked(
    gw: Gateway, asked: dict[str, Any], echoed: dict[str, Any], stream: bool
) -> None:
    """A Responses request's `truncation` (`disabled` when absent), `max_tool_calls`, and the
    identifiers and tier it sent come back in the response object as asked (the tier as the
    one that served it: `flex` in the background line, else `default`), in every event of a stream and in the stored response;
    nothing of them reaches the engine."""
    body = {**RESPONSES, **asked, "stream": stream}
    r = send(gw, "responses", body)
    assert r.status_code == 200, r.text[:300]
    if stream:
        shown = [
            json.loads(line[6:])["response"]
            for line in r.text.splitlines()
            if line.startswith("data: ") and '"response":' in line
        ]
        assert [s["status"] for s in shown][-1] in ("completed", "incomplete")
    else:
        shown = [r.json()]
    stored = httpx.get(gw.url(f"/v1/responses/{shown[-1]['id']}"), headers=AUTH, timeout=30)
    for response in [*shown, stored.json()]:
        Response.model_validate(response)
        assert {name: response[name] for name in echoed} == echoed, response
    assert gw.sim is not None
    sent = gw.sim.model_records()[-1]["body"]
    assert not set(asked) & set(sent), sent


@pytest.mark.parametrize("tier", [None, "auto", "priority"], ids=["none", "auto", "priority"])
def test_a_response_served_in_the_background_line_shows_the_flex_tier(
    gw: Gateway, tier: str | None
) -> None:
    """A Responses request sent with `X-Request-Priority: background` is served in the
    background line, so its response and the stored copy show `flex`, whatever tier it asked
    (OpenAI's reference: a response shows the tier that served it)."""
    body = {**RESPONSES, "service_tier": tier} if tier else dict(RESPONSES)
    r = send(gw, "responses", body, **{"X-Request-Priority": "background"})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["service_tier"] == "flex"
    stored = httpx.get(gw.url(f"/v1/responses/{r.json()['id']}"), headers=AUTH, timeout=30)
    assert stored.json()["service_tier"] == "flex"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("truncation", "none"),
        ("truncation", "AUTO"),
        ("truncation", ["auto"]),
        ("truncation", True),
        ("max_tool_calls", 0),
        ("max_tool_calls", -1),
        ("max_tool_calls", 2.5),
        ("max_tool_calls", "3"),
        ("max_tool_calls", True),
        ("service_tier", "bogus"),
        ("service_tier", "Flex"),
        ("service_tier", 1),
    ],
    ids=repr,
)
def test_c31_responses_truncation_and_max_tool_calls_are_checked(
    gw: Gateway, name: str, value: Any
) -> None:
    """A `truncation` other than `auto` or `disabled`, or a `max_tool_calls` that is not an
    integer >= 1, is a 400 in OpenAI's shape naming the field, before the engine."""
    before = engine_calls(gw)
    r = send(gw, "responses", {**RESPONSES, name: value})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == name and name in error["message"]
    assert error["type"] == "invalid_request_error"
    assert engine_calls(gw) == before


@pytest.mark.parametrize("name", ["prompt_cache_key", "safety_identifier", "user"])
@pytest.mark.parametrize("value", [5, ["k"], {"k": 1}, True], ids=repr)
def test_chat_identifier_fields_must_be_strings(gw: Gateway, name: str, value: Any) -> None:
    """Chat's `prompt_cache_key`, `safety_identifier` and `user` are strings (OpenAI's types):
    anything else is a 400 naming the field, before the engine."""
    before = engine_calls(gw)
    r = send(gw, "chat", {**CHAT, name: value})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == name
    assert engine_calls(gw) == before


@pytest.mark.parametrize(
    ("value", "status"),
    [("bogus", 400), ("Flex", 400), (1, 400), (["flex"], 400), ("flex", 200), ("priority", 200)],
    ids=repr,
)
def test_chat_service_tier_is_one_of_openais_tiers(gw: Gateway, value: Any, status: int) -> None:
    """Chat's `service_tier` is checked as OpenAI checks it: one of its five tiers, else a 400
    naming the field and the tiers, before the engine."""
    before = engine_calls(gw)
    r = send(gw, "chat", {**CHAT, "service_tier": value})
    assert r.status_code == status, r.text[:300]
    if status == 400:
        error = r.json()["error"]
        assert error["param"] == "service_tier"
        assert "'auto', 'default', 'flex', 'scale', 'priority'" in error["message"]
        assert engine_calls(gw) == before


@pytest.mark.parametrize("value", [21, -1, 10**30, True, 2.5], ids=repr)
def test_responses_top_logprobs_out_of_openais_range_names_the_range(
    gw: Gateway, value: Any
) -> None:
    """`top_logprobs` outside OpenAI's 0..20 (or not an integer) is a 400 that names the
    range, before the engine; one within it but above 0 says log probabilities are not
    available here."""
    before = engine_calls(gw)
    r = send(gw, "responses", {**RESPONSES, "top_logprobs": value})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "top_logprobs"
    assert "between 0 and 20" in error["message"], error["message"]
    assert engine_calls(gw) == before


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_c31_truncation_auto_over_the_context_says_nothing_is_dropped(
    sim_factory: Any, gateway_factory: Any, stream: bool
) -> None:
    """A Responses input over a 2,048-token context with `truncation: "auto"` is the same 400
    `context_length_exceeded` as without it, stating the prompt's counted tokens against the
    context, and says that this server does not truncate input automatically; without
    `auto` it does not."""
    gateway, text, counted = _overflowing(sim_factory, gateway_factory)
    said = {}
    for truncation in ("auto", "disabled", None):
        body: dict[str, Any] = {"model": ALIAS, "input": text, "stream": stream}
        if truncation is not None:
            body["truncation"] = truncation
        r = httpx.post(gateway.url("/v1/responses"), json=body, headers=AUTH, timeout=30)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "input")
        message = error["message"]
        assert message.startswith("This model's maximum context length is 2048 tokens."), message
        assert f"prompt contains {counted} input tokens" in message, (message, counted)
        said[truncation] = message
    assert "does not truncate input automatically" in said["auto"], said["auto"]
    assert "'truncation' is 'auto'" in said["auto"]
    assert all("truncat" not in said[other] for other in ("disabled", None)), said


@pytest.mark.fast
def test_c31_what_can_be_honoured_still_is() -> None:
    """allowed_tools keeps only the listed functions; auto with only hosted tools answers without tools; hosted tools are named as left out."""
    body = {
        "input": "hi",
        "tools": [FUNCTION, {**FUNCTION, "name": "g"}, {"type": "web_search"}],
        "tool_choice": {
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "g"}],
        },
    }
    out = translate_responses(body)
    assert [t["function"]["name"] for t in out.chat["tools"]] == ["g"]
    assert out.chat["tool_choice"] == "required" and out.dropped_tools == ["web_search"]
    auto = translate_responses({"input": "hi", "tools": [{"type": "web_search"}]})
    assert "tools" not in auto.chat and "tool_choice" not in auto.chat
    hosted = {**MESSAGES, "tools": [CUSTOM, HOSTED], "tool_choice": {"type": "any"}}
    chat = translate_messages(hosted).chat
    assert chat["tool_choice"] == "required" and len(chat["tools"]) == 1


# ----------------------------------------------------------------------------------------- C32


def check(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``qwen38-gateway check ARGS`` with no config file anywhere (defaults apply)."""
    env = {**os.environ, "QWEN38_GATEWAY_CONFIG": str(tmp / "absent.toml")}
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_c32_a_config_named_on_the_command_line_must_exist(workdir: Path) -> None:
    """`--config` naming a file that does not exist (a typo) is an error naming it, for `check`,
    `serve` and `keys add`, instead of running on the defaults (whose keys file `keys add` would
    write); `usage report` refuses it in its own words
    (`tests.test_usage_report.test_report_names_the_ledger_it_reads_and_refuses_to_guess`)."""
    absent = str(workdir / "typo.toml")
    for args in (
        ("check", "--config", absent),
        ("serve", "--config", absent),
        ("keys", "add", "--config", absent, "--tenant", "acme"),
        ("token", "issue", "--config", absent, "--tenant", "acme"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "gateway", *args],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert f"{absent}: no such file" in done.stdout + done.stderr, (args, done.stdout)
        assert "sk-" not in done.stdout
    assert not (workdir / "typo.toml").exists()


def test_c32_check_keys_file_checks_the_keys_file(workdir: Path) -> None:
    """`check --keys-file F` without a config: a valid file exits 0 with the default listener's missing TLS as a warning; a broken file exits 1; with --config too, the listener fails the check."""
    keys = workdir / "keys.env"
    write_keys(keys, {"KEY_A": ("acme", KEY_A)})
    ok = check(workdir, "--keys-file", str(keys))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "WARN listener" in ok.stdout and "OK   keys" in ok.stdout
    broken = workdir / "broken.env"
    write_keys(broken, {}, extra="KEY_B=acme:short\n")
    bad = check(workdir, "--keys-file", str(broken))
    assert bad.returncode == 1 and "FAIL keys" in bad.stdout
    config = workdir / "gateway.toml"
    config.write_text('[server]\nhost = "0.0.0.0"\n')
    both = check(workdir, "--config", str(config), "--keys-file", str(keys))
    assert both.returncode == 1 and "FAIL listener" in both.stdout
