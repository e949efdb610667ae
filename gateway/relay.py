"""The client side of a model answer: the SSE response and the stream and JSON relays.

`ClientStream` is the SSE response to the client (headers sent when first needed, writes that
give up on a client that stopped reading, one final error event after the headers went out).
`relay_stream` forwards the engine's events as they arrive, one client write per engine read
(case C01); `relay_json` rewrites a whole answer. Both record usage on the `ModelCall`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Protocol

from aiohttp import HttpVersion11, web

from gateway.answers import (
    OFFLOAD_BYTES,
    OFFLOADED_DIALECTS,
    AnswerWorker,
    NotAnObject,
    Offloaded,
    rewrite,
)
from gateway.child import WorkerFailed
from gateway.errors import (
    EngineAnswerTooLarge,
    EngineBadResponse,
    EngineDisconnected,
    GatewayError,
    UpstreamError,
)
from gateway.sse import EventTooLarge, StreamProtocolError
from gateway.state import CLOCK, METRICS, ModelCall
from gateway.upstream import UpstreamAnswer

if TYPE_CHECKING:
    from gateway.dialects import StreamRelay

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class Beat(Protocol):
    """The signs of life of a waiting stream (`gateway.waiting.Heartbeat`)."""

    every: float

    async def beat(self, keepalive: bytes) -> None:
        """Send ``keepalive`` or a progress event; raises ConnectionResetError if the client left."""

    def sent(self) -> None:
        """Bytes went to the client now (the next beat is due ``every`` seconds later)."""

    def due_in(self) -> float:
        """Seconds until the next beat is due: ``every`` after the last bytes sent."""


class Tap(Protocol):
    """A record of what a stream sends, for other connections to read (`gateway.flight.Flight`).

    ``detached``: the stream's own client is gone but the generation goes on; nothing is
    written to its connection any more, only to the tap.
    """

    detached: bool

    def opened(self, status: int, headers: Mapping[str, str]) -> None:
        """The status line and headers."""

    def sent(self, data: bytes) -> None:
        """Bytes written."""

    def ended(self, error_status: int = 0) -> None:
        """The stream ended (with an error event of ``error_status``; 0: without one)."""

    def lost(self) -> bool:
        """The client went away: True when the stream goes on without it (detached)."""


TAP = web.RequestKey("tap", Tap)
"""The request's `Tap`, set by `gateway.retries.lead` for a stream others may attach to."""


class ClientStalled(ConnectionResetError):
    """The client left a stream unread longer than ``server.client_write_timeout_s``."""


HEADERS_HOLD_S = 0.02
"""Seconds a stream's headers wait for its first event, to go out in one write with it (one
packet, one wake-up of the client, instead of two): after that they go alone."""


AFTER_DONE_S = 1.0
"""Seconds a stream waits, after the engine's ``data: [DONE]``, for the end of the engine's body
before it ends the client's stream without it (vLLM sends both in the same moment)."""


_HEADERS_ALLOWANCE = 4096
"""Bytes counted for a stream's held headers (its status line and SSE and rate-limit headers
take under 1 KiB) when deciding whether its last bytes can be left to aiohttp's end."""


class _SseResponse(web.StreamResponse):
    """aiohttp's stream response with the headers kept until the first write, as aiohttp's
    own `web.Response` keeps them (an attribute of aiohttp's; where it is gone, the headers
    simply go out at `prepare`), and the stream's last bytes kept for aiohttp's own end of the
    response (`ClientStream.end`)."""

    _send_headers_immediately = False
    final = b""
    """The stream's last bytes, written with the chunked terminator when aiohttp ends the
    response: after the handler returned (its bookkeeping done), as a `web.Response`'s body."""

    async def write_eof(self, data: bytes = b"") -> None:
        """Write `final` and ``data`` with the chunked terminator, in one write."""
        final = self.final
        if final:
            self.final = b""
            data = final + data if data else final
        await super().write_eof(data)


