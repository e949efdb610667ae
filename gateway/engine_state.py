"""One engine's health as the gateway last saw it (`EngineState`), or the fleet's.

Set by the health poller (`gateway.engine_watch.poll_health`) and by the proxy when a request's
connection fails; read by the admission path (503 while not ready), ``/ready`` and the metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal

import structlog

from gateway.errors import RETRY_AFTER_DOWN_S, RETRY_AFTER_STARTING_S, EngineUnavailable
from gateway.metrics import Metrics

log = structlog.get_logger("gateway.upstream")

EngineStatus = Literal["starting", "warming", "ready", "down"]


class EngineState:
    """The engine's health as the poller last saw it (one engine's, or the fleet's).

    ``name``: the engine's name (its transitions are logged with it and set
    ``gateway_engine_status{engine}``); None for the fleet's state, which sets
    ``gateway_engine_up``/``gateway_engine_ready`` and with ``quiet`` logs nothing (its engines
    log their own transitions).

    States: ``starting`` (never answered yet), ``warming`` (answers ``/health`` but the launcher
    has not finished the warm-up request: ``engine.ready_file`` configured and absent),
    ``ready``, ``down`` (answered before and now proved down: `poll_health` gives the rule).
    """

    def __init__(
        self,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        *,
        name: str | None = None,
        quiet: bool = False,
    ) -> None:
        self.status: EngineStatus = "starting"
        self.since = clock()
        self.name = name
        self._quiet = quiet
        self._clock = clock
        self._metrics = metrics
        self._ready = asyncio.Event()
        # Called with (previous, new) status on every transition (the quarantine's deaths).
        self.listeners: list[Callable[[EngineStatus, EngineStatus], None]] = []
        self._gauges(0, 0)

    def _gauges(self, up: int, ready: int) -> None:
        """The fleet's (``name`` None: ``gateway_engine_up``/``_ready``) or one engine's
        (``gateway_engine_status{engine}``) gauges."""
        if self.name is None:
            self._metrics.engine_up.set(up)
            self._metrics.engine_ready.set(ready)
        else:
            self._metrics.engine_available.labels(self.name).set(ready)

    @property
    def ready(self) -> bool:
        """True when model requests may be sent."""
        return self.status == "ready"

    def set(self, status: EngineStatus, error: str | None = None) -> None:
        """Record a probe result; logs transitions (``engine_up``/``engine_down`` events)."""
        if status == self.status:
            return
        previous, self.status, self.since = self.status, status, self._clock()
        self._gauges(1 if status in ("ready", "warming") else 0, 1 if status == "ready" else 0)
        named = {"engine": self.name} if self.name is not None else {}
        if status == "ready":
            self._ready.set()
            if not self._quiet:
                log.info("engine_up", previous=previous, **named)
        else:
            self._ready.clear()
            event = "engine_down" if status == "down" else f"engine_{status}"
            if not self._quiet:
                log.warning(event, error=error, **named)
        for listener in self.listeners:
            listener(previous, status)

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
