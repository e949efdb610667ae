"""The app factory: routes, middlewares and the model request path (DESIGN sections 1, 5, 6).

One request: request id + access log -> errors -> auth -> body -> rewrite -> rate limit ->
admission queue -> engine over the Unix socket -> JSON or SSE relay -> accounting. Every
acquired slot is released in a ``finally`` on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.admission import AdmissionQueue, Ticket
from gateway.auth import Authenticator, Principal
from gateway.config import Settings, TenantSettings
from gateway.errors import (
    BadRequest,
    EngineUnavailable,
    GatewayError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
)
from gateway.keys import KeySet, load_keys_file
from gateway.logs import set_level
from gateway.metrics import ROUTES, Metrics
from gateway.ratelimit import RateLimiter, Reservation, create_rate_limiter
from gateway.reload import Reloader
from gateway.rewrite import Kind, RequestPlan, model_not_found, plan_request
from gateway.sse import SseRelay, StreamProtocolError, rewrite_completion_body
from gateway.upstream import RETRY_AFTER_DOWN_S, EngineClient, EngineState

log = structlog.get_logger("gateway.access")
events = structlog.get_logger("gateway")

PUBLIC_PATHS = frozenset({"/health", "/ready"})
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_QUEUED_COMMENT = b": queued\n\n"
_QUEUED_COMMENT_EVERY_S = 5.0
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


@dataclass
class Live:
    """What a reload swaps as a whole: settings, keys and the authenticator built from them.

    Requests read ``app[LIVE]`` attributes once at their start, so a reload never changes the
    rules under a request in flight.
    """

    settings: Settings
    keys: KeySet
    auth: Authenticator
    salt_secret: bytes
    loaded_at: float = field(default_factory=time.time)


class LiveRef:
    """The mutable cell holding the current `Live`; a reload replaces ``current`` in one step."""

    def __init__(self, live: Live) -> None:
        self.current = live


@dataclass
class RequestInfo:
    """Facts about one request for the access log and metrics; filled along the path."""

    request_id: str
    started: float
    route: str = "other"
    tenant: str = "unknown"
    key_id: str | None = None
    stream: bool | None = None
    thinking: bool | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    reason: str | None = None
    status: int = 0


LIVE = web.AppKey("live", LiveRef)
METRICS = web.AppKey("metrics", Metrics)
ENGINE = web.AppKey("engine", EngineClient)
ENGINE_STATE = web.AppKey("engine_state", EngineState)
LIMITER = web.AppKey("limiter", RateLimiter)
ADMISSION = web.AppKey("admission", AdmissionQueue)
RELOADER = web.AppKey("reloader", Reloader)
CLOCK: web.AppKey[Callable[[], float]] = web.AppKey("clock")
STARTED = web.AppKey("started", float)
INFO = web.RequestKey("info", RequestInfo)
PRINCIPAL = web.RequestKey("principal", Principal)


def build_live(settings: Settings, keys: KeySet, clock: Callable[[], float] = time.time) -> Live:
    """Compile settings and keys into a `Live` (authenticator tables, cache-salt secret)."""
    secret = keys.setting("QWEN38_CACHE_SALT_SECRET")
    salt = secret.encode() if secret else _PROCESS_SALT
    auth = Authenticator(
        keys,
        leeway_s=settings.auth.jwt_leeway_s,
        max_ttl_s=settings.auth.jwt_max_ttl_s,
        clock=clock,
    )
    return Live(settings=settings, keys=keys, auth=auth, salt_secret=salt)


# Without QWEN38_CACHE_SALT_SECRET the salt is random per process: tenants stay isolated, at the
# price of prefix-cache misses after a restart and across replicas.
_PROCESS_SALT = secrets.token_bytes(32)


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
        gateway.keys.KeysFileError: the keys file is missing, unreadable, malformed or not 0600.
    """
    if keys is None:
        keys = load_keys_file(settings.auth.keys_file)
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    metrics = Metrics(registry)
    metrics.prime(settings.tenant_labels())
    metrics.keys_loaded.set(keys.key_count)

    app = web.Application(
        middlewares=[access_middleware, auth_middleware],
        client_max_size=settings.server.max_body_bytes,
        handler_args={"max_field_size": 16384},
    )
    app[LIVE] = LiveRef(build_live(settings, keys))
    app[METRICS] = metrics
    app[CLOCK] = clock
    app[STARTED] = time.time()
    app[ENGINE_STATE] = EngineState(metrics, clock)
    app[ADMISSION] = AdmissionQueue(
        settings.engine.max_concurrency,
        settings.engine.queue_size,
        settings.engine.queue_timeout_s,
        metrics,
        clock=clock,
    )

    def on_reload(new_settings: Settings, new_keys: KeySet) -> None:
        app[LIVE].current = build_live(new_settings, new_keys)
        set_level(new_settings.logging.level)
        metrics.prime(new_settings.tenant_labels())
        metrics.keys_loaded.set(new_keys.key_count)
        if LIMITER in app:
            app[LIMITER].reconfigure(new_settings)
        engine = new_settings.engine
        app[ADMISSION].reconfigure(
            engine.max_concurrency, engine.queue_size, engine.queue_timeout_s
        )

    app[RELOADER] = Reloader(
        config_path=config_path,
        keys_path=settings.auth.keys_file,
        poll_s=settings.auth.reload_poll_s,
        on_reload=on_reload,
        metrics=metrics,
        settings=settings,
    )
    app.cleanup_ctx.append(_engine_ctx)
    app.cleanup_ctx.append(_limiter_ctx)
    app.cleanup_ctx.append(_reloader_ctx)

    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models, allow_head=False)
    app.router.add_get("/v1/models/{id}", get_model, allow_head=False)
    app.router.add_get("/health", health, allow_head=True)
    app.router.add_get("/ready", ready, allow_head=True)
    return app


