"""One conformance suite, two engines: streams cut short, engine crashes, and what they cost.

Like `tests.test_conformance`, each test runs against real vLLM and the simulator (ids ``[real]``
and ``[sim]``), both under the project's launcher, with the real gateway in front. The engine's
side is read from the engine itself: its ``/metrics`` over the Unix socket
(``vllm:num_requests_running``, ``vllm:generation_tokens_total``, ``vllm:prompt_tokens_total``).
Tests marked ``sim_only`` need the simulator's fault injection (a request's ``"sim"`` object).

Long streams ask the engine to ignore end-of-sequence (``ignore_eos``, a vLLM sampling
parameter) and to stop at ``max_tokens``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ALIAS, KEY_A, Gateway, wait_until
from tests.realengine.launcher import LaunchedEngine

AUTH = {"Authorization": f"Bearer {KEY_A}"}
LONG_TOKENS = 6000
# The engine stops generating this soon after the client leaves (vLLM aborts the request when
# the HTTP connection closes; the gateway closes its engine connection when the client goes).
ABORT_WITHIN_S = 1.0


def long_stream_body(engine: LaunchedEngine, **extra: Any) -> dict[str, Any]:
    """A chat stream that generates ``LONG_TOKENS`` tokens (seconds on either engine)."""
    body: dict[str, Any] = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": True,
        "max_tokens": LONG_TOKENS,
        "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False},
        **extra,
    }
    if engine.kind == "sim":
        body.setdefault("sim", {})["completion_tokens"] = LONG_TOKENS
    return body


@contextlib.contextmanager
def sse(gw: Gateway, body: dict[str, Any]) -> Iterator[Iterator[str]]:
    """POST a streaming chat completion; yield an iterator over its ``data:`` payloads.

    Leaving the block closes the connection, as a client that goes away does.
    """
    with (
        httpx.Client(timeout=httpx.Timeout(60, connect=5)) as http,
        http.stream("POST", gw.url("/v1/chat/completions"), headers=AUTH, json=body) as r,
    ):
        assert r.status_code == 200, r.read()
        yield (line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: "))


def engine_metric(engine: LaunchedEngine, name: str) -> float:
    """Sum of the samples called ``name`` in the engine's own /metrics."""
    text = engine.metrics_text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def engine_idle(engine: LaunchedEngine) -> bool:
    """No request is running in the engine."""
    return engine_metric(engine, "vllm:num_requests_running") == 0


def charged(gw: Gateway, kind: str) -> float:
    """Tokens of ``kind`` (prompt, completion) the gateway charged tenant acme so far."""
    return gw.metric("gateway_tokens_total", tenant="acme", type=kind)


def settled(gw: Gateway) -> bool:
    """The gateway has no request in flight (its accounting is done)."""
    return gw.metric("gateway_requests_in_flight") == 0


def wait_ready(gw: Gateway, timeout: float) -> bool:
    """Wait until the gateway's /ready answers 200."""

    def ready() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(gw.url("/ready"), timeout=2).status_code == 200
        return False

    return wait_until(ready, timeout, 0.2)


def chat_ok(gw: Gateway) -> bool:
    """A short non-streamed chat completion succeeds."""
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    r = httpx.post(gw.url("/v1/chat/completions"), headers=AUTH, json=body, timeout=60)
    return r.status_code == 200 and bool(r.json()["choices"])


# -------------------------------------------------------------------------------- client leaves


def test_client_leaving_mid_stream_stops_the_engine(
    engine: LaunchedEngine, engine_gateway: Gateway
) -> None:
    """A client that leaves mid-stream: the engine stops generating within 1 s."""
    assert wait_until(lambda: engine_idle(engine), 10)
    with sse(engine_gateway, long_stream_body(engine)) as events:
        for count, _ in enumerate(events, 1):
            if count == 20:
                break
        assert engine_metric(engine, "vllm:num_requests_running") == 1
    left = time.monotonic()
    assert wait_until(lambda: engine_idle(engine), ABORT_WITHIN_S, 0.02), "engine still running"
    assert time.monotonic() - left <= ABORT_WITHIN_S
    generated = engine_metric(engine, "vllm:generation_tokens_total")
    time.sleep(0.5)
    assert engine_metric(engine, "vllm:generation_tokens_total") == generated
    assert wait_until(lambda: settled(engine_gateway), 5)
    assert engine_gateway.metric("gateway_client_disconnects_total") >= 1
    assert chat_ok(engine_gateway)


# -------------------------------------------------------------------------------- engine crashes


def test_engine_killed_mid_stream_then_recovered(
    engine: LaunchedEngine, engine_gateway: Gateway
) -> None:
    """Engine killed mid-stream: an error event and no [DONE]; relaunched, the gateway recovers."""
    payloads: list[str] = []
    with sse(engine_gateway, long_stream_body(engine)) as events:
        for payload in events:
            payloads.append(payload)
            if len(payloads) == 10:
                engine.kill_engine()
    assert "[DONE]" not in payloads
    last = json.loads(payloads[-1])
    assert "error" in last and last["error"]["message"] and last["error"]["type"]

    # Down: the gateway says so at once, in OpenAI's shape, with Retry-After.
    def refused() -> bool:
        body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(engine_gateway.url("/v1/chat/completions"), headers=AUTH, json=body)
        return r.status_code == 503 and int(r.headers.get("Retry-After", "0")) >= 1

    assert wait_until(refused, 10, 0.1)
    engine.restart()  # the launcher exited with its engine; its supervisor starts it again
    assert wait_ready(engine_gateway, 30), "the gateway did not see the engine come back"
    assert chat_ok(engine_gateway)
    assert settled(engine_gateway)


