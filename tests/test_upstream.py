"""The engine boundary: answers, error translation and counting, health, the drift check."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from gateway.config import EngineSettings
from gateway.engine_watch import check_drift, engine_running, poll_health
from gateway.errors import (
    EngineBadResponse,
    EngineBusy,
    EngineDisconnected,
    EngineFailed,
    EngineRejected,
    EngineUnreachable,
    GatewayTimeout,
)
from gateway.metrics import Metrics
from gateway.upstream import EngineState, Upstream, engine_error, tokenize_count
from tests.clock import FakeClock
from tests.inprocess import ENGINE_MODEL, SimServer, short_tempdir, start_sim, until

pytestmark = pytest.mark.fast

CHAT = "/v1/chat/completions"


@pytest.fixture
def directory() -> Iterator[Path]:
    """A short private directory for the engine socket."""
    with short_tempdir("q38u-") as path:
        yield path


@pytest.fixture
async def sim(directory: Path) -> AsyncIterator[SimServer]:
    """The simulator's app on ``directory/e.sock`` in this event loop."""
    server = await start_sim(directory)
    yield server
    await server.stop()


@pytest.fixture
def metrics() -> Metrics:
    """A fresh metrics registry."""
    return Metrics(CollectorRegistry())


def upstream_for(directory: Path, metrics: Metrics, **engine: float) -> Upstream:
    """An `Upstream` over ``directory/e.sock``."""
    settings = EngineSettings(socket=str(directory / "e.sock"), model=ENGINE_MODEL, **engine)
    return Upstream(settings, metrics)


def errors_of(metrics: Metrics, kind: str) -> float:
    """``gateway_upstream_errors_total{kind}``."""
    value = metrics.registry.get_sample_value("gateway_upstream_errors_total", {"kind": kind})
    return value or 0.0


def chat(**fields: object) -> bytes:
    """A chat body for the engine."""
    body = {"model": ENGINE_MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (503, b"", EngineBusy),
        (500, b"oops", EngineFailed),
        (502, b"", EngineFailed),
        (401, b"{}", EngineBadResponse),
        (404, b"{}", EngineBadResponse),
        (302, b"", EngineBadResponse),
    ],
)
def test_engine_statuses_become_errors_by_type(
    status: int, body: bytes, expected: type[Exception]
) -> None:
    """503 is busy, other 5xx failed; 401/403/404 and odd statuses are bad answers."""
    assert type(engine_error(status, body)) is expected


def test_an_engine_4xx_keeps_its_status_message_and_param() -> None:
    """vLLM's error body on a 4xx passes through as `EngineRejected`."""
    raw = json.dumps({"error": {"message": "too long", "param": "messages", "code": 400}})
    error = engine_error(400, raw.encode())
    assert isinstance(error, EngineRejected)
    assert (error.status, error.message, error.param) == (400, "too long", "messages")
    plain = engine_error(422, b"not json")
    assert plain.status == 422 and plain.message == "The engine rejected the request."


def test_engine_running_sums_the_running_requests() -> None:
    """``vllm:num_requests_running`` is summed over its samples; absent is None."""
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 2.0\n'
        'vllm:num_requests_running{engine="1"} 1.0\n'
    )
    assert engine_running(text) == 3.0
    assert engine_running("# TYPE other gauge\nother 1\n") is None


async def test_an_answer_streams_its_chunks_and_is_released(
    sim: SimServer, directory: Path, metrics: Metrics
) -> None:
    """A 200 answer's body arrives as chunks to its end; the connection goes back to the pool."""
    upstream = upstream_for(directory, metrics)
    try:
        answer = await upstream.post(CHAT, chat(stream=True), "rid-1")
        assert answer.status == 200
        raw = b"".join([chunk async for chunk in answer.chunks()])
        answer.release()
        assert raw.endswith(b"data: [DONE]\n\n")
        body = await upstream.post(CHAT, chat(), "rid-2")
        assert json.loads(await body.body(1 << 20))["model"] == ENGINE_MODEL
        body.release()
    finally:
        await upstream.close()
    headers = {k.lower(): v for k, v in sim.model_records()[0]["headers"].items()}
    assert headers["x-request-id"] == "rid-1"