class ClientStream:
    """The SSE response of one model call; the headers are made at `start` and go out with the
    first write (`flush_headers` sends them alone).

    Args:
        request: the client's request.
        call: the model call (its snapshot gives the write timeout, its dialect the error shape).
    """

    __slots__ = (
        "_call",
        "_direct",
        "_headers_held",
        "_made",
        "_request",
        "_timeout",
        "relay",
        "response",
        "tap",
    )

    def __init__(self, request: web.Request, call: ModelCall) -> None:
        self._request = request
        self._call = call
        self.tap = request.get(TAP)
        self._timeout = call.settings.server.client_write_timeout_s
        self.response: _SseResponse | None = None
        self.relay: StreamRelay | None = None  # made when the stream opens (queued or answered)
        self._direct: asyncio.Transport | None = None  # chunks framed here (see `_write`)
        self._headers_held = False  # prepared, not yet written (they go with the first write)
        self._made: _SseResponse | None = None  # by `make`, not yet started

    def make(self) -> None:
        """Make the response and the relay of a stream not yet started, sending and preparing
        nothing. `gateway.proxy` calls it while the engine works on the request (the POST sent,
        its headers not yet back: `gateway.upstream.Upstream.post`'s ``sent``), so that the way
        from the engine's first event to the client's holds less work (about 60 µs of a c=1
        TTFT, `tests/perf/README.md`). An engine that refuses the request leaves them unused:
        its error is answered as JSON (`response` is still None)."""
        if self.response is None and self._made is None:
            self._made = self._make_response()
        call = self._call
        if self.relay is None and call.plan is not None:
            self.relay = call.dialect.stream_relay(call.settings, call.plan)

    def _make_response(self) -> _SseResponse:
        call = self._call
        headers = dict(SSE_HEADERS)
        if call.reservation is not None:
            headers.update(call.dialect.limit_headers(call.reservation.headers))
        response = _SseResponse(status=200, headers=headers)
        response.headers["x-request-id"] = call.context.request_id
        close_delimited(self._request, response)
        return response

    async def start(self) -> _SseResponse:
        """Make the SSE headers once: no proxy buffering, no compression (case C01). They go
        out with the first write, or alone at `flush_headers`."""
        if self.response is None:
            response = self._made if self._made is not None else self._make_response()
            self._made = None
            tap = self.tap
            if tap is not None:
                tap.opened(response.status, response.headers)
            if tap is None or not tap.detached:
                try:
                    await response.prepare(self._request)
                    self._headers_held = True
                except ConnectionResetError:
                    if tap is None or not tap.lost():
                        raise
            self.response = response
        return self.response

    @property
    def headers_held(self) -> bool:
        """The headers are made and not yet written (they go with the first write)."""
        return self._headers_held

    async def flush_headers(self) -> None:
        """Send the headers now if they are still held (the engine is slow to its first event,
        or sent only part of it). A client gone meanwhile is handled as at `send`: with a tap,
        the stream may go on without it.

        Raises:
            ConnectionResetError: the client went away (and the stream does not go on).
        """
        if not self._headers_held or self.response is None:
            return
        tap = self.tap
        if tap is not None and tap.detached:
            self._headers_held = False  # its client is gone: the headers are only the tap's
            return
        try:
            await self._write(self.response, b"", flush=True)
        except ConnectionResetError:
            if tap is None or not tap.lost():
                raise

    async def send(self, data: bytes) -> None:
        """Write to the stream; a client that stops reading counts as gone after the timeout.

        The timer is armed only when data already waits in the socket's user-space buffer (the
        client is behind) or when this write alone can fill it (an engine that lagged sends many
        tokens in one event), so a client that keeps up costs one plain write.

        Raises:
            ConnectionResetError: the client went away (`ClientStalled` when it stopped reading).
        """
        response = self.response or await self.start()
        tap = self.tap
        if tap is None:
            await self._write(response, data)
            return
        tap.sent(data)
        if tap.detached:
            return
        try:
            await self._write(response, data)
        except ConnectionResetError:
            if not tap.lost():
                raise

    async def _write(self, response: web.StreamResponse, data: bytes, flush: bool = False) -> None:
        """Write ``data`` as one HTTP chunk; wait (at most ``client_write_timeout_s``) only when
        the client is behind.

        The first write carries the held headers (aiohttp's writer joins them to the chunk in
        one write); ``flush`` sends them even with no data. After them, a chunked response
        (HTTP/1.1) is framed here and written to the transport (``size CRLF data CRLF``, RFC
        9112 section 7.1: the bytes aiohttp's writer would send, without its per-write
        bookkeeping, one event of a stream at a time); the end of the stream and anything else
        go through aiohttp's writer.
        """
        if self._headers_held:
            self._headers_held = False
            if response.headers.get("Transfer-Encoding") == "chunked":
                self._direct = self._request.transport
            transport = self._request.transport
        elif not data:
            return
        else:
            transport = self._direct
            if transport is not None:
                if transport.is_closing():
                    raise ConnectionResetError("the client closed the connection")
                behind = transport.get_write_buffer_size()
                transport.write(b"%x\r\n%b\r\n" % (len(data), data))  # one copy, one syscall
                if not behind and len(data) <= transport.get_write_buffer_limits()[1]:
                    return
                await self._drained(transport, self._request.writer.drain())
                return
            transport = self._request.transport
        if transport is None or (
            not transport.get_write_buffer_size()
            and len(data) <= transport.get_write_buffer_limits()[1]
        ):
            await response.write(data)
            return
        await self._drained(transport, response.write(data))

    async def _drained(self, transport: asyncio.Transport, writes: Awaitable[None]) -> None:
        """Wait for ``writes`` at most ``client_write_timeout_s``, else cut the client.

        Raises:
            ClientStalled: the client did not read in time (its connection is aborted).
        """
        try:
            await asyncio.wait_for(writes, self._timeout)
        except asyncio.TimeoutError:
            transport.abort()
            raise ClientStalled(f"client did not read for {self._timeout:g} s") from None

    async def end(self, tail: bytes, at_once: bool = False) -> web.StreamResponse:
        """End a complete stream: status 200 for the log; ``tail`` (the last events) and the
        chunked terminator go out in one write when aiohttp ends the response, after the
        request's bookkeeping (slot, usage, ledger, access line) is done, as a JSON answer's
        body does. The client's next request on the connection then finds the gateway free
        instead of behind that work (0.2-0.4 ms of its TTFT at c=1, `tests/perf/README.md`),
        and usage is settled before the client sees the end. A client gone by then is
        aiohttp's to notice; the answer was whole. aiohttp's end waits for a client that is
        behind without a limit, so ``tail`` is left to it only when it fits in the socket's
        buffer at once (`_fits`); otherwise it is written here first, under
        ``client_write_timeout_s`` (a stalled client is then a 499, not a connection held).
        With ``at_once`` (bookkeeping that may wait on the engine: the counters' settling of a
        cut request, its prompt count), ``tail`` is written here too and only the terminator
        waits for the bookkeeping.

        Raises:
            ConnectionResetError: the client went away, or stalled, while ``tail`` was written
                here (`ClientStalled`)."""
        response = self.response or await self.start()
        tap = self.tap
        if tap is not None:
            tap.sent(tail)
            tap.ended(self._call.context.error_status)
        self._call.context.status = 200
        if tap is None or not tap.detached:
            if tail and (at_once or not self._fits(len(tail))):
                # aiohttp's end waits for the client without a limit: bytes that may make it
                # wait (a client behind, or a large last event) go out here, under
                # ``client_write_timeout_s``, and only the terminator is left to it.
                try:
                    await self._write(response, tail)
                except ConnectionResetError:
                    if tap is None or not tap.lost():
                        raise
                    return response
                tail = b""
            self._headers_held = False  # aiohttp's writer sends them with the last bytes
            response.final = tail
        return response

    def _fits(self, size: int) -> bool:
        """``size`` bytes more (and the headers, when still held) stay within the transport's
        high-water mark (64 KiB), so writing them never waits for the client: aiohttp's end of
        the response, which would wait without a limit, may take them."""
        transport = self._request.transport
        if transport is None or transport.is_closing():
            return True  # nothing waits: the write fails at once, aiohttp's to notice
        held = _HEADERS_ALLOWANCE if self._headers_held else 0
        buffered = transport.get_write_buffer_size()
        return buffered + size + held <= transport.get_write_buffer_limits()[1]

    async def end_with_error(self, error: GatewayError) -> web.StreamResponse:
        """After the headers went out an error is one final error event, then the end.

        The access line and ``gateway_requests_total`` keep the status sent (200); the error's
        own status goes to ``error_status`` and the reason names it: ``engine_<kind>`` for an
        engine failure (``engine_disconnect``, ``engine_bad_response``, ...).
        """
        context = self._call.context
        response = self.response or await self.start()
        context.status = response.status
        context.error_status = error.status
        if isinstance(error, UpstreamError) and error.reason == "upstream_error":
            context.reason = context.reason or f"engine_{error.kind}"
        context.reason = context.reason or error.reason
        render = getattr(self.relay, "error_event", None)  # a relay that knows what was sent
        event = render(error) if render is not None else self._call.dialect.error_event(error)
        tap = self.tap
        if tap is not None:
            tap.sent(event)
            tap.ended(self._call.context.error_status)
            if tap.detached:
                return response
        self._headers_held = False  # aiohttp's writer sends them with the event
        try:
            await response.write(event)
            await response.write_eof()
        except ConnectionResetError:
            pass
        return response

    def gone(self, stalled: bool = False) -> web.StreamResponse:
        """The client went away: see `client_gone`; returns the response to end the handler."""
        client_gone(self._request, self._call, stalled)
        return self.response if self.response is not None else web.Response(status=499)


