"""One non-streamed engine answer rewritten into the client's: in the event loop when small, in a
worker process when large, so ``/health``, ``/ready`` and every stream keep moving meanwhile.

Decoding and encoding JSON are C code that holds the interpreter lock from start to end: in a
thread they stall the event loop as much as inline (measured: 1.2 s of silence on ``/health``
for a 30 MB answer on a busy 2-core machine). An answer over `OFFLOAD_BYTES` therefore goes to
one worker process (``python -m gateway.answers``, started at the first such answer, one answer
at a time) over its stdin, in slices written as the pipe takes them; the worker decodes it,
applies the dialect's `gateway.dialects.Dialect.json_answer`, encodes the client's body and
sends it back on its stdout, which the caller relays to the client slice by slice
(`Offloaded.chunks`). The gateway process only moves slices of bytes, never the answer whole in
one step. A stored Responses answer comes back as the store's compact JSON
(`gateway.translate.responses_store`), stored by the caller. The worker's memory is its own:
about ten times the largest answer it rewrote while it works, bounded by
``engine.max_answer_bytes``.

Frames on both pipes: an 8-byte big-endian length, then that many bytes. Gateway to worker:
a pickle of (dialect, settings, plan), then the answer. Worker to gateway: a pickle of the
`Rewritten` without its body (or of the `NotAnObject` error), then the body.
"""

from __future__ import annotations

import copyreg
import dataclasses
import json
import pickle
import struct
import sys
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gateway.child import LENGTH, SLICE_BYTES, Child, WorkerFailed, frame, read_frame
from gateway.config import Settings
from gateway.meter import EngineUsage, parse_usage
from gateway.rewrite import RequestPlan

OFFLOAD_BYTES = 1 << 20
"""Answers larger than this (bytes) are rewritten in the worker process."""


def _mapping_proxy(items: dict[Any, Any]) -> MappingProxyType[Any, Any]:
    return MappingProxyType(items)


# The settings' read-only tables travel to the worker as dicts made read-only again there.
copyreg.pickle(MappingProxyType, lambda proxy: (_mapping_proxy, (dict(proxy),)))


class NotAnObject(ValueError):
    """The engine's answer is not a JSON object."""


@dataclass(frozen=True)
class Rewritten:
    """The client's answer and what the gateway needs from the engine's.

    Attributes:
        body: the client's JSON body (UTF-8).
        usage: the engine's ``usage`` (`gateway.meter.parse_usage`), None when absent.
        stored: (tenant, response id, response JSON, input items JSON) of a Responses answer
            to store, when rewritten in the worker; None otherwise.
    """

    body: bytes
    usage: EngineUsage | None
    stored: tuple[str, str, bytes, bytes] | None = None


JsonAnswer = Callable[[dict[str, Any], Settings, RequestPlan], dict[str, Any]]


def rewrite(
    raw: bytes, json_answer: JsonAnswer, settings: Settings, plan: RequestPlan
) -> Rewritten:
    """Decode ``raw``, read its usage, rewrite it with ``json_answer`` and encode the result.

    Raises:
        NotAnObject: ``raw`` is not JSON or not an object.
    """
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise NotAnObject(str(exc)) from exc
    if not isinstance(body, dict):
        raise NotAnObject(type(body).__name__)
    usage = parse_usage(body.get("usage"))
    answer = json_answer(body, settings, plan)
    encoded = json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode()
    return Rewritten(encoded, usage)


class _Captured:
    """The worker's stand-in for the response store: keeps what the dialect would store."""

    def __init__(self) -> None:
        self.entry: tuple[str, str, bytes, bytes] | None = None

    def put_json(
        self, tenant: str, response_id: str, response_json: bytes, input_json: bytes
    ) -> bool:
        self.entry = (tenant, response_id, response_json, input_json)
        return True