# --------------------------------------------------------------------------------- lifetimes


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    """Upstream session and the health poller that drives `EngineState`."""
    settings = app[LIVE].current.settings
    client = EngineClient(settings.engine, app[METRICS])
    app[ENGINE] = client
    tasks = [
        asyncio.create_task(_poll_health(app, client)),
        asyncio.create_task(_check_drift(app, client)),
    ]
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await client.close()


async def _poll_health(app: web.Application, client: EngineClient) -> None:
    """Probe the engine's /health every ``engine.health_interval_s`` seconds."""
    state = app[ENGINE_STATE]
    while True:
        engine = app[LIVE].current.settings.engine
        status, error = await client.health(timeout=max(1.0, engine.health_interval_s))
        if status == "ready" and engine.ready_file and not os.path.exists(engine.ready_file):
            status = "warming"
        if status == "down" and state.status == "starting":
            status = "starting"
        state.set(status, error)
        await asyncio.sleep(engine.health_interval_s)


def engine_running(text: str) -> float | None:
    """``vllm:num_requests_running`` summed over engines, from a Prometheus exposition text."""
    total = None
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:num_requests_running":
            total = sum(sample.value for sample in family.samples)
    return total


async def _check_drift(app: web.Application, client: EngineClient) -> None:
    """Compare the gateway's in-flight count with the engine's running requests; log drift.

    The engine running more requests than the gateway admitted means generations nobody waits
    for (an abort that did not reach the engine); fewer, for two checks in a row, means a slot
    the gateway never released. Both are logged as ``inflight_drift`` for the operator.
    """
    previous = 0.0
    while True:
        await asyncio.sleep(app[LIVE].current.settings.engine.drift_check_interval_s)
        if not app[ENGINE_STATE].ready:
            continue
        try:
            running = engine_running(await client.metrics_text(timeout=5.0))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            continue
        if running is None:
            continue
        drift = app[ADMISSION].in_flight - running
        if drift and previous and (drift > 0) == (previous > 0):
            events.warning(
                "inflight_drift",
                gateway_in_flight=app[ADMISSION].in_flight,
                engine_running=running,
            )
        previous = drift


async def _limiter_ctx(app: web.Application) -> AsyncIterator[None]:
    limiter = create_rate_limiter(app[LIVE].current.settings, app[METRICS], clock=app[CLOCK])
    app[LIMITER] = limiter
    await limiter.start()
    yield
    await limiter.close()


async def _reloader_ctx(app: web.Application) -> AsyncIterator[None]:
    reloader = app[RELOADER]
    await reloader.start()
    yield
    await reloader.stop()


