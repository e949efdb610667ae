"""Supervision of the engine process: spawn, wait for /health, warm up, tell systemd, watch, stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from structlog.typing import FilteringBoundLogger

from engine.command import Launch
from engine.config import Settings
from engine.health import EngineClient
from engine.procgroup import ProcessGroup
from engine.progress import StallWatch, Verdict, parse_progress
from engine.report import Reporter
from engine.socketfile import SupervisorError, acquire_lock, remove_stale_socket
from engine.status import RestartReason
from engine.systemd import SystemdNotifier

# Margin added to the timeouts announced to systemd with EXTEND_TIMEOUT_USEC, in seconds.
_SYSTEMD_MARGIN_S = 10.0


def describe_exit(returncode: int) -> tuple[str, str | None]:
    """(text, signal name) for an exit status as asyncio reports it (negative = killed by signal)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"engine exited on signal {name}", name
    return f"engine exited with code {returncode}", None


def _usec(seconds: float) -> str:
    return str(int(seconds * 1_000_000))


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@dataclass(frozen=True)
class Failure:
    """Why a phase gave up on the engine: the restart reason counted and one sentence."""

    reason: RestartReason
    text: str


class Supervisor:
    """Runs one engine from spawn to exit; `run` returns the launcher's exit status.

    Lifecycle (DESIGN section 8), each step logged as one JSON event:

    1. ``spawn``: lock ``<socket>.lock``, remove a stale socket, start ``launch.argv`` in a new
       process group with its output passed through.
    2. ``healthy``: ``GET /health`` answers 200 within ``start_timeout_s`` (connection refused
       means still loading).
    3. ``warmup``: one short completion. A failure is logged and counted in ``ready`` but does
       not block readiness: the engine answers /health, so a request-level problem (wrong name,
       budget too short) would also hit the first user, and restarting would not fix it; a hung
       engine is caught by step 4.
    4. ``ready``: ``READY=1`` to systemd, then a probe every ``health_interval_s``; each 200
       sends ``WATCHDOG=1``. No 200 for ``unhealthy_after_s``: TERM the process group (with
       SIGCONT, as systemd.kill(5) does, so a stopped engine can act on it), KILL after
       ``stop_grace_s``, exit 1 so systemd restarts the unit. After each 200 the progress
       watchdog reads ``GET /metrics`` (`engine.progress`): a request running with no counter
       moving for ``stall_after_s`` is a hang, ended the same way.

    Every state change and every probe is written to ``status_file`` (`engine.status`), with a
    restart counted by reason whenever the engine run ends in a failure.

    The engine exiting by itself is exit 1 with its code or signal named. SIGTERM/SIGINT:
    ``STOPPING=1``, the same signal to the engine, KILL after ``stop_grace_s``; a second signal
    kills at once. Exit 0 when the engine stopped within the grace period, else 1.
    """

    def __init__(
        self,
        settings: Settings,
        launch: Launch,
        *,
        environ: Mapping[str, str],
        notifier: SystemdNotifier,
        log: FilteringBoundLogger,
    ) -> None:
        self._settings = settings
        self._launch = launch
        self._environ = environ
        self._log = log
        self._proc: asyncio.subprocess.Process | None = None
        self._group: ProcessGroup | None = None
        self._exited: asyncio.Future[int] | None = None
        self._stop: asyncio.Future[int] | None = None
        self._force: asyncio.Event | None = None
        self._spawned_at = 0.0
        self._start_deadline = 0.0
        self._warmup_failures = 0
        self._report = Reporter(settings.supervise, notifier, log)
        self._progress_readable: bool | None = None

    # -- plumbing -------------------------------------------------------------------------------

    def _on_signal(self, signum: int) -> None:
        assert self._stop is not None and self._force is not None
        if not self._stop.done():
            self._stop.set_result(signum)
        else:
            self._force.set()

    def _signal_group(self, signum: int) -> None:
        """Send ``signum`` to the engine's process group (the engine and its workers), never to
        a group that took the engine's pid after it was reaped (engine/procgroup.py)."""
        assert self._group is not None
        self._group.signal(signum)

    @property
    def _pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def _loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    # -- entry point ----------------------------------------------------------------------------

    async def run(self) -> int:
        """Supervise until the engine is gone; 0 after a requested stop, 1 on any failure."""
        loop = asyncio.get_running_loop()
        self._stop = loop.create_future()
        self._force = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        try:
            return await self._run()
        except SupervisorError as exc:
            self._log.error("start_refused", error=str(exc))
            self._report.notify(f"STATUS=not started: {exc}")
            self._report.restart("start_refused", str(exc))
            return 1
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)

    async def _run(self) -> int:
        engine = self._settings.engine
        lock = acquire_lock(engine.socket)
        try:
            if remove_stale_socket(engine.socket):
                self._log.info("stale_socket_removed", socket=engine.socket)
            self._report.ready(False)
            env, dropped = self._launch.environment(self._environ)
            if dropped:
                self._log.warning("env_dropped", names=list(dropped))
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *self._launch.argv,
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as exc:
                raise SupervisorError(f"cannot start {self._launch.argv[0]}: {exc}") from exc
            self._group = ProcessGroup.of(self._proc.pid)
            self._spawned_at = self._loop_time()
            self._start_deadline = self._spawned_at + self._settings.supervise.start_timeout_s
            self._exited = asyncio.ensure_future(self._proc.wait())
            self._log.info(
                "spawn",
                pid=self._pid,
                start_ticks=self._group.started,
                argv=list(self._launch.argv),
                env=dict(self._public_env()),
            )
            self._report.status(state="loading", engine_pid=self._pid, detail="loading the model")
            async with EngineClient(engine.socket) as client:
                for phase in (self._wait_healthy, self._warm_up):
                    code = await self._guard(phase(client))
                    if code is not None:
                        return code
                return await self._guard_final(self._watch(client))
        finally:
            self._report.ready(False)
            os.close(lock)

    def _public_env(self) -> Mapping[str, str]:
        """The variables the launcher sets, values shown only for the ``CUDA_*`` ones."""
        return {
            name: value if name.startswith("CUDA_") else "<set>"
            for name, value in self._launch.env.items()
        }

    async def _guard(self, phase: Coroutine[Any, Any, Failure | None]) -> int | None:
        """Run ``phase`` until it ends, the engine exits or a signal arrives.

        Returns None when the phase succeeded, else the launcher's exit status (after stopping
        or killing the engine as needed). A phase returns a `Failure` or None.
        """
        assert self._exited is not None and self._stop is not None
        task = asyncio.ensure_future(phase)
        pending: set[asyncio.Future[Any]] = {task, self._exited, self._stop}
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if self._stop.done():
            await _cancel(task)
            return await self._shutdown()
        if self._exited.done():
            await _cancel(task)
            return self._engine_exited()
        failure = task.result()
        if failure is None:
            return None
        return await self._terminate(failure)

    async def _guard_final(self, phase: Coroutine[Any, Any, Failure]) -> int:
        code = await self._guard(phase)
        assert code is not None  # _watch only returns with a failure reason
        return code

    # -- phases ---------------------------------------------------------------------------------

    async def _wait_healthy(self, client: EngineClient) -> Failure | None:
        supervise = self._settings.supervise
        self._report.notify(
            f"STATUS=loading the model (engine pid {self._pid})",
            "EXTEND_TIMEOUT_USEC="
            + _usec(supervise.start_timeout_s + supervise.stop_grace_s + _SYSTEMD_MARGIN_S),
        )
        last_state = ""
        while True:
            remaining = self._start_deadline - self._loop_time()
            if remaining <= 0:
                return Failure(
                    "start_timeout",
                    f"/health did not answer 200 within start_timeout_s "
                    f"({supervise.start_timeout_s:g} s)",
                )
            health = await client.health(min(supervise.probe_timeout_s, remaining))
            if health.healthy:
                after = self._loop_time() - self._spawned_at
                self._log.info("healthy", pid=self._pid, after_s=round(after, 3))
                return None
            if health.state != last_state:
                last_state = health.state
                self._log.info("waiting", state=health.state, detail=health.detail)
            remaining = self._start_deadline - self._loop_time()
            await asyncio.sleep(max(0.0, min(supervise.health_interval_s, remaining)))

    async def _warm_up(self, client: EngineClient) -> Failure | None:
        supervise = self._settings.supervise
        if not supervise.warmup:
            self._log.info("warmup", skipped=True)
            return None
        self._report.notify(f"STATUS=warming up (engine pid {self._pid})")
        self._report.status(state="warming", detail="one short completion before ready")
        budget = max(self._start_deadline - self._loop_time(), supervise.probe_timeout_s)
        result = await client.warm_up(
            self._settings.engine.served_model, supervise.warmup_max_tokens, budget
        )
        fields = {"duration_s": round(result.duration_s, 3), "status": result.status}
        if result.ok:
            self._log.info("warmup", ok=True, completion_tokens=result.completion_tokens, **fields)
        else:
            self._warmup_failures += 1
            self._log.warning("warmup", ok=False, detail=result.detail, **fields)
        return None

    async def _watch(self, client: EngineClient) -> Failure:
        supervise = self._settings.supervise
        engine = self._settings.engine
        warm = "warm" if self._warmup_failures == 0 else "warm-up failed"
        ready_detail = f"{engine.served_model} on {engine.socket} ({warm})"
        ready_status = f"STATUS=ready: {ready_detail}"
        self._report.notify("READY=1", ready_status)
        self._report.ready(True, self._pid)
        self._report.status(state="ready", detail=ready_detail)
        self._log.info(
            "ready",
            pid=self._pid,
            startup_s=round(self._loop_time() - self._spawned_at, 3),
            warmup_failures=self._warmup_failures,
            stall_after_s=supervise.stall_after_s,
        )
        watch = StallWatch(supervise.stall_after_s)
        last_ok = self._loop_time()
        failing = False
        while True:
            deadline = last_ok + supervise.unhealthy_after_s
            timeout = max(0.05, min(supervise.probe_timeout_s, deadline - self._loop_time()))
            health = await client.health(timeout)
            now = self._loop_time()
            if health.healthy:
                if failing:
                    failing = False
                    self._log.info("recovered", pid=self._pid, after_s=round(now - last_ok, 3))
                    self._report.notify(ready_status)
                    self._report.ready(True, self._pid)
                    self._report.status(state="ready", detail=ready_detail)
                last_ok = now
                self._report.notify("WATCHDOG=1")
                verdict = await self._read_progress(client, watch)
                if verdict.hung:
                    text = watch.describe(verdict)
                    self._log.error("hung", pid=self._pid, detail=text)
                    return Failure("hang", f"hung: {text}")
            else:
                silent = now - last_ok
                if not failing:
                    failing = True
                    self._log.warning(
                        "unhealthy",
                        pid=self._pid,
                        state=health.state,
                        detail=health.detail,
                        since_healthy_s=round(silent, 3),
                    )
                    self._report.notify(f"STATUS=unhealthy: {health.state} ({health.detail})")
                    self._report.ready(False)
                    self._report.status(
                        state="unhealthy", detail=f"{health.state}: {health.detail}"
                    )
                if silent >= supervise.unhealthy_after_s:
                    return Failure(
                        "unhealthy",
                        f"no healthy /health answer for {silent:.1f} s (unhealthy_after_s "
                        f"{supervise.unhealthy_after_s:g}); last probe: {health.state}",
                    )
            wait = min(supervise.health_interval_s, last_ok + supervise.unhealthy_after_s - now)
            await asyncio.sleep(max(0.0, wait))

    async def _read_progress(self, client: EngineClient, watch: StallWatch) -> Verdict:
        """One ``/metrics`` read fed to the watchdog; logs when the counters become unreadable
        or readable again, and writes the reading to the status file."""
        text = await client.metrics(self._settings.supervise.probe_timeout_s)
        progress = parse_progress(text) if text is not None else None
        verdict = watch.observe(self._loop_time(), progress)
        readable = progress is not None
        if readable != self._progress_readable:
            if readable:
                self._log.info("progress_readable", pid=self._pid)
            else:
                why = "no answer" if text is None else "no vllm:num_requests_running series"
                self._log.warning("progress_unreadable", pid=self._pid, detail=why)
            self._progress_readable = readable
        self._report.status(
            running=progress.running if progress is not None else None,
            stalled_s=round(verdict.stalled_s, 3),
        )
        return verdict

    # -- endings --------------------------------------------------------------------------------

    async def _kill(self, first: int, interrupt: Awaitable[Any]) -> list[str]:
        """Send ``first`` (and SIGCONT) to the group, then SIGKILL after ``stop_grace_s`` or as
        soon as ``interrupt`` completes; returns the signal names sent, in order."""
        assert self._exited is not None
        sent = [signal.Signals(first).name]
        self._signal_group(first)
        self._signal_group(signal.SIGCONT)
        waiter = asyncio.ensure_future(interrupt)
        await asyncio.wait(
            {self._exited, waiter},
            timeout=self._settings.supervise.stop_grace_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        await _cancel(waiter)
        if not self._exited.done():
            sent.append("SIGKILL")
            self._signal_group(signal.SIGKILL)
            await self._exited
        # Workers that outlived the engine's main process hold GPU memory: reap them.
        self._signal_group(signal.SIGKILL)
        return sent

    async def _terminate(self, failure: Failure) -> int:
        """Kill an engine that failed a phase (hung, unhealthy, never healthy); exit status 1."""
        assert self._exited is not None and self._stop is not None
        reason = failure.text
        self._log.error("killing", pid=self._pid, cause=failure.reason, reason=reason)
        self._report.notify(f"STATUS=killing the engine: {reason}")
        self._report.ready(False)
        self._report.status(state="killing", detail=reason)
        sent = await self._kill(signal.SIGTERM, asyncio.shield(self._stop))
        text, signame = describe_exit(self._exited.result())
        self._log.error(
            "killed",
            pid=self._pid,
            cause=failure.reason,
            reason=reason,
            signals=sent,
            exit=text,
            signal=signame,
        )
        self._report.restart(failure.reason, reason)
        return 1

    def _engine_exited(self) -> int:
        """The engine ended without being asked: log how, reap its group, exit status 1."""
        assert self._exited is not None
        returncode = self._exited.result()
        text, signame = describe_exit(returncode)
        self._signal_group(signal.SIGKILL)
        self._log.error("exited", pid=self._pid, returncode=returncode, signal=signame, reason=text)
        self._report.notify(f"STATUS={text}")
        self._report.restart("exited", text)
        return 1

    async def _shutdown(self) -> int:
        """First SIGTERM/SIGINT: pass it on, wait ``stop_grace_s``, then kill."""
        assert self._exited is not None and self._stop is not None and self._force is not None
        signum = self._stop.result()
        name = signal.Signals(signum).name
        grace = self._settings.supervise.stop_grace_s
        self._report.notify(
            "STOPPING=1",
            f"STATUS=stopping ({name})",
            "EXTEND_TIMEOUT_USEC=" + _usec(grace + _SYSTEMD_MARGIN_S),
        )
        self._log.info("stopping", pid=self._pid, signal=name, grace_s=grace)
        self._report.status(state="stopping", detail=f"stopping on {name}")
        if self._exited.done():
            sent: list[str] = []
        else:
            sent = await self._kill(signum, self._force.wait())
        returncode = self._exited.result()
        text, signame = describe_exit(returncode)
        forced = "SIGKILL" in sent
        log = self._log.warning if forced else self._log.info
        log(
            "exited",
            pid=self._pid,
            returncode=returncode,
            signal=signame,
            signals=sent,
            reason=text,
        )
        self._report.status(state="stopped", detail=text)
        return 1 if forced else 0
