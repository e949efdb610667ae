"""Streams that wait for the engine behind another tenant: what each dialect sends meanwhile, read
by the official SDKs, through the real gateway and the simulator (seconds-long waits; the
minutes-long ones with the real CLIs are in test_cli_long_wait.py)."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from pydantic import TypeAdapter

from tests.conftest import KEY_A, KEY_B, Gateway, wait_until

ANTHROPIC_EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
RESPONSES_EVENT = TypeAdapter(openai.types.responses.ResponseStreamEvent)
WAITING = {
    "engine": {"max_concurrency": 1, "queued_comment_after_s": 0.2},
    "server": {"sse_keepalive_s": 0.25, "sse_progress_event_s": 1.0},
}


@pytest.fixture
def gw(sim_factory: Callable[..., Any], gateway_factory: Callable[..., Gateway]) -> Gateway:
    """One simulator slot and a gateway that beats fast."""
    return gateway_factory(sim_factory("--completion-tokens", "12"), WAITING)


def hold_slot(gw: Gateway, seconds: float) -> threading.Thread:
    """Another tenant's stream takes the engine's one slot for about ``seconds`` (read to its end)."""
    body = {
        "messages": [{"role": "user", "content": "hold"}],
        "stream": True,
        "sim": {"prefill_ms": seconds * 1000, "completion_tokens": 2},
    }

    def run() -> None:
        gw.read_through(KEY_B, body, seconds + 30)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert wait_until(lambda: gw.metric("gateway_requests_in_flight", tenant="beta") == 1, 10)
    return thread


def engine_bodies(gw: Gateway, tenant_text: str) -> list[dict[str, Any]]:
    """Engine requests (finished) whose last message contains ``tenant_text``."""
    assert gw.sim is not None
    out = []
    for record in gw.sim.model_records():
        messages = (record.get("body") or {}).get("messages") or []
        if messages and tenant_text in json.dumps(messages[-1]):
            out.append(record)
    return out


def test_a_queued_messages_stream_opens_pings_and_shows_progress(gw: Gateway) -> None:
    """Messages: a queued stream gets message_start at once, pings, then no-op message_delta
    events (the only thing Claude Code's watchdog counts), all valid for the anthropic SDK, and
    the answer after them with the engine's input count."""
    holder = hold_slot(gw, 8.0)
    client = anthropic.Anthropic(base_url=gw.base_url, api_key=KEY_A, max_retries=0)
    raw = b""
    with httpx.stream(
        "POST",
        gw.url("/v1/messages"),
        json={
            "model": "qwen3.8-27b",
            "max_tokens": 64,
            "stream": True,
            "messages": [{"role": "user", "content": "queued-anthropic"}],
        },
        headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        for chunk in r.iter_bytes():
            raw += chunk
    holder.join(30)
    blocks = [b for b in raw.decode().split("\n\n") if b.strip()]
    names = [b.split("\n")[0].removeprefix("event: ") for b in blocks]
    assert names[0] == "message_start"
    first_block = names.index("content_block_start")
    waiting = names[1:first_block]
    assert "ping" in waiting and waiting.count("message_delta") >= 2
    assert all(b == 'event: ping\ndata: {"type":"ping"}' for b in blocks if "ping" in b[:12])
    events = [
        ANTHROPIC_EVENT.validate_json(b.split("data: ", 1)[1])
        for b in blocks
        if not b.startswith("event: ping")
    ]
    names = [e.type for e in events]
    first_block = names.index("content_block_start")
    start = events[0]
    assert start.type == "message_start" and start.message.usage.input_tokens == 0
    progress = [e for e in events[1:first_block] if e.type == "message_delta"]
    assert all(e.delta.stop_reason is None and e.usage.output_tokens == 0 for e in progress)
    final = events[-2]
    assert final.type == "message_delta" and final.delta.stop_reason == "end_turn"
    assert final.usage.input_tokens and final.usage.input_tokens > 0
    # The SDK's own accumulation over the same kind of wait.
    holder = hold_slot(gw, 4.0)
    with client.messages.stream(
        model="qwen3.8-27b",
        max_tokens=64,
        messages=[{"role": "user", "content": "queued-anthropic-sdk"}],
    ) as stream:
        message = stream.get_final_message()
    holder.join(30)
    client.close()
    assert message.stop_reason == "end_turn" and message.content[-1].type == "text"
    assert message.usage.output_tokens == 12 and message.usage.input_tokens > 0
    assert len(engine_bodies(gw, "queued-anthropic")) == 2  # one engine request each


def test_a_queued_responses_stream_repeats_in_progress(gw: Gateway) -> None:
    """Responses: a queued stream gets response.created and response.in_progress at once, then
    more response.in_progress events (Codex's idle timer counts events, not comments), with
    increasing sequence numbers, and the answer; the openai SDK reads every event."""
    holder = hold_slot(gw, 8.0)
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0)
    events = list(
        client.responses.create(model="qwen3.8-27b", input="queued-responses", stream=True)
    )
    holder.join(30)
    client.close()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    first_item = kinds.index("response.output_item.added")
    assert kinds[1:first_item].count("response.in_progress") >= 3
    assert kinds[-1] == "response.completed"
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    for event in events:
        RESPONSES_EVENT.validate_python(event.model_dump())
    assert events[-1].response.output_text and len(engine_bodies(gw, "queued-responses")) == 1


def test_a_queued_chat_stream_gets_comments(gw: Gateway) -> None:
    """Chat: a queued stream gets ': queued' comments (bytes for the openai SDK's read timeout,
    here shorter than the wait) and then its answer."""
    holder = hold_slot(gw, 3.0)
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0, timeout=1.5)
    chunks = list(
        client.chat.completions.create(
            model="qwen3.8-27b",
            messages=[{"role": "user", "content": "queued-chat"}],
            stream=True,
        )
    )
    holder.join(30)
    client.close()
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len(engine_bodies(gw, "queued-chat")) == 1