def close_delimited(request: web.Request, response: web.StreamResponse) -> None:
    """End the connection with ``response`` when its client reads a body of unknown length to
    the connection's close: an HTTP/1.0 request (no chunked coding, RFC 9112 section 6.3), even
    one with ``Connection: keep-alive`` (aiohttp drops that header then, but keeps the
    connection open, and the client would wait for the end of a stream until the idle
    timeout)."""
    if request.version < HttpVersion11 and response.content_length is None:
        response.force_close()


def client_gone(request: web.Request, call: ModelCall, stalled: bool = False) -> None:
    """The client went away: logged 499 (nginx's "client closed request") and counted."""
    context = call.context
    context.status = 499
    context.reason = "client_stalled" if stalled else "client_disconnect"
    call.context.app[METRICS].client_disconnects.labels(call.caller.label).inc()


async def relay_stream(
    request: web.Request,
    call: ModelCall,
    answer: UpstreamAnswer,
    stream: ClientStream,
    heartbeat: Beat | None = None,
) -> web.StreamResponse:
    """Forward the engine's SSE as it arrives: one client write per engine read (case C01).

    Whatever ends the stream (the client gone, cancellation, an engine drop), the usage seen
    so far is recorded on ``call.usage``: the final usage of a complete answer, the running
    usage (what was streamed) of one cut short. An engine failure after the headers is one final
    error event; a client that went away is a 499. The relay opened while the request was
    queued (``stream.relay``) is kept; ``heartbeat`` beats while the engine is silent before its
    first read.
    """
    assert call.plan is not None, "the call is planned before the engine is called"
    metrics = call.context.app[METRICS]
    clock = call.context.app[CLOCK]
    context = call.context
    relay = stream.relay
    if relay is None:
        relay = stream.relay = call.dialect.stream_relay(call.settings, call.plan)
    state = relay.state
    failure: GatewayError | None = None
    keepalive = call.dialect.keepalive
    if heartbeat is None or heartbeat.every <= 0:
        keepalive = None
    last = b""
    try:
        await stream.start()
        try:
            if keepalive is not None and heartbeat is not None:
                opening = getattr(relay, "start", None)
                data = opening() if opening is not None else b""
                if data:
                    await stream.send(data)
            loop = asyncio.get_running_loop()
            held_until = loop.time() + HEADERS_HOLD_S
            if not answer.buffered:
                first = await _first_read(answer, stream, HEADERS_HOLD_S, heartbeat, keepalive)
                if first is not None:
                    answer.unread(first)
            async for data in answer:
                out = relay.feed(data)
                if out:
                    if call.ttft_s is None and state.events:
                        call.ttft_s = clock() - context.started
                        metrics.ttft.labels(call.caller.label).observe(call.ttft_s)
                    if state.done and answer.buffered:
                        # The engine's [DONE] and the end of its body are here: the last
                        # events go out with the stream's end, in one write.
                        last = last + out if last else out
                        continue
                    await stream.send(out)
                elif stream.headers_held and not state.done and not answer.buffered:
                    # Nothing to send yet (the first event comes in pieces, or the dialect
                    # shows none for it): the headers wait for the next read only what is left
                    # of their hold.
                    more = await _first_read(
                        answer, stream, held_until - loop.time(), heartbeat, keepalive
                    )
                    if more is None:
                        break
                    answer.unread(more)
                if state.done and not answer.buffered:
                    # The answer is whole at [DONE]; vLLM ends its body right after it. An
                    # engine (or a proxy before it) that keeps the body open is waited for
                    # `AFTER_DONE_S`, not its read timeout: the connection is then closed
                    # instead of reused (`UpstreamAnswer.release` of an unfinished body).
                    more = await answer.read_within(AFTER_DONE_S)
                    if more is None:
                        break
                    answer.unread(more)
        except UpstreamError as exc:
            if not state.done:
                failure = exc
            # else the engine's [DONE] came, then its connection failed before the body's end
            # (the engine died just after its answer): the answer is whole and ends as one,
            # not with an error event the SDKs raise on; the failure stays counted and the
            # connection is not reused.
        except EventTooLarge as exc:
            failure = answer.failed(
                EngineAnswerTooLarge("event", call.settings.engine.max_event_bytes), exc
            )
        except StreamProtocolError as exc:
            failure = answer.failed(EngineBadResponse(), exc)
        tail = relay.finish() if failure is None else b""
        if failure is None and not relay.clean_end:
            failure = answer.failed(EngineDisconnected())
        if state.error is not None:
            answer.reported_error()
            context.reason = "stream_error"
            context.error_status = engine_event_status(state.error)
        if failure is not None:
            if last:
                await stream.send(last)
            return await stream.end_with_error(failure)
        # Without the engine's final usage (its error event, an answer cut short) the
        # bookkeeping may wait on the engine's counters: the last events go out at once.
        return await stream.end(last + tail if last else tail, at_once=state.usage is None)
    except ConnectionResetError as exc:
        return stream.gone(isinstance(exc, ClientStalled))
    finally:
        call.usage.record_stream(state.usage, state.running, state.content_events)


