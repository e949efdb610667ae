"""Watching the engine: the health poller that sets `EngineState`, and the drift check.

`poll_health` probes the engine's ``/health`` and decides when it is down; `check_drift` compares
the gateway's admitted requests with the engine's ``vllm:num_requests_running``. Both run as
background tasks of the app (`gateway.app`) and talk to the engine only through `Upstream`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import structlog
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import EngineSettings
from gateway.upstream import HEALTH_TIMEOUT, EngineState, Upstream, proves_down

log = structlog.get_logger("gateway.upstream")
events = structlog.get_logger("gateway")


async def poll_health(
    upstream: Upstream,
    state: EngineState,
    settings: Callable[[], EngineSettings],
    ready_file: Callable[[], str] | None = None,
    rotation: Callable[[bool, str | None], None] | None = None,
) -> None:
    """Probe the engine's /health every ``engine.health_interval_s`` seconds, forever.

    The rule for ``down``: a probe whose failure `proves_down` (socket missing or refusing, a
    non-200 answer) marks the engine down at once. Any other failure (a timeout, a dropped
    probe) marks a ready or warming engine down only when probes have kept failing, with no
    success between, for ``engine.unhealthy_after_s`` seconds counted from the start of the
    first failed probe, and at least two of them: a single slow probe never does. Until then
    each failure is logged as ``engine_probe_failed`` and the state is kept. Each probe waits
    ``max(1, engine.health_interval_s)`` seconds. ``settings`` returns the live ``[engine]``
    table (a reload changes the interval and the threshold); ``ready_file`` the engine's own
    warm-up marker (one of several engines), else ``engine.ready_file``.

    The rule for rotation (``rotation(in_rotation, reason)``, several engines): a probe with no
    answer after ``engine.rotation_timeout_s``, or a failed one, takes the engine out of
    rotation for new requests when nothing else came from it since the probe started
    (`Upstream.progress_at`: no byte of any answer). An idle engine answers ``/health`` at once,
    so silence means it hangs; a busy one whose streams still move is alive whatever its
    ``/health`` takes (a one-slot engine in a long prefill is out of rotation, but it is busy:
    nothing would be sent to it anyway). The first probe answered 200 puts it back.
    """
    failing_since: float | None = None
    failures = 0
    while True:
        engine = settings()
        started = time.monotonic()
        probe = asyncio.ensure_future(upstream.health(timeout=max(1.0, engine.health_interval_s)))
        try:
            if rotation is not None:
                await asyncio.wait({probe}, timeout=engine.rotation_timeout_s)
                if not probe.done() and upstream.progress_at < started:
                    rotation(False, HEALTH_TIMEOUT)
            status, error = await probe
        finally:
            probe.cancel()
        if rotation is not None:
            if status == "ready":
                rotation(True, None)
            elif upstream.progress_at < started:
                rotation(False, error)
        marker = ready_file() if ready_file is not None else engine.ready_file
        if status == "ready" and marker and not os.path.exists(marker):
            status = "warming"
        if status != "down" or proves_down(error) or state.status not in ("ready", "warming"):
            failing_since, failures = None, 0
        else:
            failing_since = started if failing_since is None else failing_since
            failures += 1
            failing_s = time.monotonic() - failing_since
            if failures < 2 or failing_s < engine.unhealthy_after_s:
                log.warning(
                    "engine_probe_failed", error=error, failures=failures, failing_s=failing_s
                )
                await asyncio.sleep(engine.health_interval_s)
                continue
        if status == "down" and state.status == "starting":
            status = "starting"
        state.set(status, error)
        await asyncio.sleep(engine.health_interval_s)


def engine_running(text: str) -> float | None:
    """``vllm:num_requests_running`` summed over engines, from a Prometheus exposition text.

    Raises:
        ValueError: the text is not the Prometheus text format.
    """
    total = None
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:num_requests_running":
            total = sum(sample.value for sample in family.samples)
    return total


async def check_drift(
    upstream: Upstream,
    state: EngineState,
    in_flight: Callable[[], int],
    interval_s: Callable[[], float],
) -> None:
    """Compare the gateway's in-flight count with the engine's running requests; log drift.

    The engine running more requests than the gateway admitted means generations nobody waits
    for (an abort that did not reach the engine); fewer, for two checks in a row, means a slot
    the gateway never released. Both are logged as ``inflight_drift`` for the operator.
    """
    previous = 0.0
    while True:
        await asyncio.sleep(interval_s())
        if not state.ready:
            continue
        text = await upstream.metrics_text(timeout=5.0)
        try:
            running = engine_running(text) if text is not None else None
        except ValueError:
            continue
        if running is None:
            continue
        admitted = in_flight()
        drift = admitted - running
        if drift and previous and (drift > 0) == (previous > 0):
            events.warning("inflight_drift", gateway_in_flight=admitted, engine_running=running)
        previous = drift
