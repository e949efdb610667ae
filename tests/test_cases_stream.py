"""Cases C20, C22 and C24: time limits, keep-alives and odd events on the model request path."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai

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
