"""A model call's reservation against its tenant's budgets, bounded by the engine's own count.

`reserve_budgets` takes the tenant's budgets (`gateway.budgets`: quotas, then the per-minute
limits) for the plan's ``reserve_tokens``: the prompt ceiling
(`gateway.ceiling`, a bound the engine's count cannot exceed) plus the output budget. When a
token budget refuses the ceiling, the engine's exact count of the prompt is asked once
(``POST /tokenize``, `gateway.upstream.Upstream.count_prompt`) and the reservation tried again
with it: a prompt the ceiling over-states (tool schemas, characters that escape) still passes
when the tenant can afford what the engine will really count, and the reservation stays a bound
either way. Requests, concurrency and a count the engine cannot give refuse as before.
"""

from __future__ import annotations

import time

import structlog
from aiohttp import web

from gateway.errors import RateLimited
from gateway.ratelimit import Reservation
from gateway.state import BUDGETS, ENGINES, METRICS, ModelCall

log = structlog.get_logger("gateway.budget")

EXACT_COUNT_TIMEOUT_S = 5.0
"""Longest wait for the engine's ``/tokenize`` count before admission; past it the ceiling's
refusal stands."""


async def reserve_budgets(request: web.Request, call: ModelCall) -> Reservation:
    """Reserve ``call.plan.reserve_tokens`` in the quotas, then the rate limits; returns the
    rate-limit reservation (``call.hold`` is set).

    Raises:
        gateway.quota.QuotaExceeded: 429 ``insufficient_quota`` (nothing held).
        RateLimited: 429 ``rate_limit_exceeded`` (requests, tokens, concurrency; nothing held).
    """
    try:
        return await _reserve(request, call)
    except RateLimited as refused:
        plan = call.plan
        assert plan is not None
        if plan.prompt_exact or refused.limit not in ("tokens", "insufficient_quota"):
            raise
        started = time.monotonic()
        fleet = request.app[ENGINES]
        counter = fleet.counter(fleet.affinity.home(call.session))
        count = await counter.count_prompt(plan.body, timeout=EXACT_COUNT_TIMEOUT_S)
        log.info(
            "prompt_counted",
            ceiling=plan.prompt_ceiling,
            count=count,
            seconds=round(time.monotonic() - started, 4),
        )
        if count is None or count >= plan.prompt_ceiling:
            raise
        call.plan = plan.with_prompt_count(count)
        request.app[METRICS].prompt_counts.inc()
        return await _reserve(request, call)


async def _reserve(request: web.Request, call: ModelCall) -> Reservation:
    assert call.plan is not None
    call.hold = await request.app[BUDGETS].reserve(call.caller.tenant, call.plan.reserve_tokens)
    return call.hold.rate
