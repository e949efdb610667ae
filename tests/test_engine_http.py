"""The gateway's own HTTP/1.1 link to the engine: heads, bodies, errors, timeouts, flow, the pool.

Every test talks to a real socket: a fake engine (`RawEngine`) served in the test's event loop
answers each request with hand-written bytes, so framing mistakes, silences and closes happen
exactly where a test puts them. What `gateway.upstream` makes of the errors is tested in
tests/test_upstream.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.engine_http import (
    CHUNK_LINE_MAX_BYTES,
    HEAD_MAX_BYTES,
    READ_HIGH_WATER,
    EngineConnection,
    EngineHttpError,
    EnginePool,
)
from tests.clock import FakeClock
from tests.inprocess import short_tempdir, until

pytestmark = pytest.mark.fast

Script = Callable[["RawEngine", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Answer = bytes | Sequence[bytes]

CHAT = "/v1/chat/completions"
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.fixture
def directory() -> Iterator[Path]:
    """A short private directory for the engine socket."""
    with short_tempdir("q38h-") as path:
        yield path


class RawEngine:
    """A fake engine on a Unix (or TCP) socket: each connection runs ``script``, which reads
    requests with `next_request` and writes raw answer bytes.

    Attributes:
        connections: connections accepted so far.
        requests: every request received (head and body bytes), in order.
        writers: the server side of every connection.
    """

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start_unix(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._accept, path)

    async def start_tcp(self, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on 127.0.0.1; returns the port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=ssl_context)
        return int(self._server.sockets[0].getsockname()[1])

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A task of our own per connection (not the server's), so that `stop` cancels it quietly.
        self.connections += 1
        self.writers.append(writer)
        task = asyncio.ensure_future(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self.script(self, reader, writer)
        except (ConnectionError, ssl.SSLError):
            pass  # the gateway side aborted
        finally:
            writer.close()

    async def next_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """The next request (head and ``Content-Length`` body), or None once the client closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head + body

    async def stop(self) -> None:
        """Close every connection and the listening socket."""
        for writer in self.writers:
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class TrackedPool(EnginePool):
    """An `EnginePool` that also remembers every connection it handed out, so that a test's end
    can close the ones it left in use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handed: list[EngineConnection] = []

    async def acquire(self) -> EngineConnection:
        connection = await super().acquire()
        self.handed.append(connection)
        return connection


@contextlib.asynccontextmanager
async def serving(
    directory: Path, script: Script, *, idle_s: float = 4.0, clock: FakeClock | None = None
) -> AsyncIterator[tuple[RawEngine, TrackedPool]]:
    """A `RawEngine` running ``script`` on ``directory/e.sock`` and a pool of connections to it."""
    path = str(directory / "e.sock")
    engine = RawEngine(script)
    await engine.start_unix(path)
    pool = TrackedPool(path, "", idle_s, 2.0, clock or time.monotonic)
    try:
        yield engine, pool
    finally:
        for connection in pool.handed:
            connection.abort()
        pool.close()
        await engine.stop()
        await asyncio.sleep(0)  # the transports' connection_lost callbacks


def answering(*answers: Answer, close: bool = False, gap: float = 0.002) -> Script:
    """A script answering the connection's requests in turn with ``answers`` (bytes, or pieces
    written ``gap`` seconds apart), then waiting for the client to leave (``close``: closing)."""

    async def script(
        engine: RawEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        for answer in answers:
            if await engine.next_request(reader) is None:
                return
            pieces = [answer] if isinstance(answer, bytes) else answer
            for i, piece in enumerate(pieces):
                if i:
                    await asyncio.sleep(gap)
                writer.write(piece)
                await writer.drain()
        if not close:
            await reader.read()

    return script


def chunked(*payloads: bytes, trailer: bytes = b"") -> bytes:
    """A chunked body of one chunk per payload, then the last chunk and ``trailer``."""
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in payloads)
    return chunks + b"0\r\n" + trailer + b"\r\n"


def send(pool: EnginePool, connection: EngineConnection, body: bytes = b"{}") -> None:
    """Send a chat completion request on ``connection``."""
    connection.send(pool.head("POST", CHAT, {"X-Request-Id": "rid-1"}, len(body)), body)


async def read_all(connection: EngineConnection, timeout: float | None = 2.0) -> bytes:
    """Every body byte to the body's end."""
    parts = []
    while data := await connection.read(timeout):
        parts.append(data)
    return b"".join(parts)


async def exchange(pool: EnginePool, timeout: float | None = 2.0) -> tuple[EngineConnection, bytes]:
    """One request on a pooled connection, its answer read to the end (connection not released)."""
    connection = await pool.acquire()
    send(pool, connection)
    await connection.read_head(timeout)
    return connection, await read_all(connection, timeout)


# Heads and bodies


async def test_a_chunked_answer_is_decoded_and_the_connection_kept(directory: Path) -> None:
    """A 200 chunked answer: status, no length, the payloads joined, then reusable (complete)."""
    raw = CHUNKED_HEAD + chunked(b"data: 1\n\n", b"data: 2\n\n")
    async with serving(directory, answering(raw)) as (engine, pool):
        connection, body = await exchange(pool)
        assert connection.status == 200 and connection.content_length is None
        assert body == b"data: 1\n\ndata: 2\n\n"
        assert connection.complete
        assert await connection.read(1.0) == b""  # the end, again
        request = engine.requests[0]
        assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\n")
        assert request.endswith(b"Content-Length: 2\r\n\r\n{}")


