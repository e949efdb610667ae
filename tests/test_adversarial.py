"""Adversarial regression tests: hostile input, hostile clients and credential edge cases.

Each test reproduces one finding of a break-the-gateway session against the real processes
(gateway and engine simulator). All are bounded in time; none floods the machine.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ALIAS, DEFAULT_KEYS, KEY_A, KEY_B, Gateway, write_keys

CHAT = "/v1/chat/completions"
HS_SECRET = b"adversarial-test-hs256-secret-0123456789"


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hs256_token(payload: bytes, kid: str = "k1") -> str:
    """A compact JWS signed with ``HS_SECRET``; ``payload`` is raw bytes (may hold NaN)."""
    header = b64u(json.dumps({"alg": "HS256", "kid": kid}).encode())
    signing_input = f"{header}.{b64u(payload)}"
    signature = hmac.new(HS_SECRET, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64u(signature)}"


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def no_500_logged(gw: Gateway, request_id: str) -> bool:
    """No access line of this request has status 500 (an unhandled error)."""
    lines = [line for line in gw.access_logs() if line.get("request_id") == request_id]
    return bool(lines) and not any(line.get("status") == 500 for line in lines)


def rid(name: str) -> dict[str, str]:
    """An ``X-Request-Id`` naming this probe, so its access line can be found."""
    return {"X-Request-Id": f"adv-{name}-{time.monotonic_ns()}"}


def raw_exchange(gw: Gateway, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes on a new connection and read until the server closes or goes quiet."""
    host, port = gw.base_url.removeprefix("http://").split(":")
    out = b""
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
    return out


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


# ------------------------------------------------------------------------ hostile JSON bodies


def test_deeply_nested_jwt_header_is_401_not_500(stack: Gateway) -> None:
    """An unauthenticated JWT-shaped credential whose header is deeply nested JSON gets 401, not 500."""
    header = b'{"alg":"HS256","x":' + b"[" * 3000 + b"]" * 3000 + b"}"
    token = f"{b64u(header)}.e30.c2ln"
    r = httpx.post(
        stack.url(CHAT),
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {token}", **(ids := rid("jwt"))},
        timeout=10,
    )
    error = assert_openai_error(r, 401)
    assert error["code"] == "invalid_api_key"
    assert no_500_logged(stack, ids["X-Request-Id"])


@pytest.mark.parametrize("depth", [100_000, 5_000])
def test_deeply_nested_json_body_is_400_not_500(stack: Gateway, depth: int) -> None:
    """A body nested deeper than the JSON parser's recursion limit is 400 invalid_request, not 500."""
    body = b'{"messages":[{"role":"user","content":"hi"}],"x":' + b"[" * depth + b"]" * depth + b"}"
    r = httpx.post(
        stack.url(CHAT),
        content=body,
        headers={**auth(), "Content-Type": "application/json", **(ids := rid("deep"))},
        timeout=10,
    )
    error = assert_openai_error(r, 400)
    assert error["code"] == "invalid_request"
    assert no_500_logged(stack, ids["X-Request-Id"])


def test_a_deeply_nested_claude_code_user_id_is_served(stack: Gateway) -> None:
    """``metadata.user_id`` is read for Claude Code's session as JSON text; text nested 5,000
    deep inside that string is just a user id (200), not a 500."""
    user_id = '{"session_id":' + "[" * 5000 + "]" * 5000 + "}"
    body = {
        "model": ALIAS,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": user_id},
    }
    headers = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01", **(ids := rid("uid"))}
    r = httpx.post(stack.url("/v1/messages"), json=body, headers=headers, timeout=10)
    assert r.status_code == 200, r.text[:300]
    assert no_500_logged(stack, ids["X-Request-Id"])


def test_tool_arguments_nested_past_the_limit_are_no_object() -> None:
    """A model's tool-call arguments nested past the body limit (or past Python's parser) give
    the Anthropic answer an empty ``input``, as any other arguments that are not an object."""
    from gateway.translate.common import arguments_object

    assert set(arguments_object('{"a": ' + "[" * 100 + "]" * 100 + "}")) == {"a"}
    assert arguments_object('{"a": ' + "[" * 200 + "]" * 200 + "}") == {}
    assert arguments_object('{"a": ' + "[" * 5000 + "]" * 5000 + "}") == {}


