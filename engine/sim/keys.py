"""Typed keys of the simulator's application and per-request state, declared in one place."""

from __future__ import annotations

from contextvars import ContextVar

from aiohttp import web

from engine.sim.metrics import SimMetrics
from engine.sim.options import SimOptions
from engine.sim.record import Recorder, Trace
from engine.sim.scheduler import Scheduler

OPTIONS = web.AppKey("options", SimOptions)
METRICS = web.AppKey("metrics", SimMetrics)
SCHEDULER = web.AppKey("scheduler", Scheduler)
RECORDER = web.AppKey("recorder", Recorder)
# SHA-256 digests of the accepted API keys (empty: no key required)
KEY_DIGESTS = web.AppKey("key_digests", tuple)
# The `Trace` of the request being handled: set by the outermost middleware in the request's own
# task, so the handler and everything it awaits see it.
TRACE: ContextVar[Trace] = ContextVar("sim_trace")
