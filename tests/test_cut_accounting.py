"""What a request costs when it is cut short, and what the client sees of the usage the gateway
asks for: in process, the gateway app in front of the simulator's app on a real Unix socket.

The engine's counters are read from the simulator's own registry (``vllm:*_tokens_total``); a
request's charge from its settled usage, handed to a finish hook (the same object the quota and
rate-limit settles, ``gateway_tokens_total``, the usage ledger and the access line read).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator, Iterator, MutableMapping
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from engine.sim.keys import METRICS as SIM_METRICS
from gateway.counters import SUM_CHECK_EVERY
from gateway.state import (
    ADMISSION,
    FINISH_HOOKS,
    IDLE_COUNTERS,
    METRICS,
    UPSTREAM,
    RequestContext,
)
from tests.inprocess import (
    AUTH_A,
    ENGINE_MODEL,
    SimServer,
    Stack,
    chat_body,
    open_stack,
    sse_data,
    start_sim,
    until,
)

CHAT = "/v1/chat/completions"
# The engine writes slowly (each event in two pieces 20 ms apart) while it generates unpaced:
# like vLLM's API server lagging behind its engine core, tokens are generated (and counted)
# well ahead of what was streamed when the client leaves.
LAGGING = {"completion_tokens": 4000, "split_writes": 2, "write_gap_ms": 20}


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every structlog entry of the test, as dicts."""
    with capture_logs() as entries:
        yield entries


@pytest.fixture
async def stack(aiohttp_client: Any) -> AsyncIterator[Stack]:
    """The simulator and a gateway with the default engine.max_concurrency of 1."""
    async with open_stack(aiohttp_client) as s:
        yield s


def finished(stack: Stack) -> list[RequestContext]:
    """Register a finish hook; the list fills with each finished request's context."""
    seen: list[RequestContext] = []
    stack.app[FINISH_HOOKS].append(seen.append)
    return seen


def engine_counters(sim: SimServer) -> tuple[float, float]:
    """(``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``) of the simulator."""
    totals = {"vllm:prompt_tokens_total": 0.0, "vllm:generation_tokens_total": 0.0}
    for family in sim.app[SIM_METRICS].registry.collect():
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["vllm:prompt_tokens_total"], totals["vllm:generation_tokens_total"]


def charged(stack: Stack, kind: str) -> float:
    """``gateway_tokens_total`` of tenant acme for ``kind`` (prompt, completion)."""
    value = stack.app[METRICS].registry.get_sample_value(
        "gateway_tokens_total", {"tenant": "acme", "type": kind}
    )
    return value or 0.0


async def leave_after_events(stack: Stack, body: dict[str, Any], events: int) -> None:
    """Stream ``body``, read ``events`` events, then go away (close the connection)."""
    r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    assert r.status == 200
    for _ in range(events):
        await r.content.readuntil(b"\n\n")
    r.close()


def one_charge(
    seen: list[RequestContext], logs: list[MutableMapping[str, Any]]
) -> tuple[int, int, str]:
    """The settled (prompt, completion, source) of the one request, the same in its access line."""
    assert len(seen) == 1
    call = seen[0].call
    assert call is not None and call.usage.settled
    usage = call.usage
    assert usage.prompt_tokens is not None and usage.completion_tokens is not None
    assert usage.source is not None
    line = [e for e in logs if e.get("event") == "request"][-1]
    assert (line["prompt_tokens"], line["completion_tokens"]) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert line.get("usage_source") == usage.source
    return usage.prompt_tokens, usage.completion_tokens, usage.source


async def cut_charge(
    stack: Stack, seen: list[RequestContext], logs: list[MutableMapping[str, Any]]
) -> tuple[int, int, tuple[float, float]]:
    """A client leaves a lagging stream after 3 events: its charge (prompt, completion), which
    came from the engine's counters, and the engine's own counter delta (prompt, generation)."""
    assert stack.sim is not None
    before = engine_counters(stack.sim)
    await leave_after_events(stack, chat_body(stream=True, max_tokens=4000, sim=LAGGING), 3)
    assert await until(lambda: bool(seen))
    after = engine_counters(stack.sim)
    prompt, completion, source = one_charge(seen, logs)
    assert source == "counters"
    return prompt, completion, (after[0] - before[0], after[1] - before[1])


_VOLATILE = re.compile(rb'"id":"[^"]*"|"created":\d+')


def normalised(event: str, alias: str) -> bytes:
    """An event with its per-request id and timestamp blanked and the engine's model name."""
    raw = event.encode().replace(
        f'"model":"{alias}"'.encode(), f'"model":"{ENGINE_MODEL}"'.encode()
    )
    return _VOLATILE.sub(b"~", raw.replace(b'"reasoning_content":', b'"reasoning":'))


async def engine_stream(sim: SimServer, body: dict[str, Any]) -> list[str]:
    """The simulator's own answer to ``body`` (sent straight to its socket)."""
    connector = aiohttp.UnixConnector(path=sim.socket)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post("http://engine/v1/chat/completions", json=body) as r,
    ):
        return sse_data(await r.read())


