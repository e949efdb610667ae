"""Failover pieces in process: the rotation rule of the health poller (a silent engine out within
``health_interval_s + rotation_timeout_s``, a streaming one kept), a request the engine never
read moved, one it read kept until the engine is down, the prompt counter's engine choice."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.admission import AdmissionQueue
from gateway.config import EngineSettings, EngineSpec, QuarantineSettings
from gateway.engine_watch import poll_health
from gateway.engines import Engines
from gateway.errors import EngineDisconnected, EngineUnreachable
from gateway.failover import DOWN, STALLED, EngineStalled, Rotation
from gateway.metrics import Metrics
from gateway.quarantine import Quarantine
from gateway.upstream import EngineState, Upstream
from tests.inprocess import short_tempdir, until

pytestmark = pytest.mark.fast


@pytest.fixture
def directory() -> Iterator[Path]:
    """A short private directory for the sockets."""
    with short_tempdir("q38f-") as path:
        yield path


class Engine:
    """An engine stand-in on a Unix socket whose /health can hang and whose POST streams
    ``beats`` events 50 ms apart (a live engine generating)."""

    def __init__(self) -> None:
        self.hang = asyncio.Event()  # set: /health never answers
        self.beats = 0
        self.pause = 0.0  # seconds of silence after the first event

    async def health(self, request: web.Request) -> web.Response:
        while self.hang.is_set():
            await asyncio.sleep(0.01)
        return web.Response(text="")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse()
        await response.prepare(request)
        for beat in range(self.beats):
            await response.write(b"data: {}\n\n")
            await asyncio.sleep(self.pause if beat == 0 and self.pause else 0.05)
        await response.write_eof()
        return response


@pytest.fixture
async def fake_engine(directory: Path) -> AsyncIterator[tuple[Engine, str]]:
    """The stand-in served on ``directory/e.sock``."""
    stand_in = Engine()
    app = web.Application()
    app.router.add_get("/health", stand_in.health)
    app.router.add_post("/v1/chat/completions", stand_in.stream)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    await web.UnixSite(runner, str(directory / "e.sock")).start()
    yield stand_in, str(directory / "e.sock")
    stand_in.hang.clear()
    await runner.cleanup()


def settings_for(socket: str, **engine: float) -> EngineSettings:
    return EngineSettings(socket=socket, unhealthy_after_s=60, **engine)


async def test_a_silent_engine_leaves_rotation_within_interval_plus_timeout_and_rejoins(
    fake_engine: tuple[Engine, str],
) -> None:
    """A /health that stops answering takes an idle engine out of rotation within
    health_interval_s + rotation_timeout_s (not down), and the first answer puts it back."""
    stand_in, socket = fake_engine
    settings = settings_for(socket, health_interval_s=0.2, rotation_timeout_s=0.3)
    metrics = Metrics(CollectorRegistry())
    upstream, state = Upstream(settings, metrics), EngineState(metrics)
    verdicts: list[tuple[float, bool]] = []
    task = asyncio.ensure_future(
        poll_health(
            upstream, state, lambda: settings, None, lambda live, _: verdicts.append((time.monotonic(), live))
        )
    )  # fmt: skip
    try:
        assert await until(lambda: state.ready and bool(verdicts))
        stand_in.hang.set()
        hung = time.monotonic()
        assert await until(lambda: not verdicts[-1][1], 3)
        out_s = verdicts[-1][0] - hung
        assert out_s <= 0.2 + 0.3 + 0.25, out_s
        assert state.status == "ready"  # down keeps its own, slower rule
        stand_in.hang.clear()
        assert await until(lambda: verdicts[-1][1], 3)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await upstream.close()


async def test_a_slow_probe_while_the_engine_streams_keeps_it_in_rotation(
    fake_engine: tuple[Engine, str],
) -> None:
    """While a stream's bytes keep coming, probes that answer late take nothing out of
    rotation; once the stream ends, the silent engine is out."""
    stand_in, socket = fake_engine
    settings = settings_for(socket, health_interval_s=0.1, rotation_timeout_s=0.15)
    metrics = Metrics(CollectorRegistry())
    upstream, state = Upstream(settings, metrics), EngineState(metrics)
    verdicts: list[bool] = []
    task = asyncio.ensure_future(
        poll_health(upstream, state, lambda: settings, None, lambda live, _: verdicts.append(live))
    )
    try:
        assert await until(lambda: state.ready and bool(verdicts))
        stand_in.beats = 30  # 1.5 s of events
        answer = await upstream.post("/v1/chat/completions", b"{}", "r1")
        stand_in.hang.set()
        async for _ in answer.chunks():
            pass
        answer.release()
        assert False not in verdicts
        assert await until(lambda: verdicts[-1] is False, 3)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await upstream.close()


async def _server(directory: Path, name: str) -> asyncio.AbstractServer:
    """A Unix server that reads what it gets and never answers."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)
        writer.close()

    return await asyncio.start_unix_server(handle, str(directory / name))


