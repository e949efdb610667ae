"""SSE framing of a streamed answer, with the write-level faults of a `Behaviour`.

vLLM writes each event as ``data: <json>\\n\\n`` in one write (vllm-protocol.md section 5.3).
The faults change only the bytes between events and where writes are cut: line ending
(`framing`), `: keepalive` comments, events that are not JSON objects (`junk_events`), several
events per write (`coalesce`), writes cut into pieces (`split_writes`, `split_utf8`,
`split_crlf`, `byte_writes`) with `write_gap_ms` between pieces so that a reader sees them as
separate reads. Cut writes stand for the network cutting the bytes, not for a slow server: a
pump task writes the pieces, and the server's writer does not wait for it (so cuts alone never
make the server merge tokens into fewer events).
"""

from __future__ import annotations

import asyncio
import collections

from aiohttp import web

from engine.sim.options import Behaviour

_NEWLINES = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}
# `junk_events`: data lines that are neither a JSON object nor [DONE].
_JUNK = (b"data:", b"data: ", b"data: null", b"data: hello", b"data: [1,2]")


def cut_points(data: bytes, behaviour: Behaviour) -> list[int]:
    """Offsets (ascending, inside `data`) where one write is cut into pieces."""
    size = len(data)
    if behaviour.byte_writes:
        return list(range(1, size))
    cuts: set[int] = set()
    parts = behaviour.split_writes
    if parts > 1:
        cuts.update(size * k // parts for k in range(1, parts))
    if behaviour.split_utf8:
        # after the lead byte of every multi-byte UTF-8 sequence (0b11xxxxxx)
        cuts.update(i + 1 for i, byte in enumerate(data) if byte >= 0xC0)
    if behaviour.split_crlf:
        cuts.update(i + 1 for i in range(size - 1) if data[i : i + 2] == b"\r\n")
    return sorted(c for c in cuts if 0 < c < size)


class EventWriter:
    """Writes `data:` events to a prepared streaming response.

    `send` takes the payload (JSON bytes or ``[DONE]``); `flush` writes what `coalesce` still
    holds; `finish` also waits until every cut write is on the wire and must be awaited before
    the response ends; `close` stops the pump. Write errors (the client went away) propagate as
    ConnectionError.
    """

    def __init__(self, response: web.StreamResponse, behaviour: Behaviour) -> None:
        newline = _NEWLINES[behaviour.framing]
        self._response = response
        self._behaviour = behaviour
        self._end = newline + newline
        self._comment = b": keepalive" + self._end if behaviour.keepalive else b""
        if behaviour.junk_events:
            self._comment += b"".join(line + self._end for line in _JUNK)
        self._pending: list[bytes] = []
        self._held = 0
        self._cut = (
            behaviour.split_writes > 1
            or behaviour.split_utf8
            or behaviour.split_crlf
            or behaviour.byte_writes
        )
        self._plain = (
            not self._cut and not self._comment and behaviour.coalesce == 1 and newline == b"\n"
        )
        self._queue: collections.deque[bytes] = collections.deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._pump_task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    async def send(self, payload: bytes) -> None:
        """Frame one event and write it, or hold it until `coalesce` events are collected."""
        if self._plain:
            await self._response.write(b"data: " + payload + b"\n\n")
            return
        if self._comment:
            self._pending.append(self._comment)
        self._pending.append(b"data: " + payload + self._end)
        self._held += 1
        if self._held >= self._behaviour.coalesce:
            await self.flush()

    async def flush(self) -> None:
        """Write every held event in one write."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        self._held = 0
        await self._write(data)

    async def finish(self) -> None:
        """Flush, then wait until the pump has written every cut piece."""
        await self.flush()
        if self._pump_task is not None:
            await self._idle.wait()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop the pump (the response is over or abandoned)."""
        if self._pump_task is not None:
            self._pump_task.cancel()

    async def _write(self, data: bytes) -> None:
        if not self._cut:
            await self._response.write(data)
            return
        if self._error is not None:
            raise self._error
        if self._pump_task is None:
            self._pump_task = asyncio.ensure_future(self._pump())
        self._queue.append(data)
        self._idle.clear()
        self._wake.set()

    async def _pump(self) -> None:
        gap = self._behaviour.write_gap_ms / 1000
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queue:
                    data = self._queue.popleft()
                    start = 0
                    for cut in [*cut_points(data, self._behaviour), len(data)]:
                        if start:
                            await asyncio.sleep(gap)
                        await self._response.write(data[start:cut])
                        start = cut
                self._idle.set()
        except (ConnectionError, RuntimeError) as exc:
            self._error = (
                exc if isinstance(exc, ConnectionError) else ConnectionResetError(str(exc))
            )
            self._idle.set()