@pytest.mark.sim_only
def test_engine_error_event_mid_stream_reaches_the_client(
    engine: LaunchedEngine, engine_gateway: Gateway
) -> None:
    """The engine's own in-stream error event is relayed as the last event, with no finish."""
    body = long_stream_body(engine)
    body["sim"]["error_after"] = 5
    with sse(engine_gateway, body) as events:
        payloads = [p for p in events if p != "[DONE]"]
    # vLLM ends such a stream with [DONE] after the error event; what counts is that the error
    # is the last thing the client reads, and that no choice claims a finish_reason.
    assert json.loads(payloads[-1])["error"]["code"] == 500
    assert all('"finish_reason":"' not in p for p in payloads)
    assert chat_ok(engine_gateway)


@pytest.mark.sim_only
def test_engine_dropping_the_connection_gives_an_error_event(
    engine: LaunchedEngine, engine_gateway: Gateway
) -> None:
    """The engine closes the connection mid-stream: the client gets an error event, no [DONE]."""
    body = long_stream_body(engine)
    body["sim"]["drop_after"] = 5
    with sse(engine_gateway, body) as events:
        payloads = list(events)
    assert "[DONE]" not in payloads
    assert "error" in json.loads(payloads[-1])
    assert chat_ok(engine_gateway)


# ---------------------------------------------------------------------------- cut-stream charges


def _freeze_generation(engine: LaunchedEngine) -> None:
    """Stop the engine from generating while its API server still answers /metrics.

    Real vLLM: SIGSTOP its ``VLLM::EngineCore`` and ``VLLM::Worker`` processes (same process
    group as the API server).
    """
    group = engine.engine_pid()
    assert group is not None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.getpgid(int(entry)) != group:
                continue
            with open(f"/proc/{entry}/comm") as comm:
                if comm.read().startswith("VLLM::"):
                    os.kill(int(entry), signal.SIGSTOP)


ACCOUNTING_PENDING = pytest.mark.xfail(
    strict=True,
    reason="a stream cut without usage is charged one completion token per streamed event (real "
    "vLLM merges several tokens into one event) and the prompt estimate, not the engine's counts",
)


def _assert_charged_like_the_engine(
    gw: Gateway, engine: LaunchedEngine, before: tuple[float, ...], after_engine: tuple[float, ...]
) -> None:
    assert wait_until(lambda: settled(gw), 10)
    prompt = charged(gw, "prompt") - before[2]
    completion = charged(gw, "completion") - before[3]
    generated = after_engine[1] - before[1]
    prompted = after_engine[0] - before[0]
    assert abs(completion - generated) <= 1, f"charged {completion}, engine generated {generated}"
    assert abs(prompt - prompted) <= 1, f"charged {prompt} prompt tokens, engine saw {prompted}"


def _counters(gw: Gateway, engine: LaunchedEngine) -> tuple[float, float, float, float]:
    return (
        engine_metric(engine, "vllm:prompt_tokens_total"),
        engine_metric(engine, "vllm:generation_tokens_total"),
        charged(gw, "prompt"),
        charged(gw, "completion"),
    )


@ACCOUNTING_PENDING
def test_client_gone_stream_is_charged_what_the_engine_generated(
    engine: LaunchedEngine, engine_gateway: Gateway
) -> None:
    """Client gone mid-stream: tokens charged = the engine's generation counter delta (±1)."""
    assert wait_until(lambda: engine_idle(engine) and settled(engine_gateway), 10)
    before = _counters(engine_gateway, engine)
    with sse(engine_gateway, long_stream_body(engine)) as events:
        for count, _ in enumerate(events, 1):
            if count == 50:
                break
    assert wait_until(lambda: engine_idle(engine), 5)
    after = (
        engine_metric(engine, "vllm:prompt_tokens_total"),
        engine_metric(engine, "vllm:generation_tokens_total"),
    )
    assert after[1] - before[1] >= 40
    _assert_charged_like_the_engine(engine_gateway, engine, before, after)


@ACCOUNTING_PENDING
def test_engine_dropped_stream_is_charged_what_the_engine_generated(
    engine: LaunchedEngine, engine_gateway: Gateway
) -> None:
    """Engine gone mid-stream: tokens charged = the engine's generation counter delta (±1)."""
    assert wait_until(lambda: engine_idle(engine) and settled(engine_gateway), 10)
    before = _counters(engine_gateway, engine)
    body = long_stream_body(engine)
    if engine.kind == "sim":
        body["sim"]["drop_after"] = 300
    with sse(engine_gateway, body) as events:
        for count, _ in enumerate(events, 1):
            if count == 50 and engine.kind == "real":
                _freeze_generation(engine)
                time.sleep(1.0)  # what the API server already has reaches the gateway
                after = (
                    engine_metric(engine, "vllm:prompt_tokens_total"),
                    engine_metric(engine, "vllm:generation_tokens_total"),
                )
                engine.kill_engine()
    if engine.kind == "sim":
        after = (
            engine_metric(engine, "vllm:prompt_tokens_total"),
            engine_metric(engine, "vllm:generation_tokens_total"),
        )
    try:
        _assert_charged_like_the_engine(engine_gateway, engine, before, after)
    finally:
        if engine.kind == "real":
            engine.restart()
            assert wait_ready(engine_gateway, 30)