# ------------------------------------------------------------------------ what the client sees


async def test_running_usage_never_reaches_a_client_that_did_not_ask(stack: Stack) -> None:
    """The gateway asks the engine for usage on every chunk; a client that did not ask gets
    byte for byte what the engine sends without it (id and timestamp aside)."""
    assert stack.sim is not None
    answer = {"completion_tokens": 12, "tokens_per_second": 50}  # one token an event
    thinking = {"enable_thinking": True}
    body = chat_body(stream=True, max_tokens=12, chat_template_kwargs=thinking, sim=answer)
    r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    got = sse_data(await r.read())
    direct = dict(body, model=ENGINE_MODEL, stream_options={"include_usage": True})
    expected = [e for e in await engine_stream(stack.sim, direct) if '"choices":[]' not in e]
    alias = json.loads(got[0])["model"]
    assert [normalised(e, alias) for e in got] == [normalised(e, alias) for e in expected]
    assert all('"usage"' not in e for e in got)
    sent = stack.sim.model_records()[0]["body"]
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


async def test_running_usage_kept_for_a_client_that_asked_for_it(stack: Stack) -> None:
    """A client that asked include_usage and continuous_usage_stats gets usage on every chunk,
    the last running count equal to the final usage chunk's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = chat_body(stream=True, stream_options=options, sim={"completion_tokens": 9})
    r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    chunks = [json.loads(e) for e in sse_data(await r.read()) if e != "[DONE]"]
    assert all("usage" in c for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    running = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert running == sorted(running) and running[-1] == 9


# ------------------------------------------------------------------------------ what it costs


async def test_cut_stream_is_charged_the_engine_counter_delta(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """A client gone mid-stream while its request held the engine's only slot: charged the
    engine's counter delta, more than was streamed, once, everywhere (access line, metric)."""
    assert stack.sim is not None
    seen = finished(stack)
    prompt, completion, delta = await cut_charge(stack, seen, logs)
    assert (prompt, completion) == delta and prompt > 0
    call = seen[0].call
    assert call is not None and call.usage.streamed is not None
    assert completion > call.usage.streamed.completion_tokens  # generated, never streamed
    assert (charged(stack, "prompt"), charged(stack, "completion")) == (prompt, completion)
    assert stack.app[ADMISSION].in_flight == 0