# ------------------------------------------------------------------------------- middlewares


def _sane_request_id(value: str) -> bool:
    """A client request id is kept when short and plain, and not shaped like a credential
    (an ``sk-`` key or a JWT sent by mistake would otherwise reach logs and the engine)."""
    return bool(_REQUEST_ID_RE.match(value)) and not value.startswith(("sk-", "eyJ"))


def _route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    canonical = resource.canonical if resource is not None else "other"
    return canonical if canonical in ROUTES else "other"


@web.middleware
async def access_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """Request id, the one access log line, request metrics, and the error layer.

    A `GatewayError` before the response started becomes its OpenAI-shaped JSON; after, the
    handler has already ended the stream with an error event. A client that went away is
    logged with status 499 (nginx's "client closed request").
    """
    supplied = request.headers.get("X-Request-Id", "")
    request_id = supplied if _sane_request_id(supplied) else uuid.uuid4().hex
    clock = request.app[CLOCK]
    info = RequestInfo(request_id=request_id, started=clock(), route=_route_label(request))
    request[INFO] = info
    structlog.contextvars.bind_contextvars(request_id=request_id)
    response: web.StreamResponse | None = None
    try:
        try:
            response = await handler(request)
        except GatewayError as exc:
            response = _error_response(exc)
            info.reason = info.reason or exc.reason
        except web.HTTPException as exc:
            response = _error_response(_translate_http(exc))
            info.reason = info.reason or "http"
        except asyncio.CancelledError:
            info.status = 499
            info.reason = info.reason or "client_disconnect"
            raise
        except Exception:
            events.exception("unhandled_error")
            response = _error_response(GatewayError("Internal server error."))
            info.reason = "internal"
        if not info.status:
            info.status = response.status
        response.headers["x-request-id"] = request_id
        return response
    finally:
        _finish_request(request, info)
        structlog.contextvars.unbind_contextvars("request_id")


def _finish_request(request: web.Request, info: RequestInfo) -> None:
    """Emit the access line and the request metrics exactly once."""
    metrics = request.app[METRICS]
    duration = request.app[CLOCK]() - info.started
    status = info.status or 500
    metrics.requests.labels(info.tenant, info.route, str(status)).inc()
    metrics.request_duration.labels(info.tenant, info.route).observe(duration)
    fields: dict[str, Any] = {
        "method": request.method,
        "route": info.route,
        "status": status,
        "tenant": info.tenant,
        "duration_ms": round(duration * 1000, 2),
    }
    if info.key_id is not None:
        fields["key_id"] = info.key_id
    if info.stream is not None:
        fields["stream"] = info.stream
    if info.thinking is not None:
        fields["thinking"] = info.thinking
    if info.ttft_s is not None:
        fields["ttft_ms"] = round(info.ttft_s * 1000, 2)
    if info.prompt_tokens is not None:
        fields["prompt_tokens"] = info.prompt_tokens
        fields["completion_tokens"] = info.completion_tokens
    if info.reason:
        fields["reason"] = info.reason
    if status >= 500:
        log.warning("request", **fields)
    else:
        log.info("request", **fields)


def _translate_http(exc: web.HTTPException) -> GatewayError:
    """aiohttp's routing answers (404/405) in OpenAI shape."""
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        return MethodNotAllowed(
            "Method not allowed for this route.", headers={"Allow": allowed} if allowed else None
        )
    if exc.status == 404:
        return NotFound("Unknown route.")
    err = GatewayError(exc.reason or "HTTP error")
    err.status = exc.status  # type: ignore[misc]
    return err


def _error_response(exc: GatewayError) -> web.Response:
    return web.Response(
        status=exc.status,
        body=exc.json_bytes(),
        content_type="application/json",
        headers=exc.headers,
    )


@web.middleware
async def auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """Every path but /health and /ready needs a credential, unknown paths included (C14).

    Authentication decides on the same normalised path the router matched.
    """
    if request.path in PUBLIC_PATHS:
        return await handler(request)
    info: RequestInfo = request[INFO]
    live = request.app[LIVE].current
    try:
        principal = live.auth.authenticate(request.headers.get("Authorization"))
    except GatewayError as exc:
        request.app[METRICS].auth_failures.labels(exc.reason).inc()
        raise
    request[PRINCIPAL] = principal
    info.tenant = live.settings.tenant_label(principal.tenant)
    info.key_id = principal.key_id
    return await handler(request)