async def test_a_request_the_engine_never_read_moves_when_it_stalls(directory: Path) -> None:
    """A POST still unread in a stalled engine's socket (a listener that accepts nothing, as a
    stopped process) ends at the stall as EngineStalled (not sent: it goes elsewhere, no
    death)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / "s.sock"))
    listener.listen(8)
    upstream = Upstream(settings_for(str(directory / "s.sock")), Metrics(CollectorRegistry()))
    rotation = Rotation(lambda name, stalled: None)
    try:
        posting = asyncio.ensure_future(
            rotation.post(upstream, "/v1/chat/completions", b"{}" * 100, "r1", stream=True)
        )
        await asyncio.sleep(0.2)
        assert not posting.done()
        rotation.set(upstream.name, False, "health timeout")
        with pytest.raises(EngineStalled) as stalled:
            await asyncio.wait_for(posting, 2)
        assert not stalled.value.sent
    finally:
        listener.close()
        await upstream.close()


async def test_a_request_the_engine_read_stays_until_the_engine_is_down(directory: Path) -> None:
    """A POST the engine read survives a stall (a busy engine may answer /health late) and
    ends as a drop under it (retried once, a death) when the engine is declared down."""
    server = await _server(directory, "r.sock")
    upstream = Upstream(settings_for(str(directory / "r.sock")), Metrics(CollectorRegistry()))
    rotation = Rotation(lambda name, stalled: None)
    try:
        posting = asyncio.ensure_future(
            rotation.post(upstream, "/v1/chat/completions", b"{}", "r2", stream=True)
        )
        await asyncio.sleep(0.2)
        rotation.signal(upstream.name, STALLED)
        await asyncio.sleep(0.3)
        assert not posting.done()
        rotation.signal(upstream.name, DOWN)
        with pytest.raises(EngineUnreachable) as dropped:
            await asyncio.wait_for(posting, 2)
        assert dropped.value.sent and not isinstance(dropped.value, EngineStalled)
    finally:
        server.close()
        await upstream.close()
        await server.wait_closed()


def _fleet(specs: list[EngineSpec], metrics: Metrics) -> Engines:
    """A fleet of ``specs`` with one slot each and quarantine off (not started)."""
    queue = AdmissionQueue(1, 8, 60, metrics, engines=[(s.name, 1) for s in specs])
    return Engines(
        specs,
        metrics,
        time.monotonic,
        EngineState(metrics, quiet=True),
        queue,
        Quarantine(QuarantineSettings(enabled=False), b"k" * 32, metrics),
    )


async def test_prompt_counts_and_granted_requests_go_to_an_engine_in_rotation() -> None:
    """The prompt counter is the preferred engine while in rotation, else the first engine in
    rotation, else the first ready one; a request granted a stalled engine moves."""
    metrics = Metrics(CollectorRegistry())
    specs = [EngineSpec(name=n, socket=f"/nonexistent/{n}.sock") for n in ("e0", "e1", "e2")]
    fleet = _fleet(specs, metrics)
    fleet.start(lambda: EngineSettings(health_interval_s=600))
    try:
        for state in fleet.states.values():
            state.set("ready")
        assert fleet.counter("e1").name == "e1"
        fleet.rotation.set("e1", False, "health timeout")
        assert not fleet.in_rotation("e1") and fleet.counter("e1").name == "e0"
        assert fleet.elsewhere("e1") and not fleet.elsewhere("e0")  # granted e1: moved
        fleet.rotation.set("e0", False, "health timeout")
        assert fleet.counter("e1").name == "e2" and fleet.counter(None).name == "e2"
        fleet.states["e2"].set("down", "connection refused")
        assert fleet.counter("e1").name == "e0"  # none in rotation: the first ready one
        fleet.rotation.set("e1", True, None)
        assert fleet.counter(None).name == "e1" and fleet.in_rotation("e1")
    finally:
        await fleet.close()


async def test_an_engine_marked_down_ends_its_answers_only_when_silent(
    fake_engine: tuple[Engine, str],
) -> None:
    """Marked down right after a byte, an engine's stream goes on to its end; marked down with
    nothing from it for unhealthy_after_s, its open answer is ended (the read fails)."""
    stand_in, socket = fake_engine
    metrics = Metrics(CollectorRegistry())
    specs = [EngineSpec(name="e0", socket=socket), EngineSpec(name="e1", socket="/nonexistent/e1")]
    fleet = _fleet(specs, metrics)
    fleet.start(lambda: EngineSettings(health_interval_s=600, unhealthy_after_s=0.3))
    state, upstream = fleet.states["e0"], fleet.upstreams["e0"]
    try:
        assert await until(lambda: state.ready)
        stand_in.beats = 10
        answer = await upstream.post("/v1/chat/completions", b"{}", "r1")
        await answer.__anext__()
        state.set("down", "health timeout")
        assert len([chunk async for chunk in answer.chunks()]) >= 8  # not cut
        answer.release()
        state.set("ready")
        stand_in.beats, stand_in.pause = 2, 30.0
        silent = await upstream.post("/v1/chat/completions", b"{}", "r2")
        await silent.__anext__()
        await asyncio.sleep(0.4)
        state.set("down", "health timeout")
        with pytest.raises(EngineDisconnected):
            await asyncio.wait_for(silent.__anext__(), 2)
        assert len(upstream.answers) == 0
    finally:
        await fleet.close()
