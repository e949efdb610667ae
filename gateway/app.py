"""The app factory: shared state, lifetimes and routes of the public application.

One request: `gateway.middleware` (context and access log -> errors -> authentication) -> a
plain handler (`gateway.handlers`) or the model path (`gateway.proxy`), which calls the engine
through `gateway.upstream` and relays its answer through `gateway.relay`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.accounting import Accounting
from gateway.admission import AdmissionQueue
from gateway.answers import AnswerWorker
from gateway.body_memory import BodyMemory
from gateway.budgets import Budgets
from gateway.config import Settings
from gateway.counters import IdleCounters
from gateway.credentials import KeySet
from gateway.deadline import Forecaster
from gateway.dialects import CHAT, COMPLETIONS
from gateway.drain import Drain
from gateway.engine_watch import check_drift
from gateway.engines import Engines
from gateway.fleet_sync import FLEET_SYNC, fleet_ctx
from gateway.handlers import get_model, health, list_models, ready, usage
from gateway.keys_file import load_keys_file
from gateway.limiter import create_rate_limiter
from gateway.logs import set_level
from gateway.messages_api import ANTHROPIC, count_tokens
from gateway.metrics import Metrics
from gateway.middleware import (
    auth_middleware,
    context_middleware,
    error_middleware,
    expect_continue,
)
from gateway.plan_worker import PLAN_WORKER, PlanWorker
from gateway.proxy import model_handler, record_call
from gateway.quarantine import Quarantine, fingerprint_key
from gateway.reload import Reloader
from gateway.responses_api import (
    STORE,
    cancel_response,
    delete_response,
    get_response,
    list_input_items,
    make_store,
    responses_dialect,
)
from gateway.retries import FLIGHTS, Flights
from gateway.state import (
    ACCOUNTING,
    ADMISSION,
    ANSWER_WORKER,
    BODY_MEMORY,
    BUDGETS,
    CLOCK,
    DIALECTS,
    DRAIN,
    ENGINE_STATE,
    ENGINES,
    FINISH_HOOKS,
    FORECASTER,
    IDLE_COUNTERS,
    LIMITER,
    LIVE,
    METRICS,
    QUARANTINE,
    RELOADER,
    STARTED,
    UPSTREAM,
    LiveRef,
    build_live,
)
from gateway.upstream import EngineState, EngineStatus


def create_app(
    settings: Settings,
    *,
    keys: KeySet | None = None,
    config_path: str | None = None,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> web.Application:
    """Build the public application.

    Args:
        settings: validated configuration.
        keys: the loaded keys file; None loads ``settings.auth.keys_file``.
        config_path: the TOML file to watch for reloads (None: only the keys file is watched).
        registry: Prometheus registry for the gateway's families (a fresh one when None).
        clock: monotonic clock in seconds (durations, limits, queue).

    Raises:
        gateway.credentials.KeysFileError: the keys file is missing, unreadable, malformed or
            not 0600.
    """
    if keys is None:
        keys = load_keys_file(settings.auth.keys_file)
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    metrics = Metrics(registry)
    metrics.prime(settings.tenant_labels())
    metrics.keys_loaded.set(keys.key_count)

    app = web.Application(
        middlewares=[context_middleware, error_middleware, auth_middleware],
        client_max_size=settings.server.max_body_bytes,
        # Bodies are decoded by gateway.body.read_body, after authentication, never before.
        handler_args={"max_field_size": 16384, "auto_decompress": False},
    )
    app[LIVE] = LiveRef(build_live(settings, keys))
    app[METRICS] = metrics
    app[CLOCK] = clock
    app[STARTED] = time.time()
    app[DRAIN] = Drain()
    app[ENGINE_STATE] = EngineState(metrics, clock, quiet=True)
    specs = settings.engine_specs
    app[ADMISSION] = AdmissionQueue(
        settings.engine.max_concurrency,
        settings.engine.queue_size,
        settings.engine.queue_timeout_s,
        metrics,
        clock=clock,
        engines=[(spec.name, spec.max_concurrency) for spec in specs],
        affinity_load_factor=settings.engine.affinity_load_factor,
    )
    admission = app[ADMISSION]
    app[BODY_MEMORY] = BodyMemory(
        settings.server.bodies_max_bytes,
        metrics,
        lambda: 1.0 / admission.drain_rate,
        upload_idle_s=settings.server.body_timeout_s,
    )
    app[FORECASTER] = Forecaster(metrics, clock)
    app[FORECASTER].export(settings.deadline)
    app[QUARANTINE] = quarantine = Quarantine(
        settings.quarantine,
        fingerprint_key(app[LIVE].current.salt_secret),
        metrics,
        health_interval_s=lambda: app[LIVE].current.settings.engine.health_interval_s,
        unhealthy_after_s=lambda: app[LIVE].current.settings.engine.unhealthy_after_s,
    )

    # The engines: their states drive the queue's rotation, the quarantine's deaths and the
    # fleet's state (gateway.engines); their sessions open with the app (_upstream_ctx).
    app[ENGINES] = Engines(specs, metrics, clock, app[ENGINE_STATE], app[ADMISSION], quarantine)
    app[DIALECTS] = {}
    app[FLIGHTS] = Flights(clock, metrics.registry)
    app[FINISH_HOOKS] = []

    def on_reload(new_settings: Settings, new_keys: KeySet) -> None:
        app[LIVE].current = build_live(new_settings, new_keys, previous=app[LIVE].current)
        # The state file stays the one the gateway started with (a restart changes it).
        kept = dataclasses.replace(
            new_settings.quarantine, state_file=quarantine.settings.state_file
        )
        quarantine.settings = kept
        quarantine.key = fingerprint_key(app[LIVE].current.salt_secret)
        set_level(new_settings.logging.level)
        metrics.prime(new_settings.tenant_labels())
        metrics.keys_loaded.set(new_keys.key_count)
        app[FORECASTER].export(new_settings.deadline)
        if LIMITER in app:
            app[LIMITER].reconfigure(new_settings)
        if ACCOUNTING in app:
            app[ACCOUNTING].reconfigure(new_settings)
        app[BODY_MEMORY].limit = new_settings.server.bodies_max_bytes
        engine = new_settings.engine
        app[ENGINES].reconfigure(engine)
        known = app[ENGINES].specs
        app[ADMISSION].reconfigure(
            {s.name: s.max_concurrency for s in new_settings.engine_specs if s.name in known},
            engine.queue_size,
            engine.queue_timeout_s,
            engine.affinity_load_factor,
        )
        if FLEET_SYNC in app:
            app[FLEET_SYNC].wake()  # publish a revocation now

    app[RELOADER] = Reloader(
        config_path=config_path,
        keys_path=settings.auth.keys_file,
        poll_s=settings.auth.reload_poll_s,
        on_reload=on_reload,
        metrics=metrics,
        settings=settings,
    )
    app.cleanup_ctx.append(fleet_ctx)
    app.cleanup_ctx.append(_upstream_ctx)
    app.cleanup_ctx.append(_limiter_ctx)
    app.cleanup_ctx.append(_accounting_ctx)
    app.cleanup_ctx.append(_reloader_ctx)

    app[STORE] = make_store(settings, clock)
    responses = responses_dialect(app[STORE])
    for route, dialect in (
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", COMPLETIONS),
        ("/v1/messages", ANTHROPIC),
        ("/v1/responses", responses),
    ):
        app.router.add_post(route, model_handler(dialect), expect_handler=expect_continue)
        app[DIALECTS][route] = dialect
    app.router.add_post("/v1/messages/count_tokens", count_tokens, expect_handler=expect_continue)
    app[DIALECTS]["/v1/messages/count_tokens"] = ANTHROPIC
    stored = "/v1/responses/{response_id}"
    app.router.add_get(stored, get_response, allow_head=False, expect_handler=expect_continue)
    app.router.add_delete(stored, delete_response, expect_handler=expect_continue)
    app.router.add_post(stored + "/cancel", cancel_response, expect_handler=expect_continue)
    items = stored + "/input_items"
    app.router.add_get(items, list_input_items, allow_head=False, expect_handler=expect_continue)
    app[DIALECTS][stored] = responses
    app[DIALECTS][stored + "/cancel"] = responses
    app[DIALECTS][items] = responses
    # Every route takes `expect_continue`: aiohttp's default answers an unknown expectation
    # with a text page quoting the header (a 500 when it holds a lone surrogate).
    for path, get_handler, head in (
        ("/v1/models", list_models, False),
        ("/v1/models/{id}", get_model, False),
        ("/v1/usage", usage, False),
        ("/health", health, True),
        ("/ready", ready, True),
    ):
        app.router.add_get(path, get_handler, allow_head=head, expect_handler=expect_continue)
    return app


async def _upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    """Each engine's session and health poller (`Engines.start`), the drift check of each, the
    quarantine file's watcher, the engine's idle counters (one engine of one slot), the answer
    worker and the plan worker (`gateway.plan_worker`). ``UPSTREAM`` is the first engine's session (requests that need no slot pick
    an engine in rotation through `Engines.counter`)."""
    fleet = app[ENGINES]
    fleet.start(lambda: app[LIVE].current.settings.engine)
    app[UPSTREAM] = upstream = fleet.upstream(None)
    queue = app[ADMISSION]
    state = app[ENGINE_STATE]
    app[IDLE_COUNTERS] = idle = IdleCounters(upstream)
    app[ANSWER_WORKER] = worker = AnswerWorker()
    app[PLAN_WORKER] = planner = PlanWorker(app[STORE])

    def on_engine(previous: EngineStatus, status: EngineStatus) -> None:
        idle.forget()  # another engine process, or none: its counters start again
        admission = app[ADMISSION]
        if status == "ready" and admission.max_concurrency == 1 and admission.in_flight == 0:
            idle.refresh(admission.grants)

    state.listeners.append(on_engine)
    tasks = [
        asyncio.create_task(
            check_drift(
                fleet.upstreams[name],
                fleet.states[name],
                functools.partial(lambda n: queue.engines[n].in_flight, name),
                lambda: app[LIVE].current.settings.engine.drift_check_interval_s,
            )
        )
        for name in fleet.names
    ]
    tasks.append(asyncio.create_task(_watch_quarantine(app[QUARANTINE])))
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await idle.close()
    await worker.close()
    await planner.close()
    await fleet.close()


async def _watch_quarantine(quarantine: Quarantine) -> None:
    """Pick up the operator's changes to the quarantine state file every ``poll_s``."""
    while True:
        await asyncio.sleep(quarantine.settings.poll_s)
        quarantine.refresh()


async def _limiter_ctx(app: web.Application) -> AsyncIterator[None]:
    """The rate limiter ``[ratelimit] backend`` names, started and closed with the app."""
    limiter = create_rate_limiter(app[LIVE].current.settings, app[METRICS], clock=app[CLOCK])
    app[LIMITER] = limiter
    await limiter.start()
    yield
    await limiter.close()


async def _accounting_ctx(app: web.Application) -> AsyncIterator[None]:
    """Quotas and the usage ledger: restored and started before the first request, and the
    ledger's last records committed after the last one."""
    accounting = Accounting(app[LIVE].current.settings, app[METRICS])
    app[ACCOUNTING] = accounting
    app[BUDGETS] = Budgets(app[LIMITER], accounting.quota)
    await accounting.start()
    hook = functools.partial(record_call, accounting)
    app[FINISH_HOOKS].append(hook)
    yield
    app[FINISH_HOOKS].remove(hook)
    await accounting.close()


async def _reloader_ctx(app: web.Application) -> AsyncIterator[None]:
    """The config and keys watcher (SIGHUP and polling)."""
    reloader = app[RELOADER]
    await reloader.start()
    yield
    await reloader.stop()
