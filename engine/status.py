"""The launcher's status file: its state, the watchdog's reading and restart counters, as JSON.

The launcher has no network listener (its container runs with ``--network none``), so it writes
what monitoring needs to ``supervise.status_file`` (in ``/run/qwen38`` next to the engine
socket), replaced atomically on every change and every probe. The gateway's metrics listener
reads it at each scrape and exports it as ``qwen38_engine_*`` series; ``jq`` reads it too.

Format (``"format": 1``; keys are only ever added):

.. code-block:: text

    format          1
    updated_at      Unix time of this write, seconds (float)
    launcher_pid    the launcher's pid (in its own PID namespace when containerised)
    engine_pid      the engine's pid, null before the spawn
    state           starting | loading | warming | ready | unhealthy | killing | stopping |
                    stopped | exited
    detail          one sentence on the state (why it is unhealthy, stalled, killed ...)
    running         vllm:num_requests_running at the last successful /metrics read, or null
    stalled_s       seconds a request has been running with no progress (0 when moving or idle)
    stall_after_s   the watchdog's threshold in seconds (0: the verdict is off)
    hangs_total     hangs the progress watchdog detected (each ended the engine)
    restarts_total  {reason: count} engine runs ended by the launcher or by the engine itself,
                    each followed by a restart of the unit: hang, unhealthy, exited,
                    start_timeout, start_refused
    last_restart    {"reason", "detail", "at"} of the latest, or null

Counters survive launcher restarts: a new launcher reads the previous file and continues from
its counts. ``/run`` is a tmpfs, so they start from zero after a reboot, which Prometheus
handles as a counter reset.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

STATUS_FORMAT = 1

RestartReason = Literal["hang", "unhealthy", "exited", "start_timeout", "start_refused"]
RESTART_REASONS: tuple[RestartReason, ...] = (
    "hang",
    "unhealthy",
    "exited",
    "start_timeout",
    "start_refused",
)
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


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def read_status(path: str) -> dict[str, Any] | None:
    """The parsed status file, or None when it is absent, unreadable or of another format."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != STATUS_FORMAT:
        return None
    return data


class StatusFile:
    """Writes the status file; with an empty path every call is a no-op.

    Args:
        path: ``supervise.status_file``.
        stall_after_s: reported as is.
        clock: Unix time in seconds (`time.time`).
    """

    def __init__(
        self, path: str, stall_after_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self._path = path
        self._clock = clock
        previous = read_status(path) if path else None
        restarts = previous.get("restarts_total") if previous else None
        restarts = restarts if isinstance(restarts, dict) else {}
        self._data: dict[str, Any] = {
            "format": STATUS_FORMAT,
            "updated_at": clock(),
            "launcher_pid": os.getpid(),
            "engine_pid": None,
            "state": "starting",
            "detail": "",
            "running": None,
            "stalled_s": 0.0,
            "stall_after_s": stall_after_s,
            "hangs_total": _count(previous.get("hangs_total")) if previous else 0,
            "restarts_total": {reason: _count(restarts.get(reason)) for reason in RESTART_REASONS},
            "last_restart": previous.get("last_restart") if previous else None,
        }

    @property
    def data(self) -> Mapping[str, Any]:
        """The current content (what the last write put in the file)."""
        return self._data

    def update(self, **fields: Any) -> None:
        """Set ``fields`` (keys of the format above) and rewrite the file.

        Raises:
            OSError: the file cannot be written (the caller logs it; supervision goes on).
        """
        if "state" in fields and fields["state"] not in STATES:
            raise ValueError(f"unknown state {fields['state']!r}")
        self._data.update(fields)
        self._write()

    def record_restart(self, reason: RestartReason, detail: str) -> None:
        """Count one engine run ended for ``reason`` (and a hang), then rewrite the file."""
        self._data["restarts_total"][reason] += 1
        if reason == "hang":
            self._data["hangs_total"] += 1
        self._data["last_restart"] = {"reason": reason, "detail": detail, "at": self._clock()}
        self._write()

    def _write(self) -> None:
        if not self._path:
            return
        self._data["updated_at"] = self._clock()
        temporary = f"{self._path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                json.dump(self._data, handle, sort_keys=True)
                handle.write("\n")
            os.replace(temporary, self._path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