def _in_worker(dialect: str, raw: bytes, settings: Settings, plan: RequestPlan) -> Rewritten:
    """`rewrite` in the worker process, the dialect found by its name."""
    captured = _Captured()
    if dialect == "responses":
        from gateway.responses_api import responses_dialect

        json_answer = responses_dialect(captured).json_answer  # type: ignore[arg-type]
    elif dialect == "messages":
        from gateway.messages_api import ANTHROPIC

        json_answer = ANTHROPIC.json_answer
    else:
        from gateway.dialects import CHAT, COMPLETIONS

        json_answer = {"chat": CHAT, "completions": COMPLETIONS}[dialect].json_answer
    result = rewrite(raw, json_answer, settings, plan)
    return dataclasses.replace(result, stored=captured.entry)


OFFLOADED_DIALECTS = ("chat", "completions", "messages", "responses")
"""Dialects whose answers the worker can rewrite (it rebuilds them by name)."""


@dataclass
class Offloaded:
    """An answer rewritten in the worker: its facts now, its body still to read off the pipe.

    Attributes:
        result: the `Rewritten` facts (its ``body`` empty).
        length: bytes of the client's body.
    """

    result: Rewritten
    length: int
    _worker: AnswerWorker

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body in slices of at most `SLICE_BYTES`; the worker is free again at the end.

        Raises:
            WorkerFailed: the worker died meanwhile.
        """
        left = self.length
        try:
            while left > 0:
                piece = await self._worker.read(min(left, SLICE_BYTES))
                left -= len(piece)
                yield piece
        finally:
            self._worker.done(clean=left == 0)


class AnswerWorker:
    """The worker process for large answers (a `gateway.child.Child`): started on first use,
    one answer at a time, started again after it died."""

    def __init__(self) -> None:
        self._child = Child("gateway.answers")

    async def rewrite(
        self, dialect: str, parts: list[bytes], settings: Settings, plan: RequestPlan
    ) -> Offloaded:
        """Send the answer in ``parts`` for ``dialect`` (one of `OFFLOADED_DIALECTS`) to the worker; its answer.

        The worker stays taken until the returned `Offloaded.chunks` is read to its end (or
        closed).

        Raises:
            NotAnObject: ``raw`` is not a JSON object.
            WorkerFailed: the worker died.
        """
        # The engine request is not needed there.
        light = dataclasses.replace(plan, body=b"", tokenize_body=None)
        child = self._child
        await child.lock.acquire()
        handed = False
        try:
            await child.started()
            job = pickle.dumps((dialect, settings, light))
            await child.send(frame(job), LENGTH.pack(sum(map(len, parts))), *parts)
            facts = pickle.loads(await child.read_frame())
            length = LENGTH.unpack(await child.read(LENGTH.size))[0]
            if isinstance(facts, NotAnObject):
                self.done(clean=length == 0)
                handed = True
                raise facts
            handed = True
            return Offloaded(facts, length, self)
        except (pickle.UnpicklingError, struct.error, EOFError) as exc:
            raise WorkerFailed(type(exc).__name__) from exc
        finally:
            if not handed:
                child.stop()
                child.lock.release()

    async def read(self, size: int) -> bytes:
        """Exactly ``size`` bytes of the answer being relayed."""
        return await self._child.read(size)

    def done(self, clean: bool) -> None:
        """The answer was read (``clean``) or abandoned half way (the worker is stopped)."""
        if not clean:
            self._child.stop()
        if self._child.lock.locked():
            self._child.lock.release()

    async def close(self) -> None:
        """Stop the worker process (the gateway shuts down)."""
        await self._child.close()


def _serve(stdin: Any, stdout: Any) -> None:
    """The worker's loop: one job after another until stdin closes."""
    while True:
        job = read_frame(stdin)
        if job is None:
            return
        dialect, settings, plan = pickle.loads(job)
        raw = read_frame(stdin) or b""
        try:
            result = _in_worker(dialect, raw, settings, plan)
        except NotAnObject as exc:
            stdout.write(frame(pickle.dumps(exc)) + LENGTH.pack(0))
        else:
            del raw
            facts = pickle.dumps(dataclasses.replace(result, body=b""))
            stdout.write(frame(facts) + LENGTH.pack(len(result.body)))
            stdout.write(result.body)
        stdout.flush()


if __name__ == "__main__":
    # Through the module's own name, so what is pickled names gateway.answers, not __main__.
    from gateway.answers import _serve as serve

    serve(sys.stdin.buffer, sys.stdout.buffer)
