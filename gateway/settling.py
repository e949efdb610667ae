"""The end of a model call: its usage made final (exact for a request cut short), its engine slot
given back, its tokens counted and its limits and quotas settled, whatever ended it.

`take_baseline` gives a request that holds the engine's only slot the engine's counters read
while the engine was idle before it;
`release_ticket` waits, for a request cut short, until the engine's abort has landed and charges
the counter delta (`gateway.counters`), then frees the slot; `settle` asks the engine for its
own prompt count of a cut request whose prompt count the engine never reported (after the slot
is free), counts the settled tokens and settles the rate limits and quotas. Both run to their
end even when the client hangs up meanwhile (`run_to_end`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog
from aiohttp import web

from gateway.admission import Ticket
from gateway.counters import Baseline, generated, settled_counters
from gateway.state import (
    ADMISSION,
    BUDGETS,
    ENGINE_STATE,
    ENGINES,
    IDLE_COUNTERS,
    METRICS,
    UPSTREAM,
    ModelCall,
)

log = structlog.get_logger("gateway.settling")

PROMPT_COUNT_TIMEOUT_S = 2.0
"""Longest wait for the engine's prompt count of a request cut before its usage arrived."""


async def run_to_end(work: Coroutine[Any, Any, None]) -> None:
    """Await ``work`` to its end even if the handler is cancelled meanwhile (the client went
    away): slots, limits, quotas and the usage record must not depend on when the client hangs
    up. The cancellation is passed on once ``work`` is done."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


async def release_ticket(request: web.Request, call: ModelCall, ticket: Ticket) -> None:
    """Give the engine slot back, charging the tenant's fair share what was used (not the
    reservation).

    A request cut short while it held the engine's only slot keeps the slot until the engine's
    abort has landed (at most `gateway.counters.SETTLE_BOUND_S`), then is charged its counter
    delta (`gateway.counters`): releasing it earlier would let the next request share the
    engine and spoil the delta. The client is gone or has its last byte by then. A cut request
    whose prompt count the engine never reported is charged its prompt estimate here; its usage
    is made final by `settle`, once the slot is free.
    """
    assert call.plan is not None
    usage = call.usage
    pending = call.baseline
    baseline = pending if not isinstance(pending, asyncio.Future) else None
    try:
        if isinstance(pending, asyncio.Future):
            baseline = await asyncio.shield(pending)
        if baseline is not None and usage.cut and not usage.settled:
            after = await settled_counters(call.context.app[UPSTREAM], baseline.counters)
            if after is not None and call.context.app[ADMISSION].grants == baseline.grants:
                usage.generated = generated(baseline.counters, after)
                call.context.app[IDLE_COUNTERS].keep(after, baseline.grants)
    finally:
        release_ticket_now(request, call, ticket, baseline)


def release_waits(call: ModelCall) -> bool:
    """`release_ticket` has something to wait for: a baseline reading still under way, or the
    engine's counters after a cut (otherwise `release_ticket_now` does it all)."""
    baseline = call.baseline
    if isinstance(baseline, asyncio.Future):
        return True
    usage = call.usage
    return baseline is not None and usage.cut and not usage.settled


def release_ticket_now(
    request: web.Request, call: ModelCall, ticket: Ticket, baseline: Baseline | None = None
) -> None:
    """The slot given back with what the call used so far (the end of `release_ticket`).

    At one slot the engine's counters for the next request are the call's ``baseline`` (its
    counters before it, resolved) plus its final usage when it ended complete
    (`gateway.counters.IdleCounters.advance`), else read in the background.
    """
    assert call.plan is not None
    usage = call.usage
    if needs_prompt_count(call):
        ticket.release(call.plan.prompt_fallback + usage.completion_so_far())
    else:
        prompt, completion = usage.settle(call.plan.prompt_fallback, call.plan.n)
        ticket.release(prompt + completion)
    admission = call.context.app[ADMISSION]
    if admission.max_concurrency == 1 and admission.in_flight == 0:
        idle = call.context.app[IDLE_COUNTERS]
        if (
            baseline is not None
            and baseline.grants == admission.grants
            and usage.settled
            and usage.source == "engine"
            and call.plan.n == 1
        ):
            idle.advance(baseline, prompt, completion)
        else:
            idle.refresh(admission.grants)


def needs_prompt_count(call: ModelCall) -> bool:
    """A call cut short without any prompt count from the engine (no usage streamed, no
    counter delta), not settled yet."""
    assert call.plan is not None
    usage = call.usage
    return usage.cut and not usage.settled and usage.engine_prompt(call.plan.n) is None


async def take_baseline(request: web.Request, call: ModelCall) -> None:
    """The engine's counters before sending ``call``, when it holds the engine's only slot
    (``engine.max_concurrency = 1`` and no other request at the engine): the reading taken
    while the engine was idle since the previous request (`gateway.counters.IdleCounters`), so
    the request path reads ``/metrics`` only when there is none, and a reading still under way
    finishes beside the request (`gateway.counters.IdleCounters.baseline_at_once`); else no
    baseline is taken and a cut is charged its streamed usage (`gateway.meter.Meter.settle`)."""
    call.baseline = None
    admission = call.context.app[ADMISSION]
    if admission.max_concurrency != 1 or admission.in_flight != 1:
        return
    call.baseline = await call.context.app[IDLE_COUNTERS].baseline_at_once(admission.grants)


async def settle(request: web.Request, call: ModelCall) -> None:
    """Make the usage final, count the tokens of a call that reached the engine, settle limits
    and quotas.

    A call cut short without any prompt count from the engine asks the engine for its own count
    of the prompt (`Upstream.count_prompt`, while the engine is up); the estimate stands
    otherwise.
    """
    assert call.plan is not None and call.hold is not None
    usage = call.usage
    if needs_prompt_count(call) and call.context.app[ENGINE_STATE].ready:
        counter = call.context.app[ENGINES].counter(call.engine)
        usage.prompt_tokens = await counter.count_prompt(
            call.plan.tokenize_request(), timeout=PROMPT_COUNT_TIMEOUT_S
        )
    tokens = _count(request, call)
    await call.context.app[BUDGETS].settle(call.hold, tokens)


def settle_now(request: web.Request, call: ModelCall) -> bool:
    """`settle` without awaiting, when it has nothing to wait for (no prompt count to ask the
    engine, budgets in memory); False (nothing done) otherwise."""
    assert call.plan is not None and call.hold is not None
    if needs_prompt_count(call) and call.context.app[ENGINE_STATE].ready:
        return False
    budgets = call.context.app[BUDGETS]
    if not budgets.in_memory:
        return False
    budgets.settle_now(call.hold, _count(request, call))
    return True


def _count(request: web.Request, call: ModelCall) -> int:
    """Make the usage final and count its tokens in the metrics; prompt plus completion."""
    assert call.plan is not None
    usage = call.usage
    prompt, completion = usage.settle(call.plan.prompt_fallback, call.plan.n)
    if usage.source in ("engine", "streamed", "counters") and prompt > call.plan.prompt_ceiling:
        # The template rendered more than `gateway.ceiling` bounds: the reservation was short.
        call.context.app[METRICS].prompt_ceiling_exceeded.inc()
        log.error(
            "prompt_ceiling_exceeded",
            prompt_tokens=prompt,
            ceiling=call.plan.prompt_ceiling,
            exact=call.plan.prompt_exact,
        )
    if usage.reached_engine:
        metrics = call.context.app[METRICS]
        metrics.tokens.labels(call.caller.label, "prompt").inc(prompt)
        metrics.tokens.labels(call.caller.label, "completion").inc(completion)
    return prompt + completion
