"""Typed keys of the simulator's application and per-request state, declared in one place."""

from __future__ import annotations

from aiohttp import web

from engine.sim.metrics import SimMetrics
from engine.sim.options import SimOptions
from engine.sim.record import Recorder
from engine.sim.scheduler import Scheduler

OPTIONS = web.AppKey("options", SimOptions)
METRICS = web.AppKey("metrics", SimMetrics)
SCHEDULER = web.AppKey("scheduler", Scheduler)
RECORDER = web.AppKey("recorder", Recorder)
# SHA-256 digests of the accepted API keys (empty: no key required)
KEY_DIGESTS = web.AppKey("key_digests", tuple)
# request keys: the request's `record.Trace`, and its parsed JSON body once read
TRACE = "sim_trace"
JSON_BODY = "sim_json"
