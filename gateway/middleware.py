"""The middlewares, outermost first as starlette orders them: context, errors, authentication.

- `context_middleware`: the request id, the `RequestContext` (configuration snapshot taken once),
  and at the end the one access line, the request metrics and the finish hooks;
- `error_middleware`: a `GatewayError` (or aiohttp's 404/405, or a bug) becomes its error
  response before the response started; after, the handler has already ended its stream;
- `auth_middleware`: every path but /health and /ready needs a credential (case C14); the
  caller is resolved once into `Caller`.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import HttpVersion11, web

from gateway.auth import Authenticator
from gateway.body import check_content_encoding
from gateway.dialects import CHAT, Dialect
from gateway.errors import (
    BadRequest,
    GatewayError,
    HttpError,
    InvalidApiKey,
    MethodNotAllowed,
    NotFound,
)
from gateway.http_errors import error_for
from gateway.logs import access_line
from gateway.metrics import ROUTES
from gateway.secret_scan import OwnCredential, decodings, looks_like_credential
from gateway.state import (
    BODY_MEMORY,
    CLOCK,
    CONTEXT,
    DIALECTS,
    DRAIN,
    FINISH_HOOKS,
    LIMITER,
    LIVE,
    METRICS,
    Caller,
    RequestContext,
)

events = structlog.get_logger("gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PUBLIC_PATHS = frozenset({"/health", "/ready"})
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def sane_request_id(value: str) -> bool:
    """A client request id is kept when short and plain, and holds no credential's shape
    as sent or percent-, hex- or base64-decoded, at its start or further in
    (`gateway.secret_scan.looks_like_credential`: an ``sk-`` key, a JWT or a ``Bearer`` value
    sent by mistake, ``trace_sk-...`` included, would otherwise reach logs, the ledger, every
    response header and the engine; a loaded API key's secret without its prefix is refused by
    the caller, by its digest: `gateway.auth.Authenticator.holds_api_key`)."""
    return bool(_REQUEST_ID_RE.match(value)) and not looks_like_credential(value)


def _holds_a_key(request_id: str, authorization: str | None, auth: Authenticator) -> bool:
    """True when ``request_id``, as sent or decoded (`gateway.secret_scan.decodings`: percent,
    hex, base64), holds the credential this request presents (`_carries_own_credential`) or a
    key the gateway loaded (`Authenticator.holds_api_key`)."""
    return any(
        _carries_own_credential(form, authorization) or auth.holds_api_key(form)
        for form in decodings(request_id)
    )


def _carries_own_credential(request_id: str, authorization: str | None) -> bool:
    """True when a client's request id holds the credential this request presents, whole or any
    `gateway.secret_scan.MIN_SECRET_CHARS`-long run of it (an ``sk-q38-`` key's secret without
    its prefix, a piece of a JWT): such an id is replaced before it is logged, echoed in
    ``x-request-id`` and completion ids, or sent to the engine. The credential is the one
    `credential` reads (``Authorization``, or the route's API-key header), checked or not."""
    own = OwnCredential.of(authorization)
    return own is not None and own.shares_run_with(request_id)


def _route(request: web.Request) -> tuple[str, str]:
    """The matched route's template and its metric label (the template when in `ROUTES`)."""
    resource = request.match_info.route.resource
    canonical = resource.canonical if resource is not None else "other"
    return canonical, canonical if canonical in ROUTES else "other"


def _dialect(app: web.Application, request: web.Request, template: str) -> Dialect | None:
    """The client API a request speaks: its route's, or for an unknown path or method under a
    model route (``GET /v1/messages``, ``/v1/messages/x``) the API of that route, so its 401,
    404 or 405 comes in that API's shape and takes its credential header."""
    dialects = app[DIALECTS]
    dialect = dialects.get(template)
    if dialect is not None:
        return dialect
    path = request.path
    prefixes = [t for t in dialects if path == t or path.startswith(t + "/")]
    return dialects[max(prefixes, key=len)] if prefixes else None


@web.middleware
async def context_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Make the `RequestContext`; at the end log the access line and count the request once.

    A client that went away (the handler cancelled) is logged with status 499 (nginx's
    "client closed request").
    """
    app = request.app
    live = app[LIVE].current
    supplied = request.headers.get("X-Request-Id", "")
    template, route = _route(request)
    dialect = _dialect(app, request, template)
    client_id = sane_request_id(supplied) and not _holds_a_key(
        supplied, credential(request, dialect or CHAT), live.auth
    )
    request_id = supplied if client_id else os.urandom(16).hex()  # 128 random bits, 32 hex
    context = RequestContext(
        request_id=request_id,
        started=app[CLOCK](),
        route=route,
        live=live,
        app=app,
        client_request_id=client_id,
    )
    if dialect is not None:
        context.dialect = dialect
    request[CONTEXT] = context
    structlog.contextvars.bind_contextvars(request_id=request_id)
    try:
        try:
            response = await handler(request)
        except (asyncio.CancelledError, web.HTTPException):
            raise
        except Exception as exc:  # raised by the error middleware itself: still an envelope
            response = _unexpected(request, context, exc)
        if not context.status:
            context.status = response.status
        response.headers["x-request-id"] = request_id
        return response
    except asyncio.CancelledError:
        if not context.status:  # a status already sent stands (the client left after it)
            context.status = 499
            gone = "shutdown" if app[DRAIN].forced else "client_disconnect"
            context.reason = context.reason or gone
        raise
    finally:
        finish_request(request, context)
        structlog.contextvars.unbind_contextvars("request_id")


def _unexpected(request: web.Request, context: RequestContext, exc: Exception) -> web.Response:
    """An exception no other layer answered, as the route's error: 400 for text no codec
    accepts (the client's input, logged without a traceback as ``bad_encoding``), else 500
    (a bug, logged with its traceback as ``unhandled_error``)."""
    error = error_for(exc, 500)
    if isinstance(exc, UnicodeError):
        events.warning("bad_encoding", error=type(exc).__name__)
        context.reason = context.reason or "bad_encoding"
    else:
        events.exception("unhandled_error", exc_info=exc)
        context.reason = "internal"
    error = context.dialect.adapt_error(error)
    return web.Response(
        status=error.status,
        body=context.dialect.error_body(error),
        content_type="application/json",
        headers=error.headers,
    )


def finish_request(request: web.Request, context: RequestContext) -> None:
    """Emit the access line and the request metrics exactly once, then run the finish hooks;
    the call's plan (its bodies) is dropped after them."""
    app = context.app
    metrics = app[METRICS]
    duration = app[CLOCK]() - context.started
    context.duration_s = duration
    if not context.status:
        context.status = 500
    status = context.status
    label = context.tenant_label
    metrics.requests.labels(label, context.route, str(status)).inc()
    metrics.request_duration.labels(label, context.route).observe(duration)
    fields: dict[str, Any] = {
        "method": request.method,
        "route": context.route,
        "status": status,
        "tenant": label,
        "duration_ms": round(duration * 1000, 2),
    }
    if context.caller is not None:
        fields["key_id"] = context.caller.principal.key_id
        if context.caller.principal.subject is not None:
            fields["subject"] = context.caller.principal.subject
    call = context.call
    if call is not None and call.engine_request_id != context.request_id:
        fields["engine_request_id"] = call.engine_request_id
    if call is not None and call.plan is not None:
        fields["stream"] = call.plan.stream
        if call.plan.thinking is not None:
            fields["thinking"] = call.plan.thinking
        if call.ttft_s is not None:
            fields["ttft_ms"] = round(call.ttft_s * 1000, 2)
        if call.usage.settled:
            fields["prompt_tokens"] = call.usage.prompt_tokens
            fields["completion_tokens"] = call.usage.completion_tokens
            if call.usage.source not in (None, "engine", "none"):
                fields["usage_source"] = call.usage.source  # a request cut short
    if context.reason:
        fields["reason"] = context.reason
    if context.error_status:
        fields["error_status"] = context.error_status
    access_line(fields, warning=status >= 500 or context.error_status >= 500)
    for hook in app[FINISH_HOOKS]:
        try:
            hook(context)
        except Exception:
            events.exception("finish_hook_failed")
    if call is not None:
        # The call and its context refer to each other: without this their request and engine
        # bodies would wait for the next full garbage collection, which the gateway's gc
        # thresholds make rare (gateway.server), and hold many requests' bodies at once. The
        # quarantine print holds the engine body until it is computed, so it goes too.
        call.plan = None
        call.fingerprint = None
        if call.body_hold is not None:
            app[BODY_MEMORY].release(call.body_hold)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn an error raised before the response started into its JSON error response.

    `GatewayError`s are serialised in the route's dialect (OpenAI's shape for every route
    today); aiohttp's routing answers (404, 405) are translated first; text no codec accepts
    (a lone surrogate decoded from a header or a URL: `UnicodeError`) is the client's, a 400;
    a connection the client broke before any answer (`ConnectionError`, e.g. a body cut off
    mid-upload) is logged 499; anything else is a bug: logged with its traceback, answered 500.
    """
    context = request[CONTEXT]
    try:
        return await handler(request)
    except GatewayError as exc:
        error = exc
        context.reason = context.reason or exc.reason
    except web.HTTPException as exc:
        error = _translate_http(exc)
        context.reason = context.reason or "http"
    except UnicodeError as exc:
        events.warning("bad_encoding", error=type(exc).__name__)
        error = error_for(exc, 400)
        context.reason = "bad_encoding"
    except ConnectionError:
        # The client's connection broke before an answer (its body cut off mid-upload, say):
        # nobody can read a response. Logged 499 "client closed request" like a client that
        # leaves mid-stream, never a 500 of the gateway's.
        context.status = 499
        context.reason = context.reason or "client_disconnect"
        return web.Response(status=499)
    except Exception:
        events.exception("unhandled_error")
        error = GatewayError("Internal server error.")
        context.reason = "internal"
    forget(error)
    if context.caller is not None:
        await _add_limit_headers(request, context.caller, error)
    error = context.dialect.adapt_error(error)
    response = web.Response(
        status=error.status,
        body=context.dialect.error_body(error),
        content_type="application/json",
        headers=error.headers,
    )
    if request.headers.get("Expect") and not request.content.is_eof():
        response.force_close()  # the body was never asked for: do not wait for it
    elif error.headers.get("Connection", "").lower() == "close":
        # An answer that says so ends its connection (RFC 9112 section 9.6): the body left
        # unread (a refused coding, an upload cut off) or a draining gateway serves no more.
        response.force_close()
    return response


def forget(error: BaseException) -> None:
    """Drop what an answered error still refers to: its traceback (every frame it passed through,
    with their locals: the body's bytes, its decoded form, a decoder's window) and the
    exceptions it was raised from.

    A frame that holds the exception it raised (a prepared error in a local, ``error = exc``
    here) makes a reference cycle, freed only by the cycle collector, which the gateway's gc
    thresholds (`gateway.server`) make rare: refused bodies held 3-36 MiB each until it ran,
    past the body-memory bound (2 GiB after 200 refused compressed bodies, measured).
    """
    error.__traceback__ = None
    error.__context__ = None
    error.__cause__ = None


async def _add_limit_headers(request: web.Request, caller: Caller, error: GatewayError) -> None:
    """Give an authenticated caller's error the tenant's ``x-ratelimit-*`` headers as of now
    (taking nothing), unless a reservation or refusal already set them: every authenticated
    answer carries them, a 400 for a bad field or a 404 for an unknown model included (the
    dialect renames them, e.g. Anthropic's ``anthropic-ratelimit-*``). A limiter that fails
    here (Redis down) leaves the error as it was: the error matters more than its headers."""
    if any(name.lower().startswith("x-ratelimit-") for name in error.headers):
        return
    try:
        headers = await request.app[LIMITER].headers(caller.tenant)
    except Exception:
        events.warning("limit_headers_failed", exc_info=True)
        return
    for name, value in headers.items():
        error.headers.setdefault(name, value)


def _translate_http(exc: web.HTTPException) -> GatewayError:
    """aiohttp's routing answers (404/405) in OpenAI shape."""
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        return MethodNotAllowed(
            "Method not allowed for this route.", headers={"Allow": allowed} if allowed else None
        )
    if exc.status == 404:
        return NotFound("Unknown route.")
    if 400 <= exc.status < 500:
        return HttpError(exc.status, exc.reason or "HTTP error")
    error = GatewayError(exc.reason or "HTTP error")
    error.status = exc.status
    return error


def credential(request: web.Request, dialect: Dialect) -> str | None:
    """The request's ``Authorization`` value, or the dialect's API-key header (Anthropic's
    ``x-api-key``) as a Bearer credential when there is no ``Authorization``."""
    authorization = request.headers.get("Authorization")
    key_header = dialect.api_key_header
    if authorization is None and key_header is not None and key_header in request.headers:
        authorization = "Bearer " + request.headers[key_header]
    return authorization


def repeated_credential(request: web.Request, dialect: Dialect) -> str | None:
    """The credential header (``Authorization``, or the dialect's API-key header) the request
    sends on more than one line, or None. Each holds one value (RFC 9110 section 5.3): of two, a
    proxy before the gateway may act on one and the gateway on the other, so neither is used."""
    headers = request.headers
    for name in ("Authorization", dialect.api_key_header):
        if name is not None and len(headers.getall(name, ())) > 1:
            return name
    return None


def credential_header(request: web.Request, dialect: Dialect) -> str | None:
    """The header `credential` takes the credential from (``Authorization`` or the dialect's
    API-key header), or None when the request has neither."""
    if "Authorization" in request.headers:
        return "Authorization"
    key_header = dialect.api_key_header
    if key_header is not None and key_header in request.headers:
        return key_header
    return None


async def expect_continue(request: web.Request) -> None:
    """aiohttp ``expect_handler`` of the POST routes: ``100 Continue`` only for a request that
    will be accepted (RFC 9110 section 10.1.1).

    A client that sends ``Expect: 100-continue`` waits for it before uploading the body, so a
    missing, bad or repeated credential, a ``Content-Length`` over ``server.max_body_bytes``, a
    ``Content-Encoding`` the gateway does not undo or a gateway that is draining are answered
    (401, 400, 413, 415, 503, by the usual middlewares and handler, logged once) without the body
    ever being sent. Any other expectation is ignored rather than
    answered with aiohttp's 417 page, which quotes the header.
    """
    if request.version != HttpVersion11:
        return
    if request.headers.get("Expect", "").lower() != "100-continue":
        return
    app = request.app
    live = app[LIVE].current
    limit = live.settings.server.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return
    if app[DRAIN].draining:
        return
    try:
        check_content_encoding(request)
    except GatewayError:
        return
    template, _ = _route(request)
    dialect = _dialect(app, request, template) or CHAT
    if repeated_credential(request, dialect) is not None:
        return
    try:
        live.auth.authenticate(credential(request, dialect))
    except GatewayError:
        return
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the response proper has not started (aiohttp's default)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every path but /health and /ready needs a credential, unknown paths included (C14).
    A credential header sent twice is a 400 (`repeated_credential`), whatever the values.

    Authentication decides on the same normalised path the router matched, with the request's
    configuration snapshot; the tenant's settings and metric label are resolved here, once.
    """
    if request.path in PUBLIC_PATHS:
        return await handler(request)
    context = request[CONTEXT]
    live = context.live
    repeated = repeated_credential(request, context.dialect)
    if repeated is not None:
        raise BadRequest(f"The request sends more than one {repeated} header; send one.")
    try:
        principal = live.auth.authenticate(credential(request, context.dialect))
    except InvalidApiKey as exc:
        request.app[METRICS].auth_failures.labels(exc.reason).inc()
        key_header = context.dialect.api_key_header
        raise exc.sent_in(credential_header(request, context.dialect), key_header) from None
    except GatewayError as exc:
        request.app[METRICS].auth_failures.labels(exc.reason).inc()
        raise
    settings = live.settings
    context.caller = Caller(
        principal=principal,
        tenant=settings.tenant(principal.tenant),
        label=settings.tenant_label(principal.tenant),
    )
    return await handler(request)
