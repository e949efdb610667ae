"""The engine boundary: the session over the engine's Unix socket, its answers, health and errors.

Everything the gateway knows about talking to the engine lives here: `Upstream` POSTs a request
and returns an `UpstreamAnswer` (its chunks, its body, abort, release); every aiohttp client
failure is translated here into a `gateway.errors.UpstreamError` and counted once in
``gateway_upstream_errors_total`` (labelled with the error's ``kind``); a non-200 answer becomes
its error by `engine_error`. The engine's state is `gateway.engine_state.EngineState`; the tasks
that watch it (the health poller, the drift check) are in `gateway.engine_watch`.
"""

from __future__ import annotations

import asyncio
import contextvars
import fcntl
import json
import re
import struct
import termios
import time
import weakref
from collections.abc import AsyncIterable, Callable, Sequence
from socket import AF_UNIX

import aiohttp
import structlog

from gateway.config import EngineSettings, EngineSpec
from gateway.engine_http import EngineConnection, EngineHttpError, EnginePool
from gateway.engine_state import EngineState as EngineState
from gateway.engine_state import EngineStatus as EngineStatus
from gateway.errors import (
    EngineAnswerTooLarge,
    EngineBadResponse,
    EngineBusy,
    EngineDisconnected,
    EngineFailed,
    EngineRejected,
    EngineUnreachable,
    GatewayError,
    GatewayTimeout,
    UpstreamError,
    quotable_name,
    scrub_credentials,
)
from gateway.metrics import Metrics

log = structlog.get_logger("gateway.upstream")
events = structlog.get_logger("gateway")

_CONNECT_ERRORS = (aiohttp.ClientConnectorError, FileNotFoundError, ConnectionRefusedError)
REFUSED = "connection refused"
"""Probe reason: the socket is missing or refuses connections (the engine process is gone)."""
ERROR_BODY_MAX_BYTES = 1 << 20
"""Most bytes of a non-200 engine answer read (vLLM's error bodies are a few hundred bytes)."""
DROP_RECHECK_S = 0.1
"""Pause before the second ``/health`` probe after a dropped connection (`Upstream.post`)."""
HEALTH_TIMEOUT = "health timeout"
"""Probe reason: no answer within the probe's timeout (a slow engine gives it too)."""
_JSON_HEADERS = {"Content-Type": "application/json"}


def proves_down(reason: str | None) -> bool:
    """True when a failed probe's ``reason`` proves the engine down by itself: the socket is
    missing or refuses (`REFUSED`), or the engine answered ``/health`` with a non-200 status
    (vLLM answers 503 once its engine core died: "Health" in the vLLM OpenAI server docs).
    A timeout or a dropped probe connection proves nothing alone: real vLLM's ``/health``
    answers late while the host is busy generating.
    """
    return reason == REFUSED or (reason or "").startswith("health status ")


SENDING: contextvars.ContextVar[list[EngineConnection] | None] = contextvars.ContextVar(
    "qwen38_sending", default=None
)
"""When set to a list, each engine connection a POST of this context takes is appended to it."""


def unread_bytes(connections: Sequence[EngineConnection]) -> int | None:
    """Bytes sent on ``connections`` (Unix sockets) that the engine has not read yet, or None
    when unknown (no connection yet, closed, not a Unix socket).

    Linux's ``SIOCOUTQ`` (``TIOCOUTQ``, unix(7)) of a Unix stream socket counts the data still
    queued at the peer: a stopped engine leaves its request there; a live one reads it at once,
    even while it is busy generating.
    """
    for connection in reversed(connections):
        transport = connection.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None or sock.family != AF_UNIX:
            return None
        try:
            raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        except OSError:
            return None
        return int(struct.unpack("i", raw)[0])
    return None


