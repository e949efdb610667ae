"""Answering one generation request: entry faults, paced tokens, an SSE stream or a JSON body.

Streams follow vllm-protocol.md sections 5.3-5.6; a client leaving aborts the request at once
(section 6): its handler is cancelled, or its next write fails.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from engine.sim.errors import ApiError
from engine.sim.framing import EventWriter
from engine.sim.keys import SCHEDULER, TRACE
from engine.sim.middleware import json_response
from engine.sim.options import Behaviour
from engine.sim.scheduler import Slot
from engine.sim.tokens import Answer
from engine.sim.wire import DONE, IN_STREAM_ERROR, ChunkEncoder

# The only 503 body vLLM sends on API routes (elastic EP scaling, section 3.3).
SCALING_BODY = {"error": "The model is currently scaling. Please try again later."}
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
# The exit status of the `exit_after` fault (EX_SOFTWARE of BSD sysexits.h: an internal error).
EXIT_CRASH = 70


def close_connection(request: web.Request) -> None:
    """Close the client's connection now, whatever was (not) sent: the engine dropping it."""
    transport = request.transport
    if transport is not None:
        transport.close()


async def entry_faults(request: web.Request, behaviour: Behaviour) -> web.StreamResponse | None:
    """Apply the faults that act before any answer: refuse, hang, slow headers."""
    trace = TRACE.get()
    if behaviour.refuse == "close":
        trace.outcome, trace.status = "error", 0
        close_connection(request)
        return web.Response()
    if behaviour.refuse == "503":
        return json_response(SCALING_BODY, 503)
    if behaviour.hang:
        await asyncio.Event().wait()
    if behaviour.headers_delay_s:
        await asyncio.sleep(behaviour.headers_delay_s)
    if behaviour.exit_after == 0:
        crash()
    return None


class Pacer:
    """Spaces tokens `1 / tokens_per_second` apart on a fixed schedule (no drift); at rate 0
    yields to the event loop every 16 tokens so concurrent streams share it."""

    def __init__(self, tokens_per_second: float) -> None:
        self._interval = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
        self._next: float | None = None
        self._count = 0

    @property
    def paced(self) -> bool:
        """True when tokens are spaced in time (a rate above 0)."""
        return bool(self._interval)

    async def wait(self) -> None:
        """Return when the next token is due (at once for the first one)."""
        self._count += 1
        if not self._interval:
            if self._count % 16 == 0:
                await asyncio.sleep(0)
            return
        now = time.monotonic()
        if self._next is None:
            self._next = now
        elif self._next > now:
            await asyncio.sleep(self._next - now)
        self._next += self._interval


def fault_at(behaviour: Behaviour) -> tuple[int, str | None]:
    """(tokens before the fault, "exit" | "drop" | "error" | "stall" | None): the earliest
    fault wins, and on a tie exit before drop before error before stall."""
    faults = [
        (count, rank, name)
        for rank, (count, name) in enumerate(
            (
                (behaviour.exit_after, "exit"),
                (behaviour.drop_after, "drop"),
                (behaviour.error_after, "error"),
                (behaviour.stall_after, "stall"),
            )
        )
        if count is not None
    ]
    if not faults:
        return 1 << 62, None
    count, _, name = min(faults)
    return count, name


def crash() -> None:
    """Exit the process at once, as a crashed engine does: no cleanup, the socket file stays,
    every connection is cut by the kernel."""
    os._exit(EXIT_CRASH)


def engine_reason(answer: Answer) -> str:
    """The engine's finish reason for metrics: tool calls end on a plain stop token."""
    return "stop" if answer.finish_reason == "tool_calls" else answer.finish_reason


Emit = Callable[[int, int], Awaitable[None]]


