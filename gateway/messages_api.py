"""The Anthropic Messages API on the model path: the ``ANTHROPIC`` dialect and ``count_tokens``.

``POST /v1/messages`` is a `gateway.dialects.Dialect` like chat: its body is translated onto the
engine's chat route (`gateway.translate.anthropic_request`) and then planned by the same
`gateway.rewrite.plan_request` (alias, thinking policy, sampling, ``cache_salt``, request id,
reservation from its own ``max_tokens``), and its answer is translated back
(`gateway.translate.anthropic_stream`); errors use Anthropic's envelope and types.

``POST /v1/messages/count_tokens`` renders nothing on the engine's GPU: it asks the engine's
``/tokenize`` (the chat form, with the same translated messages and tools and the tenant's
thinking mode) for the prompt's exact token count. That takes no engine sequence slot and no
admission ticket; it counts as one request against the tenant's requests-per-minute limit.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from gateway.affinity import Affinity, session_key
from gateway.body import client_body, unplannable_as_400
from gateway.body_memory import BodyHold, read_held
from gateway.config import Settings, TenantSettings
from gateway.dialects import Dialect, PlanInput, PromptCounter, exact_overflow
from gateway.errors import EngineBadResponse, GatewayError, ModelNotFound
from gateway.middleware import credential
from gateway.plan_worker import (
    COUNT_TOKENS,
    OFFLOAD_BYTES,
    PLAN_WORKER,
    CountAsk,
    Job,
    body_headers,
)
from gateway.rewrite import RequestPlan, resolve_thinking
from gateway.sse import SseRelay
from gateway.state import BODY_MEMORY, BUDGETS, CONTEXT, DRAIN, ENGINE_STATE, ENGINES, Caller
from gateway.translate.anthropic_errors import (
    anthropic_error,
    anthropic_error_bytes,
    anthropic_headers,
)
from gateway.translate.anthropic_request import translate_messages
from gateway.translate.anthropic_stream import PING_EVENT, AnthropicWriter, sse
from gateway.translate.chat_events import answer_events
from gateway.translate.common import PromptTooLong
from gateway.translate.plan import TranslatedPlan, plan_translated
from gateway.translate.relay import TranslatingRelay, Writer
from gateway.upstream import tokenize_count


def _plan(given: PlanInput) -> RequestPlan:
    translated = translate_messages(given.body)
    return plan_translated(given, translated)


def _stops(plan: RequestPlan) -> list[str]:
    translated = plan.translated if isinstance(plan, TranslatedPlan) else None
    stops = translated.chat.get("stop") if translated is not None else None
    return list(stops) if isinstance(stops, list) else []


def _fail(writer: Writer, error: GatewayError) -> bytes:
    _, body, _ = anthropic_error(error)
    assert isinstance(writer, AnthropicWriter)
    return writer.error(body["error"]["type"], body["error"]["message"])


def _relay(settings: Settings, plan: RequestPlan) -> TranslatingRelay:
    inner = SseRelay(
        settings.engine.model,
        settings.model.alias,
        client_wants_usage=True,
        max_event_bytes=settings.engine.max_event_bytes,
    )
    writer = AnthropicWriter(
        settings.model.alias, input_estimate=plan.prompt_estimate, stops=_stops(plan)
    )
    return TranslatingRelay(inner, writer, _fail, PING_EVENT)


def _json(body: dict[str, Any], settings: Settings, plan: RequestPlan) -> dict[str, Any]:
    writer = AnthropicWriter(
        settings.model.alias, input_estimate=plan.prompt_estimate, stops=_stops(plan), stream=False
    )
    writer.feed(answer_events(body))
    return writer.message()


def _error_event(error: GatewayError) -> bytes:
    _, body, _ = anthropic_error(error)
    return sse("error", body)


async def _explain(counter: PromptCounter, plan: RequestPlan, error: GatewayError) -> GatewayError:
    """The engine's prompt-too-long 400 with true numbers (`gateway.dialects.exact_overflow`),
    which Anthropic's wordings state (case C31)."""
    exact = await exact_overflow(counter, plan, error)
    return error if exact is None else PromptTooLong(error, exact)


def _adapt(error: GatewayError) -> GatewayError:
    """The error with Anthropic's status (529 for an unavailable engine) and headers."""
    status, body, headers = anthropic_error(error)
    adapted = GatewayError(
        body["error"]["message"], param=error.param, headers=headers, reason=error.reason
    )
    adapted.status = status
    return adapted