async def test_baseline_is_read_while_the_engine_is_idle_not_on_the_request_path(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """With one slot the counters read after the previous request ended are the next request's
    baseline: no /metrics read between its grant and its POST, and its cut is still charged
    the exact counter delta."""
    assert stack.sim is not None
    warm = chat_body(sim={"completion_tokens": 5})
    assert (await stack.client.post(CHAT, json=warm, headers=AUTH_A)).status == 200
    idle = stack.app[IDLE_COUNTERS]
    assert await until(lambda: idle._reading is not None and idle._reading.done())
    upstream = stack.app[UPSTREAM]
    order: list[str] = []
    real_metrics, real_post = upstream.metrics_text, upstream.post

    async def metrics_text(timeout: float) -> str | None:
        order.append("metrics")
        return await real_metrics(timeout)

    async def post(*args: Any, **kwargs: Any) -> Any:
        order.append("post")
        return await real_post(*args, **kwargs)

    upstream.metrics_text = metrics_text  # type: ignore[method-assign]
    upstream.post = post  # type: ignore[method-assign]
    seen = finished(stack)
    before = engine_counters(stack.sim)
    await leave_after_events(stack, chat_body(stream=True, max_tokens=4000, sim=LAGGING), 3)
    assert await until(lambda: bool(seen))
    after = engine_counters(stack.sim)
    assert order[0] == "post" and "metrics" in order  # read again only to settle the cut
    prompt, completion, source = one_charge(seen, logs)
    assert source == "counters"
    assert (prompt, completion) == (after[0] - before[0], after[1] - before[1])


def count_readings(stack: Stack) -> list[int]:
    """Count the gateway's reads of the engine's ``/metrics`` from now on (one-item list)."""
    upstream = stack.app[UPSTREAM]
    real = upstream.metrics_text
    reads = [0]

    async def metrics_text(timeout: float) -> str | None:
        reads[0] += 1
        return await real(timeout)

    upstream.metrics_text = metrics_text  # type: ignore[method-assign]
    return reads


async def test_complete_requests_sum_the_counters_instead_of_reading_them(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """With one slot a complete request's counters after it are the ones before plus its final
    usage: 40 complete requests read ``/metrics`` a few times, not 40, and a cut request after
    them is still charged the exact counter delta."""
    assert stack.sim is not None
    reads = count_readings(stack)
    idle = stack.app[IDLE_COUNTERS]
    for tokens in range(1, 41):
        body = chat_body(sim={"completion_tokens": tokens % 7 + 1}, max_tokens=50)
        r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
        assert r.status == 200
        await r.read()
        assert await until(lambda: idle._reading is None or idle._reading.done())
    assert idle._summable is True
    assert 2 <= reads[0] <= 2 + 40 // SUM_CHECK_EVERY + 1
    prompt, completion, delta = await cut_charge(stack, finished(stack), logs)
    assert (prompt, completion) == delta


async def test_counters_moved_by_another_client_stop_the_sums(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """An engine whose counters do not add up to the gateway's usage (another client of the
    engine generated meanwhile) is caught by the next check: sums stop for good (logged
    ``engine_counters_not_summable``), every later request's counters are read."""
    assert stack.sim is not None
    idle = stack.app[IDLE_COUNTERS]

    async def one() -> None:
        r = await stack.client.post(CHAT, json=chat_body(max_tokens=5), headers=AUTH_A)
        assert r.status == 200
        await r.read()
        assert await until(lambda: idle._reading is None or idle._reading.done())

    for _ in range(3):
        await one()
    assert idle._summable is True
    connector = aiohttp.UnixConnector(path=stack.sim.socket)
    async with aiohttp.ClientSession(connector=connector) as direct:
        body = chat_body(model=ENGINE_MODEL, max_tokens=5)
        async with direct.post("http://engine" + CHAT, json=body) as r:
            assert r.status == 200
    for _ in range(SUM_CHECK_EVERY):
        await one()
    assert idle._summable is False
    assert [e for e in logs if e.get("event") == "engine_counters_not_summable"]
    reads = count_readings(stack)
    for _ in range(3):
        await one()
    assert reads[0] == 3


async def test_cut_non_stream_request_is_charged_the_engine_counter_delta(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """A client that gives up on a non-streamed answer: charged what the engine generated for
    it until the abort landed (its counter delta)."""
    assert stack.sim is not None
    seen = finished(stack)
    before = engine_counters(stack.sim)
    body = chat_body(max_tokens=500, sim={"completion_tokens": 500, "tokens_per_second": 100})
    with pytest.raises(asyncio.TimeoutError):
        await stack.client.post(
            CHAT, json=body, headers=AUTH_A, timeout=aiohttp.ClientTimeout(total=0.4)
        )
    assert await until(lambda: bool(seen))
    after = engine_counters(stack.sim)
    prompt, completion, source = one_charge(seen, logs)
    assert source == "counters" and seen[0].status == 499
    assert completion == after[1] - before[1] > 0
    assert prompt == after[0] - before[0] > 0


async def test_shared_engine_cut_stream_is_charged_what_was_streamed(
    aiohttp_client: Any, logs: list[MutableMapping[str, Any]]
) -> None:
    """With engine.max_concurrency > 1 the engine's counters are shared: a stream the engine
    dropped is charged its streamed running usage (the engine's own counts)."""
    async with open_stack(aiohttp_client, {"engine": {"max_concurrency": 2}}) as stack:
        assert stack.sim is not None
        seen = finished(stack)
        before = engine_counters(stack.sim)
        body = chat_body(stream=True, sim={"completion_tokens": 50, "drop_after": 7})
        r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
        assert "[DONE]" not in sse_data(await r.read())
        assert await until(lambda: bool(seen))
        after = engine_counters(stack.sim)
        prompt, completion, source = one_charge(seen, logs)
        call = seen[0].call
        assert call is not None and call.baseline is None
        assert source == "streamed" and completion == 7 == after[1] - before[1]
        assert prompt == after[0] - before[0]


async def test_engine_restarted_under_a_cut_stream_falls_back_to_what_was_streamed(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """The engine dies under a stream and another one answers on its socket before the cut is
    settled: its counters are not the request's, the streamed usage is charged."""
    sim = stack.sim
    assert sim is not None
    warm = chat_body(sim={"completion_tokens": 30})
    assert (await stack.client.post(CHAT, json=warm, headers=AUTH_A)).status == 200
    seen = finished(stack)
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = chat_body(
        stream=True, stream_options=options, sim={"completion_tokens": 100, "stall_after": 5}
    )
    r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    streamed = 0
    while streamed < 5:  # the engine stalls after 5 tokens, the request still running
        streamed = json.loads((await r.content.readuntil(b"\n\n"))[6:])["usage"][
            "completion_tokens"
        ]
    fresh_dir = stack.directory / "fresh"
    fresh_dir.mkdir()
    fresh = await start_sim(fresh_dir)
    # The fresh engine has counted more than the old one: only the counters' creation time
    # tells that they are another engine's.
    await engine_stream(fresh, dict(body, model=ENGINE_MODEL, sim={"completion_tokens": 300}))
    assert engine_counters(fresh)[1] > engine_counters(sim)[1] + 5
    try:
        os.replace(fresh.socket, sim.socket)  # new connections reach the fresh engine
        await sim.runner.cleanup()  # the old engine dies: its connections drop
        assert "error" in json.loads(sse_data(await r.read())[-1])
        assert await until(lambda: bool(seen))
        prompt, completion, source = one_charge(seen, logs)
        assert source == "streamed" and completion == 5 and prompt > 0
    finally:
        await fresh.runner.cleanup()