class Run:
    """The generation of one request: each choice is an engine sequence of its own.

    Like vLLM's engine, a request with `n` choices is `n` sequences (`n` times the prompt in
    `vllm:prompt_tokens_total`, one finished request each); with `--max-num-seqs 1` they run
    one after the other, otherwise side by side. Tokens are counted in the metrics as they
    are generated; `prompt_tokens` holds each sequence's prompt. `emit(choice, step)` is
    called for each generated token. A fault stops every sequence after its count of tokens
    in all (or after the last sequence's last token): "exit" leaves the process to the caller
    (`crash`, once what was generated is written); "drop" and "error" end them as `error`;
    "stall" keeps them running and generating nothing until the client leaves, while
    `/health` stays 200 (an engine core stuck behind a healthy API server).
    """

    def __init__(
        self,
        request: web.Request,
        behaviour: Behaviour,
        answers: Sequence[Answer],
        *,
        prompt_tokens: Sequence[int],
        arrival: float,
        emit: Emit | None = None,
        started: Callable[[], None] | None = None,
    ) -> None:
        self._scheduler = request.app[SCHEDULER]
        self._behaviour = behaviour
        self._answers = answers
        self._prompt_tokens = prompt_tokens
        self._arrival = arrival
        self._emit = emit
        self._started = started
        self._limit, self.fault = fault_at(behaviour)
        self._left = len(answers)
        self.produced = 0
        self.cut = False

    async def run(self) -> str | None:
        """Generate every choice; the fault that cut the answer ("exit", "drop", "error") or
        None.

        A stall never returns: the caller's task is cancelled when the client leaves.
        """
        if len(self._answers) == 1:
            await self._sequence(0)
        else:
            tasks = [asyncio.ensure_future(self._sequence(i)) for i in range(len(self._answers))]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return self.fault if self.cut else None

    async def _sequence(self, index: int) -> None:
        answer = self._answers[index]
        behaviour = self._behaviour
        async with self._scheduler.admit(self._prompt_tokens[index], self._arrival) as slot:
            await asyncio.sleep(behaviour.prefill_ms / 1000)
            if self._started is not None:
                self._started()
                self._started = None
            pacer = Pacer(behaviour.tokens_per_second)
            for step in range(len(answer.tokens)):
                if self.cut or self.produced >= self._limit:
                    await self._fault(slot)
                    return
                await pacer.wait()
                if self.cut:
                    await self._fault(slot)
                    return
                slot.token()
                self.produced += 1
                if self._emit is not None:
                    await self._emit(index, step)
                if len(self._answers) > 1 and not pacer.paced:
                    await asyncio.sleep(0)  # sequences side by side take turns, token by token
            self._left -= 1
            if self.fault is not None and not self._left:  # shorter than the fault's count
                await self._fault(slot)
                return
            slot.finish(engine_reason(answer))

    async def _fault(self, slot: Slot) -> None:
        self.cut = True
        if self.fault == "stall":
            await asyncio.Event().wait()
        slot.finish("error")


class Collector:
    """What the API server has not sent yet, per choice: vLLM's per-request output collector.

    Tokens generated while the writer is busy (the client or the gateway not reading, so a
    write waits for the socket to drain) pile up and leave as one event
    carrying them all, as they do in vLLM whenever its API server lags. `tokens_per_event`
    makes every event carry at least that many tokens of a choice (its last event fewer), so
    merged events can also be had on demand.
    """

    def __init__(self, answers: Sequence[Answer], tokens_per_event: int) -> None:
        self._answers = answers
        self._per_event = tokens_per_event
        self._pending: dict[int, list[int]] = {}
        self._ready = asyncio.Event()
        self._closed = False
        self._head: list[bytes] = []

    def put_head(self, payload: bytes) -> None:
        """Queue a chunk that is not a token (the role chunks)."""
        self._head.append(payload)
        self._ready.set()

    def put(self, index: int, step: int) -> bool:
        """Queue token `step` of choice `index`; wake the writer and return True when an event
        is due."""
        steps = self._pending.setdefault(index, [])
        steps.append(step)
        if len(steps) >= self._per_event or step == len(self._answers[index].tokens) - 1:
            self._ready.set()
            return True
        return False

    def close(self) -> None:
        """No more tokens: the writer sends what is left and returns."""
        self._closed = True
        self._ready.set()

    async def take(self) -> tuple[list[bytes], list[tuple[int, list[int]]]] | None:
        """Wait for an event to be due; the queued chunks and (choice, steps) groups, or None
        once closed and empty."""
        while True:
            if not self._closed:
                await self._ready.wait()
            self._ready.clear()
            item = self.take_now()
            if item is not None:
                return item
            if self._closed:
                return None

    def take_now(self) -> tuple[list[bytes], list[tuple[int, list[int]]]] | None:
        """The queued chunks and the due (choice, steps) groups at once, or None if none."""
        head, self._head = self._head, []
        groups = [(i, steps) for i, steps in self._pending.items() if self._due(i, steps)]
        for index, _ in groups:
            del self._pending[index]
        return (head, groups) if head or groups else None

    def _due(self, index: int, steps: list[int]) -> bool:
        return (
            self._closed
            or len(steps) >= self._per_event
            or steps[-1] == len(self._answers[index].tokens) - 1
        )