@pytest.mark.parametrize(
    ("path", "field"),
    [(CHAT, "content"), (CHAT, "tools"), (CHAT, "tool_calls"), ("/v1/completions", "prompt")],
)
def test_nested_lists_in_text_fields_are_not_500(stack: Gateway, path: str, field: str) -> None:
    """Nested lists (600 deep, valid JSON) in content/tools/tool_calls/prompt never give a 500."""
    deep = nested(600)
    body: dict[str, Any]
    if field == "content":
        body = {"messages": [{"role": "user", "content": deep}]}
    elif field == "tools":
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": deep}
    elif field == "tool_calls":
        body = {"messages": [{"role": "assistant", "content": "a", "tool_calls": deep}]}
    else:
        body = {"prompt": deep}
    body["max_tokens"] = 2
    ids = rid(field)
    r = httpx.post(stack.url(path), json=body, headers={**auth(), **ids}, timeout=10)
    assert r.status_code != 500, r.text[:300]
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)
    assert no_500_logged(stack, ids["X-Request-Id"])


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_undecodable_content_encoding_is_400_not_500(stack: Gateway, encoding: str) -> None:
    """A body labelled gzip/deflate that does not decode is a 400 in OpenAI shape, not a 500."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    r = httpx.post(
        stack.url(CHAT),
        content=body.encode(),
        headers={
            **auth(),
            "Content-Type": "application/json",
            "Content-Encoding": encoding,
            **(ids := rid(encoding)),
        },
        timeout=10,
    )
    assert_openai_error(r, 400)
    assert no_500_logged(stack, ids["X-Request-Id"])


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_number_literals_are_rejected(stack: Gateway, literal: str) -> None:
    """NaN/Infinity (not JSON, RFC 8259) in a body are 400 and never forwarded to the engine."""
    before = len(stack.sim.model_records()) if stack.sim else 0
    body = (
        '{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"temperature":' + literal + "}"
    )
    r = httpx.post(
        stack.url(CHAT),
        content=body.encode(),
        headers={**auth(), "Content-Type": "application/json"},
        timeout=10,
    )
    assert_openai_error(r, 400)
    assert stack.sim is not None
    assert len(stack.sim.model_records()) == before


# ---------------------------------------------------------------------------- credentials


def test_malformed_authorization_header_is_not_echoed(stack: Gateway) -> None:
    """A header line the HTTP parser rejects never echoes the API key back in the error body."""
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + KEY_A.encode() + b"\x01\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    response = raw_exchange(stack, request)
    assert response.startswith(b"HTTP/1.")
    assert KEY_A.encode() not in response
    assert KEY_A[7:].encode() not in response


@pytest.fixture
def jwt_gateway(sim_factory, gateway_factory, workdir: Path) -> Gateway:
    """A gateway whose keys file also holds the HS256 signing key ``JWT_k1``."""
    write_keys(workdir / "gw-keys.env", DEFAULT_KEYS, f"JWT_k1=hs256:{b64u(HS_SECRET)}\n")
    return gateway_factory(sim_factory())


def _jwt_status(gw: Gateway, payload: bytes) -> int:
    token = hs256_token(payload)
    r = httpx.post(
        gw.url(CHAT),
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    return r.status_code


def test_jwt_control_token_is_accepted(jwt_gateway: Gateway) -> None:
    """Control: a well-formed HS256 token for acme is accepted by the fixture gateway."""
    now = int(time.time())
    payload = json.dumps({"sub": "acme", "iat": now, "exp": now + 600}).encode()
    assert _jwt_status(jwt_gateway, payload) == 200


@pytest.mark.parametrize(
    "template",
    [
        b'{"sub":"acme","iat":%(now)d,"exp":NaN}',
        b'{"sub":"acme","iat":NaN,"exp":%(far)d}',
        b'{"sub":"acme","iat":%(now)d,"exp":%(soon)d,"nbf":NaN}',
    ],
    ids=["exp-nan", "iat-nan-bypasses-max-ttl", "nbf-nan"],
)
def test_jwt_with_nan_time_claim_is_refused(jwt_gateway: Gateway, template: bytes) -> None:
    """A signed JWT whose exp/iat/nbf is NaN is 401 (NaN would never expire nor hit max TTL)."""
    now = int(time.time())
    payload = template % {b"now": now, b"soon": now + 600, b"far": now + 10 * 365 * 86400}
    assert _jwt_status(jwt_gateway, payload) == 401


def test_jwt_sub_with_trailing_newline_is_refused(jwt_gateway: Gateway) -> None:
    """A JWT ``sub`` of ``"acme\\n"`` breaks the tenant-name rule and is 401, not a new tenant."""
    now = int(time.time())
    payload = json.dumps({"sub": "acme\n", "iat": now, "exp": now + 600}).encode()
    assert _jwt_status(jwt_gateway, payload) == 401


# -------------------------------------------------------------------------- hostile clients


def test_stalled_reader_does_not_hold_the_engine_slot_forever(sim_factory, gateway_factory) -> None:
    """A client that stops reading a stream is cut off in bounded time, so others get the engine."""
    sim = sim_factory()
    gw = gateway_factory(
        sim,
        {
            "engine": {"max_concurrency": 1, "queue_timeout_s": 60},
            "server": {"client_write_timeout_s": 2.0},
        },
    )
    body = json.dumps(
        {
            "model": ALIAS,
            "messages": [{"role": "user", "content": "long"}],
            "stream": True,
            "sim": {"completion_tokens": 50_000, "token_bytes": 512, "tokens_per_second": 0},
        }
    ).encode()
    host, port = gw.base_url.removeprefix("http://").split(":")
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect((host, int(port)))
    try:
        stalled.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(1.0)  # the stream fills the socket buffers and stalls
        started = time.monotonic()
        try:
            r = httpx.post(
                gw.url(CHAT),
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers=auth(KEY_B),
                timeout=20,
            )
            status: int | str = r.status_code
        except httpx.TimeoutException:
            status = "timeout"
        assert status == 200, f"other tenant got {status} after {time.monotonic() - started:.1f}s"
    finally:
        stalled.close()


def test_connections_with_incomplete_requests_are_closed(sim_factory, gateway_factory) -> None:
    """Idle connections and ones with partial headers or a partial body are closed in bounded time."""
    gw = gateway_factory(
        sim_factory(), {"server": {"keepalive_timeout_s": 2.0, "body_timeout_s": 2.0}}
    )
    host, port = gw.base_url.removeprefix("http://").split(":")
    partial = {
        "idle": b"",
        "partial headers": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
        "partial body": (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + KEY_A.encode() + b"\r\nContent-Length: 100\r\n\r\n{"
        ),
    }
    socks: dict[str, socket.socket] = {}
    try:
        for name, data in partial.items():
            sock = socket.create_connection((host, int(port)))
            if data:
                sock.sendall(data)
            sock.settimeout(0.2)
            socks[name] = sock
        closed: set[str] = set()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and len(closed) < len(socks):
            for name, sock in socks.items():
                if name in closed:
                    continue
                try:
                    if sock.recv(65536) == b"":
                        closed.add(name)
                except TimeoutError:
                    pass
                except OSError:
                    closed.add(name)
            time.sleep(0.5)
        assert closed == set(socks), f"still open after 15 s: {sorted(set(socks) - closed)}"
    finally:
        for sock in socks.values():
            sock.close()


@pytest.mark.parametrize("route", [CHAT, "/v1/messages", "/v1/responses"])
def test_client_that_breaks_off_its_upload_is_a_499_not_a_500(stack: Gateway, route: str) -> None:
    """A client that closes its connection mid-body is logged 499 client_disconnect, no 500,
    no traceback, and the engine slot stays free for the next request."""
    host, port = stack.base_url.removeprefix("http://").split(":")
    request_id = f"adv-cut-upload-{time.monotonic_ns()}"
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST {route} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n".encode()
        + b'{"messages"'
    )
    time.sleep(0.5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()  # SO_LINGER 0: a reset, as a client killed mid-upload sends

    def line() -> dict[str, Any] | None:
        found = [entry for entry in stack.access_logs() if entry.get("request_id") == request_id]
        return found[0] if found else None

    deadline = time.monotonic() + 10
    while line() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    entry = line()
    assert entry is not None, "no access line for the cut upload"
    assert entry["status"] == 499, entry
    assert entry.get("reason") == "client_disconnect", entry
    assert not [e for e in stack.logs() if e.get("event") == "unhandled_error"]
    answer = httpx.post(
        stack.url(CHAT),
        headers=auth(),
        json={"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text[:300]


# ------------------------------------------------------------------------- engine behaviour


def test_engine_drop_mid_answer_is_not_resubmitted(stack: Gateway) -> None:
    """A non-streaming request whose engine connection drops mid-answer reaches the engine once."""
    assert stack.sim is not None
    before = len(stack.sim.model_records())
    r = httpx.post(
        stack.url(CHAT),
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 20,
            "sim": {"drop_after": 5},
        },
        headers=auth(),
        timeout=15,
    )
    assert_openai_error(r, 502)
    assert len(stack.sim.model_records()) - before == 1