ANTHROPIC = Dialect(
    name="messages",
    engine_path="/v1/chat/completions",
    plan=_plan,
    stream_relay=_relay,
    json_answer=_json,
    error_body=anthropic_error_bytes,
    error_event=_error_event,
    adapt_error=_adapt,
    keepalive=PING_EVENT,
    api_key_header="x-api-key",
    limit_headers=anthropic_headers,
    explain_rejection=_explain,
)


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the engine's exact count.

    Raises:
        BadRequest: the body is not a valid count request (Anthropic's fields, see
            `translate_messages`).
        NotFound: the model is neither the alias nor an accepted name.
        RateLimited: the tenant's requests-per-minute limit.
        EngineUnavailable, UpstreamError: the engine cannot count now.
        PayloadTooLarge, RateLimited: the body does not fit ``server.bodies_max_bytes``.
    """
    context = request[CONTEXT]
    caller = context.caller
    assert caller is not None, "authentication runs first"
    memory = request.app[BODY_MEMORY]
    hold = BodyHold(caller.tenant.name, caller.tenant.weight)
    try:
        return await _count_tokens(request, caller, hold)
    finally:
        memory.release(hold)


def count_ask(
    raw: bytes,
    authorization: str | None,
    headers: Mapping[str, str],
    settings: Settings,
    tenant: TenantSettings,
) -> CountAsk:
    """A ``count_tokens`` body made into the engine's ``/tokenize`` question: parsed and checked
    (`gateway.body.client_body`), translated as a Messages request (`translate_messages`),
    its thinking mode resolved as the request would be.

    Raises:
        BadRequest: not a valid count request.
        ModelNotFound: the model is neither the alias nor an accepted name.
    """
    client = client_body(raw, authorization)
    with unplannable_as_400():
        translated = translate_messages(client, count_only=True)
        model = translated.chat.get("model")
        if model is not None and (not isinstance(model, str) or not settings.model.accepts(model)):
            raise ModelNotFound(model)
        thinking = resolve_thinking(translated.chat, settings, tenant)
    body: dict[str, Any] = {
        "model": settings.engine.model,
        "messages": translated.chat["messages"],
        "add_generation_prompt": True,
        "chat_template_kwargs": {"enable_thinking": thinking},
    }
    if translated.chat.get("tools"):
        body["tools"] = translated.chat["tools"]
    ask = json.dumps(body, ensure_ascii=False).encode()
    return CountAsk(ask, session_key(headers, client))


async def _count_tokens(
    request: web.Request, caller: Caller, memory_hold: BodyHold
) -> web.Response:
    with request.app[DRAIN].answering():
        return await _count(request, caller, memory_hold)


async def _count(request: web.Request, caller: Caller, memory_hold: BodyHold) -> web.Response:
    app = request.app
    live = request[CONTEXT].live
    settings = live.settings
    with app[DRAIN].uploading():
        raw = await read_held(request, app[BODY_MEMORY], memory_hold, settings.server, caller.label)
    authorization = credential(request, ANTHROPIC)
    if len(raw) > OFFLOAD_BYTES:
        job = Job(
            COUNT_TOKENS,
            authorization,
            body_headers(request.headers),
            settings,
            caller.tenant,
            request[CONTEXT].request_id,
            live.salt_secret,
        )
        ask = await app[PLAN_WORKER].count(job, raw)
    else:
        ask = count_ask(raw, authorization, request.headers, settings, caller.tenant)
    del raw  # held only while parsed (`gateway.body_memory`)
    state = app[ENGINE_STATE]
    if not state.ready:
        raise state.unavailable()
    fleet, session = app[ENGINES], ask.session
    home = fleet.affinity.home(Affinity.digest(caller.tenant.name, session)) if session else None
    budgets = app[BUDGETS]
    hold = await budgets.reserve(caller.tenant, 0, quotas=False)
    reservation = hold.rate
    try:
        answer = await fleet.counter(home).post("/tokenize", ask.body, uuid.uuid4().hex)
        if answer.status != 200:
            raise await answer.error()
        try:
            count = await tokenize_count(answer.chunks(), settings.engine.max_answer_bytes)
        except GatewayError:
            answer.abort()
            raise
        answer.release()  # an answer not read to its end closes its connection
        if count is None:
            raise answer.failed(EngineBadResponse("The engine's count answer had no count."))
    finally:
        await budgets.release(hold)
    return web.json_response(
        {"input_tokens": count}, headers=anthropic_headers(reservation.headers)
    )
