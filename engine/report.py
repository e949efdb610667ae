"""What the launcher tells the outside world: systemd (sd_notify), the ready file, the status file.

Each channel fails soft: a write that fails is logged once and supervision goes on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from structlog.typing import FilteringBoundLogger

from engine.config import SuperviseConfig
from engine.status import RestartReason, StatusFile
from engine.systemd import SystemdNotifier


class Reporter:
    """The three channels of one launcher run.

    Args:
        supervise: ``[supervise]`` (``ready_file``, ``status_file``, ``stall_after_s``).
        notifier: systemd's notification socket (a no-op outside systemd).
        log: the launcher's logger (for the one warning per failing channel).
    """

    def __init__(
        self, supervise: SuperviseConfig, notifier: SystemdNotifier, log: FilteringBoundLogger
    ) -> None:
        self._supervise = supervise
        self._notifier = notifier
        self._log = log
        self._status = StatusFile(supervise.status_file, supervise.stall_after_s)
        self._failed: set[str] = set()

    def _once(self, channel: str, event: str, **fields: Any) -> None:
        if channel not in self._failed:
            self._failed.add(channel)
            self._log.warning(event, **fields)

    def notify(self, *assignments: str) -> None:
        """sd_notify(3) ``assignments`` (``READY=1``, ``STATUS=...``, ``WATCHDOG=1``)."""
        try:
            self._notifier.notify(*assignments)
        except OSError as exc:
            self._once("notify", "notify_failed", error=str(exc))

    def ready(self, ready: bool, pid: int | None = None) -> None:
        """Create (with ``pid``) or remove ``ready_file``, the gateway's warm-up signal."""
        path = self._supervise.ready_file
        if not path:
            return
        try:
            if ready:
                with open(path, "w") as handle:
                    handle.write(f"{pid}\n")
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._log.warning("ready_file_failed", path=path, error=exc.strerror)

    def status(self, **fields: Any) -> None:
        """Set ``fields`` of the status file (format in `engine.status`) and rewrite it."""
        self._write(self._status.update, **fields)

    def restart(self, reason: RestartReason, text: str) -> None:
        """Count one engine run ended for ``reason``; the state becomes ``exited``."""
        self._write(self._status.record_restart, reason, text)
        self.status(state="exited", detail=text)

    def _write(self, write: Callable[..., None], *args: Any, **fields: Any) -> None:
        try:
            write(*args, **fields)
        except OSError as exc:
            path = self._supervise.status_file
            self._once("status", "status_file_failed", path=path, error=exc.strerror)
