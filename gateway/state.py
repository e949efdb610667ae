"""Shared state: typed app and request keys, the live configuration, and the per-request objects.

Declared in one place so every module reads the same names. Per request there are two objects:
`RequestContext` (every HTTP request: id, route, the configuration snapshot, caller, status; the
access log's facts), and `ModelCall` (a model request, made once after authentication: caller,
snapshot, dialect, plan, reservation, admission ticket, usage, timings), reachable from the
context as ``context.call``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from gateway.accounting import Accounting
from gateway.admission import AdmissionQueue, Ticket
from gateway.answers import AnswerWorker
from gateway.auth import Authenticator, Principal, revoked_digests, revoked_kids
from gateway.body_memory import BodyHold, BodyMemory
from gateway.budgets import Budgets, Hold
from gateway.config import UNKNOWN_TENANT, Settings, TenantSettings
from gateway.counters import Baseline, IdleCounters
from gateway.credentials import KeySet
from gateway.deadline import Forecaster
from gateway.dialects import CHAT, Dialect
from gateway.drain import Drain
from gateway.engines import Engines
from gateway.meter import Meter
from gateway.metrics import Metrics
from gateway.quarantine import Quarantine, RequestPrint
from gateway.ratelimit import RateLimiter, Reservation
from gateway.reload import Reloader
from gateway.rewrite import RequestPlan
from gateway.upstream import EngineState, Upstream


@dataclass(frozen=True)
class Live:
    """What a reload swaps as a whole: settings, keys and the authenticator built from them.

    Each request takes the current one once, at its start (`RequestContext.live`), so a reload
    never changes the rules, the alias or the limits under a request in flight.
    """

    settings: Settings
    keys: KeySet
    auth: Authenticator
    salt_secret: bytes


class LiveRef:
    """The mutable cell holding the current `Live`; a reload replaces ``current`` in one step."""

    def __init__(self, live: Live) -> None:
        self.current = live


# Without QWEN38_CACHE_SALT_SECRET the salt is random per process: tenants stay isolated, at the
# price of prefix-cache misses after a restart and across replicas.
_PROCESS_SALT = secrets.token_bytes(32)


def build_live(
    settings: Settings,
    keys: KeySet,
    clock: Callable[[], float] = time.time,
    previous: Live | None = None,
) -> Live:
    """Compile settings and keys into a `Live` (authenticator tables, cache-salt secret); the
    keys and signing keys ``previous`` had and ``keys`` lacks are remembered as revoked
    (`revoked_digests`, `revoked_kids`)."""
    secret = keys.setting("QWEN38_CACHE_SALT_SECRET")
    salt = secret.encode() if secret else _PROCESS_SALT
    auth = Authenticator(
        keys,
        leeway_s=settings.auth.jwt_leeway_s,
        max_ttl_s=settings.auth.jwt_max_ttl_s,
        clock=clock,
        revoked=revoked_digests(previous.auth if previous else None, keys),
        fleet_revoked=previous.auth.fleet_revoked if previous else None,
        revoked_kids=revoked_kids(previous.auth if previous else None, keys),
    )
    return Live(settings=settings, keys=keys, auth=auth, salt_secret=salt)


@dataclass(frozen=True)
class Caller:
    """Who made a request, resolved once after authentication.

    Attributes:
        principal: the authenticated credential (tenant name, key id or ``jwt:<kid>``).
        tenant: the tenant's settings in the request's snapshot.
        label: the tenant's metric label (`Settings.tenant_label`: bounded by the config).
    """

    principal: Principal
    tenant: TenantSettings
    label: str


@dataclass(eq=False)
class RequestContext:
    """One HTTP request's facts for the access log and request metrics (every route).

    Made by the outermost middleware; ``caller`` is set by authentication, ``call`` by the model
    path. Hooks registered under `FINISH_HOOKS` receive it once the request is over.

    Attributes:
        request_id: the client's ``X-Request-Id`` when sane, else a fresh UUID (hex).
        client_request_id: ``request_id`` is the client's (not generated here).
        started: clock reading at arrival (seconds, the app's monotonic clock).
        route: the route template (bounded, `gateway.metrics.ROUTES`).
        live: the configuration snapshot this request runs under.
        app: the application serving it (``request.app``, kept: aiohttp resolves that
            property through the route's match on every read).
        dialect: the client API of the route (error shape; OpenAI's for plain routes).
        caller: the authenticated caller, or None.
        call: the model request, or None.
        status: the HTTP status sent (499: the client went away), 0 until known.
        reason: a bounded label explaining an error status, or None.
        error_status: the status of an error that ended a stream after its 200 went out (the
            error event's status, e.g. 502), else 0; ``status`` stays the 200 sent.
        duration_s: seconds from arrival to the end, set when the request is over.
    """

    request_id: str
    started: float
    route: str
    live: Live
    app: web.Application
    client_request_id: bool = False
    dialect: Dialect = CHAT
    caller: Caller | None = None
    call: ModelCall | None = None
    status: int = 0
    reason: str | None = None
    error_status: int = 0
    duration_s: float | None = None

    @property
    def tenant_label(self) -> str:
        """The caller's metric label, ``unknown`` before authentication."""
        return self.caller.label if self.caller is not None else UNKNOWN_TENANT


@dataclass(eq=False)
class ModelCall:
    """One model request on its way through the path (mitmproxy's ``HTTPFlow``, in spirit).

    Made once after authentication; each stage of `gateway.proxy` fills its part: plan (rewrite),
    reservation (rate limits), ticket (admission queue), usage (relay, then settle), timings.

    Attributes:
        context: the HTTP request's `RequestContext` (id, snapshot, caller, status).
        caller: the authenticated caller (the same as ``context.caller``).
        dialect: the client API this request speaks.
        live: the configuration snapshot of this request (``context.live``).
        settings: the settings of that snapshot (``live.settings``).
        plan: the engine request and its facts, once the body was planned.
        hold: what the call holds against its tenant's budgets (`gateway.budgets`), once taken.
        ticket: the admission ticket, once queued.
        body_hold: the memory its body holds (`gateway.body_memory`), once reading began;
            released when the request is finished.
        usage: the token counts.
        queued_s: seconds waited in the admission queue, once granted.
        engine_request_id: the id the engine gets (body ``request_id`` and ``X-Request-Id``),
            unique per model request whatever clients send, because vLLM's aborts and
            duplicate-id handling key on it: the gateway's own id, or the client's
            ``X-Request-Id`` followed by ``-`` and 12 random hex digits (so it still shows in
            the engine's logs and the completion ``id``). Set by `gateway.proxy.open_call`.
        ttft_s: seconds from arrival to the first event relayed, for streams.
        fingerprint: the engine body's quarantine fingerprint (`gateway.quarantine`, computed
            when first read), or None while the quarantine is off.
        baseline: the engine's counters read just before the request was sent, taken only
            while it holds the engine's only slot (`gateway.counters`), or a reading of them
            under way since before it was sent (a future of the same); None otherwise.
        session: the request's session (`gateway.affinity.Affinity.digest`), or None.
        engine: the name of the engine the request was last sent to, once sent.
        background: the request said it is background work (`gateway.waiting.background_request`).
        attaches: other connections served from this request's generation (`gateway.retries`).
    """

    context: RequestContext
    caller: Caller
    dialect: Dialect
    live: Live
    settings: Settings
    plan: RequestPlan | None = None
    hold: Hold | None = None
    ticket: Ticket | None = None
    body_hold: BodyHold | None = None
    usage: Meter = field(default_factory=Meter)
    queued_s: float | None = None
    ttft_s: float | None = None
    fingerprint: RequestPrint | None = None
    engine_request_id: str = ""
    baseline: Baseline | asyncio.Future[Baseline | None] | None = None
    session: bytes | None = None
    engine: str | None = None
    background: bool = False
    attaches: int = 0

    @property
    def reservation(self) -> Reservation | None:
        """The rate-limit part of ``hold`` (its headers go on the answer), once taken."""
        return self.hold.rate if self.hold is not None else None


FinishHook = Callable[[RequestContext], None]

LIVE = web.AppKey("live", LiveRef)
METRICS = web.AppKey("metrics", Metrics)
UPSTREAM = web.AppKey("upstream", Upstream)
ENGINE_STATE = web.AppKey("engine_state", EngineState)
ENGINES = web.AppKey("engines", Engines)
IDLE_COUNTERS = web.AppKey("idle_counters", IdleCounters)
ANSWER_WORKER = web.AppKey("answer_worker", AnswerWorker)
LIMITER = web.AppKey("limiter", RateLimiter)
BUDGETS = web.AppKey("budgets", Budgets)
ACCOUNTING = web.AppKey("accounting", Accounting)
ADMISSION = web.AppKey("admission", AdmissionQueue)
BODY_MEMORY = web.AppKey("body_memory", BodyMemory)
FORECASTER = web.AppKey("forecaster", Forecaster)
QUARANTINE = web.AppKey("quarantine", Quarantine)
RELOADER = web.AppKey("reloader", Reloader)
CLOCK: web.AppKey[Callable[[], float]] = web.AppKey("clock")
STARTED = web.AppKey("started", float)
DRAIN = web.AppKey("drain", Drain)
# Route template -> the client API it speaks (error shape); routes not listed speak OpenAI's.
DIALECTS: web.AppKey[dict[str, Dialect]] = web.AppKey("dialects")
# Called with the finished `RequestContext` after the access line (the usage ledger's record).
FINISH_HOOKS: web.AppKey[list[FinishHook]] = web.AppKey("finish_hooks")
CONTEXT = web.RequestKey("context", RequestContext)