# ---------------------------------------------------------------------------- plain handlers


async def health(request: web.Request) -> web.Response:
    """200 while the process is alive."""
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 when keys are loaded and the engine is healthy and warm; JSON detail either way."""
    app = request.app
    state = app[ENGINE_STATE]
    live = app[LIVE].current
    keys_ok = live.keys.key_count > 0 or bool(live.keys.signing_keys)
    is_ready = keys_ok and state.ready
    body = {
        "ready": is_ready,
        "engine": state.status,
        "engine_state_for_s": round(app[CLOCK]() - state.since, 3),
        "keys_loaded": live.keys.key_count,
        "queue_depth": app[ADMISSION].depth,
        "in_flight": app[ADMISSION].in_flight,
    }
    return web.json_response(body, status=200 if is_ready else 503)


def _model_card(request: web.Request) -> dict[str, Any]:
    settings = request.app[LIVE].current.settings
    return {
        "id": settings.model.alias,
        "object": "model",
        "created": int(request.app[STARTED]),
        "owned_by": "qwen38-gateway",
        "max_model_len": settings.engine.max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    """The alias only, in OpenAI's list shape; no server paths (vllm-protocol.md section 8.1)."""
    headers = await _limit_headers(request)
    return web.json_response({"object": "list", "data": [_model_card(request)]}, headers=headers)


async def get_model(request: web.Request) -> web.Response:
    """One model card, or 404 ``model_not_found``."""
    if request.match_info["id"] != request.app[LIVE].current.settings.model.alias:
        raise model_not_found(request.match_info["id"])
    headers = await _limit_headers(request)
    return web.json_response(_model_card(request), headers=headers)


async def _limit_headers(request: web.Request) -> dict[str, str]:
    principal: Principal = request[PRINCIPAL]
    tenant = request.app[LIVE].current.settings.tenant(principal.tenant)
    return await request.app[LIMITER].headers(tenant)


# ----------------------------------------------------------------------- model request path


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``, streaming or not."""
    return await _proxy(request, "chat", "/v1/chat/completions")


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``, streaming or not."""
    return await _proxy(request, "completions", "/v1/completions")