async def test_a_non_200_answer_is_translated_and_counted_once(
    sim: SimServer, directory: Path, metrics: Metrics
) -> None:
    """The engine's 503 becomes `EngineBusy`, counted once as ``status_5xx``; a 4xx is not."""
    upstream = upstream_for(directory, metrics)
    try:
        answer = await upstream.post(CHAT, chat(sim={"refuse": "503"}), "r")
        error = await answer.error()
        assert isinstance(error, EngineBusy) and errors_of(metrics, "status_5xx") == 1
        rejected = await upstream.post(CHAT, chat(chat_template="x"), "r")
        assert isinstance(await rejected.error(), EngineRejected)
        assert errors_of(metrics, "status_5xx") == 1
    finally:
        await upstream.close()


async def test_no_socket_is_unreachable(directory: Path, metrics: Metrics) -> None:
    """A socket path with nothing behind it is `EngineUnreachable`, counted as ``connect``."""
    upstream = upstream_for(directory, metrics)
    try:
        with pytest.raises(EngineUnreachable):
            await upstream.post(CHAT, chat(), "r")
        assert await upstream.health(timeout=1.0) == ("down", "connection refused")
        assert await upstream.metrics_text(timeout=1.0) is None
    finally:
        await upstream.close()
    assert errors_of(metrics, "connect") == 1


async def test_a_closed_connection_from_a_live_engine_is_a_disconnect(
    sim: SimServer, directory: Path, metrics: Metrics
) -> None:
    """The engine closing without an answer while its /health still answers: 502, no retry."""
    upstream = upstream_for(directory, metrics)
    try:
        with pytest.raises(EngineDisconnected):
            await upstream.post(CHAT, chat(sim={"refuse": "close"}), "r")
    finally:
        await upstream.close()
    assert errors_of(metrics, "disconnect") == 1 and len(sim.model_records()) == 1


async def test_silence_past_the_read_timeout_is_a_timeout(
    sim: SimServer, directory: Path, metrics: Metrics
) -> None:
    """No byte for ``read_timeout_s`` while reading a body: `GatewayTimeout`, counted."""
    upstream = upstream_for(directory, metrics, read_timeout_s=0.2)
    try:
        answer = await upstream.post(CHAT, chat(stream=True, sim={"silence_s": 2}), "r")
        with pytest.raises(GatewayTimeout):
            async for _ in answer.chunks():
                pass
        answer.abort()
    finally:
        await upstream.close()
    assert errors_of(metrics, "timeout") == 1


async def test_abort_stops_the_engine_generation(
    sim: SimServer, directory: Path, metrics: Metrics
) -> None:
    """`UpstreamAnswer.abort` closes the socket: the engine records the request aborted."""
    upstream = upstream_for(directory, metrics)
    try:
        body = chat(stream=True, sim={"tokens_per_second": 50, "completion_tokens": 500})
        answer = await upstream.post(CHAT, body, "r")
        await answer.__anext__()
        answer.abort()
        assert await until(lambda: [r["outcome"] for r in sim.model_records()] == ["aborted"])
    finally:
        await upstream.close()


async def test_engine_state_moves_and_wakes_waiters(metrics: Metrics) -> None:
    """`EngineState` starts ``starting``, wakes `wait_ready` when ready, and its 503 names it."""
    clock = FakeClock()
    state = EngineState(metrics, clock)
    assert state.status == "starting" and state.unavailable().status == 503
    waiter = asyncio.ensure_future(state.wait_ready(5.0))
    clock.advance(3)
    state.set("ready")
    assert await waiter and state.since == clock.now
    state.set("down", "connection refused")
    assert not await state.wait_ready(0.01)
    assert state.unavailable().headers["Retry-After"] == "10"


