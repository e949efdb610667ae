"""Cases C20, C22 and C24: time limits, keep-alives and odd events on the model request path;
when a stream's headers go out."""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import time
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ALIAS, KEY_A, Gateway

AUTH = {"Authorization": f"Bearer {KEY_A}"}


def chat(sim: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A chat body, with the simulator's per-request ``sim`` object when given."""
    out: dict[str, Any] = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]}
    if sim:
        out["sim"] = sim
    out.update(extra)
    return out


def raw_stream(gw: Gateway, payload: dict[str, Any], timeout: float = 60) -> tuple[int, bytes]:
    """POST a streaming chat request; its status and every byte of the body."""
    with httpx.stream(
        "POST",
        gw.url("/v1/chat/completions"),
        json={**payload, "stream": True},
        headers=AUTH,
        timeout=timeout,
    ) as r:
        return r.status_code, b"".join(r.iter_raw())


def data_payloads(raw: bytes) -> list[bytes]:
    """The payload of every ``data:`` line of an SSE body."""
    return [
        line[5:].strip()
        for line in raw.replace(b"\r\n", b"\n").split(b"\n")
        if line.startswith(b"data:")
    ]


def sdk(gw: Gateway, timeout: float = 60) -> openai.OpenAI:
    """The official client pointed at the gateway, no retries."""
    return openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0, timeout=timeout)


# ----------------------------------------------------------------------------------------- C24


def test_c24_non_json_engine_events_are_dropped(stack: Gateway) -> None:
    """C24: data:, data: null, data: hello, data: [1,2] from the engine never reach the client; the SDK finishes."""
    status, raw = raw_stream(stack, chat({"junk_events": True, "completion_tokens": 8}))
    assert status == 200
    payloads = data_payloads(raw)
    assert payloads[-1] == b"[DONE]"
    for payload in payloads[:-1]:
        assert isinstance(json.loads(payload), dict), payload
    assert len(payloads) >= 8
    with sdk(stack) as client:
        stream = client.chat.completions.create(
            model=ALIAS,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"sim": {"junk_events": True, "completion_tokens": 8}},
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text
    time.sleep(0.2)
    dropped = [e for e in stack.logs() if e.get("event") == "engine_event_dropped"]
    ids = [e.get("request_id") for e in dropped]
    assert len(ids) >= 2 and len(set(ids)) == len(ids), "logged once per request"


# ----------------------------------------------------------------------------------------- C22


def test_c22_keepalive_comments_while_the_engine_prefills(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """C22: 5 s of engine silence after the headers: SSE comments every second keep a 2 s read timeout from firing; TTFT still counts the silence."""
    gw = gateway_factory(sim_factory(), {"server": {"sse_keepalive_s": 1.0}})
    sim = {"silence_s": 5, "completion_tokens": 6}
    with openai.OpenAI(
        base_url=gw.url("/v1"),
        api_key=KEY_A,
        max_retries=0,
        timeout=httpx.Timeout(30, read=2.0),
    ) as client:
        stream = client.chat.completions.create(
            model=ALIAS,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"sim": sim},
        )
        chunks = [c for c in stream if c.choices]
    assert chunks and "".join(c.choices[0].delta.content or "" for c in chunks)
    status, raw = raw_stream(gw, chat(sim))
    assert status == 200
    head = raw[: raw.index(b"data:")]
    assert head.count(b": keep-alive\n\n") >= 3, head
    payloads = data_payloads(raw)
    assert payloads[-1] == b"[DONE]" and all(isinstance(json.loads(p), dict) for p in payloads[:-1])
    time.sleep(0.2)
    lines = [e for e in gw.access_logs() if e.get("ttft_ms") is not None]
    assert lines and all(e["ttft_ms"] >= 5000 for e in lines[-2:])


