"""A helper process of the gateway: ``python -m <module>``, started on first use, one job at a
time, started again after it died, speaking length-prefixed frames on its stdin and stdout.

Decoding and encoding JSON are C code that holds the interpreter lock from start to end, so work
on a large JSON document stalls the event loop as much in a thread as inline. The gateway gives
such work to a helper process instead (`gateway.answers` for large engine answers,
`gateway.plan_worker` for large request bodies) and only moves bytes meanwhile.

A frame is an 8-byte big-endian length, then that many bytes. What the frames carry is the
helper's own protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import sys
from pathlib import Path
from typing import BinaryIO

SLICE_BYTES = 1 << 20
"""Bytes moved per step between a pipe and the gateway's buffers."""
LENGTH = struct.Struct(">Q")


class WorkerFailed(Exception):
    """The helper process died or broke its protocol during a job."""


def frame(data: bytes) -> bytes:
    """``data`` as one frame: its length (`LENGTH`), then itself."""
    return LENGTH.pack(len(data)) + data


def read_frame(stream: BinaryIO) -> bytes | None:
    """The helper's side: the next frame's bytes from ``stream`` (blocking), or None at its end."""
    head = stream.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None
    return stream.read(LENGTH.unpack(head)[0])


def package_root(module: str) -> str:
    """The directory holding ``module``'s top-level package as this process imported it.

    ``python -m`` puts its working directory first on ``sys.path``: started there, the helper
    imports the very package the gateway runs, whatever directory the gateway was started in
    (a ``gateway/`` directory of another checkout there would otherwise be imported instead).
    """
    top = sys.modules[module.split(".", 1)[0]]
    assert top.__file__ is not None, "the helper's package is a regular package"
    return str(Path(top.__file__).resolve().parent.parent)


class Child:
    """The gateway's side of one helper process.

    Args:
        module: the module run as ``python -m module``; it must read frames on its stdin and
            write them on its stdout until its stdin closes.

    A job holds the process for its whole exchange (`lock`, or its user's own turns, as
    `gateway.plan_worker.FairTurns`); a job abandoned half way (its request cancelled,
    the helper silent) calls `stop`, so the next job starts a fresh process rather than reading
    the rest of an old answer.
    """

    def __init__(self, module: str) -> None:
        self.module = module
        self.lock = asyncio.Lock()
        self._proc: asyncio.subprocess.Process | None = None

    async def started(self) -> None:
        """Start the process unless it runs.

        Raises:
            WorkerFailed: it could not be started.
        """
        if self._proc is None or self._proc.returncode is not None:
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    self.module,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    limit=SLICE_BYTES * 2,
                    cwd=package_root(self.module),
                )
            except OSError as exc:
                raise WorkerFailed(type(exc).__name__) from exc

    async def send(self, *parts: bytes) -> None:
        """Write ``parts`` to the process's stdin, waiting as the pipe takes them.

        Raises:
            WorkerFailed: the process is gone.
        """
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise WorkerFailed("not started")
        try:
            for part in parts:
                view = memoryview(part)  # slices of a view: the part is never copied here
                for start in range(0, len(view), SLICE_BYTES):
                    proc.stdin.write(view[start : start + SLICE_BYTES])
                    await proc.stdin.drain()
        except (OSError, RuntimeError) as exc:
            raise WorkerFailed(type(exc).__name__) from exc

    async def read(self, size: int) -> bytes:
        """Exactly ``size`` bytes from the process's stdout.

        Raises:
            WorkerFailed: the process closed its stdout first.
        """
        proc = self._proc
        if proc is None or proc.stdout is None:
            raise WorkerFailed("not started")
        try:
            return await proc.stdout.readexactly(size)
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise WorkerFailed(type(exc).__name__) from exc

    async def read_frame(self) -> bytes:
        """The next frame's bytes from the process's stdout.

        Raises:
            WorkerFailed: the process closed its stdout first.
        """
        return await self.read(LENGTH.unpack(await self.read(LENGTH.size))[0])

    def stop(self) -> None:
        """Kill the process now (a job was abandoned half way, or the process is to give back
        the memory a large job left it); the next job starts another."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    async def close(self) -> None:
        """Kill the process and reap it (the gateway shuts down)."""
        proc = self._proc
        self.stop()
        if proc is not None:
            with contextlib.suppress(Exception):
                await proc.wait()