class Upstream:
    """The engine over its Unix socket (or TLS for an engine on another host): model requests on
    pooled connections of their own (`gateway.engine_http.EnginePool`), probes and the rest on
    one aiohttp session.

    Idle pooled connections are not reused after ``pool_idle_s`` (below the engine's 5 s
    keep-alive); there is no total timeout (thinking answers run for many minutes), only
    ``connect_timeout_s`` and ``read_timeout_s`` between two reads. ``progress_at`` is the engine's last sign of life
    (`time.monotonic`): a probe answered, or any byte of any answer (the failover rule of
    `gateway.engine_watch.poll_health`); ``answers`` the answers still open.
    """

    def __init__(
        self, settings: EngineSettings, metrics: Metrics, spec: EngineSpec | None = None
    ) -> None:
        self.settings = settings
        self._metrics = metrics
        self.name = spec.name if spec is not None else "default"
        self.progress_at = float("-inf")
        self.answers: weakref.WeakSet[UpstreamAnswer] = weakref.WeakSet()  # not ended yet
        connector: aiohttp.BaseConnector
        if spec is not None and spec.url:
            # An engine on another host: TLS with the system's trust store and host-name check.
            self.base = spec.url.rstrip("/")
            connector = aiohttp.TCPConnector(keepalive_timeout=settings.pool_idle_s, limit=0)
            self.pool = EnginePool("", spec.url, settings.pool_idle_s, settings.connect_timeout_s)
        else:
            self.base = "http://engine"
            socket = spec.socket if spec is not None else settings.socket
            connector = aiohttp.UnixConnector(
                path=socket, keepalive_timeout=settings.pool_idle_s, limit=0
            )
            self.pool = EnginePool(socket, "", settings.pool_idle_s, settings.connect_timeout_s)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=settings.connect_timeout_s,
                sock_read=settings.read_timeout_s,
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        """Close every pooled connection."""
        self.pool.close()
        await self.session.close()

    def failed(self, error: UpstreamError, cause: BaseException | None = None) -> UpstreamError:
        """Count ``error`` in ``gateway_upstream_errors_total{kind}``, log it, and return it."""
        self.count(error.kind, cause)
        return error

    def count(self, kind: str, cause: BaseException | None = None) -> None:
        """Count one upstream failure of ``kind`` (`gateway.metrics.UPSTREAM_ERROR_KINDS`)."""
        self._metrics.upstream_errors.labels(kind).inc()
        if kind != "stream_error":
            detail = type(cause).__name__ if cause is not None else kind
            log.warning("upstream_error", kind=kind, error=detail)

    async def post(
        self,
        path: str,
        body: bytes,
        request_id: str,
        *,
        stream: bool = True,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamAnswer:
        """POST a JSON body; return the answer with its headers read and its body unread.

        Never retried on a live engine: a connection that drops may have carried a whole
        generation, and running it twice costs the one-sequence engine minutes. A drop is
        followed by one ``/health`` probe: an engine that refuses it or answers non-200 died
        (its pooled connections die with it), which is reported as unreachable so that a
        queued request can wait for the engine's return instead of failing; a probe that only
        times out proves nothing (`proves_down`) and the drop is a disconnect. ``sent`` is
        called once the request is written, before the wait for the engine's headers: work
        that then runs while the engine works rather than after its answer.

        Raises:
            EngineUnreachable: the socket refuses or does not exist (engine down or loading),
                or the connection dropped and the engine proved down (``sent`` true).
            GatewayTimeout: no answer within ``read_timeout_s``.
            EngineDisconnected: the engine dropped the connection and is still up.
        """
        settings = self.settings
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "X-Request-Id": request_id,
        }
        head = self.pool.head("POST", path, headers, len(body))
        # A non-streaming answer is silent until it is complete: no read timeout (the caller's
        # total time limit bounds it instead).
        timeout = settings.read_timeout_s if stream else None
        try:
            connection = await self.pool.acquire()
        except asyncio.TimeoutError as exc:
            raise self.failed(GatewayTimeout(), exc) from exc
        except OSError as exc:
            raise self.failed(EngineUnreachable(), exc) from exc
        held = SENDING.get()
        if held is not None:
            held.append(connection)
        try:
            connection.send(head, body)
            if sent is not None:
                sent()
            await connection.read_head(timeout)
        except asyncio.TimeoutError as exc:
            self.pool.release(connection)
            raise self.failed(GatewayTimeout(), exc) from exc
        except EngineHttpError as exc:
            self.pool.release(connection)
            gone = await self._proved_down(min(1.0, settings.connect_timeout_s))
            error = EngineUnreachable(sent=True) if gone else EngineDisconnected()
            raise self.failed(error, exc) from exc
        except BaseException:
            connection.abort()
            self.pool.release(connection)
            raise
        self.progress_at = time.monotonic()
        answer = UpstreamAnswer(self, connection, timeout)
        self.answers.add(answer)
        return answer

    async def _proved_down(self, timeout: float) -> bool:
        """After a connection dropped before any answer: True when ``/health`` proves the
        engine down (`proves_down`). A process that is exiting may still hold its socket, or
        a probe may go out on a pooled connection it already closed, for a moment: a probe
        that proves nothing is made once more after `DROP_RECHECK_S`."""
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(DROP_RECHECK_S)
            status, reason = await self.health(timeout=timeout)
            if status == "down" and proves_down(reason):
                return True
            if status == "ready":
                return False
        return False

    async def count_prompt(self, ask: bytes | None, timeout: float) -> int | None:
        """The engine's own prompt token count, or None.

        Posts ``ask``, the ``POST /tokenize`` body of an engine request
        (`gateway.rewrite.tokenize_ask`), for the exact count of a prompt (vLLM's tokenizer
        endpoint). None when ``ask`` is None (the request is not one prompt) or the engine does
        not answer in time.
        """
        if ask is None:
            return None
        try:
            async with self.session.post(
                f"{self.base}/tokenize",
                data=ask,
                headers=_JSON_HEADERS,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                if resp.status != 200:
                    return None
                return await tokenize_count(resp.content.iter_any(), self.settings.max_answer_bytes)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return None

    async def health(self, timeout: float) -> tuple[EngineStatus, str | None]:
        """Probe ``GET /health``: ``ready`` on 200, ``down`` otherwise, with a short reason.

        Reasons: `REFUSED` (socket missing or refusing), ``"health status N"`` (a non-200
        answer), `HEALTH_TIMEOUT`, or an aiohttp error's class name; `proves_down` tells the
        definite ones from those a slow or busy engine also gives.
        """
        try:
            async with self.session.get(
                f"{self.base}/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                await resp.read()
                self.progress_at = time.monotonic()
                if resp.status == 200:
                    return "ready", None
                return "down", f"health status {resp.status}"
        except _CONNECT_ERRORS:
            return "down", REFUSED
        except asyncio.TimeoutError:
            return "down", HEALTH_TIMEOUT
        except aiohttp.ClientError as exc:
            return "down", type(exc).__name__

    async def metrics_text(self, timeout: float) -> str | None:
        """The engine's Prometheus exposition text, or None when it did not answer 200 in time."""
        try:
            async with self.session.get(
                f"{self.base}/metrics", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                resp.raise_for_status()
                return await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            log.debug("engine_scrape_failed", error=type(exc).__name__)
            return None


class UpstreamAnswer:
    """One engine answer: status and headers read, body unread.

    Read it with `chunks` (a stream) or `body` (JSON), or turn a non-200 answer into its error
    with `error`. End it with `release` after a complete read (the connection returns to the
    pool) or `abort` otherwise: closing the socket is how the engine learns to stop generating
    (vLLM aborts a request whose client disconnected). Read failures raise `UpstreamError`s,
    already counted.

    Args:
        upstream: the engine.
        connection: the connection the answer arrives on, its head read.
        timeout: the longest silence between two reads (s), or None.
    """

    __slots__ = (
        "__weakref__",
        "_connection",
        "_ended",
        "_pending",
        "_timeout",
        "_upstream",
        "broken",
        "status",
    )

    def __init__(
        self, upstream: Upstream, connection: EngineConnection, timeout: float | None
    ) -> None:
        self._upstream = upstream
        self._connection = connection
        self._timeout = timeout
        self._ended = False
        self._pending: bytes | None = None
        self.status = connection.status
        self.broken = False  # a read failed: the connection dropped or timed out

    def __aiter__(self) -> UpstreamAnswer:
        return self

    async def __anext__(self) -> bytes:
        """The next read of the body as it arrives (any size); StopAsyncIteration at its end.

        Raises:
            GatewayTimeout: no byte for ``engine.read_timeout_s``.
            EngineDisconnected: the connection dropped or the body was malformed.
        """
        pending = self._pending
        if pending is not None:
            self._pending = None
            return pending
        try:
            data = await self._connection.read(self._timeout)
        except (asyncio.TimeoutError, EngineHttpError) as exc:
            raise self._read_failed(exc) from exc
        if not data:
            raise StopAsyncIteration
        self._upstream.progress_at = time.monotonic()
        return data

    async def read_within(self, within: float) -> bytes | None:
        """The next read (``b""`` at the body's end), or None when none came within ``within``
        seconds (the answer is read on later as usual).

        Raises:
            GatewayTimeout, EngineDisconnected: as `__anext__`.
        """
        pending = self._pending
        if pending is not None:
            self._pending = None
            return pending
        try:
            data = await self._connection.read_within(self._timeout, max(within, 0.0))
        except (asyncio.TimeoutError, EngineHttpError) as exc:
            raise self._read_failed(exc) from exc
        if data:
            self._upstream.progress_at = time.monotonic()
        return data

    @property
    def buffered(self) -> bool:
        """The next read returns at once: body bytes have arrived and wait to be read, or the
        body's end has."""
        return self._pending is not None or self._connection.buffered

    def unread(self, data: bytes) -> None:
        """Give ``data`` (a read taken from `__anext__`) back: the next read returns it first."""
        self._pending = data

    async def _read(self) -> bytes:
        try:
            data = await self._connection.read(self._timeout)
        except (asyncio.TimeoutError, EngineHttpError) as exc:
            raise self._read_failed(exc) from exc
        self._upstream.progress_at = time.monotonic()
        return data

    def _read_failed(self, exc: Exception) -> UpstreamError:
        """A read that failed, as the error raised (counted): silence past the read timeout
        is `GatewayTimeout`, a dropped connection or a malformed body `EngineDisconnected`."""
        self.broken = True
        error = GatewayTimeout() if isinstance(exc, asyncio.TimeoutError) else EngineDisconnected()
        return self._upstream.failed(error, exc)

    def chunks(self) -> UpstreamAnswer:
        """The body as an async iterator of reads (``async for data in answer.chunks()``)."""
        return self

    async def body(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes (``engine.max_answer_bytes``).

        Raises: as `parts`.
        """
        return b"".join(await self.parts(limit))

    async def parts(self, limit: int) -> list[bytes]:
        """The whole body as the reads that brought it, at most ``limit`` bytes in all.

        An answer whose ``Content-Length`` or bytes read pass ``limit`` is refused before more
        of it is held: the caller aborts the answer (the engine stops generating). The reads
        are not joined: a copy of a large answer in one step would hold up every other request.

        Raises:
            EngineAnswerTooLarge: the answer is larger than ``limit`` bytes.
            GatewayTimeout: no byte for ``engine.read_timeout_s``.
            EngineDisconnected: the connection dropped.
        """
        length = self._connection.content_length
        if length is not None and length > limit:
            raise self._upstream.failed(EngineAnswerTooLarge("answer", limit))
        parts: list[bytes] = []
        size = 0
        while True:
            data = await self._read()
            if not data:
                return parts
            size += len(data)
            if size > limit:
                raise self._upstream.failed(EngineAnswerTooLarge("answer", limit))
            parts.append(data)

    async def error(self) -> GatewayError:
        """The error a non-200 answer stands for (`engine_error`), body read; counted when 5xx."""
        try:
            raw = await self.body(ERROR_BODY_MAX_BYTES)
        except UpstreamError as exc:  # counted by body()
            return exc
        error = engine_error(self.status, raw)
        if isinstance(error, UpstreamError):
            self._upstream.failed(error)
        return error

    def failed(self, error: UpstreamError, cause: BaseException | None = None) -> UpstreamError:
        """Count a failure found in this answer's content (a bad body, a cut stream)."""
        return self._upstream.failed(error, cause)

    def reported_error(self) -> None:
        """Count an error event the engine sent inside its stream (kind ``stream_error``)."""
        self._upstream.count("stream_error")

    def release(self) -> None:
        """The body was read to its end: return the connection to the pool."""
        self._end(abort=False)

    def abort(self) -> None:
        """Close the connection: the engine aborts the generation (case C10); a read waiting on
        it fails (`EngineDisconnected`)."""
        self._end(abort=True)

    def _end(self, abort: bool) -> None:
        self._upstream.answers.discard(self)
        if self._ended:
            if abort:
                self._connection.abort()
            return
        self._ended = True
        if abort:
            self._connection.abort()
        self._upstream.pool.release(self._connection)


_TOKENIZE_COUNT = re.compile(rb'"count"\s*:\s*(\d{1,18})\s*[,}]')
"""The ``count`` member of a ``/tokenize`` answer, its number whole (the byte after it read)."""
_COUNT_TAIL = 64
"""Bytes of one read kept for the next: a ``"count": N,`` cut between two reads is found whole."""


async def tokenize_count(reads: AsyncIterable[bytes], limit: int) -> int | None:
    """The ``count`` of a ``/tokenize`` answer, found in its bytes as they arrive, holding at
    most `_COUNT_TAIL` of them beyond the read at hand.

    The token ids beside the count take about 7 bytes a token (a 30 MB prompt's answer is over
    40 MB, past ``engine.max_answer_bytes``), and only the count is needed. vLLM's
    `TokenizeResponse` writes ``count`` first (then ``max_model_len``, ``tokens``,
    ``token_strs``), so it is found in the first read; in any other order it is found where it
    is (a string of ``token_strs`` cannot hold ``"count":``, JSON escapes its quotes). None when
    the answer ends without one, or when ``limit`` bytes passed before it.

    Raises: what ``reads`` raises (the engine's read failing).
    """
    tail = b""
    size = 0
    async for data in reads:
        size += len(data)
        window = tail + data if tail else data
        match = _TOKENIZE_COUNT.search(window)
        if match is not None:
            return int(match.group(1))
        if size > limit:
            return None
        tail = window[-_COUNT_TAIL:]
    return None


_PARAM_RE = re.compile(r"[a-z_]+(?:\[\d+\])*(?:\.[a-z_]+(?:\[\d+\])*)*")
_PARAM_NAME_RE = re.compile(r"[a-z_]+")


def stated_param(param: str) -> str | None:
    """An engine's ``param`` as the client may see it: a path of lower-case names, dots and
    ``[index]`` whose every name an error may state (`gateway.errors.quotable_name`: a field's
    snake_case name, or a short word), else None. A name can be a client's key (pydantic puts
    a dict's keys in the path), and the message beside it is judged by the same rule."""
    if not _PARAM_RE.fullmatch(param):
        return None
    for name in _PARAM_NAME_RE.findall(param):
        if quotable_name(name) != name:
            return None
    return param


def engine_error(status: int, body: bytes) -> GatewayError:
    """Translate a non-200 engine answer into the error the client gets.

    A 4xx other than 401/403/404 describes the request: `EngineRejected` with the engine's
    status, ``error.message`` and ``error.param`` (vLLM's OpenAI-compatible error body), with
    anything in them that could be a credential the client put in its body redacted
    (`gateway.errors.scrub_credentials`). 503 is
    `EngineBusy`; other 5xx `EngineFailed`; anything else (401, 403, 404, 1xx, 3xx) is a bad
    answer (`EngineBadResponse`). Not counted: `UpstreamAnswer.error` counts.
    """
    if 400 <= status < 500 and status not in (401, 403, 404):
        message, param = "The engine rejected the request.", None
        try:
            obj = json.loads(body)
            err = obj.get("error") if isinstance(obj, dict) else None
            if isinstance(err, dict):
                message = str(err.get("message") or message)
                param = err.get("param") if isinstance(err.get("param"), str) else None
        except ValueError:
            pass
        if param is not None:
            param = stated_param(param)
        return EngineRejected(status, scrub_credentials(message), param=param)
    if status == 503:
        return EngineBusy()
    if status >= 500:
        return EngineFailed()
    return EngineBadResponse()
