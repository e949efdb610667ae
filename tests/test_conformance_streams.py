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
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
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
# The simulator's gauge drops the moment its connection closes, so its bound is the gateway's
# own reaction. Real vLLM's ``vllm:num_requests_running`` drops only once its engine loop has
# taken the abort and published its next stats; with both CPUs busy (the suite runs two
# workers beside the CPU engine) that took 1.16 s once in CI, so it is allowed one second more.
ABORT_WITHIN_S = {"sim": 1.0, "real": 2.0}


def long_stream_body(engine: LaunchedEngine, **extra: Any) -> dict[str, Any]:
    """A chat stream that generates ``LONG_TOKENS`` tokens (seconds on either engine).

    Each body is new (a nonce in the prompt): the gateway quarantines a request that was at the
    engine each time it died, and these tests kill the engine on purpose.
    """
    body: dict[str, Any] = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": f"Tell me a long story ({uuid.uuid4().hex})."}],
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
    """A client that leaves mid-stream: the engine stops generating within `ABORT_WITHIN_S`,
    well before the answer's end."""
    assert wait_until(lambda: engine_idle(engine), 10)
    before = engine_metric(engine, "vllm:generation_tokens_total")
    with sse(engine_gateway, long_stream_body(engine)) as events:
        # The first content event, then leave: on an idle machine the tiny model outruns the
        # relay (all of a 6,000-token answer can be generated before 20 events arrive), so the
        # client leaves early and the proof of the abort is the answer left unfinished.
        for _ in events:
            break
    left = time.monotonic()
    idle_at = None
    within = ABORT_WITHIN_S[engine.kind]
    while time.monotonic() - left < within + 5:
        # The probe's start is when the engine was seen idle: a scrape of vLLM's 74 metric
        # families takes a while on a loaded machine and is not the engine's stopping time.
        probe = time.monotonic()
        if engine_idle(engine):
            idle_at = probe
            break
        time.sleep(0.02)
    assert idle_at is not None, "engine still running"
    assert idle_at - left <= within, f"engine stopped {idle_at - left:.2f} s after"
    generated = engine_metric(engine, "vllm:generation_tokens_total")
    time.sleep(0.5)
    assert engine_metric(engine, "vllm:generation_tokens_total") == generated
    assert generated - before < LONG_TOKENS, "the engine finished the answer: no abort seen"
    assert wait_until(lambda: settled(engine_gateway), 5)
    assert engine_gateway.metric("gateway_client_disconnects_total") >= 1
    assert chat_ok(engine_gateway)


# -------------------------------------------------------------------------------- engine crashes


@dataclass
class Crash:
    """What one engine crash mid-stream looked like from the client, the gateway and the engine.

    Attributes:
        payloads: the ``data:`` payloads the client read, in order.
        refused: a request while the engine was down got 503 with Retry-After.
        launcher_status: the launcher's exit status after its engine died.
        recovered: /ready came back and a chat completion succeeded, with nothing restarted
            but the launcher.
        before: (engine prompt, engine generation, charged prompt, charged completion) before.
        engine_after: (engine prompt, engine generation) just before the kill, generation frozen
            (real engine only; the simulator is one process, its counters die with it).
        charged_after: (charged prompt, charged completion) once the gateway settled the cut
            stream, before anything else ran.
    """

    payloads: list[str]
    refused: bool
    launcher_status: int | None
    recovered: bool
    before: tuple[float, float, float, float]
    engine_after: tuple[float, float] | None
    charged_after: tuple[float, float]