async def test_the_poller_holds_warming_until_the_ready_file(
    sim: SimServer, directory: Path, metrics: Metrics
) -> None:
    """A healthy engine is ``warming`` while ``engine.ready_file`` is absent, then ``ready``."""
    ready_file = directory / "warm"
    settings = EngineSettings(
        socket=sim.socket, model=ENGINE_MODEL, health_interval_s=0.05, ready_file=str(ready_file)
    )
    upstream = Upstream(settings, metrics)
    state = EngineState(metrics)
    task = asyncio.ensure_future(poll_health(upstream, state, lambda: settings))
    try:
        assert await until(lambda: state.status == "warming")
        ready_file.touch()
        assert await until(lambda: state.ready)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await upstream.close()


async def test_drift_between_admitted_and_running_is_logged(
    sim: SimServer, directory: Path, metrics: Metrics
) -> None:
    """Two checks in a row with more admitted than the engine runs log ``inflight_drift``."""
    upstream = upstream_for(directory, metrics)
    state = EngineState(metrics)
    state.set("ready")
    with capture_logs() as logs:
        task = asyncio.ensure_future(check_drift(upstream, state, lambda: 2, lambda: 0.02))
        try:
            assert await until(lambda: any(e["event"] == "inflight_drift" for e in logs))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await upstream.close()
    drift = next(e for e in logs if e["event"] == "inflight_drift")
    assert drift["gateway_in_flight"] == 2 and drift["engine_running"] == 0


async def _reads(data: bytes, *cuts: int) -> AsyncIterator[bytes]:
    """``data`` as the reads that cut it at ``cuts``."""
    start = 0
    for cut in (*cuts, len(data)):
        yield data[start:cut]
        start = cut


TOKENIZE_ANSWERS = [
    # vLLM's TokenizeResponse: count first, then the ids (about 7 bytes a token).
    (
        b'{"count":4321,"max_model_len":254976,"tokens":['
        + b"151644," * 4320
        + b'1],"token_strs":null}',
        4321,
    ),
    # Older vLLM wrote the ids first; spaces as another encoder might write them.
    (b'{"tokens": [' + b"11, " * 999 + b'11], "count" : 1000, "max_model_len": 8}', 1000),
    (b'{"count":0,"max_model_len":8,"tokens":[]}', 0),
    # A token string that reads "count" is not the member.
    (b'{"token_strs":["count","\\"count\\":"],"count":2,"tokens":[5,6]}', 2),
]


@pytest.mark.parametrize(("answer", "count"), TOKENIZE_ANSWERS)
async def test_a_tokenize_count_is_found_wherever_the_reads_cut_it(
    answer: bytes, count: int
) -> None:
    """`tokenize_count` finds the count whole however the engine's reads cut the answer (inside
    the key, between the digits, before the comma), holding a few bytes beyond the read at hand."""
    where = answer.index(b'"count"')
    for cut in range(max(1, where - 3), min(len(answer), where + 20)):
        assert await tokenize_count(_reads(answer, cut), 1 << 20) == count, cut
    assert await tokenize_count(_reads(answer, *range(1, len(answer))), 1 << 20) == count


async def test_a_tokenize_answer_without_a_count_or_past_the_limit_gives_none() -> None:
    """No count in the answer, or none before ``limit`` bytes: None (the caller's fallback)."""
    assert await tokenize_count(_reads(b'{"max_model_len":8,"tokens":[1,2]}', 5), 1 << 20) is None
    assert await tokenize_count(_reads(b'{"count":"7"}'), 1 << 20) is None
    late = b'{"tokens":[' + b"1," * 50_000 + b'1],"count":50001}'
    assert await tokenize_count(_reads(late, *range(4096, len(late), 4096)), 64 * 1024) is None
    assert await tokenize_count(_reads(late, *range(4096, len(late), 4096)), 1 << 20) == 50_001