def engine_event_status(error: Mapping[str, object]) -> int:
    """The status an engine's in-stream error event stands for, for the access line's
    ``error_status``: its ``code`` when that is an HTTP error status (vLLM's `ErrorResponse`
    puts the status there, e.g. 500), else 502 (the engine failed)."""
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    return 502


async def _first_read(
    answer: UpstreamAnswer,
    stream: ClientStream,
    hold: float,
    heartbeat: Beat | None = None,
    keepalive: bytes | None = None,
) -> bytes | None:
    """The engine's first read, None at the end of the body. The stream's headers wait for it
    ``hold`` seconds (`HEADERS_HOLD_S`, to go out with it), then go alone; after that
    ``keepalive`` (or a progress event) is sent every ``heartbeat.every`` seconds
    (``server.sse_keepalive_s``, counted from the last bytes sent) while the engine is silent
    (prefill of a long prompt takes minutes), so idle timeouts of clients and proxies do not
    fire.

    Raises:
        UpstreamError: the engine failed before its first byte.
        ConnectionResetError: the client went away meanwhile.
    """
    data = await answer.read_within(hold)
    if data is None:
        flushing = stream.headers_held
        await stream.flush_headers()
        if heartbeat is None or keepalive is None:
            try:
                return await answer.__anext__()
            except StopAsyncIteration:
                return None
        if flushing:
            heartbeat.sent()
        while data is None:
            # Due ``every`` after the last bytes sent, also those of the queue's wait, so the
            # move from the queue to the engine leaves no longer silence.
            data = await answer.read_within(heartbeat.due_in())
            if data is None:
                await heartbeat.beat(keepalive)
    return data or None