def test_no_silence_longer_than_the_keepalive_from_the_queue_into_a_prefill(
    sim_factory: Callable[..., Any], gateway_factory: Callable[..., Gateway]
) -> None:
    """A queued chat stream (comments every second) that then waits for a 3 s prefill: the
    beats go on every second from the last one of the queue, not a whole interval after the
    engine took the request (up to twice the interval of silence)."""
    config = {
        "engine": {"max_concurrency": 1, "queued_comment_after_s": 0.2},
        "server": {"sse_keepalive_s": 1.0, "sse_progress_event_s": 0},
    }
    gw = gateway_factory(sim_factory("--completion-tokens", "2"), config)
    holder = hold_slot(gw, 2.0)  # granted about 0.8 s after a beat of the queue
    body = {
        "model": "qwen3.8-27b",
        "messages": [{"role": "user", "content": "queued-then-prefill"}],
        "stream": True,
        "sim": {"prefill_ms": 3000},
    }
    times: list[float] = []
    with httpx.stream(
        "POST",
        gw.url("/v1/chat/completions"),
        json=body,
        headers={"Authorization": f"Bearer {KEY_A}"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        raw = b""
        for piece in response.iter_raw():
            times.append(time.monotonic())
            raw += piece
    holder.join(30)
    assert b": queued" in raw and raw.rstrip().endswith(b"data: [DONE]")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < 1.5, gaps


def test_a_queued_client_that_closes_leaves_the_queue_at_once(gw: Gateway) -> None:
    """A queued stream whose client closes its connection leaves the queue within a second and
    never reaches the engine (499 client_disconnect)."""
    holder = hold_slot(gw, 4.0)
    body = {"messages": [{"role": "user", "content": "gone-before-served"}], "stream": True}
    with httpx.stream(
        "POST",
        gw.url("/v1/chat/completions"),
        json=body,
        headers={"Authorization": f"Bearer {KEY_A}"},
        timeout=10,
    ) as r:
        chunks = r.iter_bytes()
        assert next(chunks).startswith(b": queued")  # the headers and a first comment
        assert gw.metric("gateway_queue_depth") == 1
    closed = time.monotonic()
    assert wait_until(lambda: gw.metric("gateway_queue_depth") == 0, 5)
    assert time.monotonic() - closed < 1.5
    holder.join(30)
    assert engine_bodies(gw, "gone-before-served") == []
    lines = [e for e in gw.access_logs() if e.get("tenant") == "acme"]
    assert lines[-1]["status"] == 499 and lines[-1]["reason"] == "client_disconnect"


@pytest.fixture
def stalled_gw(sim_factory: Callable[..., Any], gateway_factory: Callable[..., Gateway]) -> Gateway:
    """As `gw`, with a 1 s write timeout for clients that stop reading."""
    config = {**WAITING, "server": {**WAITING["server"], "client_write_timeout_s": 1.0}}
    config["server"]["sse_progress_event_s"] = 0.25
    return gateway_factory(sim_factory("--completion-tokens", "12"), config)


def test_a_queued_client_that_stopped_reading_is_found_by_the_keepalive_writes(
    stalled_gw: Gateway,
) -> None:
    """A queued Responses stream whose client keeps its connection open but reads nothing (a
    dead peer's socket) is dropped once the keep-alive writes fill the socket buffers and stay
    unread for server.client_write_timeout_s: 499 client_stalled, never sent to the engine."""
    gw = stalled_gw
    holder = hold_slot(gw, 12.0)
    tools = [
        {
            "type": "function",
            "name": f"tool_{i}",
            "description": "x" * 2000,
            "parameters": {"type": "object", "properties": {}},
        }
        for i in range(40)
    ]
    body = json.dumps(
        {"model": "qwen3.8-27b", "input": "stalled-reader", "stream": True, "tools": tools}
    ).encode()
    host, port = gw.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        sock.sendall(
            b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY_A}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert wait_until(lambda: gw.metric("gateway_queue_depth") == 1, 5)
        assert wait_until(lambda: gw.metric("gateway_queue_depth") == 0, 10)
        lines = [e for e in gw.access_logs() if e.get("tenant") == "acme"]
        assert lines[-1]["status"] == 499 and lines[-1]["reason"] == "client_stalled"
    finally:
        sock.close()
    holder.join(30)
    assert engine_bodies(gw, "stalled-reader") == []


def test_an_interactive_answer_goes_before_its_tenants_background_tasks(gw: Gateway) -> None:
    """A chat UI's title (service_tier "flex") and tags (X-Request-Priority: background) requests
    queued before its answer are served after it, through the openai SDK."""
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0)
    holder = hold_slot(gw, 15.0)
    done: list[str] = []

    def ask(text: str, **extra: Any) -> None:
        client.chat.completions.create(
            model="qwen3.8-27b", messages=[{"role": "user", "content": text}], **extra
        )
        done.append(text)

    title = threading.Thread(target=ask, args=("task-title",), kwargs={"service_tier": "flex"})
    title.start()
    assert wait_until(lambda: gw.metric("gateway_queue_depth") == 1, 10)
    tags = threading.Thread(
        target=ask,
        args=("task-tags",),
        kwargs={"extra_headers": {"X-Request-Priority": "background"}},
    )
    tags.start()
    assert wait_until(lambda: gw.metric("gateway_queue_depth") == 2, 10)
    ask("the-answer")
    for thread in (title, tags, holder):
        thread.join(60)
    client.close()
    assert gw.sim is not None
    order = [
        json.dumps(r["body"]["messages"][-1]["content"])
        for r in gw.sim.model_records()
        if "hold" not in json.dumps(r["body"]["messages"])
    ]
    assert [
        next(t for t in ("the-answer", "task-title", "task-tags") if t in o) for o in order
    ] == [
        "the-answer",
        "task-title",
        "task-tags",
    ]
    assert sorted(done) == ["task-tags", "task-title", "the-answer"]


def _timed_stream(
    gw: Gateway, path: str, body: dict[str, Any], key: str = KEY_A
) -> tuple[int, bytes, list[float]]:
    """POST a stream; its status, raw bytes, and the arrival time of each piece from the send."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"}
    times: list[float] = []
    raw = b""
    with httpx.stream("POST", gw.url(path), json=body, headers=headers, timeout=60) as response:
        for piece in response.iter_raw():
            times.append(time.monotonic() - started)
            raw += piece
        return response.status_code, raw, times


HEAD_WAIT = {"server": {"sse_keepalive_s": 1.0, "sse_progress_event_s": 0}}


def test_a_stream_waiting_for_the_engines_headers_shows_life(
    sim_factory: Callable[..., Any], gateway_factory: Callable[..., Gateway]
) -> None:
    """The engine takes 3 s to send its headers (a long tokenization, a busy engine): the
    stream opens and beats every `sse_keepalive_s` meanwhile, then the whole answer; no
    silence longer than twice the beat. (The translated routes send no `sim` object to the
    engine: their beats are tested across an engine restart below.)"""
    gw = gateway_factory(sim_factory("--completion-tokens", "4"), HEAD_WAIT)
    body = {
        "model": "qwen3.8-27b",
        "stream": True,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "head-wait"}],
        "sim": {"headers_delay_s": 4},
    }
    status, raw, times = _timed_stream(gw, "/v1/chat/completions", body)
    assert status == 200
    # The headers and a first comment one beat in (1 s), long before the engine's (4 s).
    assert times[0] < 1.7, times[:3]
    gaps = [b - a for a, b in itertools.pairwise([0.0, *times])]
    assert max(gaps) < 1.7, gaps
    text = raw.decode()
    assert ": keep-alive" in text and text.rstrip().endswith("data: [DONE]")


def test_a_stream_whose_engine_never_sends_headers_ends_with_an_error_event(
    sim_factory: Callable[..., Any], gateway_factory: Callable[..., Gateway]
) -> None:
    """An engine that hangs before its headers: the stream beats until `read_timeout_s`, then
    ends with one SSE error event (504 `upstream_timeout`), not a plain JSON 504 after a silent
    wait; the openai SDK reads it as an APIError."""
    config = {**HEAD_WAIT, "engine": {"read_timeout_s": 3}}
    gw = gateway_factory(sim_factory(), config)
    body = {
        "model": "qwen3.8-27b",
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "head-hang"}],
        "sim": {"hang": True},
    }
    status, raw, times = _timed_stream(gw, "/v1/chat/completions", body)
    assert status == 200 and times[0] < 1.7
    text = raw.decode()
    assert ": keep-alive" in text
    last = json.loads(text.strip().split("\n\n")[-1][6:])
    assert last["error"]["code"] == "upstream_timeout", last
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(
            model="qwen3.8-27b",
            messages=[{"role": "user", "content": "head-hang"}],
            max_tokens=8,
            stream=True,
            extra_body={"sim": {"hang": True}},
        ):
            pass
    assert wait_until(lambda: gw.metric("gateway_requests_in_flight", tenant="acme") == 0, 5)


def _check_dialect_stream(path: str, text: str) -> None:
    """The beats and the whole answer, in the dialect of ``path``."""
    if path == "/v1/chat/completions":
        assert ": keep-alive" in text and text.rstrip().endswith("data: [DONE]")
    elif path == "/v1/messages":
        assert text.startswith("event: message_start") and "event: ping" in text
        assert text.count("event: message_start") == 1 and "event: message_stop" in text
        for block in text.strip().split("\n\n"):
            data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
            if not block.startswith("event: ping"):
                ANTHROPIC_EVENT.validate_python(json.loads(data[0]))
    else:
        assert text.count("event: response.created") == 1 and "response.completed" in text


def _restart_after_exit(sim: Any, delay: float, *extra: str) -> threading.Thread:
    """Once ``sim`` exits, start it again ``delay`` seconds later (with ``extra`` arguments)."""

    def back() -> None:
        assert wait_until(lambda: sim.proc.poll() is not None, 20)
        time.sleep(delay)
        sim.args = [*sim.args, *extra]
        sim.restart()

    thread = threading.Thread(target=back, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_stream_granted_while_its_engine_is_down_shows_life(
    sim_factory: Callable[..., Any], gateway_factory: Callable[..., Gateway], path: str
) -> None:
    """A stream queued behind a request whose engine dies is granted the slot while the engine
    is down and waits for its return (3 s): meanwhile it opens and beats in its dialect
    (comments; Anthropic's message_start and pings; Responses' created event), then the whole
    answer comes, with no silence longer than about twice the beat."""
    config = {
        **HEAD_WAIT,
        "engine": {"max_concurrency": 1, "queue_timeout_s": 30, "queued_comment_after_s": 60},
    }
    sim = sim_factory("--completion-tokens", "4")
    gw = gateway_factory(sim, config)
    killer = {
        "model": "qwen3.8-27b",
        "stream": True,
        "messages": [{"role": "user", "content": "killer"}],
        "sim": {"tokens_per_second": 10, "completion_tokens": 100, "exit_after": 5},
    }
    holder = threading.Thread(target=lambda: gw.read_through(KEY_B, killer, 30), daemon=True)
    holder.start()
    assert wait_until(lambda: gw.metric("gateway_requests_in_flight", tenant="beta") == 1, 10)
    restarter = _restart_after_exit(sim, 3.0)
    body: dict[str, Any] = {"model": "qwen3.8-27b", "stream": True}
    if path == "/v1/responses":
        body["input"] = "engine-return"
    else:
        body["messages"] = [{"role": "user", "content": "engine-return"}]
        body["max_tokens"] = 64
    status, raw, times = _timed_stream(gw, path, body)
    restarter.join(30)
    holder.join(30)
    assert status == 200
    assert times[-1] > 3, times  # it did wait for the engine's return
    gaps = [b - a for a, b in itertools.pairwise([0.0, *times])]
    assert max(gaps) < 1.7, gaps  # the queue's wait (about 0.5 s), then beats of 1 s
    _check_dialect_stream(path, raw.decode())


def test_a_stream_whose_engine_died_before_its_first_byte_beats_until_it_is_sent_again(
    sim_factory: Callable[..., Any], gateway_factory: Callable[..., Gateway]
) -> None:
    """The engine dies with the request before its first byte and is back 3 s later: the
    request is sent once more, and meanwhile the stream opens and beats; then the whole
    answer."""
    sim = sim_factory("--completion-tokens", "4")
    gw = gateway_factory(sim, {**HEAD_WAIT, "engine": {"queue_timeout_s": 30}})
    # The restarted engine ignores the request's `sim` object, which killed the first one.
    restarter = _restart_after_exit(sim, 3.0, "--request-control", "off")
    body = {
        "model": "qwen3.8-27b",
        "stream": True,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "die-first"}],
        "sim": {"exit_after": 0},
    }
    status, raw, times = _timed_stream(gw, "/v1/chat/completions", body)
    restarter.join(30)
    assert status == 200 and times[-1] > 3, times
    gaps = [b - a for a, b in itertools.pairwise([0.0, *times])]
    assert max(gaps) < 1.7, gaps
    _check_dialect_stream("/v1/chat/completions", raw.decode())
    assert gw.metric("gateway_engine_retries_total") == 1
