"""The model request path: one `ModelCall` taken through its stages in order.

``open_call`` (after authentication) -> ``plan_call`` (read and parse the body, validate and
rewrite it in the call's dialect) -> ``reserve`` (rate limits) -> ``admit`` (the fair admission
queue, ``: queued`` comments for long-waiting streams) -> ``call_engine`` (the engine boundary,
`gateway.upstream`; the engine's counters read first when the request holds the engine's only
slot) -> ``relay_stream`` / ``relay_json`` (`gateway.relay`) -> ``release_ticket`` and ``settle``
(`gateway.settling`: usage made final, exact for a request cut short; slot, tokens, limits,
quotas) -> finish (the access line, metrics and hooks, `gateway.middleware`;
`record_call` writes the usage ledger's record of every model request there).

Quotas (`gateway.accounting`) are reserved before the per-minute limits and settled with them.

Every acquired slot (tenant concurrency, engine admission) is released in a ``finally`` on every
path: success, error, client disconnect, cancellation.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time

import structlog
from aiohttp import web

from gateway.accounting import Accounting
from gateway.affinity import Affinity
from gateway.body_memory import BodyHold, read_held
from gateway.budget import reserve_budgets
from gateway.deadline import door_check, enqueued, finished, predict
from gateway.dialects import Dialect, PlanInput
from gateway.drain import Drain
from gateway.errors import (
    EngineDisconnected,
    EngineUnavailable,
    EngineUnreachable,
    GatewayError,
    GatewayTimeout,
    RequestQuarantined,
)
from gateway.failover import EngineStalled
from gateway.launcher_status import killed_for_hang
from gateway.middleware import Handler, credential
from gateway.plan_worker import (
    OFFLOAD_BYTES,
    OFFLOADED_DIALECTS,
    PLAN_WORKER,
    Job,
    body_headers,
    plan_body,
)
from gateway.relay import ClientStalled, ClientStream, client_gone, relay_json, relay_stream
from gateway.responses_api import STORE, chained_bytes
from gateway.retries import (
    FLIGHTS,
    RETRY_COUNT_HEADER,
    body_digest,
    follow,
    idempotency_key,
    lead,
    retry_count,
)
from gateway.settling import (
    release_ticket,
    release_ticket_now,
    release_waits,
    run_to_end,
    settle,
    settle_now,
    take_baseline,
)
from gateway.state import (
    ADMISSION,
    ANSWER_WORKER,
    BODY_MEMORY,
    CLOCK,
    CONTEXT,
    DRAIN,
    ENGINE_STATE,
    ENGINES,
    FORECASTER,
    METRICS,
    QUARANTINE,
    UPSTREAM,
    Caller,
    ModelCall,
    RequestContext,
)
from gateway.waiting import Heartbeat, beating, wait_for_slot

log = structlog.get_logger("gateway.proxy")


def model_handler(dialect: Dialect) -> Handler:
    """The route handler of ``dialect``: streaming or not, as the client asks."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await handle_model_request(request, dialect)

    handler.__doc__ = f"``POST {dialect.engine_path}``-shaped model request ({dialect.name})."
    return handler


def open_call(request: web.Request, dialect: Dialect) -> ModelCall:
    """Make the request's `ModelCall` (once, after authentication) and attach it to its context."""
    context = request[CONTEXT]
    caller = context.caller
    assert isinstance(caller, Caller), "authentication runs before the model path"
    engine_id = context.request_id
    if context.client_request_id:
        engine_id = f"{engine_id}-{secrets.token_hex(6)}"
    live = context.live
    call = ModelCall(
        context=context,
        caller=caller,
        dialect=dialect,
        live=live,
        settings=live.settings,
        engine_request_id=engine_id,
    )
    context.call = call
    return call


async def hold_body(request: web.Request, call: ModelCall) -> bytes:
    """Read the body within ``server.bodies_max_bytes`` (`gateway.body_memory.read_held`); the
    hold (``call.body_hold``) is released by `gateway.middleware.finish_request` when the
    request's bodies are dropped."""
    tenant = call.caller.tenant
    hold = call.body_hold = BodyHold(tenant.name, tenant.weight)
    app = call.context.app
    with app[DRAIN].uploading():
        return await read_held(
            request, app[BODY_MEMORY], hold, call.settings.server, call.caller.label
        )


