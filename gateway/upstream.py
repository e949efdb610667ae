"""The engine client: one aiohttp session over the Unix socket, the health poller, error translation.

aiohttp client exceptions are translated here into `gateway.errors` (STYLE: third-party errors
are translated where the library is called) and counted in ``gateway_upstream_errors_total``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal

import aiohttp
import structlog

from gateway.config import EngineSettings
from gateway.errors import BadGateway, EngineUnavailable, GatewayError, GatewayTimeout
from gateway.metrics import Metrics

log = structlog.get_logger("gateway.upstream")

EngineStatus = Literal["starting", "warming", "ready", "down"]
# Seconds a client should wait before retrying while the engine loads or restarts: a V100 takes
# minutes to load and warm up the 23 GB checkpoint, a crash restart about as long.
RETRY_AFTER_STARTING_S = 30.0
RETRY_AFTER_DOWN_S = 10.0


class EngineState:
    """The engine's health as the poller last saw it.

    States: ``starting`` (never answered yet), ``warming`` (answers ``/health`` but the launcher
    has not finished the warm-up request: ``engine.ready_file`` configured and absent),
    ``ready``, ``down`` (answered before, now refuses, fails or times out).
    """

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.status: EngineStatus = "starting"
        self.since = clock()
        self.last_error: str | None = None
        self._clock = clock
        self._metrics = metrics
        self._ready = asyncio.Event()
        metrics.engine_up.set(0)
        metrics.engine_ready.set(0)

    @property
    def ready(self) -> bool:
        """True when model requests may be sent."""
        return self.status == "ready"

    def set(self, status: EngineStatus, error: str | None = None) -> None:
        """Record a probe result; logs transitions (``engine_up``/``engine_down`` events)."""
        self.last_error = error
        if status == self.status:
            return
        previous, self.status, self.since = self.status, status, self._clock()
        self._metrics.engine_up.set(1 if status in ("ready", "warming") else 0)
        self._metrics.engine_ready.set(1 if status == "ready" else 0)
        if status == "ready":
            self._ready.set()
            log.info("engine_up", previous=previous)
        else:
            self._ready.clear()
            log.warning("engine_down" if status == "down" else f"engine_{status}", error=error)

    def unavailable(self) -> EngineUnavailable:
        """The 503 to answer while the engine is not ready."""
        retry = RETRY_AFTER_DOWN_S if self.status == "down" else RETRY_AFTER_STARTING_S
        return EngineUnavailable(
            f"The model is not available right now (engine {self.status}). Retry later.",
            retry_after_s=retry,
        )

    async def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the ready state; True if reached."""
        if self.ready:
            return True
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class EngineClient:
    """HTTP over the engine's Unix socket.

    Idle pooled connections are closed after ``pool_idle_s`` (below the engine's 5 s keep-alive);
    there is no total timeout (thinking answers run for many minutes), only ``connect_timeout_s``
    and ``read_timeout_s`` between two reads.
    """

    def __init__(self, settings: EngineSettings, metrics: Metrics) -> None:
        self.settings = settings
        self._metrics = metrics
        connector = aiohttp.UnixConnector(
            path=settings.socket, keepalive_timeout=settings.pool_idle_s, limit=0
        )
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
        await self.session.close()

    def error(self, kind: str, exc: BaseException | None = None) -> GatewayError:
        """Count an upstream failure of ``kind`` and return the client-facing error for it."""
        self._metrics.upstream_errors.labels(kind).inc()
        detail = type(exc).__name__ if exc is not None else kind
        log.warning("upstream_error", kind=kind, error=detail)
        if kind == "connect":
            return EngineUnavailable(
                "The model is not available right now (engine unreachable). Retry later.",
                retry_after_s=RETRY_AFTER_DOWN_S,
            )
        if kind == "timeout":
            return GatewayTimeout("The engine did not answer in time.")
        return BadGateway("The engine failed while answering this request.")

    async def post(self, path: str, body: bytes, request_id: str) -> aiohttp.ClientResponse:
        """POST a JSON body; return the response with its headers read and its body unread.

        Never retried on a live engine: a connection that drops may have carried a whole
        generation, and running it twice costs the one-sequence engine minutes. A drop is
        followed by one ``/health`` probe: an engine that no longer answers died (its pooled
        connections die with it), which is reported as unavailable so that a queued request
        can wait for the engine's return instead of failing.

        Raises:
            EngineUnavailable: the socket refuses or does not exist (engine down or loading),
                or the connection dropped and the engine no longer answers.
            GatewayTimeout: no answer within ``read_timeout_s``.
            BadGateway: the engine dropped the connection and is still up.
        """
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "X-Request-Id": request_id,
        }
        try:
            return await self.session.post(
                f"http://engine{path}", data=body, headers=headers, compress=False
            )
        except (aiohttp.ClientConnectorError, FileNotFoundError, ConnectionRefusedError) as exc:
            raise self.error("connect", exc) from exc
        except asyncio.TimeoutError as exc:
            raise self.error("timeout", exc) from exc
        except aiohttp.ClientError as exc:
            status, _ = await self.health(timeout=min(1.0, self.settings.connect_timeout_s))
            raise self.error("connect" if status == "down" else "disconnect", exc) from exc

    async def health(self, timeout: float) -> tuple[EngineStatus, str | None]:
        """Probe ``GET /health``: ``ready`` on 200, ``down`` otherwise, with a short reason."""
        try:
            async with self.session.get(
                "http://engine/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    return "ready", None
                return "down", f"health status {resp.status}"
        except (aiohttp.ClientConnectorError, FileNotFoundError, ConnectionRefusedError):
            return "down", "connection refused"
        except asyncio.TimeoutError:
            return "down", "health timeout"
        except aiohttp.ClientError as exc:
            return "down", type(exc).__name__

    async def metrics_text(self, timeout: float) -> str:
        """The engine's Prometheus exposition text.

        Raises:
            aiohttp.ClientError, asyncio.TimeoutError: the engine did not answer in time.
        """
        async with self.session.get(
            "http://engine/metrics", timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            resp.raise_for_status()
            return await resp.text()