def test_an_engine_error_reaches_the_client_before_the_slow_bookkeeping(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """A stream the engine ends with an error event before any token: at one slot the
    request keeps the slot until the engine's counters settle (`/metrics` 0.4 s late here, so
    about a second), and only the stream's end waits for that; the error event, and the events
    before it, reach the client at once."""
    gw = gateway_factory(
        sim_factory("--metrics-delay-s", "0.4"), {"engine": {"max_concurrency": 1}}
    )
    body = {**chat({"error_after": 0}), "stream": True}
    raw = b""
    seen_error = None
    with httpx.stream(
        "POST", gw.url("/v1/chat/completions"), json=body, headers=AUTH, timeout=30
    ) as response:
        assert response.status_code == 200
        for piece in response.iter_raw():
            raw += piece
            if seen_error is None and b'"error":' in raw:
                seen_error = time.monotonic()
    ended = time.monotonic()
    assert seen_error is not None, raw
    assert ended - seen_error >= 0.4, (
        f"the error event came {ended - seen_error:.2f} s before the end"
    )
    lines = [e for e in gw.access_logs() if e.get("route") == "/v1/chat/completions"]
    assert len(lines) == 1 and lines[0]["usage_source"] == "counters", lines


def test_keepalives_go_on_while_the_first_event_arrives_in_pieces(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """The engine's first event arrives in two writes 3 s apart: after the headers, keep-alive
    comments go out every second until the event is whole, as during a prefill."""
    gw = gateway_factory(sim_factory(), {"server": {"sse_keepalive_s": 1.0}})
    body = {
        **chat({"split_writes": 2, "write_gap_ms": 3000, "completion_tokens": 1}),
        "stream": True,
    }
    arrivals: list[tuple[float, bytes]] = []
    with httpx.stream(
        "POST", gw.url("/v1/chat/completions"), json=body, headers=AUTH, timeout=30
    ) as response:
        assert response.status_code == 200
        for piece in response.iter_raw():
            arrivals.append((time.monotonic(), piece))
            if b"data:" in b"".join(p for _, p in arrivals):
                break
    raw = b"".join(p for _, p in arrivals)
    assert raw.count(b": keep-alive\n\n") >= 2, raw
    times = [t for t, _ in arrivals]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < 1.6, gaps  # never silent past the keep-alive interval


@pytest.mark.parametrize("keepalive_s", [0.0, 5.0])
def test_stream_headers_are_not_held_for_a_slow_first_event(
    gateway_factory: Any, sim_factory: Any, keepalive_s: float
) -> None:
    """The stream's headers wait for its first event only briefly (to go out in one write with
    it): an engine 1.5 s from its first output still gets the client its 200 and headers at
    once, keep-alive comments on or off; the events follow, whole."""
    gw = gateway_factory(sim_factory(), {"server": {"sse_keepalive_s": keepalive_s}})
    started = time.monotonic()
    with httpx.stream(
        "POST",
        gw.url("/v1/chat/completions"),
        json={**chat({"prefill_ms": 1500, "completion_tokens": 4}), "stream": True},
        headers=AUTH,
        timeout=30,
    ) as r:
        headers_after = time.monotonic() - started
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"]
        raw = b"".join(r.iter_raw())
        body_after = time.monotonic() - started
    assert headers_after < 1.0, f"headers after {headers_after:.2f} s"
    assert body_after >= 1.5
    payloads = data_payloads(raw)
    assert payloads[-1] == b"[DONE]" and len(payloads) >= 5


def test_stream_headers_are_not_held_for_a_first_event_arriving_in_pieces(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """An engine whose first event comes in pieces far apart (its first write cut in three, 0.6
    s between them) still gets the client its 200 and headers at once; the events follow, whole."""
    gw = gateway_factory(sim_factory())
    sim = {"split_writes": 3, "write_gap_ms": 600, "completion_tokens": 2}
    started = time.monotonic()
    with httpx.stream(
        "POST",
        gw.url("/v1/chat/completions"),
        json={**chat(sim), "stream": True},
        headers=AUTH,
        timeout=30,
    ) as r:
        headers_after = time.monotonic() - started
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    assert headers_after < 0.6, f"headers after {headers_after:.2f} s"
    payloads = data_payloads(raw)
    assert payloads[-1] == b"[DONE]" and len(payloads) >= 4
    assert gw.metric("gateway_requests_in_flight") == 0


def first_reads(gw: Gateway, path: str, body: dict[str, Any], count: int) -> list[bytes]:
    """POST ``body`` to ``path`` ``count`` times over raw sockets; the first ``recv`` of each."""
    raw = json.dumps(body).encode()
    port = int(gw.base_url.rsplit(":", 1)[1])
    firsts = []
    for _ in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST %b HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer %b\r\n"
                b"Content-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (path.encode(), KEY_A.encode(), len(raw), raw)
            )
            firsts.append(sock.recv(65536))
    return firsts


def test_a_quick_first_event_arrives_with_the_headers(stack: Gateway) -> None:
    """An engine whose first event follows its headers at once: the client's first read holds
    the headers and that event together (one write of the gateway), request after request."""
    body = {**chat({"completion_tokens": 3}), "stream": True}
    firsts = first_reads(stack, "/v1/chat/completions", body, 20)
    # Written alone, the headers reached a client blocked in recv by themselves in 8-13 of 20
    # requests; written with the event, in none (a loaded machine may keep an engine's first
    # event past the hold now and then).
    assert all(first.startswith(b"HTTP/1.1 200") for first in firsts)
    together = sum(b"data: {" in f.split(b"\r\n\r\n", 1)[-1] for f in firsts)
    assert together >= 17, f"{together} of {len(firsts)} first reads held an event"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
    ],
)
def test_a_translated_first_event_arrives_with_the_headers(
    gateway_factory: Any, sim_factory: Any, path: str, body: dict[str, Any]
) -> None:
    """The translated dialects too (keep-alives off, so no opening event goes out early): their
    first event, made from the engine's first events, reaches the client with the headers."""
    gw = gateway_factory(sim_factory(), {"server": {"sse_keepalive_s": 0}})
    firsts = first_reads(gw, path, {"model": ALIAS, **body, "stream": True}, 10)
    assert all(first.startswith(b"HTTP/1.1 200") for first in firsts)
    together = sum(b"data: {" in f.split(b"\r\n\r\n", 1)[-1] for f in firsts)
    assert together >= 8, f"{together} of {len(firsts)} first reads held an event"