@pytest.mark.parametrize(
    ("head", "body", "length"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n", b"hello world", 11),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b"", 0),
        (b"HTTP/1.1 200 OK\r\ncontent-length:  3 \r\nContent-Length: 3\r\n\r\n", b"abc", 3),
        (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n\r\n", b"{}", 2),
        (b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\n", b"ok", 2),
    ],
)
async def test_a_content_length_answer_reads_exactly_its_length(
    directory: Path, head: bytes, body: bytes, length: int
) -> None:
    """``Content-Length`` bodies (0 included, repeated equal values, no reason phrase) end at
    their length and leave the connection reusable."""
    status = int(head[9:12])
    async with serving(directory, answering(head + body)) as (_, pool):
        connection, read = await exchange(pool)
        assert (connection.status, connection.content_length, read) == (status, length, body)
        assert connection.complete


async def test_a_length_body_in_pieces_never_reads_past_its_end(directory: Path) -> None:
    """A ``Content-Length`` body arriving in pieces is read piece by piece up to its length."""
    pieces = [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", b"defg", b"hij"]
    async with serving(directory, answering(pieces, gap=0.02)) as (_, pool):
        connection = await pool.acquire()
        send(pool, connection)
        await connection.read_head(1.0)
        reads = []
        while data := await connection.read(1.0):
            reads.append(data)
        assert b"".join(reads) == b"abcdefghij" and len(reads) >= 2
        assert connection.complete


@pytest.mark.parametrize("status", [204, 304])
async def test_204_and_304_have_no_body(directory: Path, status: int) -> None:
    """No body follows a 204 or 304, whatever its headers say; the connection is reusable."""
    raw = b"HTTP/1.1 %d X\r\nContent-Length: 5\r\n\r\n" % status
    async with serving(directory, answering(raw, OK)) as (engine, pool):
        connection, body = await exchange(pool)
        assert (connection.status, body) == (status, b"")
        assert connection.complete
        pool.release(connection)
        again, body = await exchange(pool)
        assert again is connection and body == b"ok" and engine.connections == 1


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\n\r\n",
    ],
)
async def test_a_body_without_length_ends_with_the_connection(directory: Path, head: bytes) -> None:
    """No ``Transfer-Encoding`` and no ``Content-Length``: the body is everything up to the
    close, a normal end; such a connection is never reused."""
    script = answering([head + b"first ", b"second"], close=True, gap=0.02)
    async with serving(directory, script) as (_, pool):
        connection, body = await exchange(pool)
        assert (connection.status, connection.content_length) == (200, None)
        assert body == b"first second"
        assert not connection.complete


@pytest.mark.parametrize(
    ("head", "reused"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nConnection: Upgrade, Close\r\nContent-Length: 2\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 2\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n", True),
    ],
)
async def test_connection_header_and_version_decide_reuse(
    directory: Path, head: bytes, reused: bool
) -> None:
    """``Connection: close`` ends reuse; HTTP/1.0 is reused only with ``Connection:
    keep-alive``; a connection not reused is closed on release."""
    async with serving(directory, answering(head + b"ok", OK)) as (engine, pool):
        connection, body = await exchange(pool)
        assert body == b"ok" and connection.complete is reused
        pool.release(connection)
        assert connection.transport is not None
        assert connection.transport.is_closing() is not reused
        again, body = await exchange(pool)
        assert body == b"ok" and (again is connection) is reused
        assert engine.connections == (1 if reused else 2)


@pytest.mark.parametrize(
    "informational",
    [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n",
    ],
)
async def test_informational_answers_before_the_head_are_skipped(
    directory: Path, informational: bytes
) -> None:
    """1xx answers before the real head are passed over; the final status and body are read."""
    raw = [informational, b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"]
    async with serving(directory, answering(raw)) as (_, pool):
        connection, body = await exchange(pool)
        assert (connection.status, body) == (201, b"ok")
        assert connection.complete


async def test_chunk_extensions_trailers_and_hex_case_are_understood(directory: Path) -> None:
    """Chunk-size lines with extensions, upper and lower case hex and leading zeros, and
    trailer fields after the last chunk (RFC 9112 section 7.1)."""
    body = (
        b"A;name=value\r\n0123456789\r\n"
        b'000b ; quoted="a;b"\r\nhello world\r\n'
        b"1f\r\n" + b"x" * 31 + b"\r\n"
        b"0;last\r\nX-Trailer: 1\r\nX-Other: two\r\n\r\n"
    )
    async with serving(directory, answering(CHUNKED_HEAD + body, OK)) as (engine, pool):
        connection, read = await exchange(pool)
        assert read == b"0123456789hello world" + b"x" * 31
        assert connection.complete
        pool.release(connection)
        again, read = await exchange(pool)
        assert again is connection and read == b"ok" and engine.connections == 1


async def test_chunked_wins_over_content_length(directory: Path) -> None:
    """With both ``Transfer-Encoding: chunked`` and ``Content-Length`` the chunks frame the
    body (RFC 9112 section 6.3) and no length is reported."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with serving(directory, answering(head + chunked(b"hello"))) as (_, pool):
        connection, body = await exchange(pool)
        assert (connection.content_length, body) == (None, b"hello")


async def test_a_chunk_larger_than_the_buffer_arrives_in_reads(directory: Path) -> None:
    """One 1 MiB chunk (larger than `READ_HIGH_WATER`) is delivered across several reads,
    byte for byte."""
    payload = bytes(range(256)) * 4096
    raw = CHUNKED_HEAD + chunked(b"start", payload, b"end")
    async with serving(directory, answering(raw)) as (_, pool):
        connection = await pool.acquire()
        send(pool, connection)
        await connection.read_head(2.0)
        reads = []
        while data := await connection.read(2.0):
            reads.append(data)
        assert b"".join(reads) == b"start" + payload + b"end"
        assert len(reads) > 1 and connection.complete


async def test_bytes_after_the_last_chunk_forbid_reuse(directory: Path) -> None:
    """Bytes after a chunked answer's end (nothing was asked for them) make the connection
    not reusable; it is closed on release."""
    raw = CHUNKED_HEAD + chunked(b"ok") + b"HTTP/1.1 200 OK\r\n"
    async with serving(directory, answering(raw)) as (_, pool):
        connection, body = await exchange(pool)
        assert body == b"ok" and not connection.complete
        pool.release(connection)
        assert connection.transport is not None and connection.transport.is_closing()


async def test_an_answer_before_the_request_was_sent_forbids_reuse(directory: Path) -> None:
    """An engine that answers before reading the whole request (a 413, say) leaves unsent
    bytes: the connection is not complete, so it is not reused."""

    async def script(
        engine: RawEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(10)

    async with serving(directory, script) as (_, pool):
        connection = await pool.acquire()
        send(pool, connection, b"x" * (8 << 20))
        await connection.read_head(2.0)
        assert connection.status == 413 and await connection.read(1.0) == b""
        assert not connection.complete


# Answers refused


async def failure(
    directory: Path, raw: Answer, *, close: bool = False, in_head: bool = False
) -> EngineHttpError:
    """The `EngineHttpError` an answer of ``raw`` raises (from `read_head` when ``in_head``,
    else from reading the body after a good head)."""
    async with serving(directory, answering(raw, close=close)) as (_, pool):
        connection = await pool.acquire()
        send(pool, connection)
        with pytest.raises(EngineHttpError) as caught:
            await connection.read_head(2.0)
            assert not in_head, "the head was accepted"
            await read_all(connection)
        pool.release(connection)
        assert connection.transport is not None and connection.transport.is_closing()
        return caught.value


@pytest.mark.parametrize(
    "head",
    [
        b"HELLO\r\n\r\n",
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1\r\n\r\n",
        b"HTTP/1.1 OK 200\r\n\r\n",
        b"HTTP/1.1  200 OK\r\n\r\n",
        b"HTTP/1.1 +200 OK\r\n\r\n",
        b"HTTP/1.1 99 Low\r\n\r\n",
        b"HTTP/1.1 600 High\r\n\r\n",
        b"ICY 200 OK\r\n\r\n",
        b"\r\n\r\n",
    ],
)
async def test_a_status_line_that_is_not_http_1_is_refused(directory: Path, head: bytes) -> None:
    """Garbage, another protocol, or a status outside 100-599 raises `EngineHttpError`."""
    await failure(directory, head, in_head=True)


@pytest.mark.parametrize(
    "header",
    [
        b"X-Folded: a\r\n continued",
        b"X-Folded: a\r\n\tcontinued",
        b"Content-Length : 2",
        b"Content-Length\t: 2",
        b"No colon here",
        b": no name",
    ],
)
async def test_a_malformed_header_line_is_refused(directory: Path, header: bytes) -> None:
    """Obsolete line folding, whitespace before the colon, a line without colon or name."""
    head = b"HTTP/1.1 200 OK\r\n" + header + b"\r\nContent-Length: 2\r\n\r\nok"
    await failure(directory, head, in_head=True)


@pytest.mark.parametrize(
    "lengths",
    [
        b"Content-Length: 2\r\nContent-Length: 3",
        b"Content-Length: 2, 2",
        b"Content-Length: -2",
        b"Content-Length: +2",
        b"Content-Length: 0x2",
        b"Content-Length: two",
        b"Content-Length:",
    ],
)
async def test_a_bad_or_conflicting_content_length_is_refused(
    directory: Path, lengths: bytes
) -> None:
    """Two different lengths, a list, a sign, hex or no digits at all: not a valid length."""
    await failure(directory, b"HTTP/1.1 200 OK\r\n" + lengths + b"\r\n\r\nok", in_head=True)


@pytest.mark.parametrize(
    "codings",
    [
        b"Transfer-Encoding: gzip",
        b"Transfer-Encoding: chunked, gzip",
        b"Transfer-Encoding: gzip, chunked",
        b"Transfer-Encoding: chunked, chunked",
        b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked",
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
        b"Transfer-Encoding: identity",
    ],
)
async def test_transfer_codings_other_than_chunked_are_refused(
    directory: Path, codings: bytes
) -> None:
    """Only a lone ``chunked`` is understood: any other coding, alone or before chunked (the
    payload would still be compressed), or chunked twice, raises `EngineHttpError`."""
    head = b"HTTP/1.1 200 OK\r\n" + codings + b"\r\n\r\n"
    await failure(directory, head + chunked(b"ok"), in_head=True)


async def test_transfer_encoding_is_matched_without_case_and_spaces(directory: Path) -> None:
    """``Transfer-Encoding:  Chunked `` is chunked."""
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding:  Chunked \r\n\r\n"
    async with serving(directory, answering(head + chunked(b"ok"))) as (_, pool):
        _, body = await exchange(pool)
        assert body == b"ok"


@pytest.mark.parametrize("terminated", [False, True])
async def test_a_head_larger_than_the_limit_is_refused(directory: Path, terminated: bool) -> None:
    """Headers past `HEAD_MAX_BYTES`, whether their end has arrived or not, are refused
    instead of buffered without bound."""
    big = b"HTTP/1.1 200 OK\r\nX-Big: " + b"b" * (HEAD_MAX_BYTES + 10)
    raw = big + b"\r\nContent-Length: 0\r\n\r\n" if terminated else big
    error = await failure(directory, raw, in_head=True)
    assert "too large" in str(error)


async def test_a_head_just_under_the_limit_is_read(directory: Path) -> None:
    """A head of nearly `HEAD_MAX_BYTES` is accepted."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Big: "
    head += b"b" * (HEAD_MAX_BYTES - len(head) - 10) + b"\r\n\r\n"
    async with serving(directory, answering(head + b"ok")) as (_, pool):
        _, body = await exchange(pool)
        assert body == b"ok"


@pytest.mark.parametrize(
    "size_line",
    [
        b"zz",
        b"0x10",
        b"0X10",
        b"+5",
        b"-5",
        b" 5",
        b"",
        b";ext",
        b"5_0",
        b"\xd9\xa5",  # an Arabic-Indic digit five
        b"5 5",
    ],
)
async def test_a_bad_chunk_size_is_refused(directory: Path, size_line: bytes) -> None:
    """A chunk size that is not plain hexadecimal digits raises `EngineHttpError` (Python's
    ``int(x, 16)`` would take some of these: ``0x10``, ``+5``, `` 5``, ``5_0``)."""
    raw = CHUNKED_HEAD + size_line + b"\r\nhello\r\n0\r\n\r\n"
    error = await failure(directory, raw)
    assert "chunk size" in str(error)


async def test_a_chunk_size_line_longer_than_the_limit_is_refused(directory: Path) -> None:
    """A size line (with extensions) past `CHUNK_LINE_MAX_BYTES` is refused, even before its
    end arrives."""
    raw = CHUNKED_HEAD + b"5;" + b"e" * (CHUNK_LINE_MAX_BYTES + 10)
    error = await failure(directory, raw)
    assert "too long" in str(error)


async def test_a_chunk_size_line_within_the_limit_is_read(directory: Path) -> None:
    """A size line with a long extension, shorter than `CHUNK_LINE_MAX_BYTES`, is read."""
    line = b"5;" + b"e" * (CHUNK_LINE_MAX_BYTES - 10)
    raw = CHUNKED_HEAD + line + b"\r\nhello\r\n0\r\n\r\n"
    async with serving(directory, answering(raw)) as (_, pool):
        _, body = await exchange(pool)
        assert body == b"hello"


@pytest.mark.parametrize(
    "pieces",
    [
        [CHUNKED_HEAD + b"5\r\nhelloXX\r\n0\r\n\r\n"],
        [CHUNKED_HEAD + b"5\r\nhello", b"\n\r0\r\n\r\n"],
        [CHUNKED_HEAD + b"5\r\nhel", b"lo", b"X", b"\r\n0\r\n\r\n"],
        [CHUNKED_HEAD + b"3\r\nabc\r\n5\r\nhello!\r\n0\r\n\r\n"],
    ],
)
async def test_a_chunk_not_followed_by_crlf_is_refused(
    directory: Path, pieces: list[bytes]
) -> None:
    """A chunk's payload must be followed by CRLF, whole or in pieces."""
    error = await failure(directory, pieces)
    assert "CRLF" in str(error)


async def test_a_trailer_larger_than_the_limit_is_refused(directory: Path) -> None:
    """Trailer fields past `HEAD_MAX_BYTES` are refused instead of buffered without bound."""
    raw = CHUNKED_HEAD + b"2\r\nok\r\n0\r\nX-T: " + b"t" * (HEAD_MAX_BYTES + 10)
    error = await failure(directory, raw)
    assert "trailer" in str(error)


@pytest.mark.parametrize(
    ("raw", "in_head"),
    [
        (b"", True),
        (b"HTTP/1.1 200 OK\r\nContent-Len", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r", True),
        (CHUNKED_HEAD, False),
        (CHUNKED_HEAD + b"5\r\nhel", False),
        (CHUNKED_HEAD + b"5\r\nhello", False),
        (CHUNKED_HEAD + b"5\r\nhello\r\n", False),
        (CHUNKED_HEAD + b"5\r\nhello\r\n1", False),
        (CHUNKED_HEAD + b"5\r\nhello\r\n0\r\n", False),
        (CHUNKED_HEAD + b"5\r\nhello\r\n0\r\nX-T: 1\r\n", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabcde", False),
    ],
)
async def test_a_close_before_the_answer_ends_is_an_error(
    directory: Path, raw: bytes, in_head: bool
) -> None:
    """The engine closing mid-head, mid-chunk (payload, size line, last chunk, trailer) or
    mid-``Content-Length`` body raises `EngineHttpError`; bytes before the close are read."""
    error = await failure(directory, raw, close=True, in_head=in_head)
    assert "closed" in str(error)


async def test_a_close_mid_body_still_delivers_the_bytes_that_arrived(directory: Path) -> None:
    """The payload that arrived before the close is read first; the error comes after it."""
    raw = CHUNKED_HEAD + b"5\r\nhello\r\n6\r\n world"
    async with serving(directory, answering(raw, close=True)) as (_, pool):
        connection = await pool.acquire()
        send(pool, connection)
        await connection.read_head(1.0)
        assert connection.transport is not None
        assert await until(connection.transport.is_closing, 2.0)
        assert await connection.read(1.0) == b"hello world"
        with pytest.raises(EngineHttpError):
            await connection.read(1.0)


# Chunked framing in any pieces (property)

_payloads = st.lists(
    st.one_of(
        st.binary(min_size=1, max_size=40),
        st.sampled_from([b"\r\n", b"0\r\n\r\n", b"\r", b"\n", b"0\r\n", b"\r\n\r\n", b";a=b"]),
    ),
    max_size=8,
)
_extensions = st.sampled_from([b"", b";a=b", b";name", b' ;q="x;y"', b";a=b;c"])
_trailers = st.sampled_from([b"", b"X-Trailer: 1\r\n", b"A: b\r\nC: d;e\r\n"])


def _encode(payloads: list[bytes], extensions: list[bytes], upper: bool, trailer: bytes) -> bytes:
    chunks = []
    for i, payload in enumerate(payloads):
        size = b"%X" % len(payload) if upper else b"%x" % len(payload)
        chunks.append(size + extensions[i % len(extensions)] + b"\r\n" + payload + b"\r\n")
    return b"".join(chunks) + b"0" + extensions[-1] + b"\r\n" + trailer + b"\r\n"


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    payloads=_payloads,
    extensions=st.lists(_extensions, min_size=1, max_size=3),
    upper=st.booleans(),
    trailer=_trailers,
    cuts=st.lists(st.integers(0, 1000), max_size=12),
)
async def test_any_chunked_body_in_any_pieces_decodes_to_its_payloads(
    directory: Path,
    payloads: list[bytes],
    extensions: list[bytes],
    upper: bool,
    trailer: bytes,
    cuts: list[int],
) -> None:
    """Any chunked answer (payloads holding CRLF or a fake last chunk, extensions, trailers)
    delivered in any pieces, head included, decodes to exactly the payloads joined; the
    connection is then complete and carries a second request."""
    raw = CHUNKED_HEAD + _encode(payloads, extensions, upper, trailer)
    points = sorted({min(cut, len(raw)) for cut in cuts} | {0, len(raw)})
    pieces = [raw[a:b] for a, b in itertools.pairwise(points) if b > a]
    async with serving(directory, answering(pieces, OK, gap=0.001)) as (engine, pool):
        connection, body = await exchange(pool)
        assert body == b"".join(payloads)
        assert connection.complete
        pool.release(connection)
        again, body = await exchange(pool)
        assert again is connection and body == b"ok" and engine.connections == 1


_fragments = st.lists(
    st.one_of(
        st.binary(max_size=12),
        st.sampled_from(
            [b"\r\n", b"\r", b"\n", b"0", b"5", b"a", b"F", b"x", b";", b":", b" ", b"-", b"\0"]
        ),
    ),
    max_size=30,
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(head=st.booleans(), fragments=_fragments)
async def test_any_bytes_end_an_answer_or_raise_engine_http_error(
    directory: Path, head: bool, fragments: list[bytes]
) -> None:
    """Whatever bytes come (as a head, or as a chunked body) before the engine closes, reading
    them ends the answer or raises `EngineHttpError`, nothing else."""
    raw = (b"" if head else CHUNKED_HEAD) + b"".join(fragments)
    async with serving(directory, answering(raw, close=True)) as (_, pool):
        connection = await pool.acquire()
        send(pool, connection)
        with contextlib.suppress(EngineHttpError):
            await connection.read_head(2.0)
            await read_all(connection)


async def test_read_within_gives_up_in_time_and_loses_nothing(directory: Path) -> None:
    """`read_within` returns None once its time is up, also with half a chunk's head arrived; the
    next read returns the whole payload."""
    raw = [CHUNKED_HEAD, b"5", b"\r\nhello\r\n", chunked(b"!")]
    async with serving(directory, answering(raw, gap=0.15)) as (_, pool):
        connection = await pool.acquire()
        send(pool, connection)
        await connection.read_head(2.0)
        started = time.monotonic()
        assert await connection.read_within(2.0, 0.05) is None
        assert 0.04 <= time.monotonic() - started < 0.14
        assert await connection.read_within(2.0, 0.2) is None  # its size came, not its line end
        assert await connection.read_within(2.0, 1.0) == b"hello"
        assert await read_all(connection) == b"!"
        assert connection.complete


# Read timeouts


async def test_a_silent_engine_times_the_read_out(directory: Path) -> None:
    """Head sent, then silence: ``read(timeout=0.2)`` raises `asyncio.TimeoutError` after about
    0.2 s."""
    async with serving(directory, answering(CHUNKED_HEAD)) as (_, pool):
        connection = await pool.acquire()
        started = time.monotonic()  # before the head's last byte, which starts the 0.2 s
        send(pool, connection)
        await connection.read_head(1.0)
        with pytest.raises(asyncio.TimeoutError):
            await connection.read(0.2)
        assert 0.15 <= time.monotonic() - started < 2.0


async def test_a_silent_engine_times_the_head_out(directory: Path) -> None:
    """No answer at all: ``read_head(timeout=0.2)`` raises `asyncio.TimeoutError`."""
    async with serving(directory, answering()) as (_, pool):
        connection = await pool.acquire()
        send(pool, connection)
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await connection.read_head(0.2)
        assert 0.15 <= time.monotonic() - started < 2.0


async def test_each_read_waits_its_own_timeout(directory: Path) -> None:
    """The timeout of the read waiting counts, not the one an earlier read gave: no timeout
    after a 0.2 s one waits as long as it takes; 0.2 s after 5 s fails after 0.2 s."""
    late = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", b"ok"]
    silent = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"
    async with serving(directory, answering(late, silent, gap=0.5)) as (_, pool):
        connection = await pool.acquire()
        send(pool, connection)
        await connection.read_head(0.2)
        assert await read_all(connection, None) == b"ok"
        pool.release(connection)
        again = await pool.acquire()
        assert again is connection
        started = time.monotonic()
        send(pool, again)
        await again.read_head(5.0)
        with pytest.raises(asyncio.TimeoutError):
            await again.read(0.2)
        assert 0.15 <= time.monotonic() - started < 1.5


async def test_no_timeout_waits_as_long_as_it_takes(directory: Path) -> None:
    """``timeout=None`` (a non-streamed answer) waits past any read timer."""
    raw = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", b"ok"]
    async with serving(directory, answering(raw, gap=0.4)) as (_, pool):
        _, body = await exchange(pool, timeout=None)
        assert body == b"ok"


async def test_a_trickling_engine_never_times_out(directory: Path) -> None:
    """One chunk every 0.1 s for 1.5 s never trips a 0.3 s read timeout: the timer measures
    silence, not the answer's length."""
    pieces = [CHUNKED_HEAD] + [b"1\r\n%d\r\n" % (i % 10) for i in range(15)] + [b"0\r\n\r\n"]
    async with serving(directory, answering(pieces, gap=0.1)) as (_, pool):
        started = time.monotonic()
        connection, body = await exchange(pool, timeout=0.3)
        assert body == b"".join(b"%d" % (i % 10) for i in range(15))
        assert time.monotonic() - started >= 1.4 and connection.complete


async def test_a_trickle_read_late_does_not_time_out(directory: Path) -> None:
    """Bytes that arrived while the relay was busy elsewhere are still there to read: a read
    that starts late returns them instead of timing out."""
    pieces = [CHUNKED_HEAD + b"1\r\na\r\n", b"1\r\nb\r\n", b"0\r\n\r\n"]
    async with serving(directory, answering(pieces, gap=0.1)) as (_, pool):
        connection = await pool.acquire()
        send(pool, connection)
        await connection.read_head(0.3)
        await asyncio.sleep(0.5)  # longer than the timeout, the whole answer arrives meanwhile
        assert await read_all(connection, 0.3) == b"ab"


# Flow control


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
async def test_an_unread_answer_is_held_back_in_the_kernel(directory: Path, framing: str) -> None:
    """An engine sending far more than `READ_HIGH_WATER` to a relay that does not read: the
    connection holds at most about `READ_HIGH_WATER` (the rest waits in the engine), and
    reading then yields every byte intact."""
    payload = bytes(range(256)) * (16 * 1024)  # 4 MiB
    if framing == "chunked":
        step = 16 * 1024
        raw = CHUNKED_HEAD + chunked(*(payload[i : i + step] for i in range(0, len(payload), step)))
    elif framing == "length":
        raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
    else:
        raw = b"HTTP/1.1 200 OK\r\n\r\n" + payload
    async with serving(directory, answering(raw, close=framing == "close")) as (engine, pool):
        connection = await pool.acquire()
        send(pool, connection)
        await connection.read_head(2.0)
        await asyncio.sleep(0.3)
        assert len(connection._raw) < READ_HIGH_WATER + 300_000
        assert engine.writers[0].transport.get_write_buffer_size() > 0  # held at the engine
        assert await read_all(connection) == payload
        assert connection.complete is (framing != "close")


async def test_time_spent_held_back_is_not_the_engines_silence(directory: Path) -> None:
    """A relay that stops reading for longer than the read timeout while the engine's bytes
    wait in the kernel gets every byte when it reads again; only then does a real silence
    time out."""
    payload = bytes(range(256)) * (8 * 1024)  # 2 MiB
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(payload) + 1)
    async with serving(directory, answering(head + payload)) as (_, pool):
        connection = await pool.acquire()
        send(pool, connection)
        await connection.read_head(1.0)
        await asyncio.sleep(0.5)  # the relay is held by its client, timeout 0.2
        received = bytearray()
        while len(received) < len(payload):
            received += await connection.read(0.2)
        assert received == payload
        with pytest.raises(asyncio.TimeoutError):
            await connection.read(0.2)  # the last byte never comes


# Abort


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        CHUNKED_HEAD + b"5\r\nhel",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\n\r\nabc",
    ],
)
async def test_abort_fails_a_waiting_read_at_once(directory: Path, raw: bytes) -> None:
    """`abort` while a read waits (for the head, a chunk, a length body, a close-delimited
    body) makes that read raise `EngineHttpError` promptly; the socket is closed."""
    async with serving(directory, answering(raw)) as (engine, pool):
        connection = await pool.acquire()
        send(pool, connection)
        if raw:
            await connection.read_head(1.0)
            waiting = asyncio.ensure_future(read_all(connection, 5.0))
        else:
            waiting = asyncio.ensure_future(connection.read_head(5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        started = time.monotonic()
        connection.abort()
        with pytest.raises(EngineHttpError):
            await asyncio.wait_for(waiting, 1.0)
        assert time.monotonic() - started < 0.5
        assert connection.transport is not None and connection.transport.is_closing()
        assert not connection.reusable and not connection.complete
        with pytest.raises(EngineHttpError):
            send(pool, connection)
        assert await until(lambda: engine.writers[0].transport.is_closing(), 2.0)


# The pool


async def test_a_released_complete_connection_is_reused(directory: Path) -> None:
    """The next acquire takes the connection released complete: one connection, two requests."""
    async with serving(directory, answering(OK, OK)) as (engine, pool):
        first, _ = await exchange(pool)
        pool.release(first)
        assert first.reusable
        second, body = await exchange(pool)
        assert second is first and body == b"ok"
        assert engine.connections == 1 and len(engine.requests) == 2


async def test_a_connection_idle_too_long_is_not_reused(directory: Path) -> None:
    """A connection idle for ``idle_s`` or more (the engine may be closing it) is closed and a
    new one opened."""
    clock = FakeClock()
    async with serving(directory, answering(OK, OK), idle_s=4.0, clock=clock) as (engine, pool):
        first, _ = await exchange(pool)
        pool.release(first)
        clock.advance(3.9)
        second, _ = await exchange(pool)
        assert second is first
        pool.release(second)
        clock.advance(4.0)
        third, body = await exchange(pool)
        assert third is not first and body == b"ok" and engine.connections == 2
        assert first.transport is not None and first.transport.is_closing()


async def test_release_closes_connections_idle_too_long(directory: Path) -> None:
    """Releasing one connection closes the idle ones past ``idle_s`` (none is kept open for
    nothing)."""
    clock = FakeClock()
    async with serving(directory, answering(OK), clock=clock) as (_, pool):
        first, _ = await exchange(pool)
        second, _ = await exchange(pool)
        assert second is not first
        pool.release(first)
        clock.advance(5.0)
        pool.release(second)
        assert first.transport is not None and first.transport.is_closing()
        assert second.reusable
        third = await pool.acquire()
        assert third is second


@pytest.mark.parametrize("ending", ["abort", "unread", "half-read"])
async def test_an_answer_not_read_to_its_end_closes_its_connection(
    directory: Path, ending: str
) -> None:
    """A connection whose answer was aborted, or released unread or half read, is closed on
    release, never handed out again (its next bytes belong to the old answer)."""
    raw = CHUNKED_HEAD + b"5\r\nhello\r\n"  # the rest never comes
    async with serving(directory, answering(raw, OK)) as (engine, pool):
        connection = await pool.acquire()
        send(pool, connection)
        await connection.read_head(1.0)
        if ending == "half-read":
            assert await connection.read(1.0) == b"hello"
        elif ending == "abort":
            connection.abort()
        assert not connection.complete
        pool.release(connection)
        assert connection.transport is not None and connection.transport.is_closing()
        again = await pool.acquire()
        assert again is not connection
        assert await until(lambda: engine.connections == 2, 2.0)


async def test_a_connection_the_engine_closed_while_idle_is_not_reused(directory: Path) -> None:
    """The engine closing an idle pooled connection (its keep-alive ran out): the next acquire
    opens a new one and the request goes through."""

    async def script(
        engine: RawEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await engine.next_request(reader)
        writer.write(OK)
        await writer.drain()
        if engine.connections == 1:
            await asyncio.sleep(0.05)  # idle in the pool, then closed by the engine
        else:
            await reader.read()

    async with serving(directory, script) as (engine, pool):
        first, _ = await exchange(pool)
        assert first.complete
        pool.release(first)
        assert await until(lambda: not first.reusable, 2.0)
        second, body = await exchange(pool)
        assert second is not first and body == b"ok" and engine.connections == 2


async def test_a_connection_that_received_bytes_while_idle_is_not_reused(
    directory: Path,
) -> None:
    """Bytes arriving on an idle connection answer nothing that was asked: taking them as the
    next request's answer would pair every later answer with the wrong request. Such a
    connection is closed, not reused."""

    async def script(
        engine: RawEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while await engine.next_request(reader) is not None:
            writer.write(OK)
            await writer.drain()
            if engine.connections == 1:
                await asyncio.sleep(0.05)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")
                await writer.drain()

    async with serving(directory, script) as (engine, pool):
        first, _ = await exchange(pool)
        pool.release(first)
        assert await until(lambda: bool(first._raw), 2.0)
        second, body = await exchange(pool)
        assert second is not first and body == b"ok" and engine.connections == 2


async def test_close_closes_idle_connections_and_later_releases(directory: Path) -> None:
    """`EnginePool.close` closes the idle connections; one in use when it ran is closed on its
    release."""
    async with serving(directory, answering(OK)) as (_, pool):
        idle, _ = await exchange(pool)
        busy, _ = await exchange(pool)
        pool.release(idle)
        pool.close()
        assert idle.transport is not None and idle.transport.is_closing()
        assert busy.transport is not None and not busy.transport.is_closing()
        pool.release(busy)
        assert busy.transport.is_closing()


async def test_send_on_a_closed_connection_raises(directory: Path) -> None:
    """`send` on a connection the engine closed raises `EngineHttpError` (nothing is written)."""
    async with serving(directory, answering(OK, close=True)) as (_, pool):
        connection, _ = await exchange(pool)
        assert connection.transport is not None
        assert await until(connection.transport.is_closing, 2.0)
        with pytest.raises(EngineHttpError):
            send(pool, connection)


async def test_a_missing_socket_raises_file_not_found(directory: Path) -> None:
    """No socket file (the engine is not started): `FileNotFoundError`."""
    pool = EnginePool(str(directory / "absent.sock"), "", 4.0, 1.0)
    with pytest.raises(FileNotFoundError):
        await pool.acquire()


async def test_a_socket_nobody_listens_on_refuses(directory: Path) -> None:
    """A socket file left by an engine that died: `ConnectionRefusedError`, an `OSError`."""
    path = str(directory / "dead.sock")
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(path)
    pool = EnginePool(path, "", 4.0, 1.0)
    with pytest.raises(ConnectionRefusedError):
        await pool.acquire()


async def test_a_tcp_port_nobody_listens_on_refuses() -> None:
    """An engine URL whose port is closed: `OSError`."""
    with socket.socket() as bound:  # the port held, never listening: refused
        bound.bind(("127.0.0.1", 0))
        pool = EnginePool("", f"http://127.0.0.1:{bound.getsockname()[1]}", 4.0, 1.0)
        with pytest.raises(OSError):
            await pool.acquire()


async def test_an_engine_over_tcp_gets_its_url_prefix_and_host() -> None:
    """An engine at ``http://host:port/prefix``: requests go to the prefixed path with
    ``Host: host:port``, over pooled TCP connections."""
    engine = RawEngine(answering(OK, OK))
    port = await engine.start_tcp()
    pool = TrackedPool("", f"http://127.0.0.1:{port}/engine/", 4.0, 1.0)
    try:
        first, body = await exchange(pool)
        pool.release(first)
        second, _ = await exchange(pool)
        assert body == b"ok" and second is first and engine.connections == 1
        assert engine.requests[0].startswith(
            b"POST /engine/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % port
        )
    finally:
        for connection in pool.handed:
            connection.abort()
        await engine.stop()
        await asyncio.sleep(0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_tls_to_an_untrusted_engine_fails(directory: Path) -> None:
    """``https://`` checks the engine's certificate against the system's trust store: a
    self-signed one is refused with an `OSError` (`ssl.SSLCertVerificationError`)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-subj", "/CN=localhost", "-days", "1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    engine = RawEngine(answering(OK))
    port = await engine.start_tcp(context)
    pool = EnginePool("", f"https://localhost:{port}", 4.0, 2.0)
    try:
        with pytest.raises(ssl.SSLCertVerificationError):
            await pool.acquire()
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    ("socket_path", "url", "host", "path"),
    [
        ("/run/e.sock", "", b"engine", b"/v1/chat/completions"),
        ("", "http://10.0.0.5:8000", b"10.0.0.5:8000", b"/v1/chat/completions"),
        ("", "http://engine.internal/", b"engine.internal", b"/v1/chat/completions"),
        ("", "http://engine.internal:80/a/b", b"engine.internal", b"/a/b/v1/chat/completions"),
        ("", "https://engine.internal", b"engine.internal", b"/v1/chat/completions"),
        ("", "https://engine.internal:8443", b"engine.internal:8443", b"/v1/chat/completions"),
        ("", "http://[::1]:8000", b"[::1]:8000", b"/v1/chat/completions"),
    ],
)
def test_head_is_the_request_line_host_headers_and_length(
    socket_path: str, url: str, host: bytes, path: bytes
) -> None:
    """`EnginePool.head`: request line (with the URL's prefix), ``Host`` (port only when not the
    scheme's default), the headers in order, ``Content-Length``, a blank line."""
    pool = EnginePool(socket_path, url, 4.0, 1.0)
    head = pool.head("POST", CHAT, {"Content-Type": "application/json", "X-Request-Id": "r"}, 17)
    assert head == (
        b"POST " + path + b" HTTP/1.1\r\nHost: " + host + b"\r\n"
        b"Content-Type: application/json\r\nX-Request-Id: r\r\nContent-Length: 17\r\n\r\n"
    )


@pytest.mark.parametrize("url", ["ftp://engine", "engine:8000", "http://", "http:///path"])
def test_a_url_that_is_not_http_is_refused(url: str) -> None:
    """An engine URL without an http(s) scheme and a host raises `ValueError` at build time."""
    with pytest.raises(ValueError, match="not an http"):
        EnginePool("", url, 4.0, 1.0)


@pytest.mark.parametrize("bad", ["\r", "\n", "\0", "a\r\nX-Injected: 1"])
def test_head_refuses_line_breaks_and_nul(bad: str) -> None:
    """A CR, LF or NUL in a header value or the path raises `ValueError`: no value can smuggle
    a second header or request."""
    pool = EnginePool("/run/e.sock", "", 4.0, 1.0)
    with pytest.raises(ValueError):
        pool.head("POST", CHAT, {"X-Request-Id": bad}, 0)
    with pytest.raises(ValueError):
        pool.head("POST", CHAT + bad, {}, 0)


# The same behaviours on uvloop (the gateway's event loop in production: `gateway.server`)

UVLOOP_SCENARIOS = (
    test_a_chunked_answer_is_decoded_and_the_connection_kept,
    test_a_chunk_larger_than_the_buffer_arrives_in_reads,
    test_a_silent_engine_times_the_read_out,
    test_a_trickle_read_late_does_not_time_out,
    test_time_spent_held_back_is_not_the_engines_silence,
    test_a_connection_the_engine_closed_while_idle_is_not_reused,
    test_a_connection_that_received_bytes_while_idle_is_not_reused,
)


@pytest.mark.parametrize("scenario", UVLOOP_SCENARIOS, ids=lambda s: s.__name__[5:])
def test_on_uvloop(directory: Path, scenario: Callable[[Path], Coroutine[Any, Any, None]]) -> None:
    """The scenario behaves the same on uvloop, whose loop runs due timers before it polls
    sockets (asyncio's polls first)."""
    uvloop.run(scenario(directory))