async def plan_call(request: web.Request, call: ModelCall) -> bytes:
    """Read and parse the body, then let the dialect validate and rewrite it (``call.plan``);
    returns the body's bytes as received (after any ``Content-Encoding``), which the caller
    drops before it waits (`gateway.body_memory` counts them only while the body is planned).

    A body over `gateway.plan_worker.OFFLOAD_BYTES`, counting the stored conversation a
    Responses body continues (`gateway.responses_api.chained_bytes`), is planned in the worker
    process; a smaller one here.

    Raises:
        PayloadTooLarge, RequestTimeout, BadRequest: the body could not be read or parsed.
        ClientError: the dialect refused the body (bad field, unknown model, policy).
    """
    live = call.live
    raw = await hold_body(request, call)
    dialect = call.dialect
    authorization = credential(request, dialect)
    tenant = call.caller.tenant
    weight = len(raw)
    if dialect.name == "responses" and weight <= OFFLOAD_BYTES:
        weight += chained_bytes(call.context.app[STORE], tenant.name, raw)
    if weight > OFFLOAD_BYTES and dialect.name in OFFLOADED_DIALECTS:
        job = Job(
            dialect.name,
            authorization,
            body_headers(request.headers),
            live.settings,
            tenant,
            call.engine_request_id,
            live.salt_secret,
        )
        planned = await call.context.app[PLAN_WORKER].plan(job, raw)
    else:
        given = PlanInput(None, live.settings, tenant, call.engine_request_id, live.salt_secret)
        planned = plan_body(dialect, raw, authorization, request.headers, given)
    call.plan = planned.plan
    call.background = planned.background
    if planned.session is not None and live.settings.engine.affinity:
        call.session = Affinity.digest(tenant.name, planned.session)
    if call.plan.held_extra and call.body_hold is not None:
        hold = call.body_hold
        call.context.app[BODY_MEMORY].take(
            hold, hold.size + call.plan.held_extra, call.caller.label
        )
    return raw


