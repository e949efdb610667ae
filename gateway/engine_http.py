"""HTTP/1.1 to the engine for model requests: pooled connections, one request at a time on each,
answers read as they arrive.

The model request path is the gateway's hot path: a streamed answer is hundreds of small events,
each sent by the engine (uvicorn) as one HTTP chunk and usually read by the gateway one at a
time. A general HTTP client parses every chunk into its body stream with several Python calls
and re-arms its read timer on every read; here a read costs one append to a buffer, and the
chunked framing (RFC 9112 section 7.1) is taken apart only when the relay asks for what has
arrived, for all the chunks waiting at once. Everything else about the engine (health probes,
``/metrics``, ``/tokenize``) goes through aiohttp's client in `gateway.upstream`.

`EnginePool` opens and reuses connections (a Unix socket, or TCP with TLS for an engine on
another host); `EngineConnection` sends one request and reads its answer. Failures are raised
as `EngineHttpError` (the connection closed or the answer is not HTTP/1.1) and `OSError` (no
connection) or `asyncio.TimeoutError`; `gateway.upstream` turns them into the gateway's errors.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

HEAD_MAX_BYTES = 64 * 1024
"""Longest status line and headers accepted from the engine (uvicorn sends about 150 bytes)."""
CHUNK_LINE_MAX_BYTES = 1024
"""Longest chunk-size line (hex size and extensions) accepted."""
SMALL_BODY_BYTES = 64 * 1024
"""Request bodies up to this size are joined to their head and written in one piece."""
READ_HIGH_WATER = 64 * 1024
"""Bytes received and not yet read by the relay above which the socket is no longer read:
a client that reads slowly holds the engine's answer back in the kernel, not in the gateway."""


_CONTROL_RE = re.compile("[\r\n\0]")
"""What no request line or header value may hold (it would end the line: header smuggling)."""


class EngineHttpError(Exception):
    """The connection closed before the answer's end, or the answer is not valid HTTP/1.1."""


_CHUNKED, _LENGTH, _CLOSE, _DONE = 0, 1, 2, 3  # how the body ends


class _Expired(Exception):
    """`EngineConnection.read_within` ran out of time (never raised out of it)."""


