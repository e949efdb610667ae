"""The launcher's status file as ``qwen38_engine_*`` series in the gateway's scrape.

The launcher (``qwen38-engine serve``) runs without a network and writes its state, its progress
watchdog's reading and its restart counters to a JSON file (format 1, defined by the launcher;
each ``[[engines]]`` table's ``launcher_status_file``, or ``engine.launcher_status_file`` of the
lone engine, points at it). This collector reads every engine's file at each scrape, each as
series labelled with its engine; a missing or unreadable file gives no series for that engine
(its launcher may not have started).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

STATUS_FORMAT = 1
# Bounded label values: anything else in the file is not exported.
RESTART_REASONS = ("hang", "unhealthy", "exited", "start_timeout", "start_refused")
STATES = (
    "starting",
    "loading",
    "warming",
    "ready",
    "unhealthy",
    "killing",
    "stopping",
    "stopped",
    "exited",
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def read_launcher_status(path: str) -> dict[str, Any] | None:
    """The status file's object, or None when absent, unreadable, not JSON or another format."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != STATUS_FORMAT:
        return None
    return data


HANG_RECENT_S = 60.0
"""A hang restart this recent (seconds) is the death a request just saw."""


def killed_for_hang(path: str, now: float) -> bool:
    """True when the launcher is killing the engine for a hang, or restarted it for one within
    `HANG_RECENT_S` of ``now`` (Unix seconds): the death a request just saw was a hang.

    The launcher writes ``state: killing`` with a ``detail`` starting ``hung`` before it
    signals the engine, and ``last_restart: {"reason": "hang", "at": ...}`` once it ended.
    """
    data = read_launcher_status(path) if path else None
    if data is None:
        return False
    if data.get("state") == "killing" and str(data.get("detail") or "").startswith("hung"):
        return True
    last = data.get("last_restart")
    if isinstance(last, dict) and last.get("reason") == "hang":
        at = _number(last.get("at"))
        return at is not None and 0 <= now - at <= HANG_RECENT_S
    return False


class LauncherStatusCollector(Collector):
    """Exports each engine's status file, as named by ``paths()``: (engine name, path) pairs,
    read at each collect ("" or an unusable file: no series for that engine).

    Families, each labelled ``engine`` (the configured names: each ``[[engines]]`` table's
    ``launcher_status_file``, or ``[engine] launcher_status_file`` for the lone engine
    ``default``): ``qwen38_engine_restarts_total{engine,reason}`` (engine runs ended by a
    failure, each followed by a restart of the unit), ``qwen38_engine_hangs_total`` (hangs the
    progress watchdog found), ``qwen38_engine_stalled_seconds`` (a request running with no token
    or request counter moving, 0 when moving or idle),
    ``qwen38_engine_launcher_state{engine,state}`` (1 for the current state),
    ``qwen38_engine_launcher_updated_timestamp_seconds``.
    """

    def __init__(self, paths: Callable[[], Sequence[tuple[str, str]]]) -> None:
        self._paths = paths

    def collect(self) -> Iterator[Metric]:
        """The families above; none when no engine's file can be used."""
        found = [
            (name, read_launcher_status(path) if path else None) for name, path in self._paths()
        ]
        statuses = [(name, data) for name, data in found if data is not None]
        if not statuses:
            return
        restarts = CounterMetricFamily(
            "qwen38_engine_restarts",
            "Engine runs ended by a failure (each followed by a restart), by reason.",
            labels=["engine", "reason"],
        )
        hangs = CounterMetricFamily(
            "qwen38_engine_hangs",
            "Hangs found by the launcher's progress watchdog (a request running, no progress).",
            labels=["engine"],
        )
        stalled = GaugeMetricFamily(
            "qwen38_engine_stalled_seconds",
            "Seconds a request has been running with no engine counter moving (0 when moving).",
            labels=["engine"],
        )
        state = GaugeMetricFamily(
            "qwen38_engine_launcher_state",
            "The launcher's state: 1 for the current one.",
            labels=["engine", "state"],
        )
        updated = GaugeMetricFamily(
            "qwen38_engine_launcher_updated_timestamp_seconds",
            "Unix time of the launcher's last status write.",
            labels=["engine"],
        )
        for engine, data in statuses:
            counts = data.get("restarts_total")
            counts = counts if isinstance(counts, dict) else {}
            for reason in RESTART_REASONS:
                restarts.add_metric([engine, reason], _number(counts.get(reason)) or 0.0)
            hangs.add_metric([engine], _number(data.get("hangs_total")) or 0.0)
            stalled.add_metric([engine], _number(data.get("stalled_s")) or 0.0)
            for name in STATES:
                state.add_metric([engine, name], 1.0 if data.get("state") == name else 0.0)
            at = _number(data.get("updated_at"))
            if at is not None:
                updated.add_metric([engine], at)
        yield from (restarts, hangs, stalled, state)
        if updated.samples:
            yield updated