async def handle_model_request(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    """One model request from its body to its settled usage (the stages in the module doc).

    During a drain (`gateway.drain`) a new request is refused at once with 503 and
    ``Retry-After``, before its body is read or any limit is touched. A retry of a request
    already running or answered attaches to it (`gateway.retries`) instead of running again.
    """
    call = open_call(request, dialect)
    app = call.context.app
    if app[DRAIN].draining:
        error = Drain.error()
        error.headers["Connection"] = "close"
        raise error
    with app[DRAIN].answering():
        return await _handle_call(request, call)


async def _handle_call(request: web.Request, call: ModelCall) -> web.StreamResponse:
    app = call.context.app
    raw = await plan_call(request, call)
    settings = call.settings.retries
    if not settings.enabled:
        del raw
        return await run_call(request, call)
    flights = app[FLIGHTS]
    digest = await body_digest(call.context.route, raw)
    del raw
    key = idempotency_key(request)
    tenant = call.caller.tenant.name
    found, match = flights.find(settings, tenant, digest, key, retry_count(request))
    if found is not None:
        return await follow(request, call, found, match)
    flight = flights.open(settings, call, digest, key, RETRY_COUNT_HEADER in request.headers)
    return await lead(request, call, flight, functools.partial(run_call, request, call))


async def run_call(request: web.Request, call: ModelCall) -> web.StreamResponse:
    """The planned request through quarantine, budgets, the queue and the engine."""
    app = call.context.app
    plan = call.plan
    assert plan is not None
    quarantine = app[QUARANTINE]
    if quarantine.enabled:
        call.fingerprint = quarantine.fingerprint(plan.body)
        quarantine.check(call.fingerprint, call.caller.label)
    state = app[ENGINE_STATE]
    if not state.ready:
        raise state.unavailable()
    forecaster = app[FORECASTER]
    door_check(call, app[ADMISSION], forecaster, request.headers)  # before any limit is taken

    reservation = await reserve_budgets(request, call)
    plan = call.plan
    assert plan is not None
    metrics = app[METRICS]
    label = call.caller.label
    metrics.in_flight.labels(label).inc()
    try:
        tenant = call.caller.tenant
        home = app[ENGINES].affinity.home(call.session)
        work, forecast = predict(call, app[ADMISSION], forecaster)
        ticket = app[ADMISSION].enqueue(
            tenant.name,
            tenant.weight,
            plan.reserve_tokens,
            label=label,
            home=home,
            background=call.background,
        )
        call.ticket = ticket
        enqueued(call, forecaster, work, forecast)
        try:
            with app[DRAIN].track():
                return await admit_and_call(request, call)
        finally:
            try:
                if release_waits(call):
                    await run_to_end(release_ticket(request, call, ticket))
                else:
                    baseline = call.baseline
                    assert not isinstance(baseline, asyncio.Future)
                    release_ticket_now(request, call, ticket, baseline)
            finally:
                finished(call, forecaster)
    except GatewayError as exc:
        for name, value in reservation.headers.items():
            exc.headers.setdefault(name, value)
        raise
    finally:
        try:
            if not settle_now(request, call):
                await run_to_end(settle(request, call))
        finally:
            metrics.in_flight.labels(label).dec()


def record_call(accounting: Accounting, context: RequestContext) -> None:
    """Finish hook: the usage ledger's record of a model request (every one, refused included).

    Plain routes (no `ModelCall`) are not recorded. Tokens are the settled usage: the engine's
    counts, the cut-off count of a stream that ended early, 0 for a request refused before the
    engine.
    """
    call = context.call
    if call is None:
        return
    usage = call.usage
    principal = call.caller.principal
    accounting.record(
        tenant=principal.tenant,
        key_id=principal.key_id,
        subject=principal.subject,
        endpoint=context.route,
        status=context.error_status or context.status,
        prompt_tokens=(usage.prompt_tokens or 0) if usage.settled else 0,
        completion_tokens=(usage.completion_tokens or 0) if usage.settled else 0,
        reasoning_tokens=usage.reasoning_tokens,
        queue_s=call.queued_s,
        ttft_s=call.ttft_s,
        duration_s=context.duration_s or 0.0,
        request_id=context.request_id,
        engine=call.engine,
        attaches=call.attaches,
    )


async def admit_and_call(request: web.Request, call: ModelCall) -> web.StreamResponse:
    """Wait for an engine slot (a long-waiting stream opens and beats: `gateway.waiting`), then
    call the engine.

    A request that waited in the queue keeps waiting for an engine that went down for the rest
    of its queue time (``engine.queue_timeout_s``); a fresh one gets 503 at once.
    """
    assert call.plan is not None and call.ticket is not None
    app = call.context.app
    engine = call.settings.engine
    ticket = call.ticket
    stream = ClientStream(request, call) if call.plan.stream else None
    heartbeat = Heartbeat(stream, call, app[CLOCK]) if stream is not None else None
    try:
        comment_after = engine.queued_comment_after_s
        if heartbeat is not None and comment_after > 0:
            await wait_for_slot(ticket, heartbeat, comment_after)
        else:
            await ticket.wait(None)
        call.queued_s = ticket.waited_s
        app[FORECASTER].started(ticket)
        state = app[ENGINE_STATE]
        if not state.ready:
            remaining = max(0.0, engine.queue_timeout_s - ticket.waited_s)
            if not await beating(state.wait_ready(remaining), heartbeat):
                raise state.unavailable()
        if app[ENGINES].elsewhere(ticket.engine):
            # Granted while no engine was ready, or its engine stalled since: another one is in.
            await beating(_move(app, call, ticket.engine), heartbeat)
    except GatewayError as exc:
        if stream is None or stream.response is None:
            raise
        return await stream.end_with_error(exc)
    except ConnectionResetError as exc:
        if stream is None:
            client_gone(request, call, isinstance(exc, ClientStalled))
            return web.Response(status=499)
        return stream.gone(isinstance(exc, ClientStalled))
    queued_budget = 0.0
    if ticket.waited_s > 0:
        queued_budget = max(0.0, engine.queue_timeout_s - ticket.waited_s)
    return await call_engine(request, call, stream, queued_budget, heartbeat)


def _hang_kill(call: ModelCall, engine: str) -> bool:
    """The engine died because the launcher killed it for a hang (its status file says so):
    sending the request again would hang an engine for another ``stall_after_s``."""
    spec = next((s for s in call.settings.engine_specs if s.name == engine), None)
    path = spec.launcher_status_file if spec is not None else ""
    return bool(path) and killed_for_hang(path, time.time())


async def _move(app: web.Application, call: ModelCall, failed: str | None) -> bool:
    """Give the request's slot on engine ``failed`` back and wait, first in its tenant's line,
    for a slot on another engine (`Ticket.requeue`); True once granted elsewhere.

    Raises:
        RateLimited, EngineUnavailable: no slot within ``engine.queue_timeout_s``.
    """
    ticket = call.ticket
    assert ticket is not None
    if failed is not None:
        app[METRICS].engine_failovers.labels(failed).inc()
    ticket.requeue(avoid=failed)
    log.warning("engine_failover", engine=failed, request_id=call.context.request_id)
    return await ticket.wait(None)


async def call_engine(
    request: web.Request,
    call: ModelCall,
    stream: ClientStream | None,
    queued_budget: float,
    heartbeat: Heartbeat | None = None,
) -> web.StreamResponse:
    """POST to the engine and relay its answer; the engine answer is ended on every exit.

    An engine that refuses the connection is marked down at once. A request that had already
    waited in the queue keeps waiting for the engine's return for ``queued_budget`` seconds;
    a fresh one gets 503 at once. A request the engine died under before answering a byte is
    sent once more when the engine is ready again (within ``engine.queue_timeout_s``), unless
    its fingerprint was quarantined by that death or the launcher killed the engine for a hang;
    one that got any byte is never sent again.
    A request whose engine connection fails is a quarantine suspect (`gateway.quarantine`).

    The request's total time limit (`time_limit`) runs from here, the same for streamed and
    non-streamed answers; when it fires the engine request is aborted and the client gets 504
    (an error event on a stream). A drain that reaches its grace ends the request the same way
    with 503 ``shutting_down`` (logged ``reason="shutdown"``, not as a client disconnect).
    """
    task = asyncio.current_task()
    limit = time_limit(call)
    timed_out = False

    def expire() -> None:
        nonlocal timed_out
        timed_out = True
        if task is not None:
            task.cancel("time limit")

    timer = asyncio.get_running_loop().call_later(limit, expire) if limit else None
    try:
        return await _call_engine(request, call, stream, queued_budget, heartbeat)
    except asyncio.CancelledError:
        cut: GatewayError
        drain = call.context.app[DRAIN]
        if drain.cut_by_shutdown():
            cut = Drain.error()
        elif timed_out:
            cut = GatewayTimeout(
                f"The request exceeded its time limit of {limit:g} s at the engine "
                "(engine.request_timeout_s or engine.min_tokens_per_s)."
            )
            call.context.app[UPSTREAM].count(cut.kind)
        elif drain.forced:
            call.context.reason = "shutdown"  # the second signal: the process exits now
            raise
        else:
            client_gone(request, call)
            raise
        if task is not None and hasattr(task, "uncancel"):
            task.uncancel()  # the cancellation is handled: the answer below is sent
        call.context.reason = cut.reason
        if stream is None or stream.response is None:
            raise cut from None
        return await stream.end_with_error(cut)
    finally:
        if timer is not None:
            timer.cancel()


def time_limit(call: ModelCall) -> float | None:
    """Seconds the request may take at the engine, or None for no limit.

    ``engine.request_timeout_s`` when set; else ``engine.read_timeout_s`` (the prefill
    allowance) plus every output token the request may generate (`RequestPlan.output_tokens`:
    n x max_tokens, times the prompts of a completions list) at
    ``engine.min_tokens_per_s``; None when both are 0.
    """
    assert call.plan is not None
    engine = call.settings.engine
    if engine.request_timeout_s > 0:
        return engine.request_timeout_s
    if engine.min_tokens_per_s <= 0:
        return None
    output = call.plan.output_tokens
    return engine.read_timeout_s + output / engine.min_tokens_per_s


async def _call_engine(
    request: web.Request,
    call: ModelCall,
    stream: ClientStream | None,
    queued_budget: float,
    heartbeat: Heartbeat | None,
) -> web.StreamResponse:
    assert call.plan is not None and call.ticket is not None
    app = call.context.app
    fleet = app[ENGINES]
    several = len(fleet) > 1
    clock = app[CLOCK]
    quarantine = app[QUARANTINE]
    fingerprint = call.fingerprint
    deadline = clock() + queued_budget
    retried = False
    token: int | None = None
    # Set once a POST is written: from then on the engine may have computed tokens, whatever
    # becomes of the connection (a drop, a crash, a time limit, the client gone).
    written = False

    def sent() -> None:
        nonlocal written
        written = True
        if stream is not None:
            stream.make()

    while True:
        name = call.ticket.engine
        upstream, state = fleet.upstream(name), fleet.state(name)
        try:
            if fingerprint is not None:
                quarantine.check(fingerprint, call.caller.label)  # quarantined while waiting
            await take_baseline(request, call)
            if fingerprint is not None:
                token = quarantine.started(fingerprint, call.context.request_id, name or "default")
            call.engine = name
            if name is not None:
                app[METRICS].engine_requests.labels(name).inc()
                fleet.affinity.served(call.session, name)
            post = fleet.post(
                name,
                call.dialect.engine_path,
                call.plan.body,
                call.engine_request_id,
                stream=call.plan.stream,
                sent=sent,
            )
            # A stream waiting for the engine's headers shows life (`gateway.waiting.beating`).
            answer = await (post if heartbeat is None else beating(post, heartbeat))
            break
        except asyncio.CancelledError:
            # Cut (the client gone, a time limit, a drain) while the engine worked on the
            # request (a non-streamed answer sends its headers last): the engine has read the
            # prompt and may have generated, so the request is charged (`call_engine`).
            call.usage.reached_engine = written
            if token is not None:
                # Not a suspect (its connection did not fail), and no longer at the engine:
                # kept, the entry would hold the request's engine body for good.
                quarantine.finished(token, dropped=False)
            raise
        except EngineUnavailable as exc:
            # A request written to an engine that then went away may have been computed in
            # part: it is charged as a cut request (`gateway.settling`) unless a retry completes.
            call.usage.reached_engine = call.usage.reached_engine or written
            call.usage.unanswered = True
            dropped = isinstance(exc, EngineUnreachable) and exc.sent
            if token is not None:
                quarantine.finished(token, dropped=dropped)
                token = None
            if not isinstance(exc, EngineStalled):
                state.set("down", "connection dropped" if dropped else "connection refused")
            error: GatewayError = exc
            if dropped:
                if not retried and fingerprint is not None and not _hang_kill(call, name or ""):
                    retried = True
                    wait = max(deadline - clock(), call.settings.engine.queue_timeout_s)
                    if several:
                        # Retried once, on another engine (the quarantine counts deaths on each).
                        try:
                            if await beating(_move(app, call, name), heartbeat):
                                app[METRICS].engine_retries.inc()
                                log.warning("engine_retry", fingerprint=str(fingerprint))
                                continue
                        except GatewayError as refused:
                            error = refused
                    elif await beating(state.wait_ready(wait), heartbeat):
                        app[METRICS].engine_retries.inc()
                        log.warning("engine_retry", fingerprint=str(fingerprint))
                        continue
                elif fingerprint is not None:
                    try:
                        quarantine.check(fingerprint, call.caller.label)
                    except RequestQuarantined as refused:
                        error = refused
            elif several:
                # Never sent: it goes to another engine, ahead of its tenant's later requests.
                try:
                    if await beating(_move(app, call, name), heartbeat):
                        continue
                except GatewayError as refused:
                    error = refused
            else:
                remaining = deadline - clock()
                if remaining > 0 and await beating(state.wait_ready(remaining), heartbeat):
                    continue
            if stream is None or stream.response is None:
                raise error from None
            return await stream.end_with_error(error)
        except GatewayError as exc:
            call.usage.reached_engine = call.usage.reached_engine or written
            call.usage.unanswered = True
            if token is not None:
                # A drop the engine's health did not (yet) prove fatal stays a suspect.
                quarantine.finished(token, dropped=isinstance(exc, EngineDisconnected))
            if stream is None or stream.response is None:
                raise
            return await stream.end_with_error(exc)
    call.usage.reached_engine = True
    call.usage.unanswered = False  # the engine's headers came (an earlier try's drop is past)
    complete = False
    try:
        if answer.status != 200:
            # A status before any token: the engine refused the request (nothing computed).
            # A non-streamed answer's status comes after the generation, so its 5xx may follow
            # computed tokens: at one slot the engine's counters say how many (a cut request,
            # `gateway.settling`); with others beside it nothing can tell, and it costs nothing.
            call.usage.rejected = not (
                stream is None and answer.status >= 500 and call.baseline is not None
            )
            call.usage.unanswered = True
            error = await answer.error()
            complete = True
            if call.dialect.explain_rejection is not None:
                answer.release()  # read to its end: the connection may serve the count
                error = await call.dialect.explain_rejection(upstream, call.plan, error)
            if stream is None or stream.response is None:
                raise error
            return await stream.end_with_error(error)
        if stream is not None:
            result = await relay_stream(request, call, answer, stream, heartbeat)
        else:
            result = await relay_json(request, call, answer, app[ANSWER_WORKER])
        complete = True
        return result
    finally:
        if token is not None:
            # Only the engine connection failing makes a suspect: not a client that left.
            quarantine.finished(token, dropped=answer.broken)
        if complete:
            answer.release()
        else:
            answer.abort()  # closing the socket is how the engine learns to abort (C10)
