"""A stream that waits: queued for an engine slot, or at the engine before its first token.

One request stays one request however long it waits, because the clients' idle timers never
fire: from the moment a stream waits ``engine.queued_comment_after_s`` in the queue its headers
go out, then the dialect's opening events (Anthropic ``message_start``; Responses
``response.created`` and ``response.in_progress``; nothing for chat and completions), then every
``server.sse_keepalive_s`` bytes the clients accept as life:

- chat and completions: an SSE comment (``: queued`` in the queue, ``: keep-alive`` during the
  prefill); the ``openai`` SDK's read timeout counts bytes;
- Messages: ``event: ping``; Claude Code's byte watchdog counts it, but its event watchdog (300 s
  without an event, ``CLAUDE_STREAM_IDLE_TIMEOUT_MS`` can only raise it) skips pings, and the
  ``anthropic`` SDKs drop them, so every ``server.sse_progress_event_s`` the ping is replaced by
  a ``message_delta`` that changes nothing (`AnthropicWriter.progress`);
- Responses: an SSE comment, and every ``server.sse_progress_event_s`` a ``response.in_progress``
  event instead: Codex's idle timer (``stream_idle_timeout_ms``, 300 s) counts SSE events, and a
  comment is none.

A client that closed its connection is found at once (aiohttp cancels the handler, the ticket
leaves the queue); one whose connection is dead but not closed is found when a keep-alive write
fails: a reset or unreachable peer raises at the write, and a peer that stopped reading fills the
socket buffers, after which the write waits ``server.client_write_timeout_s`` and gives up
(`gateway.relay.ClientStream.send`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from gateway.admission import Ticket
from gateway.framing import comment
from gateway.relay import ClientStream
from gateway.state import ModelCall
from gateway.translate.common import BACKGROUND_TIERS

T = TypeVar("T")

QUEUED_COMMENT = comment("queued")
ENGINE_KEEPALIVE = comment("keep-alive")
"""What a stream waiting at the engine sends when its dialect has no keep-alive of its own."""
PRIORITY_HEADER = "X-Request-Priority"
DEFAULT_KEEPALIVE_S = 5.0
"""The beat used while queued when ``server.sse_keepalive_s`` is 0 (a queued stream must show
life: its headers are out)."""


class Heartbeat:
    """The signs of life of one waiting stream.

    Args:
        stream: the client's SSE response (its ``relay`` is made here when missing).
        call: the model call (its dialect and settings).
        clock: monotonic seconds.
    """

    __slots__ = (
        "_call",
        "_clock",
        "_last_progress",
        "_progress_every",
        "_sent_at",
        "_stream",
        "every",
    )

    def __init__(self, stream: ClientStream, call: ModelCall, clock: Callable[[], float]) -> None:
        self._stream = stream
        self._call = call
        self._clock = clock
        server = call.settings.server
        self.every = server.sse_keepalive_s
        self._progress_every = server.sse_progress_event_s
        self._last_progress = clock()
        self._sent_at: float | None = None  # the last bytes sent while waiting (clock)

    def sent(self) -> None:
        """Bytes went to the client now: the next beat is due ``every`` seconds later."""
        self._sent_at = self._clock()

    def due_in(self) -> float:
        """Seconds until the next beat: ``every`` after the last bytes sent (``every`` when none
        was sent yet), at least 0."""
        if self._sent_at is None:
            return self.every
        return max(0.0, self._sent_at + self.every - self._clock())

    def relay(self) -> object:
        """The stream's relay, made now if the stream has none yet (the queue opens it early)."""
        stream = self._stream
        if stream.relay is None:
            assert self._call.plan is not None
            stream.relay = self._call.dialect.stream_relay(self._call.settings, self._call.plan)
        return stream.relay

    async def open(self) -> None:
        """The headers and the dialect's opening events, sent while the request is queued."""
        await self._stream.start()
        opening = getattr(self.relay(), "start", None)
        data = opening(waiting=True) if opening is not None else b""
        if data:
            await self._stream.send(data)
        self._last_progress = self._sent_at = self._clock()

    async def beat(self, keepalive: bytes) -> None:
        """One sign of life: ``keepalive``, or the relay's progress event when none went out for
        ``server.sse_progress_event_s``.

        Raises:
            ConnectionResetError: the client went away (`gateway.relay.ClientStalled` when it
                stopped reading).
        """
        now = self._clock()
        progress = getattr(self._stream.relay, "progress", None)
        due = self._progress_every > 0 and now - self._last_progress >= self._progress_every
        if progress is not None and due:
            data = progress()
            if data:
                self._last_progress = now
                await self._stream.send(data)
                self._sent_at = self._clock()
                return
        await self._stream.send(keepalive)
        self._sent_at = self._clock()

    @property
    def opened(self) -> bool:
        """The stream's headers are made (opened by the queue, a beat or the relay)."""
        return self._stream.response is not None

    def engine_keepalive(self) -> bytes:
        """What a stream waiting at the engine sends between progress events: its dialect's
        keep-alive (Anthropic's ``ping``, an SSE comment otherwise)."""
        return self._call.dialect.keepalive or ENGINE_KEEPALIVE

    def queued_keepalive(self) -> bytes:
        """What a queued stream sends between progress events: its dialect's keep-alive when
        that is an event (Anthropic's ``ping``), else the ``: queued`` comment."""
        keepalive = self._call.dialect.keepalive
        if keepalive is not None and not keepalive.startswith(b":"):
            return keepalive
        return QUEUED_COMMENT


