"""Hot reload of the TOML config and the keys file, on SIGHUP and on change, all or nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from gateway.config import ConfigError, Settings, load_settings
from gateway.credentials import KeySet, KeysFileError
from gateway.keys_file import empty_keys_problem, load_keys_file
from gateway.metrics import Metrics

# Settings read once when listeners and watchers start; a reload that changes them logs
# `reload_needs_restart` naming the key and keeps running with the old value.
RESTART_ONLY = (
    "server.host",
    "server.port",
    "server.tls_cert_file",
    "server.tls_key_file",
    "server.plain_http",
    "metrics.enabled",
    "metrics.host",
    "metrics.port",
    "metrics.tls_cert_file",
    "metrics.tls_key_file",
    "auth.keys_file",
    "auth.reload_poll_s",
    "engine.socket",
    "engine.connect_timeout_s",
    "engine.pool_idle_s",
    "ledger.postgres_dsn",
    "ledger.ship_interval_s",
    "fleet.redis_url",
    "fleet.key_prefix",
    "fleet.gateway_id",
    "fleet.lease_ttl_s",
    "fleet.sync_interval_s",
    "fleet.redis_timeout_s",
)
# After a change is seen, wait this long for the file to stop changing before reading it, so
# a writer caught mid-write is not reported as a broken file.
SETTLE_S = 0.05
SETTLE_ROUNDS = 20

# The longest a file call (stat, open, read) may take before the path counts as blocked (a hung
# network mount). The call's thread is left behind; no other file call starts until it returns.
FILE_CALL_TIMEOUT_S = 5.0

Signature = tuple[int, int, int, int, int]
_T = TypeVar("_T")


class FileBlocked(Exception):
    """A file call did not return within `FILE_CALL_TIMEOUT_S` (or an earlier one still hangs)."""


class BlockingCalls:
    """Runs blocking file calls one at a time in daemon threads, each with a time limit.

    A call that does not return in ``timeout_s`` raises `FileBlocked` in the caller while its
    thread is left to finish on its own; until it does, every new call fails at once with
    `FileBlocked` instead of starting another thread that would hang the same way. The threads
    are daemon threads, so a hung one never delays the process's exit (unlike the loop's default
    executor, which `asyncio.run` joins at shutdown).
    """

    def __init__(self, timeout_s: float = FILE_CALL_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._stuck: threading.Thread | None = None

    @property
    def blocked(self) -> bool:
        """True while an earlier call that timed out has still not returned."""
        if self._stuck is not None and not self._stuck.is_alive():
            self._stuck = None
        return self._stuck is not None

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in a daemon thread; its result, or its exception re-raised here.

        Raises:
            FileBlocked: the call took longer than ``timeout_s``, or an earlier one still hangs.
        """
        if self.blocked:
            raise FileBlocked("an earlier file read still has not returned")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()

        def deliver(result: Any, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def work() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the caller, whatever it is
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(deliver, result, error)

        thread = threading.Thread(target=work, name="gateway-file-io", daemon=True)
        thread.start()
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            self._stuck = thread
            raise FileBlocked(f"a file read took longer than {self.timeout_s:g} s") from None


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

    A reload is refused as well (same log and count) when the new keys file holds no API key and
    no signing key while ``auth.allow_empty_keys`` is false, which is what an in-place rewrite
    (``cat > file``) shows for a moment, and when it no longer sets a reserved ``QWEN38_*`` setting
    the keys in force set (the metrics token of a truncated file): such settings are removed by a
    restart, never by a reload.

    Every file call (stat, open, read) runs in a daemon thread with a time limit (`BlockingCalls`),
    and the keys file is opened non-blocking and refused unless it is a regular file, so a FIFO,
    socket, directory or hung mount at a watched path is reported as a failed reload and never
    stops the watcher, SIGHUP handling or shutdown.

    Changes are found by polling ``os.stat`` every ``poll_s`` (a rotation applies within 2 s by default) and
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
        self._calls = BlockingCalls()
        self._keys: KeySet | None = None
        self._blocked_reported = False

    def _stat_both(self) -> tuple[Signature | None, Signature | None]:
        config = file_signature(self._config_path) if self._config_path else None
        return config, file_signature(self._keys_path)

    async def _signatures(self) -> tuple[Signature | None, Signature | None]:
        return await self._calls.run(self._stat_both)

    async def start(self) -> None:
        """Record the files' current state and the keys in force, and start watching."""
        try:
            self._seen = await self._signatures()
            self._keys = await self._calls.run(load_keys_file, self._keys_path)
        except (FileBlocked, KeysFileError):
            pass  # the first reload reports it
        self._config_existed = self._seen[0] is not None
        keys = self._keys
        if keys is not None and empty_keys_problem(keys, self._keys_path, allow_empty=False):
            self._log.warning(
                "keys_empty",
                keys_file=self._keys_path,
                allowed=self._current.auth.allow_empty_keys,
            )
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="gateway-reload")

    async def stop(self) -> None:
        """Stop watching; a reload in progress is abandoned and nothing is swapped.

        The cancellation is repeated until the task ends: on Python 3.11 ``asyncio.wait_for``
        can swallow a cancellation that lands as its inner wait completes (CPython gh-86296),
        and the watcher would then poll on while ``stop`` waited for it forever.
        """
        if self._task is not None:
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=0.1)
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
                continue
            try:
                changed = await self._signatures() != self._seen
                if changed:
                    await self._settle()
            except FileBlocked as exc:
                if not self._blocked_reported:  # once per episode, not on every poll
                    self._blocked_reported = True
                    self._failed("change", [f"{self._keys_path}: {exc}"])
                continue
            self._blocked_reported = False
            if changed:
                await self.reload("change")

    async def _settle(self) -> None:
        """Wait until the files stop changing (bounded by SETTLE_S * SETTLE_ROUNDS)."""
        before = await self._signatures()
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(SETTLE_S)
            now = await self._signatures()
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
            try:
                signatures = await self._signatures()
                self._seen = signatures
                settings, keys = await self._calls.run(self._load, signatures[0] is None)
            except FileBlocked as exc:
                return self._failed(trigger, [f"{self._keys_path}: {exc}"])
            except KeysFileError as exc:
                return self._failed(trigger, exc.problems)
            except ConfigError as exc:
                return self._failed(trigger, [str(exc)])
            problems = self._refusals(settings, keys)
            if problems:
                return self._failed(trigger, problems)
            try:
                self._on_reload(settings, keys)
            except Exception as exc:  # any failure to apply keeps the old state
                return self._failed(trigger, [f"applying the reload failed: {type(exc).__name__}"])
            self._current = settings
            self._keys = keys
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

    def _refusals(self, settings: Settings, keys: KeySet) -> list[str]:
        """Why a valid new key set must still not replace the one in force (empty list: none)."""
        problems = []
        empty = empty_keys_problem(
            keys, self._keys_path, allow_empty=settings.auth.allow_empty_keys
        )
        if empty is not None:
            problems.append(
                f"{empty}; the keys in force stay. Set auth.allow_empty_keys = true to run with none"
            )
        if self._keys is not None:
            for name in sorted(self._keys.settings):
                if keys.setting(name) is None:
                    problems.append(
                        f"{self._keys_path}: {name} is no longer set (a truncated file?); the "
                        "value in force stays. Reserved settings are removed by a restart"
                    )
        return problems

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