@pytest.fixture(scope="module")
def crash(engine: LaunchedEngine, engine_gateway: Gateway) -> Crash:
    """Kill the engine's process group mid-stream, once per engine (a relaunch of real vLLM
    takes about 25 s), and record what everyone saw; the launcher is then started again, as
    its supervisor would."""
    assert wait_until(lambda: engine_idle(engine) and settled(engine_gateway), 10)
    before = _counters(engine_gateway, engine)
    engine_after = None
    payloads: list[str] = []
    with sse(engine_gateway, long_stream_body(engine)) as events:
        for payload in events:
            payloads.append(payload)
            # Real vLLM's tiny model can finish the whole answer before 50 events reach an idle
            # gateway: freeze it after the first events.
            if len(payloads) == (3 if engine.kind == "real" else 50):
                if engine.kind == "real":
                    _freeze_generation(engine)
                    time.sleep(1.0)  # what the API server already has reaches the gateway
                    engine_after = (
                        engine_metric(engine, "vllm:prompt_tokens_total"),
                        engine_metric(engine, "vllm:generation_tokens_total"),
                    )
                engine.kill_engine()

    def refused() -> bool:
        body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(engine_gateway.url("/v1/chat/completions"), headers=AUTH, json=body)
        return r.status_code == 503 and int(r.headers.get("Retry-After", "0")) >= 1

    assert wait_until(lambda: settled(engine_gateway), 10)
    charged_after = (charged(engine_gateway, "prompt"), charged(engine_gateway, "completion"))
    was_refused = wait_until(refused, 10, 0.1)
    status = engine.restart()
    recovered = wait_ready(engine_gateway, 60) and chat_ok(engine_gateway)
    return Crash(payloads, was_refused, status, recovered, before, engine_after, charged_after)


def test_engine_killed_mid_stream_then_recovered(crash: Crash, engine_gateway: Gateway) -> None:
    """Engine killed mid-stream: an error event and no [DONE]; 503 while down; the launcher
    exits 1, is started again, and the gateway recovers on its own."""
    assert "[DONE]" not in crash.payloads
    last = json.loads(crash.payloads[-1])
    assert "error" in last and last["error"]["message"] and last["error"]["type"]
    assert all('"finish_reason":"' not in p for p in crash.payloads)
    assert crash.refused
    assert crash.launcher_status == 1
    assert crash.recovered
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


def _assert_charged_like_the_engine(
    gw: Gateway,
    before: tuple[float, ...],
    after_engine: tuple[float, ...],
    charged_after: tuple[float, float] | None = None,
) -> None:
    assert wait_until(lambda: settled(gw), 10)
    if charged_after is None:
        charged_after = (charged(gw, "prompt"), charged(gw, "completion"))
    prompt = charged_after[0] - before[2]
    completion = charged_after[1] - before[3]
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
    _assert_charged_like_the_engine(engine_gateway, before, after)


def test_engine_dropped_stream_is_charged_what_the_engine_generated(
    engine: LaunchedEngine, engine_gateway: Gateway, crash: Crash
) -> None:
    """Engine gone mid-stream: tokens charged = the engine's generation counter delta (±1)."""
    if engine.kind == "real":
        assert crash.engine_after is not None
        _assert_charged_like_the_engine(
            engine_gateway, crash.before, crash.engine_after, crash.charged_after
        )
        return
    # The simulator's counters die with it: let it drop the connection and live on instead.
    assert wait_until(lambda: engine_idle(engine) and settled(engine_gateway), 10)
    before = _counters(engine_gateway, engine)
    body = long_stream_body(engine)
    body["sim"]["drop_after"] = 300
    with sse(engine_gateway, body) as events:
        assert "[DONE]" not in list(events)
    after = (
        engine_metric(engine, "vllm:prompt_tokens_total"),
        engine_metric(engine, "vllm:generation_tokens_total"),
    )
    _assert_charged_like_the_engine(engine_gateway, before, after)


# The routes whose bodies carry the simulator's "sim" object; the Messages and Responses
# routes reach the engine through the same call (`gateway.proxy.call_engine`).
NON_STREAMED = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a story."}]},
    "/v1/completions": {"prompt": "Tell me a story."},
}