async def wait_for_slot(ticket: Ticket, heartbeat: Heartbeat, after: float) -> None:
    """Wait for the engine slot; after ``after`` seconds the stream opens and beats at once, then
    every ``server.sse_keepalive_s``.

    Raises:
        the errors of `Ticket.wait` (queue timeout, closed queue); ConnectionResetError when
        the client went away during a beat.
    """
    if await ticket.wait(after):
        return
    await heartbeat.open()
    every = heartbeat.every or DEFAULT_KEEPALIVE_S
    keepalive = heartbeat.queued_keepalive()
    while True:
        await heartbeat.beat(keepalive)
        if await ticket.wait(every):
            return


async def beating(waited: Awaitable[T], heartbeat: Heartbeat | None) -> T:
    """``waited`` awaited; meanwhile a stream (``heartbeat``) that gets no bytes for
    ``server.sse_keepalive_s`` opens (its headers and the dialect's opening events, as in the
    queue) and then beats every ``server.sse_keepalive_s`` until ``waited`` is done.

    For the waits between the queue and the engine's first byte that can last: the engine's
    headers (an engine that takes long to tokenize, hangs, or dies with the request before its
    first byte), and the engine's return after a crash before a retry (minutes for a V100's
    restart). Without it a stream granted its slot would get no byte from its queue's beats on
    until the engine answered or the wait ended in a plain JSON error, and agent clients give
    up after 300 s without an event (the module doc). A wait that ends within the beat costs one
    timer: the beats run in a task made only when the first one is due, and a beat under way
    when ``waited`` ends is finished, not cut, before this returns. None (not a stream), or
    keep-alives off (``sse_keepalive_s`` 0): ``waited`` alone.

    Raises:
        what ``waited`` raises; asyncio.CancelledError when the client went away during a beat
        (the wait is cancelled, as aiohttp cancels a handler whose client left).
    """
    if heartbeat is None or heartbeat.every <= 0:
        return await waited
    beats = _Beats(heartbeat)
    try:
        return await waited
    finally:
        await beats.stop()


class _Beats:
    """The beats of one `beating` wait: a timer until the first is due, then a task."""

    __slots__ = ("_done", "_handle", "_heartbeat", "_main", "_task", "_writing")

    def __init__(self, heartbeat: Heartbeat) -> None:
        self._heartbeat = heartbeat
        self._main = asyncio.current_task()
        self._task: asyncio.Task[None] | None = None
        self._writing = False
        self._done = False
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            heartbeat.due_in(), self._fire
        )

    def _fire(self) -> None:
        self._handle = None
        if not self._done:
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        heartbeat = self._heartbeat
        keepalive = heartbeat.engine_keepalive()
        while not self._done:
            self._writing = True
            try:
                if not heartbeat.opened:
                    await heartbeat.open()
                # At once after the opening too, as in the queue: aiohttp holds the headers for
                # the first write, and chat's opening writes nothing.
                await heartbeat.beat(keepalive)
            except ConnectionResetError:
                if self._main is not None and not self._done:
                    self._main.cancel()  # the client left: the wait ends as at a disconnect
                return
            finally:
                self._writing = False
            if self._done:
                return
            await asyncio.sleep(max(heartbeat.due_in(), 0.001))

    async def stop(self) -> None:
        """No more beats; one under way is finished first (a write cut midway would leave the
        stream's bytes or its headers half sent)."""
        self._done = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        task = self._task
        if task is None or task.done():
            return
        if not self._writing:
            task.cancel()  # asleep between two beats
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # this wait itself was cancelled meanwhile


def background_request(headers: Mapping[str, str], body: Any) -> bool:
    """True when the request says it is background work, to be served after its own tenant's
    interactive requests (`gateway.admission.AdmissionQueue.enqueue`): the header
    ``X-Request-Priority: background`` (any API), or ``service_tier: "flex"`` in an OpenAI body
    (chat, completions, Responses; what Open WebUI's ``TASK_MODEL_PARAMS`` can add to its title,
    tags and follow-up requests). The field is passed on; the engine ignores it.
    """
    priority = headers.get(PRIORITY_HEADER, "")
    if priority.strip().lower() == "background":
        return True
    tier = body.get("service_tier") if isinstance(body, dict) else None
    return isinstance(tier, str) and tier in BACKGROUND_TIERS  # any JSON value may come
