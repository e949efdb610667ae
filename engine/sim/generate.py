"""Answering one generation request: entry faults, paced tokens, an SSE stream or a JSON body.

Streams follow vllm-protocol.md sections 5.3-5.6; a client leaving aborts the request at once
(section 6): its handler is cancelled, or its next write fails.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from engine.sim.framing import EventWriter
from engine.sim.keys import SCHEDULER, TRACE
from engine.sim.middleware import json_response
from engine.sim.options import Behaviour
from engine.sim.protocol import ApiError
from engine.sim.record import Trace
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
    """(tokens before the cut, "exit" | "drop" | "error" | None); on a tie exit wins, then drop."""
    faults = [
        (count, rank, name)
        for rank, (name, count) in enumerate(
            (
                ("exit", behaviour.exit_after),
                ("drop", behaviour.drop_after),
                ("error", behaviour.error_after),
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


async def generate(
    answers: Sequence[Answer],
    behaviour: Behaviour,
    slot: Slot,
    trace: Trace,
    emit: Callable[[int, int, Answer], Any] | None,
) -> str | None:
    """Produce the answers' tokens at the behaviour's pace, choices interleaved step by step.

    `emit(index, step, answer)` is awaited per token when streaming. Returns the fault that
    cut the answer ("drop", "error") or None when every token was produced.
    """
    limit, fault = fault_at(behaviour)
    pacer = Pacer(behaviour.tokens_per_second)
    produced = 0
    for step in range(max(len(a.tokens) for a in answers)):
        if produced >= limit:
            return fault
        await pacer.wait()
        for index, answer in enumerate(answers):
            if step >= len(answer.tokens):
                continue
            slot.token()
            if emit is not None:
                await emit(index, step, answer)
            produced += 1
            trace.tokens_sent = produced
            if produced >= limit:
                return fault
    return fault


def engine_reason(answers: Sequence[Answer]) -> str:
    """The engine's finish reason for metrics: tool calls end on a plain stop token."""
    reason = answers[0].finish_reason
    return "stop" if reason == "tool_calls" else reason


async def stream_answer(
    request: web.Request,
    behaviour: Behaviour,
    answers: Sequence[Answer],
    encoder: ChunkEncoder,
    *,
    chat: bool,
    include_usage: bool,
    prompt_tokens: int,
    arrival: float,
) -> web.StreamResponse:
    """Answer as an SSE stream: headers at once, role chunks after prefill, one chunk per
    token, final chunks, optional usage chunk, ``[DONE]`` (sections 5.3-5.6)."""
    trace = TRACE.get()
    response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
    await response.prepare(request)
    writer = EventWriter(response, behaviour)

    async def emit(index: int, step: int, answer: Answer) -> None:
        token = answer.tokens[step]
        if chat:
            payload = encoder.token(index, token, answer, step + 1)
        else:
            payload = encoder.text(index, token, answer, step + 1)
        if payload is not None:
            await writer.send(payload)

    try:
        await asyncio.sleep(behaviour.silence_s)
        async with request.app[SCHEDULER].admit(prompt_tokens, arrival) as slot:
            await asyncio.sleep(behaviour.prefill_ms / 1000)
            if chat:
                for index in range(len(answers)):
                    await writer.send(encoder.role(index))
            fault = await generate(answers, behaviour, slot, trace, emit)
            if fault == "exit":
                await writer.flush()
                crash()
            if fault == "drop":
                await writer.flush()
                slot.finish("error")
                trace.outcome = "error"
                close_connection(request)
                return response
            if fault == "error":
                await writer.send(IN_STREAM_ERROR)
                slot.finish("error")
                trace.outcome = "error"
            else:
                if include_usage:
                    await writer.send(encoder.usage(trace.tokens_sent))
                slot.finish(engine_reason(answers))
                trace.outcome = "finished"
            if not behaviour.no_done:
                await writer.send(DONE)
            await writer.flush()
    except ConnectionError:
        trace.outcome = "aborted"
    return response


async def complete_answer(
    request: web.Request,
    behaviour: Behaviour,
    answers: Sequence[Answer],
    render: Callable[[], bytes],
    *,
    prompt_tokens: int,
    arrival: float,
) -> web.StreamResponse:
    """Answer with one JSON body once every token is produced; a client leaving cancels it."""
    trace = TRACE.get()
    await asyncio.sleep(behaviour.silence_s)
    async with request.app[SCHEDULER].admit(prompt_tokens, arrival) as slot:
        await asyncio.sleep(behaviour.prefill_ms / 1000)
        fault = await generate(answers, behaviour, slot, trace, None)
        if fault == "exit":
            crash()
        if fault == "drop":
            slot.finish("error")
            trace.outcome, trace.status = "error", 0
            close_connection(request)
            return web.Response()
        if fault == "error":
            slot.finish("error")
            raise ApiError(500, "InternalServerError", "Internal server error")
        slot.finish(engine_reason(answers))
    return web.Response(body=render(), content_type="application/json")