async def read_body(request: web.Request, limit: int, idle_timeout: float) -> bytes:
    """The request body, reading no further than ``limit`` bytes (case C16).

    Raises:
        PayloadTooLarge: ``Content-Length`` or the bytes received exceed ``limit`` (after any
            ``Content-Encoding`` is undone, so a compression bomb stops at the limit too).
        RequestTimeout: no byte arrived for ``idle_timeout`` seconds.
        BadRequest: the body does not match its ``Content-Encoding``.
    """
    too_large = PayloadTooLarge(f"Request body too large: the limit is {limit} bytes.")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    content = request.content
    while True:
        try:
            if content.is_eof():  # the rest is buffered already: no wait, no timer task
                chunk = await content.readany()
            else:
                chunk = await asyncio.wait_for(content.readany(), idle_timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(
                f"The request body stopped arriving for {idle_timeout:g} s.",
                headers={"Connection": "close"},
            ) from None
        except (HttpProcessingError, RequestPayloadError):
            raise BadRequest(
                "The request body could not be decoded with its Content-Encoding."
            ) from None
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    """``json.loads`` hook: ``NaN`` and ``Infinity`` are not JSON (RFC 8259 section 6)."""
    raise ValueError(f"{name} is not a valid JSON number")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def parse_body(raw: bytes) -> Any:
    """Parse a request body as strict JSON (UTF-8, or UTF-16/32 detected as ``json.loads`` does).

    Raises:
        BadRequest: not JSON, a non-finite number literal, or nested too deeply.
    """
    try:
        return _DECODER.decode(raw.decode(json.detect_encoding(raw)))
    except RecursionError:
        raise BadRequest("The JSON body is nested too deeply.") from None
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(
            "We could not parse the JSON body of your request. "
            "(HINT: This likely means you aren't using your HTTP library correctly.)"
        ) from None


@dataclass
class _Outcome:
    """Accounting for one model request, settled in the ``finally``."""

    reached_engine: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    streamed_events: int = 0


async def _proxy(request: web.Request, kind: Kind, path: str) -> web.StreamResponse:
    app = request.app
    info: RequestInfo = request[INFO]
    live = app[LIVE].current
    settings = live.settings
    principal: Principal = request[PRINCIPAL]
    tenant = settings.tenant(principal.tenant)

    raw = await read_body(request, settings.server.max_body_bytes, settings.server.body_timeout_s)
    try:
        plan = plan_request(
            parse_body(raw),
            kind,
            settings=settings,
            tenant=tenant,
            request_id=info.request_id,
            salt_secret=live.salt_secret,
        )
    except RecursionError:
        raise BadRequest("The JSON body is nested too deeply.") from None
    info.stream = plan.stream
    info.thinking = plan.thinking

    state = app[ENGINE_STATE]
    if not state.ready:
        raise state.unavailable()

    metrics = app[METRICS]
    limiter = app[LIMITER]
    try:
        reservation = await limiter.reserve(tenant, plan.reserve_tokens)
    except GatewayError as exc:
        info.reason = exc.reason
        raise
    outcome = _Outcome()
    label = info.tenant
    metrics.in_flight.labels(label).inc()
    try:
        ticket = app[ADMISSION].enqueue(
            tenant.name, tenant.weight, plan.reserve_tokens, label=label
        )
        try:
            return await _admitted(request, plan, path, ticket, reservation, outcome, tenant)
        finally:
            ticket.release()
    except GatewayError as exc:
        for name, value in reservation.headers.items():
            exc.headers.setdefault(name, value)
        raise
    finally:
        metrics.in_flight.labels(label).dec()
        used = _settle_tokens(plan, outcome)
        info.prompt_tokens, info.completion_tokens = used
        if outcome.reached_engine:
            metrics.tokens.labels(label, "prompt").inc(used[0])
            metrics.tokens.labels(label, "completion").inc(used[1])
        await limiter.settle(reservation, used[0] + used[1])


def _settle_tokens(plan: RequestPlan, outcome: _Outcome) -> tuple[int, int]:
    """(prompt, completion) tokens to charge: the engine's usage, else what was observed.

    A request that never reached the engine costs nothing; one cut short without usage is
    charged its prompt estimate plus one token per streamed chunk (one token a delta on this
    engine), so a disconnect pays for what was generated (issue 4).
    """
    if not outcome.reached_engine:
        return 0, 0
    prompt = outcome.prompt_tokens
    completion = outcome.completion_tokens
    if prompt is None:
        prompt = plan.prompt_estimate
    if completion is None:
        completion = outcome.streamed_events
    return prompt, completion


async def _admitted(
    request: web.Request,
    plan: RequestPlan,
    path: str,
    ticket: Ticket,
    reservation: Reservation,
    outcome: _Outcome,
    tenant: TenantSettings,
) -> web.StreamResponse:
    """Wait for an engine slot (with ``: queued`` comments for long-waiting streams), then call."""
    app = request.app
    info: RequestInfo = request[INFO]
    settings = app[LIVE].current.settings
    sse: web.StreamResponse | None = None
    try:
        comment_after = settings.engine.queued_comment_after_s
        if plan.stream and comment_after > 0:
            granted = await ticket.wait(comment_after)
            while not granted:
                if sse is None:
                    sse = await _start_sse(request, reservation.headers)
                await _send(request, sse, _QUEUED_COMMENT)
                granted = await ticket.wait(_QUEUED_COMMENT_EVERY_S)
        else:
            await ticket.wait(None)
        state = app[ENGINE_STATE]
        if not state.ready:
            remaining = max(0.0, settings.engine.queue_timeout_s - ticket.waited_s)
            if not await state.wait_ready(remaining):
                raise state.unavailable()
    except GatewayError as exc:
        if sse is None:
            raise
        return await _end_with_error(sse, info, exc)
    except ConnectionResetError as exc:
        return _client_gone(request, sse, info, isinstance(exc, ClientStalled))
    queued_budget = 0.0
    if ticket.waited_s > 0:
        queued_budget = max(0.0, settings.engine.queue_timeout_s - ticket.waited_s)
    return await _call_engine(request, plan, path, reservation, outcome, sse, queued_budget)


async def _start_sse(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    """Send the SSE response headers: no buffering by proxies, no compression (case C01)."""
    response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
    response.headers["x-request-id"] = request[INFO].request_id
    await response.prepare(request)
    return response


class ClientStalled(ConnectionResetError):
    """The client left a stream unread longer than ``server.client_write_timeout_s``."""


async def _send(request: web.Request, sse: web.StreamResponse, data: bytes) -> None:
    """Write to a stream; a client that stops reading counts as gone after the write timeout.

    The timer is armed only when data already waits in the socket's user-space buffer (the
    client is behind), so a client that keeps up costs one plain write.

    Raises:
        ConnectionResetError: the client went away (`ClientStalled` when it stopped reading).
    """
    transport = request.transport
    if transport is None or not transport.get_write_buffer_size():
        await sse.write(data)
        return
    timeout = request.app[LIVE].current.settings.server.client_write_timeout_s
    try:
        await asyncio.wait_for(sse.write(data), timeout)
    except asyncio.TimeoutError:
        transport.abort()
        raise ClientStalled(f"client did not read for {timeout:g} s") from None


async def _end_with_error(
    sse: web.StreamResponse, info: RequestInfo, exc: GatewayError
) -> web.StreamResponse:
    """After the headers went out an error is one final SSE error event, then the end."""
    info.status = exc.status
    info.reason = info.reason or exc.reason
    try:
        await sse.write(exc.sse_event())
        await sse.write_eof()
    except ConnectionResetError:
        pass
    return sse


def _client_gone(
    request: web.Request,
    sse: web.StreamResponse | None,
    info: RequestInfo,
    stalled: bool = False,
) -> web.StreamResponse:
    info.status = 499
    info.reason = "client_stalled" if stalled else "client_disconnect"
    request.app[METRICS].client_disconnects.labels(info.tenant).inc()
    return sse if sse is not None else web.Response(status=499)


async def _call_engine(
    request: web.Request,
    plan: RequestPlan,
    path: str,
    reservation: Reservation,
    outcome: _Outcome,
    sse: web.StreamResponse | None,
    queued_budget: float,
) -> web.StreamResponse:
    """POST to the engine and relay its answer; the engine request is closed on every exit.

    An engine that refuses the connection is marked down at once. A request that had already
    waited in the queue keeps waiting for the engine's return for the rest of its queue time
    (``queued_budget`` seconds); a fresh one gets 503 at once.
    """
    app = request.app
    info: RequestInfo = request[INFO]
    client = app[ENGINE]
    state = app[ENGINE_STATE]
    clock = app[CLOCK]
    deadline = clock() + queued_budget
    while True:
        try:
            upstream = await client.post(path, plan.body, info.request_id)
            break
        except EngineUnavailable as exc:
            state.set("down", "connection refused")
            remaining = deadline - clock()
            if remaining > 0 and await state.wait_ready(remaining):
                continue
            if sse is None:
                raise
            return await _end_with_error(sse, info, exc)
        except GatewayError as exc:
            if sse is None:
                raise
            return await _end_with_error(sse, info, exc)
    outcome.reached_engine = True
    complete = False
    try:
        if upstream.status != 200:
            error = await _engine_error(client, upstream)
            complete = True
            if sse is None:
                raise error
            return await _end_with_error(sse, info, error)
        if plan.stream:
            result = await _relay_stream(request, plan, upstream, reservation, outcome, sse)
        else:
            result = await _relay_json(request, plan, upstream, reservation, outcome)
        complete = True
        return result
    except asyncio.CancelledError:
        _client_gone(request, sse, info)
        raise
    finally:
        if complete:
            upstream.release()
        else:
            upstream.close()  # closing the socket is how the engine learns to abort (C10)


async def _engine_error(client: EngineClient, upstream: aiohttp.ClientResponse) -> GatewayError:
    """Translate a non-200 engine answer. 4xx bodies pass through (they describe the request)."""
    try:
        body = await upstream.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return client.error("disconnect", exc)
    status = upstream.status
    if 400 <= status < 500 and status not in (401, 403, 404):
        message, param, etype = "The engine rejected the request.", None, "invalid_request_error"
        try:
            obj = json.loads(body)
            err = obj.get("error") if isinstance(obj, dict) else None
            if isinstance(err, dict):
                message = str(err.get("message") or message)
                param = err.get("param") if isinstance(err.get("param"), str) else None
        except ValueError:
            pass
        error = GatewayError(
            message, param=param, type=etype, code="invalid_request", reason="engine_4xx"
        )
        error.status = status  # type: ignore[misc]
        return error
    if status == 503:
        client.error("status_5xx")
        return EngineUnavailable(
            "The model is not available right now (engine busy or restarting). Retry later.",
            retry_after_s=RETRY_AFTER_DOWN_S,
        )
    return client.error("status_5xx" if status >= 500 else "bad_response")


async def _relay_json(
    request: web.Request,
    plan: RequestPlan,
    upstream: aiohttp.ClientResponse,
    reservation: Reservation,
    outcome: _Outcome,
) -> web.StreamResponse:
    """Read the whole engine answer, rewrite it, count its usage, answer as JSON."""
    app = request.app
    client = app[ENGINE]
    try:
        raw = await upstream.read()
    except asyncio.TimeoutError as exc:
        raise client.error("timeout", exc) from exc
    except aiohttp.ClientError as exc:
        raise client.error("disconnect", exc) from exc
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise client.error("bad_response", exc) from exc
    if not isinstance(body, dict):
        raise client.error("bad_response")
    usage = body.get("usage")
    if isinstance(usage, dict):
        outcome.prompt_tokens = _count(usage.get("prompt_tokens"))
        outcome.completion_tokens = _count(usage.get("completion_tokens"))
    rewrite_completion_body(body, app[LIVE].current.settings.model.alias)
    return web.Response(
        body=json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
        content_type="application/json",
        headers=reservation.headers,
    )


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


async def _relay_stream(
    request: web.Request,
    plan: RequestPlan,
    upstream: aiohttp.ClientResponse,
    reservation: Reservation,
    outcome: _Outcome,
    sse: web.StreamResponse | None,
) -> web.StreamResponse:
    """Forward the engine's SSE as it arrives: one client write per engine read (case C01)."""
    app = request.app
    info: RequestInfo = request[INFO]
    settings = app[LIVE].current.settings
    client = app[ENGINE]
    metrics = app[METRICS]
    clock = app[CLOCK]
    if sse is None:
        sse = await _start_sse(request, reservation.headers)
    relay = SseRelay(
        settings.engine.model,
        settings.model.alias,
        client_wants_usage=plan.client_wants_usage,
        n=plan.n,
    )
    state = relay.state
    failure: GatewayError | None = None
    try:
        try:
            async for data in upstream.content.iter_any():
                out = relay.feed(data)
                if out:
                    if info.ttft_s is None and state.events:
                        info.ttft_s = clock() - info.started
                        metrics.ttft.labels(info.tenant).observe(info.ttft_s)
                    await _send(request, sse, out)
        except asyncio.TimeoutError as exc:
            failure = client.error("timeout", exc)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            failure = client.error("disconnect", exc)
        except StreamProtocolError as exc:
            failure = client.error("bad_response", exc)
        tail = relay.finish() if failure is None else b""
        if failure is None and not relay.clean_end:
            failure = client.error("disconnect")
        if state.error is not None:
            metrics.upstream_errors.labels("stream_error").inc()
            info.reason = "stream_error"
        if failure is not None:
            return await _end_with_error(sse, info, failure)
        await sse.write_eof(tail)  # the last chunk and the terminator in one write
    except ConnectionResetError as exc:
        return _client_gone(request, sse, info, isinstance(exc, ClientStalled))
    finally:
        # Whatever ended the stream (client gone, cancellation, engine drop), charge what was seen.
        outcome.streamed_events = state.content_events
        if state.usage is not None:
            outcome.prompt_tokens = state.usage.prompt_tokens
            outcome.completion_tokens = state.usage.completion_tokens
    info.status = 200
    return sse
