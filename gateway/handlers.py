"""The plain routes: /health, /ready, /v1/models, /v1/models/{id} and /v1/usage."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.errors import ModelNotFound
from gateway.state import (
    ACCOUNTING,
    ADMISSION,
    CLOCK,
    CONTEXT,
    DRAIN,
    ENGINE_STATE,
    ENGINES,
    LIMITER,
    STARTED,
    Caller,
)


async def health(request: web.Request) -> web.Response:
    """200 while the process is alive."""
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 when keys are loaded, the engine is healthy and warm and the gateway is not shutting
    down; 503 otherwise; JSON detail either way.

    Body: ``ready`` (bool), ``engine`` (status), ``engine_state_for_s`` (seconds in that
    status), ``keys_loaded`` (API keys), ``keys_version`` (`KeySet.version`), ``queue_depth``
    and ``in_flight`` (requests), ``draining`` (bool: SIGTERM received, the load balancer
    should send new clients elsewhere), ``engines``: per engine name its ``status``,
    ``state_for_s``, ``slots`` and ``in_flight`` (`gateway.engines.Engines.detail`); the engine
    is ready while any engine is.
    """
    app = request.app
    state = app[ENGINE_STATE]
    live = request[CONTEXT].live
    keys_ok = live.keys.key_count > 0 or bool(live.keys.signing_keys)
    draining = app[DRAIN].announced
    is_ready = keys_ok and state.ready and not draining
    body = {
        "ready": is_ready,
        "engine": state.status,
        "engine_state_for_s": round(app[CLOCK]() - state.since, 3),
        "keys_loaded": live.keys.key_count,
        "keys_version": live.keys.version,
        "queue_depth": app[ADMISSION].depth,
        "in_flight": app[ADMISSION].in_flight,
        "draining": draining,
        "engines": app[ENGINES].detail(app[CLOCK]()),
    }
    return web.json_response(body, status=200 if is_ready else 503)


def _model_card(request: web.Request) -> dict[str, Any]:
    settings = request[CONTEXT].live.settings
    return {
        "id": settings.model.alias,
        "object": "model",
        "created": int(request.app[STARTED]),
        "owned_by": "qwen38-gateway",
        "max_model_len": settings.engine.max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    """The alias only, in OpenAI's list shape; no server paths (vLLM's ``/v1/models`` shape)."""
    headers = await _limit_headers(request)
    return web.json_response({"object": "list", "data": [_model_card(request)]}, headers=headers)


async def get_model(request: web.Request) -> web.Response:
    """One model card, or 404 ``model_not_found``."""
    name = request.match_info["id"]
    if name != request[CONTEXT].live.settings.model.alias:
        raise ModelNotFound(name)
    headers = await _limit_headers(request)
    return web.json_response(_model_card(request), headers=headers)


async def _limit_headers(request: web.Request) -> dict[str, str]:
    caller = request[CONTEXT].caller
    assert isinstance(caller, Caller), "authentication runs before this handler"
    return await request.app[LIMITER].headers(caller.tenant)


async def usage(request: web.Request) -> web.Response:
    """The caller's own usage by UTC day and its quotas (README.md, "Usage and quotas"), with
    the tenant's ``x-ratelimit-*`` headers as of now (nothing reserved), as every authenticated
    answer has them: a client watching its usage reads its limits from the same answer.

    Query: ``since`` and ``until`` (``YYYY-MM-DD``, inclusive; default the 1st of this month to
    today). A tenant only ever sees its own records.

    Raises:
        BadRequest: a malformed or reversed date, or a span over 400 days.
    """
    caller = request[CONTEXT].caller
    assert isinstance(caller, Caller), "authentication runs before this handler"
    query = request.query
    body = await request.app[ACCOUNTING].document(
        caller.tenant, query.get("since"), query.get("until")
    )
    return web.json_response(body, headers=await _limit_headers(request))