class EngineConnection(asyncio.Protocol):
    """One connection to the engine: `send` a request, `read_head`, then `read` the body.

    Bytes are kept as they arrive (`data_received` appends, nothing more); `read` decodes the
    body's framing (chunked, ``Content-Length``, or until the connection closes) over everything
    waiting. At most `READ_HIGH_WATER` undecoded bytes are held: past it the socket is paused
    until the relay reads.

    Attributes:
        transport: the socket's transport (`gateway.upstream.unread_bytes` reads its queue).
        status: the answer's status code, after `read_head`.
        content_length: the answer's ``Content-Length``, or None.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.content_length: int | None = None
        self._raw = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._eof = False
        self._aborted = False
        self._mode = _DONE
        self._left = 0  # bytes left in the current chunk (chunked) or the body (length)
        self._chunk_end = False  # a chunk's payload ended: its CRLF comes next
        self._keep_alive = False
        self._in_use = False
        self._loop = asyncio.get_running_loop()
        self._loop_time = self._loop.time
        self._last = 0.0  # loop time of the last byte received (or of the request sent)
        self._timer: asyncio.TimerHandle | None = None
        self._timeout = 0.0

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's)

    def data_received(self, data: bytes) -> None:
        raw = self._raw
        raw += data
        self._last = self._loop_time()
        if not self._paused and len(raw) > READ_HIGH_WATER and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # the request

    @property
    def reusable(self) -> bool:
        """The connection is open, idle and may carry another request (keep-alive); nothing
        arrived on it since its last answer (bytes that answer no request would be taken for
        the next request's answer)."""
        transport = self.transport
        return (
            not self._in_use
            and not self._eof
            and not self._raw
            and transport is not None
            and not transport.is_closing()
        )

    def send(self, head: bytes, body: bytes) -> None:
        """Write a request (its head and body); the answer is read with `read_head` and `read`.

        Raises:
            EngineHttpError: the connection is already closed.
        """
        transport = self.transport
        if self._eof or transport is None or transport.is_closing():
            raise EngineHttpError("the engine closed the connection")
        self._in_use = True
        self._keep_alive = False
        self._mode = _DONE
        self._last = self._loop_time()
        if len(body) > SMALL_BODY_BYTES:
            transport.writelines((head, body))
        else:
            transport.write(head + body)  # one copy of a small body, one plain write

    async def _wait(self, timeout: float | None) -> None:
        """Wait for more bytes (or the connection's end); fail when none has arrived for
        ``timeout`` seconds (aiohttp's ``sock_read``). One timer watches the connection, moved
        on only when it fires (`_check`) or a read asks for another timeout, not re-armed on
        every read.

        Raises:
            asyncio.TimeoutError: nothing arrived in time.
        """
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
            self._last = self._loop_time()  # the engine's silence counts from here
        loop = self._loop
        waiter = self._waiter = loop.create_future()
        if (timeout or 0.0) != self._timeout:  # another timeout than the timer's: this one counts
            self._timeout = timeout or 0.0
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if timeout and self._timer is None:
            self._timer = loop.call_at(self._last + timeout, self._check)
        try:
            await waiter
        finally:
            self._waiter = None

    def _check(self) -> None:
        """The read timer fired: fail a read waiting since `_timeout` seconds without a byte,
        else wait for the next deadline (none while nobody reads)."""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        deadline = self._last + self._timeout
        loop = self._loop
        if loop.time() >= deadline:
            self._waiter = None
            waiter.set_exception(asyncio.TimeoutError())
        else:
            self._timer = loop.call_at(deadline, self._check)

    async def read_head(self, timeout: float | None) -> None:
        """Read the status line and headers (informational 1xx answers are skipped).

        Sets `status`, `content_length` and how the body ends: ``Transfer-Encoding: chunked``,
        else ``Content-Length``, else the connection's close (RFC 9112 section 6.3); no body
        for 204 and 304.

        Raises:
            EngineHttpError: the connection closed first, or the head is not HTTP/1.x.
            asyncio.TimeoutError: nothing arrived for ``timeout`` seconds.
        """
        while True:
            end = self._raw.find(b"\r\n\r\n")
            while end < 0:
                if len(self._raw) > HEAD_MAX_BYTES:
                    raise EngineHttpError("the answer's headers are too large")
                if self._eof:
                    raise EngineHttpError("the engine closed the connection")
                await self._wait(timeout)
                end = self._raw.find(b"\r\n\r\n")
            if end > HEAD_MAX_BYTES:
                raise EngineHttpError("the answer's headers are too large")
            head = bytes(self._raw[:end])
            del self._raw[: end + 4]
            if not self._parse_head(head):
                return

    def _parse_head(self, head: bytes) -> bool:
        """Take the status and framing from ``head``; True for a 1xx answer (another follows)."""
        lines = head.split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        version = status_line[0]
        if len(status_line) < 2 or version[:7] != b"HTTP/1." or not status_line[1].isdigit():
            raise EngineHttpError("the answer is not HTTP/1.x")
        status = int(status_line[1])
        if not 100 <= status <= 599:
            raise EngineHttpError("the answer's status is not valid")
        if status < 200:
            return True
        chunked = False
        length: int | None = None
        keep_alive = version == b"HTTP/1.1"
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name[-1:] in (b" ", b"\t") or line[:1] in (b" ", b"\t"):
                raise EngineHttpError("the answer has a malformed header")
            name = name.lower()
            if name == b"transfer-encoding":
                # Chunked alone: another coding (gzip, chunked) would reach the relay undecoded.
                if value.strip().lower() == b"chunked":
                    codings = [b"chunked"]  # the usual header, without a list to parse
                else:
                    codings = [c for c in (c.strip() for c in value.lower().split(b",")) if c]
                if chunked or codings != [b"chunked"]:
                    raise EngineHttpError("the answer's transfer coding is not supported")
                chunked = True
            elif name == b"content-length":
                value = value.strip()
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise EngineHttpError("the answer's Content-Length is not valid")
                length = int(value)
            elif name == b"connection":
                tokens = [t.strip() for t in value.lower().split(b",")]
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens:
                    keep_alive = True
        self.status = status
        self._keep_alive = keep_alive
        self.content_length = None if chunked else length
        if status in (204, 304):
            self._mode, self._left = _DONE, 0
        elif chunked:
            self._mode, self._left, self._chunk_end = _CHUNKED, 0, False
        elif length is not None:
            self._mode, self._left = (_LENGTH, length) if length else (_DONE, 0)
        else:
            self._mode, self._keep_alive = _CLOSE, False
        return False

    async def read(self, timeout: float | None) -> bytes:
        """The body bytes that have arrived (waiting for some, at most ``timeout`` seconds
        between two reads); ``b""`` at the body's end.

        Raises:
            EngineHttpError: the connection closed (or was aborted) before the body's end, or
                bad chunk framing.
            asyncio.TimeoutError: nothing arrived for ``timeout`` seconds.
        """
        while True:
            mode = self._mode
            if mode == _DONE:
                return b""
            if self._raw:
                if mode == _CHUNKED:
                    data = self._dechunk()
                elif mode == _LENGTH:
                    data = self._take(self._left)
                    self._left -= len(data)
                    if not self._left:
                        self._mode = _DONE
                else:
                    data = self._take(len(self._raw))
                if data or self._mode == _DONE:
                    return data
            if self._eof:
                if mode == _CLOSE and not self._raw and not self._aborted:
                    self._mode = _DONE
                    return b""
                raise EngineHttpError("the engine closed the connection before the answer's end")
            await self._wait(timeout)

    async def read_within(self, timeout: float | None, within: float) -> bytes | None:
        """`read`, giving up after ``within`` seconds with None when nothing could be read yet
        (the bytes that arrived meanwhile wait for the next read).

        Raises:
            EngineHttpError, asyncio.TimeoutError: as `read`.
        """
        handle = self._loop.call_later(within, self._expire)
        try:
            return await self.read(timeout)
        except _Expired:
            return None
        finally:
            handle.cancel()

    def _expire(self) -> None:
        """`read_within`'s time is up: its waiting read stops (it consumed nothing yet)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_exception(_Expired())

    def _take(self, size: int) -> bytes:
        raw = self._raw
        if size >= len(raw):
            data = bytes(raw)
            raw.clear()
        else:
            data = bytes(raw[:size])
            del raw[:size]
        if self._paused and len(raw) <= READ_HIGH_WATER and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
            self._last = self._loop_time()  # the engine's silence counts from here
        return data

    def _dechunk(self) -> bytes:
        """The payload of every chunk (whole or begun) in the buffer, framing removed
        (RFC 9112 section 7.1: ``size[;ext] CRLF payload CRLF``, ending with a 0-size chunk and
        optional trailer fields). Whole chunks, the usual case, take one pass of a few byte
        operations each."""
        raw = self._raw
        buf = bytes(raw)
        size = len(buf)
        find = buf.find
        pos = 0
        out: list[bytes] = []
        if not self._left and not self._chunk_end:
            pos = _whole_chunks(buf, out)
        while pos < size:
            if self._left:
                end = min(size, pos + self._left)
                out.append(buf[pos:end])
                self._left -= end - pos
                pos = end
                if self._left:
                    break
                self._chunk_end = True
            if self._chunk_end:
                if size - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise EngineHttpError("a chunk does not end with CRLF")
                pos += 2
                self._chunk_end = False
                continue
            eol = find(b"\r\n", pos, pos + CHUNK_LINE_MAX_BYTES)
            if eol < 0:
                if size - pos >= CHUNK_LINE_MAX_BYTES:
                    raise EngineHttpError("a chunk size line is too long")
                break
            line = buf[pos:eol]
            if line.isalnum() and b"x" not in line and b"X" not in line:
                try:
                    chunk = int(line, 16)
                except ValueError:
                    raise EngineHttpError("a chunk size is not hexadecimal") from None
            else:
                chunk = _chunk_size(line)  # extensions, or not a size
            start = eol + 2
            if chunk == 0:
                if buf[start : start + 2] == b"\r\n":
                    pos = start + 2
                else:
                    trailer_end = find(b"\r\n\r\n", eol)
                    if trailer_end < 0:
                        if size - eol > HEAD_MAX_BYTES:
                            raise EngineHttpError("the answer's trailer is too large")
                        break
                    pos = trailer_end + 4
                self._mode = _DONE
                if pos < size:
                    self._keep_alive = False  # bytes after the answer: never reuse
                break
            end = start + chunk
            if end + 2 <= size:  # the whole chunk and its CRLF are here
                if buf[end : end + 2] != b"\r\n":
                    raise EngineHttpError("a chunk does not end with CRLF")
                out.append(buf[start:end])
                pos = end + 2
            else:
                self._left = chunk
                pos = start
        if pos:
            del raw[:pos]
        if self._paused and len(raw) <= READ_HIGH_WATER and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
            self._last = self._loop_time()  # the engine's silence counts from here
        return b"".join(out) if len(out) != 1 else out[0]

    @property
    def buffered(self) -> bool:
        """The next `read` returns at once: bytes of the answer's body have arrived and are not
        read yet, or its end has."""
        return bool(self._raw) or self._eof or self._mode == _DONE

    @property
    def complete(self) -> bool:
        """The answer was read to its end and the connection may carry another request."""
        transport = self.transport
        return (
            self._mode == _DONE
            and self._keep_alive
            and not self._raw
            and not self._eof
            and transport is not None
            and not transport.is_closing()
            and not transport.get_write_buffer_size()
        )

    def finished(self) -> None:
        """The request is over (the pool takes the connection back or closes it)."""
        self._in_use = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def abort(self) -> None:
        """Close the connection at once (unsent bytes dropped): the engine sees its client gone
        and aborts the generation (vLLM's behaviour on a client disconnect). A read waiting on
        it, or any later one, raises `EngineHttpError`, also for a body ended by the close."""
        self.finished()
        self._eof = self._aborted = True
        if self.transport is not None:
            self.transport.abort()
        self._wake()


_HEX_DIGITS = b"0123456789abcdefABCDEF"


def _whole_chunks(buf: bytes, out: list[bytes]) -> int:
    """Take the run of whole chunks at the start of ``buf`` (which starts at a chunk-size line)
    whose payloads hold no CRLF, the engine's usual chunks (an SSE event each); their payloads
    are appended to ``out`` and the offset after them returned (0: none).

    ``buf`` is split at every CRLF once: a chunk is whole when its size line is followed by
    exactly that many bytes and a CRLF, so the split's pieces pair up as size and payload. The
    first piece that does not (a chunk cut short, one holding a CRLF, extensions, the last
    chunk) ends the run; `EngineConnection._dechunk` reads on from there byte by byte.

    Raises:
        EngineHttpError: a size of the run is not plain hexadecimal digits.
    """
    parts = buf.split(b"\r\n")
    last = len(parts) - 1  # what follows the last CRLF
    index = 0
    try:
        while index + 1 < last:
            size = int(parts[index], 16)
            if not size or size != len(parts[index + 1]):
                break
            index += 2
    except ValueError:
        pass
    if not index:
        return 0
    if b"".join(parts[0:index:2]).translate(None, _HEX_DIGITS):
        raise EngineHttpError("a chunk size is not hexadecimal")
    out.extend(parts[1:index:2])
    return sum(map(len, parts[:index])) + 2 * index


def _chunk_size(line: bytes) -> int:
    """The size in a chunk-size line (hex digits, then optional ``;`` extensions).

    Raises:
        EngineHttpError: not a hexadecimal size.
    """
    if not line.isalnum() or line[1:2] in (b"x", b"X"):
        line = line.split(b";", 1)[0].rstrip(b" \t")
        if not line.isalnum() or line[1:2] in (b"x", b"X"):
            raise EngineHttpError("a chunk size is not hexadecimal")
    try:
        return int(line, 16)
    except ValueError:
        raise EngineHttpError("a chunk size is not hexadecimal") from None


class EnginePool:
    """Connections to one engine, reused while idle less than ``idle_s`` seconds (below the
    engine's own keep-alive: uvicorn closes an idle connection after 5 s, and a request sent on
    a connection the engine is closing fails).

    Args:
        socket: the engine's Unix socket path, or "" for ``url``.
        url: ``http://host:port[/prefix]`` or ``https://...`` (TLS with the system's trust store
            and the host name checked: `ssl.create_default_context`).
        idle_s: ``engine.pool_idle_s``.
        connect_timeout_s: ``engine.connect_timeout_s``.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        socket: str,
        url: str,
        idle_s: float,
        connect_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._socket = socket
        self._idle_s = idle_s
        self._connect_timeout = connect_timeout_s
        self._clock = clock
        self._idle: list[tuple[EngineConnection, float]] = []
        self._closed = False
        self._ssl: ssl.SSLContext | None = None
        self._prefix = ""
        self._host, self._port = "engine", 0
        if not socket:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"not an http(s) URL: {url!r}")
            self._host = parts.hostname
            self._port = parts.port or (443 if parts.scheme == "https" else 80)
            self._prefix = parts.path.rstrip("/")
            if parts.scheme == "https":
                self._ssl = ssl.create_default_context()
        host = self._host if ":" not in self._host else f"[{self._host}]"
        default = 443 if self._ssl is not None else 80
        self._host_header = host if self._port in (0, default) else f"{host}:{self._port}"

    def head(self, method: str, path: str, headers: dict[str, str], length: int) -> bytes:
        """The request line and headers of a request with a ``length``-byte body.

        Raises:
            ValueError: a header value or the path holds a control character (no request may
                carry a second header or request smuggled in by one of its values).
        """
        if _CONTROL_RE.search("".join((path, *headers.values()))) is not None:
            raise ValueError("a line break or NUL in a request header")
        lines = [f"{method} {self._prefix}{path} HTTP/1.1", f"Host: {self._host_header}"]
        for name, value in headers.items():
            lines.append(f"{name}: {value}")
        lines.append(f"Content-Length: {length}\r\n\r\n")
        return "\r\n".join(lines).encode("latin-1")

    async def acquire(self) -> EngineConnection:
        """An idle connection young enough to reuse, else a new one.

        Raises:
            OSError: the engine refuses the connection or its socket does not exist
                (``FileNotFoundError``, ``ConnectionRefusedError``), or TLS fails.
            asyncio.TimeoutError: no connection within ``connect_timeout_s``.
        """
        now = self._clock()
        idle = self._idle
        while idle:
            connection, since = idle.pop()
            if connection.reusable and now - since < self._idle_s:
                return connection
            connection.abort()
        loop = asyncio.get_running_loop()
        if self._socket:
            opening = loop.create_unix_connection(EngineConnection, self._socket)
        else:
            opening = loop.create_connection(
                EngineConnection,
                self._host,
                self._port,
                ssl=self._ssl,
                server_hostname=self._host if self._ssl is not None else None,
            )
        _, protocol = await asyncio.wait_for(opening, self._connect_timeout or None)
        return protocol

    def release(self, connection: EngineConnection) -> None:
        """Take ``connection`` back after a request: kept when its answer was read to the end
        on a keep-alive connection, else closed. Connections idle past ``idle_s`` are closed."""
        connection.finished()
        now = self._clock()
        idle = self._idle
        while idle and (now - idle[0][1] >= self._idle_s or not idle[0][0].reusable):
            idle.pop(0)[0].abort()
        if connection.complete and not self._closed:
            idle.append((connection, now))
        else:
            connection.abort()

    def close(self) -> None:
        """Close every idle connection; connections in use close when released."""
        self._closed = True
        for connection, _ in self._idle:
            connection.abort()
        self._idle.clear()
