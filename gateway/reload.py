"""Hot reload of the TOML config and the keys file, on SIGHUP and on change, all or nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import Any

import structlog

from gateway.config import ConfigError, Settings, load_settings
from gateway.keys import KeySet, KeysFileError, load_keys_file
from gateway.metrics import Metrics

# Settings read once when listeners and watchers start; a reload that changes them logs
# `reload_needs_restart` naming the key and keeps running with the old value.
RESTART_ONLY = (
    "server.host",
    "server.port",
    "metrics.enabled",
    "metrics.host",
    "metrics.port",
    "auth.keys_file",
    "auth.reload_poll_s",
)
# After a change is seen, wait this long for the file to stop changing before reading it, so
# a writer caught mid-write is not reported as a broken file.
SETTLE_S = 0.05
SETTLE_ROUNDS = 20

Signature = tuple[int, int, int, int, int]


def file_signature(path: str) -> Signature | None:
    """``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of ``path``, None when absent.

    A rename over the file changes the inode; an in-place edit changes size or times. A path that
    cannot be stat'ed counts as absent; the reload that follows reports why it cannot be read.
    """
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _setting(settings: Settings, dotted: str) -> Any:
    section, _, key = dotted.partition(".")
    return getattr(getattr(settings, section), key)


class Reloader:
    """Watches the config and keys files and hands validated replacements to ``on_reload``.

    Both files are read and validated whole before ``on_reload(settings, keys)`` is called once;
    any problem leaves what is in force untouched, logs ``reload_failed`` with every problem
    (``path:line: message``) and counts ``gateway_config_reloads_total{result="error"}``. Success
    logs ``reload_ok``, counts ``result="ok"`` and sets ``gateway_keys_loaded``. A file that is
    deleted is an error (the previous one stays in force); it is retried when it reappears.

    Changes are found by polling ``os.stat`` every ``poll_s`` (DESIGN section 4: within 2 s) and
    on `trigger` (call it from the SIGHUP handler). Use from an aiohttp ``cleanup_ctx``:
    ``await reloader.start()``, ``yield``, ``await reloader.stop()``; start right after the
    initial load so the signatures recorded match what was loaded.

    Args:
        config_path: the TOML file to reload, or None when settings come from no file (they then
            stay as ``settings``).
        keys_path: the keys file (``auth.keys_file`` at startup).
        poll_s: seconds between stat checks (``auth.reload_poll_s``).
        on_reload: called in the event loop with the new settings and keys; must swap them in
            without blocking. An exception from it counts as a failed reload.
        metrics: where ``config_reloads`` and ``keys_loaded`` live.
        logger: structlog logger; default ``structlog.get_logger("gateway.reload")``.
        settings: the settings in force now (compared against for `RESTART_ONLY` keys); default
            loaded from ``config_path``.

    Raises:
        ConfigError: ``settings`` is None and ``config_path`` does not load.
    """

    def __init__(
        self,
        config_path: str | None,
        keys_path: str,
        poll_s: float,
        on_reload: Callable[[Settings, KeySet], None],
        metrics: Metrics,
        logger: Any = None,
        *,
        settings: Settings | None = None,
    ) -> None:
        self._config_path = config_path
        self._keys_path = keys_path
        self._poll_s = poll_s
        self._on_reload = on_reload
        self._metrics = metrics
        self._log = logger if logger is not None else structlog.get_logger("gateway.reload")
        if settings is None:
            settings = load_settings(config_path) if config_path else Settings()
        self._started_with = settings
        self._current = settings
        self._seen: tuple[Signature | None, Signature | None] = (None, None)
        self._config_existed = False
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def _signatures(self) -> tuple[Signature | None, Signature | None]:
        config = file_signature(self._config_path) if self._config_path else None
        return config, file_signature(self._keys_path)

    async def start(self) -> None:
        """Record the files' current state and start watching."""
        self._seen = self._signatures()
        self._config_existed = self._seen[0] is not None
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="gateway-reload")

    async def stop(self) -> None:
        """Stop watching; a reload in progress is abandoned and nothing is swapped."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def trigger(self) -> None:
        """Ask for a reload now, whether or not the files changed (the SIGHUP handler)."""
        self._wake.set()

    async def _watch(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._poll_s)
            if self._wake.is_set():
                self._wake.clear()
                await self.reload("signal")
            elif self._signatures() != self._seen:
                await self._settle()
                await self.reload("change")

    async def _settle(self) -> None:
        """Wait until the files stop changing (bounded by SETTLE_S * SETTLE_ROUNDS)."""
        before = self._signatures()
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(SETTLE_S)
            now = self._signatures()
            if now == before:
                return
            before = now

    async def reload(self, trigger: str = "manual") -> bool:
        """Read, validate and apply both files now.

        Args:
            trigger: why (``signal``, ``change``, ``manual``), for the log.

        Returns:
            True when the new settings and keys are in force, False when the old ones stay.
        """
        async with self._lock:
            signatures = self._signatures()
            self._seen = signatures
            try:
                settings, keys = await asyncio.to_thread(self._load, signatures[0] is None)
            except KeysFileError as exc:
                return self._failed(trigger, exc.problems)
            except ConfigError as exc:
                return self._failed(trigger, [str(exc)])
            try:
                self._on_reload(settings, keys)
            except Exception as exc:  # any failure to apply keeps the old state
                return self._failed(trigger, [f"applying the reload failed: {type(exc).__name__}"])
            self._current = settings
            if signatures[0] is not None:
                self._config_existed = True
            self._metrics.config_reloads.labels("ok").inc()
            self._metrics.keys_loaded.set(keys.key_count)
            self._log.info(
                "reload_ok",
                trigger=trigger,
                config=self._config_path,
                keys_file=self._keys_path,
                keys=keys.key_count,
                signing_keys=len(keys.signing_keys),
            )
            for dotted in RESTART_ONLY:
                if _setting(settings, dotted) != _setting(self._started_with, dotted):
                    self._log.warning("reload_needs_restart", key=dotted, config=self._config_path)
            return True

    def _load(self, config_missing: bool) -> tuple[Settings, KeySet]:
        """Both files, validated (runs in a worker thread: file reads and key parsing)."""
        if self._config_path is None:
            settings = self._current
        elif config_missing and self._config_existed:
            raise ConfigError(f"{self._config_path}: no such file (it existed before)")
        else:
            settings = load_settings(self._config_path)
        return settings, load_keys_file(self._keys_path)

    def _failed(self, trigger: str, problems: list[str]) -> bool:
        self._metrics.config_reloads.labels("error").inc()
        self._log.error(
            "reload_failed",
            trigger=trigger,
            config=self._config_path,
            keys_file=self._keys_path,
            problems=problems,
        )
        return False
