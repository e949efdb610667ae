"""A model call's reservation against its tenant's budgets, bounded by the engine's own count.

`reserve_budgets` takes the tenant's budgets (`gateway.budgets`: quotas, then the per-minute
limits) for the plan's ``reserve_tokens``: the prompt ceiling
(`gateway.ceiling`, a bound the engine's count cannot exceed) plus the output budget. When a
token budget refuses the ceiling, the engine's exact count of the prompt is asked once
(``POST /tokenize``, `gateway.upstream.Upstream.count_prompt`) and the reservation tried again
with it: a prompt the ceiling over-states (tool schemas, characters that escape) still passes
when the tenant can afford what the engine will really count, and the reservation stays a bound
either way. Requests, concurrency and a count the engine cannot give refuse as before.

`fit_default_output` makes the output budget the gateway chose for a request that set none fit
the context: vLLM refuses a request whose prompt and output budget together pass
``max_model_len`` (vLLM docs, "OpenAI-Compatible Server"; its ``get_max_tokens``), and a budget
sized from the prompt estimate would pass it for a prompt the estimate under-states. Only a
prompt whose ceiling leaves less room than the budget is counted, with the same ``/tokenize``.
"""

from __future__ import annotations

import time

import structlog
from aiohttp import web

from gateway.errors import RateLimited
from gateway.ratelimit import Reservation
from gateway.state import BUDGETS, ENGINES, METRICS, ModelCall
from gateway.upstream import Upstream

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
    await fit_default_output(request, call)
    try:
        return await _reserve(request, call)
    except RateLimited as refused:
        plan = call.plan
        assert plan is not None
        if plan.prompt_exact or refused.limit not in ("tokens", "insufficient_quota"):
            raise
        count = await _count_prompt(request, call, "limit")
        if count is None or count >= plan.prompt_ceiling:
            raise
        call.plan = plan.with_prompt_count(count)
        call.context.app[METRICS].prompt_counts.inc()
        return await _reserve(request, call)


async def _count_prompt(request: web.Request, call: ModelCall, reason: str) -> int | None:
    """The engine's count of the planned prompt (`Upstream.count_prompt`, None when it gives
    none in time), logged as ``prompt_counted`` with the ceiling it replaces, the ``reason`` it
    was asked for (``limit``: the ceiling was refused; ``default_output``) and its seconds."""
    plan = call.plan
    assert plan is not None
    started = time.monotonic()
    count = await _counter(request, call).count_prompt(
        plan.tokenize_request(), EXACT_COUNT_TIMEOUT_S
    )
    log.info(
        "prompt_counted",
        ceiling=plan.prompt_ceiling,
        count=count,
        reason=reason,
        seconds=round(time.monotonic() - started, 4),
    )
    return count


def _counter(request: web.Request, call: ModelCall) -> Upstream:
    """The engine that counts the prompt: its session's engine while in rotation, else another
    one in rotation (`gateway.engines.Engines.counter`)."""
    fleet = call.context.app[ENGINES]
    return fleet.counter(fleet.affinity.home(call.session))


async def _reserve(request: web.Request, call: ModelCall) -> Reservation:
    assert call.plan is not None
    call.hold = await call.context.app[BUDGETS].reserve(
        call.caller.tenant, call.plan.reserve_tokens
    )
    return call.hold.rate


async def fit_default_output(request: web.Request, call: ModelCall) -> None:
    """Bound the gateway's default output budget by the room the engine's own prompt count
    leaves: ``min(output_cap, max_model_len - count)`` (`gateway.rewrite.RequestPlan`), written
    into the engine body.

    Nothing is asked when the client set its own budget (the engine's refusal of one that does
    not fit is the client's answer) or when the prompt ceiling already leaves room for the
    budget. When the engine gives no count in time the budget stays as planned.
    """
    plan = call.plan
    assert plan is not None
    field = plan.default_output
    context = call.live.settings.engine.max_model_len
    if field is None or plan.prompt_exact or plan.prompt_ceiling + plan.max_output <= context:
        return
    count = await _count_prompt(request, call, "default_output")
    if count is None or count > plan.prompt_ceiling:
        return
    call.context.app[METRICS].prompt_counts.inc()
    plan = plan.with_prompt_count(count)
    room = context - count
    if room < 1:
        call.plan = plan  # the engine refuses the prompt itself, with its numbers
        return
    call.plan = plan.with_default_output(min(plan.output_cap, room))