@pytest.mark.sim_only
@pytest.mark.parametrize("fault", ["drop_after", "error_after"])
@pytest.mark.parametrize("route", sorted(NON_STREAMED))
def test_non_streamed_answer_cut_by_the_engine_is_charged_what_it_generated(
    engine: LaunchedEngine, engine_gateway: Gateway, route: str, fault: str
) -> None:
    """A non-streamed request the engine drops or fails (its 500 comes after the tokens) once
    it generated 40 tokens: a 5xx in the route's shape, and the tokens charged are the engine's
    counter deltas (±1), not 0."""
    assert wait_until(lambda: engine_idle(engine) and settled(engine_gateway), 10)
    before = _counters(engine_gateway, engine)
    body = {
        "model": ALIAS,
        **NON_STREAMED[route],
        "max_tokens": 200,
        "sim": {"completion_tokens": 200, fault: 40},
    }
    r = httpx.post(engine_gateway.url(route), headers=AUTH, json=body, timeout=60)
    assert r.status_code >= 500 and "error" in r.json(), r.text
    assert wait_until(lambda: engine_idle(engine) and settled(engine_gateway), 10)
    after = (
        engine_metric(engine, "vllm:prompt_tokens_total"),
        engine_metric(engine, "vllm:generation_tokens_total"),
    )
    assert after[1] - before[1] >= 40
    _assert_charged_like_the_engine(engine_gateway, before, after)
    assert chat_ok(engine_gateway)


@pytest.mark.sim_only
@pytest.mark.parametrize("refuse", ["503", "close"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_refusal_before_any_prefill_is_free(
    engine: LaunchedEngine, engine_gateway: Gateway, refuse: str, stream: bool
) -> None:
    """The engine answers 503 or closes the connection at once (it computed nothing, its
    counters do not move): a 5xx for the client, and nothing charged."""
    assert wait_until(lambda: engine_idle(engine) and settled(engine_gateway), 10)
    before = _counters(engine_gateway, engine)
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": f"Hi ({uuid.uuid4().hex})."}],
        "max_tokens": 50,
        "stream": stream,
        "sim": {"refuse": refuse},
    }
    r = httpx.post(engine_gateway.url("/v1/chat/completions"), headers=AUTH, json=body, timeout=60)
    assert r.status_code >= 500, r.text
    assert wait_until(lambda: engine_idle(engine) and settled(engine_gateway), 10)
    after = _counters(engine_gateway, engine)
    assert after == before, (before, after)
    assert chat_ok(engine_gateway)


DIALECT_STREAMS = {
    "/v1/messages": {
        "model": ALIAS,
        "max_tokens": 200,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me a story."}],
    },
    "/v1/responses": {
        "model": ALIAS,
        "max_output_tokens": 200,
        "stream": True,
        "input": "Tell me a story.",
    },
}


@pytest.mark.parametrize("route", sorted(DIALECT_STREAMS))
def test_dialect_stream_left_at_once_is_charged_what_the_engine_counted(
    engine: LaunchedEngine, engine_gateway: Gateway, route: str
) -> None:
    """A Messages or Responses client that leaves at its first text delta: whether the engine
    was cut or had finished, the tokens charged equal the engine's counter deltas (±1)."""
    assert wait_until(lambda: engine_idle(engine) and settled(engine_gateway), 10)
    before = _counters(engine_gateway, engine)
    with (
        httpx.Client(timeout=httpx.Timeout(60, connect=5)) as http,
        http.stream(
            "POST", engine_gateway.url(route), headers=AUTH, json=DIALECT_STREAMS[route]
        ) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"type":"content_block_delta"' in line or '.delta"' in line:
                break
    assert wait_until(lambda: engine_idle(engine) and settled(engine_gateway), 10)
    after = (
        engine_metric(engine, "vllm:prompt_tokens_total"),
        engine_metric(engine, "vllm:generation_tokens_total"),
    )
    assert after[0] > before[0]
    _assert_charged_like_the_engine(engine_gateway, before, after)
