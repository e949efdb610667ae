"""The engines behind one gateway: each one's session, health and rotation, and the fleet's sum.

`Engines` holds, per configured engine (`gateway.config.EngineSpec`), its `Upstream` (created when
the app starts) and its `EngineState` (set by its own health poller and by the proxy when a
request's connection fails). An engine is in the admission queue's rotation
(`AdmissionQueue.set_ready`) while it is ready and not stalled (`gateway.failover.Rotation`: a
slow or failed probe with nothing else from the engine). A change of its state counts a death
for the requests that were at it (and, for an engine that hangs, ends its answers)
(`gateway.quarantine`, per engine), forgets the sessions it held (its prefix cache died with it),
and sets the fleet's state: ready while any engine is ready (`/ready`, ``gateway_engine_up``,
the 503 of a request that finds no engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Sequence

from gateway.admission import AdmissionQueue
from gateway.affinity import Affinity
from gateway.config import EngineSettings, EngineSpec
from gateway.engine_watch import poll_health
from gateway.failover import DOWN, Rotation
from gateway.metrics import Metrics
from gateway.quarantine import Quarantine
from gateway.upstream import EngineState, EngineStatus, Upstream, UpstreamAnswer

_ORDER: dict[EngineStatus, int] = {"ready": 0, "warming": 1, "down": 2, "starting": 3}


class Engines:
    """The configured engines, by name, in the config's order.

    Args:
        specs: `Settings.engine_specs`.
        metrics: per-engine families (``engine`` label bounded to ``specs``' names).
        clock: monotonic seconds.
        overall: the fleet's state (the app's ``ENGINE_STATE``); set from the engines' states.
        queue: the admission queue whose rotation follows the engines' health.
        quarantine: deaths are counted per engine.
    """

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        metrics: Metrics,
        clock: Callable[[], float],
        overall: EngineState,
        queue: AdmissionQueue,
        quarantine: Quarantine,
    ) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.states = {spec.name: EngineState(metrics, clock, name=spec.name) for spec in specs}
        self.upstreams: dict[str, Upstream] = {}
        self.affinity = Affinity()
        self.rotation = Rotation(self._place)
        self.overall = overall
        self._queue = queue
        self._quarantine = quarantine
        self._metrics = metrics
        self._tasks: list[asyncio.Task[None]] = []
        self._settings: Callable[[], EngineSettings] | None = None
        metrics.prime_engines(self.specs)
        metrics.engine_slots.source = lambda: [
            (e.name, e.slots, e.in_flight, e.ready) for e in queue.engines.values()
        ]
        for name, state in self.states.items():
            state.listeners.append(functools.partial(self._changed, name))
            queue.set_ready(name, False)  # in rotation once its poller finds it ready

    @property
    def names(self) -> list[str]:
        """The engines' names, in the config's order."""
        return list(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def upstream(self, name: str | None) -> Upstream:
        """The session of engine ``name`` (the first engine's for None or an unknown name)."""
        found = self.upstreams.get(name) if name is not None else None
        return found if found is not None else next(iter(self.upstreams.values()))

    def state(self, name: str | None) -> EngineState:
        """The state of engine ``name`` (the fleet's for None or an unknown name)."""
        found = self.states.get(name) if name is not None else None
        return found if found is not None else self.overall

    def in_rotation(self, name: str) -> bool:
        """True while new requests may be placed on engine ``name`` (ready, not stalled)."""
        slots = self._queue.engines.get(name)
        return slots is not None and slots.ready

    def elsewhere(self, name: str | None) -> bool:
        """True when a request granted engine ``name`` should go to another one: ``name`` is
        out of rotation (not ready, or stalled) while another engine is in."""
        if name is None or self.in_rotation(name):
            return False
        return not self.states[name].ready or any(self.in_rotation(n) for n in self.specs)

    def counter(self, prefer: str | None = None) -> Upstream:
        """The session to ask for a prompt count (``/tokenize``, no slot needed): engine
        ``prefer`` (the request's engine, or its session's) while in rotation, else the first
        engine in rotation, else the first ready one, else ``prefer`` or the first engine."""
        if prefer is not None and prefer in self.upstreams and self.in_rotation(prefer):
            return self.upstreams[prefer]
        for test in (self.in_rotation, lambda n: self.states[n].ready):
            for name in self.upstreams:
                if test(name):
                    return self.upstreams[name]
        return self.upstream(prefer)

    async def post(
        self,
        name: str | None,
        path: str,
        body: bytes,
        request_id: str,
        *,
        stream: bool,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamAnswer:
        """POST to engine ``name``: with several engines the wait for the first byte ends when
        the engine fails meanwhile (`gateway.failover.Rotation.post`), and an answer from a
        stalled engine puts it back in rotation at once (a one-slot engine whose ``/health``
        lagged behind a non-streamed request sends nothing until it is done). ``sent``: see
        `Upstream.post`."""
        upstream = self.upstream(name)
        if len(self.specs) < 2:
            return await upstream.post(path, body, request_id, stream=stream, sent=sent)
        answer = await self.rotation.post(
            upstream, path, body, request_id, stream=stream, sent=sent
        )
        self.rotation.set(upstream.name, True, None)
        return answer

    def start(self, settings: Callable[[], EngineSettings]) -> None:
        """Open each engine's session and start its health poller (in the running loop)."""
        self._settings = settings
        for name, spec in self.specs.items():
            upstream = Upstream(settings(), self._metrics, spec)
            self.upstreams[name] = upstream
            ready_file = functools.partial(lambda s: s.ready_file, spec)
            # One engine has nowhere else to send a request: its rotation is its health.
            rotation = functools.partial(self.rotation.set, name) if len(self.specs) > 1 else None
            self._tasks.append(
                asyncio.create_task(
                    poll_health(upstream, self.states[name], settings, ready_file, rotation)
                )
            )

    def reconfigure(self, settings: EngineSettings) -> None:
        """A reload's engine settings for every engine's next requests (``read_timeout_s`` and
        the rest `Upstream.post` reads per request); its connections keep their socket, connect
        timeout and idle time (`gateway.reload.RESTART_ONLY`)."""
        for upstream in self.upstreams.values():
            upstream.settings = settings

    async def close(self) -> None:
        """Stop the pollers and close every session."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for upstream in self.upstreams.values():
            await upstream.close()

    def _changed(self, name: str, previous: EngineStatus, status: EngineStatus) -> None:
        """One engine's state changed: rotation, quarantine, affinity, then the fleet's state."""
        self._place(name, name in self.rotation.stalled)
        if status == "down":
            self.rotation.signal(name, DOWN)
            self._cut_silent(name)
        if status == "down" and previous in ("ready", "warming"):
            self._quarantine.engine_died(name)
            self.affinity.forget_engine(name)
        elif status == "ready":
            self._quarantine.engine_ready(name)
        best = min(self.states.values(), key=lambda s: _ORDER[s.status])
        overall = best.status
        if overall == "starting" and any(s.status == "down" for s in self.states.values()):
            overall = "down"
        self.overall.set(overall, None if overall == "ready" else f"engine {name} {status}")

    def _cut_silent(self, name: str) -> None:
        """Engine ``name`` was marked down: with several engines, when nothing at all came from
        it for ``engine.unhealthy_after_s`` (it hangs), end its open answers (a stream then
        ends with its dialect's error event, `EngineDisconnected`) instead of leaving them to
        ``read_timeout_s``. An engine still streaming is never cut."""
        upstream = self.upstreams.get(name)
        if upstream is None or len(self.specs) < 2 or self._settings is None:
            return
        if time.monotonic() - upstream.progress_at < self._settings().unhealthy_after_s:
            return
        for answer in list(upstream.answers):
            answer.abort()

    def _place(self, name: str, stalled: bool) -> None:
        """Engine ``name`` in the queue's rotation while ready and not stalled."""
        self._queue.set_ready(name, self.states[name].ready and not stalled)

    def detail(self, clock: float) -> dict[str, dict[str, object]]:
        """``/ready``'s per-engine detail: status, seconds in it, in rotation, slots, in flight."""
        out: dict[str, dict[str, object]] = {}
        for name, state in self.states.items():
            slots = self._queue.engines[name]
            out[name] = {
                "status": state.status,
                "state_for_s": round(clock - state.since, 3),
                "in_rotation": slots.ready,
                "slots": slots.slots,
                "in_flight": slots.in_flight,
            }
        return out
