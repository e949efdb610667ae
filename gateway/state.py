"""Shared state: typed app and request keys, the live configuration, and the per-request objects.

Declared in one place so every module reads the same names. Per request there are two objects:
`RequestContext` (every HTTP request: id, route, the configuration snapshot, caller, status; the
access log's facts), and `ModelCall` (a model request, made once after authentication: caller,
snapshot, dialect, plan, reservation, admission ticket, usage, timings), reachable from the
context as ``context.call``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from gateway.accounting import Accounting
from gateway.admission import AdmissionQueue, Ticket
from gateway.answers import AnswerWorker
from gateway.auth import Authenticator, Principal, revoked_digests
from gateway.config import UNKNOWN_TENANT, Settings, TenantSettings
from gateway.counters import Baseline, Generated, IdleCounters
from gateway.credentials import KeySet
from gateway.dialects import CHAT, Dialect
from gateway.drain import Drain
from gateway.engines import Engines
from gateway.metrics import Metrics
from gateway.quarantine import Quarantine
from gateway.quota import QuotaReservation
from gateway.ratelimit import RateLimiter, Reservation
from gateway.reload import Reloader
from gateway.rewrite import RequestPlan
from gateway.sse import RunningUsage
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
    keys ``previous`` had and ``keys`` lacks are remembered as revoked (`revoked_digests`)."""
    secret = keys.setting("QWEN38_CACHE_SALT_SECRET")
    salt = secret.encode() if secret else _PROCESS_SALT
    auth = Authenticator(
        keys,
        leeway_s=settings.auth.jwt_leeway_s,
        max_ttl_s=settings.auth.jwt_max_ttl_s,
        clock=clock,
        revoked=revoked_digests(previous.auth if previous else None, keys),
        fleet_revoked=previous.auth.fleet_revoked if previous else None,
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


@dataclass
class Usage:
    """The tokens of one model request: the one place they are counted, settled once.

    Filled by the relay from the engine's ``usage`` objects (OpenAI API reference, "The chat
    completion object"; vLLM's ``continuous_usage_stats``), by `gateway.proxy` from the engine's
    counters around a request cut short (`gateway.counters`), then made final by `settle`. The
    quota and rate-limit settles, ``gateway_tokens_total``, the usage ledger and the access log
    all read the settled counts.

    Attributes:
        reached_engine: the engine accepted the request (it may have generated tokens).
        rejected: the engine answered with an error status (it generated nothing).
        prompt_tokens: the engine's final count; after `settle`, the count charged.
        completion_tokens: the engine's final count; after `settle`, the count charged.
        reasoning_tokens: ``completion_tokens_details.reasoning_tokens`` when the engine
            reports it (a part of ``completion_tokens``), else None.
        streamed: the engine's running usage of a stream (what was streamed), if any.
        generated: the engine's counter delta of a request cut short while it held the
            engine's only slot (what was generated), if measured.
        streamed_events: content events relayed to the client.
        source: after `settle`, where the counts came from: ``engine`` (the final usage),
            ``counters`` (the counter delta), ``streamed`` (the running usage), ``estimate``
            (prompt estimate or count, one token a content event), ``none`` (never reached
            the engine), ``rejected`` (refused by the engine with an error status).
        settled: `settle` ran; the counts are final.
    """

    reached_engine: bool = False
    rejected: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    streamed: RunningUsage | None = None
    generated: Generated | None = None
    streamed_events: int = 0
    source: str | None = None
    settled: bool = False

    @property
    def cut(self) -> bool:
        """The engine took the request and no final usage came: it was cut short."""
        return (
            self.reached_engine
            and not self.rejected
            and (self.prompt_tokens is None or self.completion_tokens is None)
        )

    def engine_prompt(self, sequences: int = 1) -> int | None:
        """The engine's own prompt count, when known: the final usage's, the streamed
        running usage's, or the counter delta's (one sequence only: vLLM counts the prompt once
        per sequence)."""
        if not self.cut:
            return self.prompt_tokens
        if self.streamed is not None and self.streamed.prompt_tokens > 0:
            return self.streamed.prompt_tokens
        generated = self.generated
        if generated is not None and sequences == 1 and generated.prompt_tokens > 0:
            return generated.prompt_tokens
        return None

    def completion_so_far(self) -> int:
        """The completion tokens a cut request is known to have cost before `settle`."""
        if self.generated is not None:
            return self.generated.completion_tokens
        if self.streamed is not None:
            return self.streamed.completion_tokens
        return self.streamed_events

    def settle(self, prompt_estimate: int, sequences: int = 1) -> tuple[int, int]:
        """Make the counts final (once; later calls return the same); returns (prompt,
        completion) tokens to charge.

        A request that never reached the engine, or that the engine refused with an error
        status, costs nothing; a complete one its final usage.
        One cut short is charged, completion: the engine's counter delta when measured and at
        least what was streamed, else the streamed running usage (an undercharge bounded by
        what the engine generated after the last streamed chunk), else one token per content
        event; prompt: the engine's streamed count, else the counter delta (one sequence: vLLM
        counts the prompt once per sequence), else a count or the estimate already set in
        ``prompt_tokens``, else ``prompt_estimate``.
        """
        if self.settled:
            return self.prompt_tokens or 0, self.completion_tokens or 0
        if not self.reached_engine:
            self.prompt_tokens, self.completion_tokens, self.source = 0, 0, "none"
        elif self.rejected:
            # The engine refused it before any prefill (its 4xx/5xx status came first): no
            # token was computed, whatever the prompt's size (an over-long prompt included).
            self.prompt_tokens, self.completion_tokens, self.source = 0, 0, "rejected"
        elif not self.cut:
            self.source = "engine"
            if self.prompt_tokens is None:
                self.prompt_tokens = prompt_estimate
            if self.completion_tokens is None:
                self.completion_tokens = 0
        else:
            self._settle_cut(prompt_estimate, sequences)
        self.settled = True
        return self.prompt_tokens or 0, self.completion_tokens or 0

    def _settle_cut(self, prompt_estimate: int, sequences: int) -> None:
        streamed, generated = self.streamed, self.generated
        streamed_completion = streamed.completion_tokens if streamed is not None else 0
        if generated is not None and generated.completion_tokens < streamed_completion:
            generated = self.generated = None  # not this request's counts
        prompt = self.engine_prompt(sequences)
        if streamed is not None:
            self.reasoning_tokens = streamed.reasoning_tokens
        if generated is not None:
            self.source = "counters"
            self.completion_tokens = generated.completion_tokens
        elif streamed is not None:
            self.source = "streamed"
            self.completion_tokens = streamed_completion
        else:
            self.source = "estimate"
            self.completion_tokens = self.streamed_events
        if prompt is None:
            prompt = self.prompt_tokens if self.prompt_tokens is not None else prompt_estimate
        self.prompt_tokens = prompt


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
        plan: the engine request and its facts, once the body was planned.
        quota: the daily/monthly quota reservation, once taken.
        reservation: the rate-limit reservation, once taken.
        ticket: the admission ticket, once queued.
        usage: the token counts.
        queued_s: seconds waited in the admission queue, once granted.
        engine_request_id: the id the engine gets (body ``request_id`` and ``X-Request-Id``),
            unique per model request whatever clients send, because vLLM's aborts and
            duplicate-id handling key on it: the gateway's own id, or the client's
            ``X-Request-Id`` followed by ``-`` and 12 random hex digits (so it still shows in
            the engine's logs and the completion ``id``). Set by `gateway.proxy.open_call`.
        ttft_s: seconds from arrival to the first event relayed, for streams.
        fingerprint: the engine body's quarantine fingerprint (`gateway.quarantine`), or None
            while the quarantine is off.
        baseline: the engine's counters read just before the request was sent, taken only
            while it holds the engine's only slot (`gateway.counters`); None otherwise.
        session: the request's session (`gateway.affinity.Affinity.digest`), or None.
        engine: the name of the engine the request was last sent to, once sent.
        background: the request said it is background work (`gateway.waiting.background_request`).
    """

    context: RequestContext
    caller: Caller
    dialect: Dialect
    plan: RequestPlan | None = None
    quota: QuotaReservation | None = None
    reservation: Reservation | None = None
    ticket: Ticket | None = None
    usage: Usage = field(default_factory=Usage)
    queued_s: float | None = None
    ttft_s: float | None = None
    fingerprint: str | None = None
    engine_request_id: str = ""
    baseline: Baseline | None = None
    session: bytes | None = None
    engine: str | None = None
    background: bool = False

    @property
    def live(self) -> Live:
        """The configuration snapshot of this request."""
        return self.context.live

    @property
    def settings(self) -> Settings:
        """The settings of this request's snapshot."""
        return self.context.live.settings


FinishHook = Callable[[RequestContext], None]

LIVE = web.AppKey("live", LiveRef)
METRICS = web.AppKey("metrics", Metrics)
UPSTREAM = web.AppKey("upstream", Upstream)
ENGINE_STATE = web.AppKey("engine_state", EngineState)
ENGINES = web.AppKey("engines", Engines)
IDLE_COUNTERS = web.AppKey("idle_counters", IdleCounters)
ANSWER_WORKER = web.AppKey("answer_worker", AnswerWorker)
LIMITER = web.AppKey("limiter", RateLimiter)
ACCOUNTING = web.AppKey("accounting", Accounting)
ADMISSION = web.AppKey("admission", AdmissionQueue)
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