async def stream_answer(
    request: web.Request,
    behaviour: Behaviour,
    answers: Sequence[Answer],
    encoder: ChunkEncoder,
    *,
    chat: bool,
    include_usage: bool,
    prompt_tokens: Sequence[int],
    arrival: float,
) -> web.StreamResponse:
    """Answer as an SSE stream: headers at once, role chunks after prefill, token chunks (one
    token each while the client keeps up, merged when it lags or with `tokens_per_event`),
    final chunks, optional usage chunk, ``[DONE]`` (sections 5.3-5.6)."""
    trace = TRACE.get()
    response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
    await response.prepare(request)
    writer = EventWriter(response, behaviour)
    collector = Collector(answers, behaviour.tokens_per_event)
    done = [0] * len(answers)

    def started() -> None:
        if chat:
            for index in range(len(answers)):
                collector.put_head(encoder.role(index))

    busy = False  # the writer task is writing (and maybe waiting for the socket to drain)

    async def write(item: tuple[list[bytes], list[tuple[int, list[int]]]]) -> None:
        head, groups = item
        for payload in head:
            await writer.send(payload)
        for index, steps in groups:
            answer = answers[index]
            tokens = [answer.tokens[step] for step in steps]
            done[index] += len(steps)
            if chat:
                chunk = encoder.event(index, tokens, answer, done[index])
            else:
                chunk = encoder.text(index, tokens, answer, done[index])
            if chunk is not None:
                await writer.send(chunk)
            trace.tokens_sent += len(steps)

    async def write_events() -> None:
        nonlocal busy
        while (item := await collector.take()) is not None:
            busy = True
            try:
                await write(item)
            finally:
                busy = False
        await writer.flush()

    async def emit(index: int, step: int) -> None:
        # While the socket keeps up (less than half its high-water mark waits in its buffer)
        # the event is written at once from the generator's task, a write that does not wait.
        # Otherwise the writer task sends it, merged with whatever is generated meanwhile.
        if collector.put(index, step) and not busy:
            transport = request.transport
            if (
                transport is not None
                and transport.get_write_buffer_size() * 2 <= transport.get_write_buffer_limits()[1]
            ):
                item = collector.take_now()
                if item is not None:
                    await write(item)

    run = Run(
        request,
        behaviour,
        answers,
        prompt_tokens=prompt_tokens,
        arrival=arrival,
        emit=emit,
        started=started,
    )
    sender = asyncio.ensure_future(write_events())
    generation: asyncio.Future[str | None] | None = None
    try:
        await asyncio.sleep(behaviour.silence_s)
        generation = asyncio.ensure_future(run.run())
        await asyncio.wait((generation, sender), return_when=asyncio.FIRST_COMPLETED)
        if not generation.done():  # the writer failed: the client went away
            generation.cancel()
            await asyncio.gather(generation, return_exceptions=True)
            sender.result()
        fault = generation.result()
        collector.close()
        await sender
        if fault == "exit":
            await writer.finish()
            crash()
        if fault == "drop":
            await writer.finish()
            trace.outcome = "error"
            close_connection(request)
            return response
        if fault == "error":
            await writer.send(IN_STREAM_ERROR)
            trace.outcome = "error"
        else:
            if include_usage:
                await writer.send(encoder.usage(run.produced))
            trace.outcome = "finished"
        if not behaviour.no_done:
            await writer.send(DONE)
        await writer.finish()
        if behaviour.drop_after_done:
            close_connection(request)  # what was written goes out; the body's end never does
            return response
        if behaviour.hold_after_done_s:
            await asyncio.sleep(behaviour.hold_after_done_s)  # the body's end comes after this
    except ConnectionError:
        trace.outcome = "aborted"
    finally:
        # no await unless a task is left: the connection may be closed (drop) already, and the
        # handler must not be cancelled before it returns
        writer.close()
        left = [t for t in (generation, sender) if t is not None and not t.done()]
        for task in left:
            task.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)
        ended: list[asyncio.Future[Any]] = [t for t in (generation, sender) if t is not None]
        for future in ended:
            if future.done() and not future.cancelled():
                future.exception()  # seen: a write to a client already gone is no error here
    return response


async def complete_answer(
    request: web.Request,
    behaviour: Behaviour,
    answers: Sequence[Answer],
    render: Callable[[], bytes],
    *,
    prompt_tokens: Sequence[int],
    arrival: float,
) -> web.StreamResponse:
    """Answer with one JSON body once every token is produced; a client leaving cancels it."""
    trace = TRACE.get()
    await asyncio.sleep(behaviour.silence_s)

    async def produced(index: int, step: int) -> None:
        trace.tokens_sent += 1

    run = Run(
        request, behaviour, answers, prompt_tokens=prompt_tokens, arrival=arrival, emit=produced
    )
    fault = await run.run()
    if fault == "exit":
        crash()
    if fault == "drop":
        trace.outcome, trace.status = "error", 0
        close_connection(request)
        return web.Response()
    if fault == "error":
        raise ApiError(500, "InternalServerError", "Internal server error")
    return web.Response(body=render(), content_type="application/json")