def test_a_stream_ends_once_its_request_is_recorded(stack: Gateway) -> None:
    """The chunked terminator of a stream goes out only after the request is recorded (slot,
    usage, ledger, access line): the access line, with its status and tokens, is in the log
    the moment the client has read the end. The engine's last events go out with the end when
    they arrive together with it (checked by eye here, not counted: a loaded machine splits
    them)."""
    body = json.dumps(
        {
            **chat({"completion_tokens": 4, "tokens_per_second": 50}),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    port = int(stack.base_url.rsplit(":", 1)[1])
    ended_unlogged = []
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer %b\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                % (KEY_A.encode(), len(body), body)
            )
            seen = b""
            while not seen.endswith(b"\r\n0\r\n\r\n"):
                data = sock.recv(65536)
                assert data, "the gateway closed the stream before its end"
                seen += data
            # The end is read: the log is read at once, before anything else happens.
            logged = {entry.get("request_id"): entry for entry in stack.access_logs()}
        request_id = seen.split(b"x-request-id: ", 1)[1].split(b"\r\n", 1)[0].decode()
        entry = logged.get(request_id)
        if entry is None:
            ended_unlogged.append(request_id)
            continue
        assert entry["status"] == 200 and entry["completion_tokens"] == 4
        assert b'"usage":{' in seen and seen.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    # Written before the request's bookkeeping, the end reached the client before the access
    # line in about half the requests.
    assert not ended_unlogged, f"{len(ended_unlogged)} of 20 streams ended before being logged"


def test_a_client_that_stops_reading_at_a_large_end_is_cut(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """A stream whose last events are large (an engine that lagged merges the rest of its
    answer into one event, MBs, sent with its ``[DONE]``) and whose client has stopped reading:
    its end is not left to aiohttp's end of the response, which waits for the client without a
    limit, but cut after ``server.client_write_timeout_s`` like any write (499
    ``client_stalled``, the connection closed), not logged 200 and held open for good."""
    gw = gateway_factory(sim_factory(), {"server": {"client_write_timeout_s": 1.0}})
    sim = {"completion_tokens": 6, "tokens_per_event": 6, "token_bytes": 1_500_000}
    body = json.dumps({**chat(sim), "stream": True}).encode()
    port = int(gw.base_url.rsplit(":", 1)[1])
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer %b\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
            % (KEY_A.encode(), len(body), body)
        )
        deadline = time.monotonic() + 20
        lines: list[dict[str, Any]] = []
        while not lines and time.monotonic() < deadline:
            time.sleep(0.2)
            lines = [e for e in gw.access_logs() if e["route"] == "/v1/chat/completions"]
        assert lines, "no access line"
        assert (lines[0]["status"], lines[0].get("reason")) == (499, "client_stalled")
        sock.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(1 << 20):  # the gateway closed its side: the reads end
                pass
    assert gw.metric("gateway_requests_in_flight") == 0


@pytest.mark.parametrize("connection", [b"", b"Connection: keep-alive\r\n"])
def test_an_http10_stream_ends_with_its_connection(stack: Gateway, connection: bytes) -> None:
    """An HTTP/1.0 client reads a stream (no chunked coding, no length) to the connection's
    close: the gateway closes it at the stream's end, also when the client asked for
    ``Connection: keep-alive`` (it waited for the idle timeout, 60 s, for the end)."""
    body = json.dumps({**chat({"completion_tokens": 3}), "stream": True}).encode()
    port = int(stack.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.0\r\nHost: gw\r\nAuthorization: Bearer %b\r\n"
            b"Content-Type: application/json\r\n%bContent-Length: %d\r\n\r\n%b"
            % (KEY_A.encode(), connection, len(body), body)
        )
        seen = b""
        while True:
            data = sock.recv(65536)  # socket.timeout: the gateway kept the connection open
            if not data:
                break
            seen += data
    head, _, events = seen.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200")
    assert b"keep-alive" not in head.lower()
    assert events.endswith(b"data: [DONE]\n\n")


def test_an_engine_gone_right_after_its_done_still_ends_the_stream_whole(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """An engine whose connection drops right after its ``[DONE]``, before its body's end (the
    engine died just after the answer): the answer is whole, so the client's stream ends as a
    whole one (``[DONE]``; Anthropic's ``message_stop``), with no error event after it for the
    SDKs to raise on, logged 200 without an error status; the drop is counted, and the next
    request is served on a new engine connection."""
    gw = gateway_factory(sim_factory("--drop-after-done", "--completion-tokens", "4"))
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    with httpx.stream(
        "POST",
        gw.url("/v1/messages"),
        json={**chat(), "max_tokens": 16, "stream": True},
        headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"},
        timeout=30,
    ) as r:
        raw = b"".join(r.iter_raw())
    assert raw.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert b"event: error" not in raw
    assert gw.read_through(KEY_A, {**chat(), "stream": True}, 30) == 200
    lines = [e for e in gw.access_logs() if e["route"] != "/ready"]
    assert [(e["status"], e.get("error_status"), e.get("reason")) for e in lines] == [
        (200, None, None)
    ] * 3
    assert gw.metric("gateway_upstream_errors_total", kind="disconnect") == 3
    assert gw.metric("gateway_requests_in_flight") == 0


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_an_engine_slow_to_end_its_body_after_done_does_not_hold_the_stream(
    gateway_factory: Any, sim_factory: Any, api: str
) -> None:
    """An engine (or a proxy before it) that keeps its body open after ``[DONE]``: the answer is
    whole, so the client's stream ends about `gateway.relay.AFTER_DONE_S` later, not when the
    engine ends its body or its read timeout fires; it is whole and logged 200 with the engine's
    usage, and the next request is served (on a new engine connection)."""
    hold = 6.0
    gw = gateway_factory(
        sim_factory("--hold-after-done-s", str(hold), "--completion-tokens", "4"),
        {"engine": {"read_timeout_s": 30.0}},
    )
    if api == "chat":
        path, headers = "/v1/chat/completions", AUTH
        body = {**chat(), "stream": True, "stream_options": {"include_usage": True}}
        end = b"data: [DONE]\n\n"
    else:
        path, headers = "/v1/messages", {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
        body = {**chat(), "max_tokens": 16, "stream": True}
        end = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    started = time.monotonic()
    with httpx.stream("POST", gw.url(path), json=body, headers=headers, timeout=30) as r:
        raw = b"".join(r.iter_raw())
    took = time.monotonic() - started
    assert raw.endswith(end), raw[-300:]
    assert b"error" not in raw
    assert took < hold - 2.0, f"the stream ended {took:.1f} s after it started"
    assert gw.read_through(KEY_A, {**chat(), "stream": True}, 30) == 200
    lines = [e for e in gw.access_logs() if e["route"] != "/ready"]
    assert [(e["status"], e.get("error_status"), e.get("reason")) for e in lines] == [
        (200, None, None)
    ] * 2
    assert lines[0]["completion_tokens"] == 4 and lines[0].get("usage_source") is None
    assert gw.metric("gateway_requests_in_flight") == 0


# ----------------------------------------------------------------------------------------- C20


def test_c20_long_answers_are_not_cut_by_a_read_timeout(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """C20: answers that take longer than engine.read_timeout_s complete, streamed or not, with the openai SDK."""
    gw = gateway_factory(sim_factory(), {"engine": {"read_timeout_s": 1.0}})
    sim = {"tokens_per_second": 10, "completion_tokens": 25, "headers_delay_s": 1.5}
    with sdk(gw) as client:
        answer = client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "hi"}], extra_body={"sim": sim}
        )
    assert answer.usage is not None and answer.usage.completion_tokens == 25
    status, raw = raw_stream(gw, chat({"tokens_per_second": 10, "completion_tokens": 25}))
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")


def test_c20_derived_time_limit_gives_504_and_aborts(
    gateway_factory: Any, sim_factory: Any
) -> None:
    """C20: a limit derived from max_tokens and engine.min_tokens_per_s cuts a too-slow engine the same way streamed or not: 504, engine aborted."""
    sim_proc = sim_factory()
    gw = gateway_factory(sim_proc, {"engine": {"read_timeout_s": 1.0, "min_tokens_per_s": 40.0}})
    slow = {"tokens_per_second": 5, "completion_tokens": 40}
    started = time.monotonic()
    r = httpx.post(
        gw.url("/v1/chat/completions"),
        json=chat(slow, max_tokens=40),
        headers=AUTH,
        timeout=30,
    )
    took = time.monotonic() - started
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert "time limit of 2 s" in r.json()["error"]["message"]
    assert 1.5 < took < 5
    status, raw = raw_stream(gw, chat(slow, max_tokens=40))
    assert status == 200
    assert json.loads(data_payloads(raw)[-1])["error"]["code"] == "upstream_timeout"
    assert b"[DONE]" not in raw
    aborted = [r for r in sim_proc.model_records() if r.get("outcome") == "aborted"]
    deadline = time.monotonic() + 5
    while len(aborted) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        aborted = [r for r in sim_proc.model_records() if r.get("outcome") == "aborted"]
    assert len(aborted) == 2