async def relay_json(
    request: web.Request, call: ModelCall, answer: UpstreamAnswer, worker: AnswerWorker
) -> web.StreamResponse:
    """Read the whole engine answer, rewrite it in the call's dialect, count its usage.

    An answer over `gateway.answers.OFFLOAD_BYTES` is rewritten in ``worker`` (another
    process: decoding JSON holds the interpreter) and relayed from it in slices, so the event
    loop keeps serving.

    Raises:
        EngineAnswerTooLarge: the answer is over ``engine.max_answer_bytes`` (the caller aborts
            the engine request).
        UpstreamError: the engine failed while answering, or the answer is not a JSON object.
    """
    assert call.plan is not None, "the call is planned before the engine is called"
    parts = await answer.parts(call.settings.engine.max_answer_bytes)
    dialect = call.dialect
    headers = (
        dialect.limit_headers(call.reservation.headers) if call.reservation is not None else {}
    )
    offloaded: Offloaded | None = None
    try:
        if sum(map(len, parts)) > OFFLOAD_BYTES and dialect.name in OFFLOADED_DIALECTS:
            offloaded = await worker.rewrite(dialect.name, parts, call.settings, call.plan)
            result = offloaded.result
        else:
            raw = b"".join(parts)
            result = rewrite(raw, dialect.json_answer, call.settings, call.plan)
    except NotAnObject as exc:
        raise answer.failed(EngineBadResponse(), exc) from exc
    except WorkerFailed as exc:
        raise answer.failed(
            EngineBadResponse("The gateway failed to rewrite the engine's answer."), exc
        ) from exc
    del parts
    call.usage.record_final(result.usage)
    if offloaded is None:
        return web.Response(body=result.body, content_type="application/json", headers=headers)
    if result.stored is not None and dialect.store_answer is not None:
        dialect.store_answer(*result.stored)
    response = web.StreamResponse(status=200, headers=headers)
    response.content_type = "application/json"
    response.content_length = offloaded.length
    chunks = offloaded.chunks()
    try:
        await response.prepare(request)
        async for piece in chunks:
            await response.write(piece)
        await response.write_eof()
    finally:
        await chunks.aclose()
    return response
