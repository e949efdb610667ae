"""The OpenAI Responses API on the model path: the ``responses`` dialect and stored responses.

``POST /v1/responses`` is a `gateway.dialects.Dialect` like chat: its body is translated onto
the engine's chat route (`gateway.translate.responses_request`), planned by the same
`gateway.rewrite.plan_request` (reservation from ``max_output_tokens``, else the tenant's cap)
and its answer translated back (`gateway.translate.responses_stream`). Errors keep OpenAI's
envelope with string codes (`gateway.translate.responses_errors`); a prompt over the context is
stated with true numbers and, when ``truncation: "auto"`` was asked, says that nothing was
dropped (`explain_overflow`).

Stored responses (``[responses] store``, off by default): a request with ``store`` not false is
kept in a `ResponseStore` once complete; ``GET /v1/responses/{id}``, ``DELETE`` and
``previous_response_id`` see only the creating tenant's responses (another tenant gets 404);
``POST /v1/responses/{id}/cancel`` answers 400, as OpenAI does for a response that was not
created with ``background`` (which this server does not run). ``GET
/v1/responses/{id}/input_items`` lists the items that produced a stored response, a page at a
time (`list_input_items`, `gateway.translate.responses_items`). With the store off,
``previous_response_id`` is a 400 and the retrieval routes answer 404.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

from aiohttp import web

from gateway.body_memory import held_estimate
from gateway.config import Settings
from gateway.dialects import Dialect, PlanInput, PromptCounter, explain_sized_overflow
from gateway.errors import BadRequest, GatewayError, NotFound, quotable
from gateway.plan_worker import INPUT_ITEMS, PLAN_WORKER, Job
from gateway.rewrite import RequestPlan
from gateway.sse import SseRelay
from gateway.state import CONTEXT
from gateway.translate.chat_events import answer_events
from gateway.translate.common import PromptTooLong, overflow_of
from gateway.translate.plan import TranslatedPlan, plan_translated
from gateway.translate.relay import TranslatingRelay, Writer
from gateway.translate.responses_errors import failure_code, responses_error_bytes
from gateway.translate.responses_items import items_page
from gateway.translate.responses_request import NO_TRUNCATION, translate_responses
from gateway.translate.responses_store import ResponseStore, compact
from gateway.translate.responses_stream import KEEPALIVE_COMMENT, ResponsesWriter

STORE = web.AppKey("responses_store", ResponseStore)

_PREVIOUS_ID_RE = re.compile(rb'"previous_response_id"\s*:\s*"([A-Za-z0-9_.:\-]{1,200})"')
_PREVIOUS_IDS_LOOKED_UP = 4


def chained_bytes(store: ResponseStore, tenant: str, raw: bytes) -> int:
    """Bytes of the stored conversation a Responses body ``raw`` continues through its
    ``previous_response_id`` (`Stored.size`; 0 when none is found), read from the bytes without
    parsing them: planning such a body decodes that conversation too, so it counts toward
    `gateway.plan_worker.OFFLOAD_BYTES` as the body does.

    The key can appear unescaped in the bytes only as a key (inside a JSON string its quotes are
    escaped), so a match is ``previous_response_id`` itself or a key of that name deeper in the
    body; the largest of the first few entries found is taken.
    """
    if b'"previous_response_id"' not in raw:
        return 0
    sizes = [0]
    for found in itertools.islice(_PREVIOUS_ID_RE.finditer(raw), _PREVIOUS_IDS_LOOKED_UP):
        entry = store.get(tenant, found.group(1).decode())
        if entry is not None:
            sizes.append(entry.size)
    return max(sizes)


_ID_RE = re.compile(r"resp_[0-9a-f]{24}")


def _not_found(response_id: str, param: str = "response_id", note: str = "") -> NotFound:
    """404 for an id the caller has no stored response under, naming where it came from
    (``param``: the route's ``response_id``, or the body's ``previous_response_id``); the id is
    quoted when it has the shape of this server's ids (`gateway.translate.common.new_id`), else
    only when `quotable`; ``note`` follows (why none can be found)."""
    shown = response_id if _ID_RE.fullmatch(response_id) else quotable(response_id)
    return NotFound(f"Response with id '{shown}' not found.{note}", param=param)


def make_store(settings: Settings, clock: Any) -> ResponseStore:
    """The app's store, sized by ``[responses]``."""
    config = settings.responses
    return ResponseStore(config.store_max_items, config.store_max_bytes, config.store_ttl_s, clock)


def responses_dialect(store: ResponseStore) -> Dialect:
    """The ``responses`` dialect, storing into ``store`` when the operator enabled storing."""

    def plan(given: PlanInput) -> RequestPlan:
        body = given.body
        history = None
        held_extra = 0
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous is not None:
            if not given.settings.responses.store:
                raise BadRequest(
                    "'previous_response_id' needs stored responses, which are off on this "
                    "server; send the whole conversation in 'input'.",
                    param="previous_response_id",
                )
            if not isinstance(previous, str):
                raise BadRequest(
                    "'previous_response_id' must be a string.", param="previous_response_id"
                )
            entry = store.get(given.tenant.name, previous)
            if entry is None:
                raise _not_found(previous, "previous_response_id")
            history = [*entry.input_items, *entry.response.get("output", [])]
            # The conversation it continues is held decoded and in the engine body.
            held_extra = entry.size + held_estimate(entry.input_json + entry.response_json)
        translated = translate_responses(body, history=history)
        if given.background:
            # Served in the background line: the response shows that tier (`_served_tier`).
            translated.extra["service_tier"] = "flex"
        stored = given.settings.responses.store and translated.extra.get("store", True)
        translated.extra["stored"] = stored
        translated.extra["tenant"] = given.tenant.name
        # Kept as the store keeps it: bytes, not a decoded list, while the request runs.
        translated.extra["input_json"] = (
            compact([*(history or []), *_input_items(body)]) if stored else b""
        )
        return dataclasses.replace(plan_translated(given, translated), held_extra=held_extra)

    def keep(writer: ResponsesWriter) -> None:
        extra = writer.extra
        if extra.get("stored") and writer.status in ("completed", "incomplete"):
            response = writer.response()
            store.put_json(extra["tenant"], response["id"], compact(response), extra["input_json"])

    def fail(writer: Writer, error: GatewayError) -> bytes:
        assert isinstance(writer, ResponsesWriter)
        return writer.fail(failure_code(error), error.message)

    def relay(settings: Settings, plan: RequestPlan) -> TranslatingRelay:
        inner = SseRelay(
            settings.engine.model,
            settings.model.alias,
            client_wants_usage=True,
            max_event_bytes=settings.engine.max_event_bytes,
        )
        writer = ResponsesWriter(settings.model.alias, _extra(plan), on_end=keep)
        return TranslatingRelay(inner, writer, fail, KEEPALIVE_COMMENT)

    def json_answer(body: dict[str, Any], settings: Settings, plan: RequestPlan) -> dict[str, Any]:
        writer = ResponsesWriter(settings.model.alias, _extra(plan), stream=False, on_end=keep)
        writer.feed(answer_events(body))
        return writer.finalize()

    def error_event(error: GatewayError) -> bytes:
        return ResponsesWriter("", {}).fail(failure_code(error), error.message)

    return Dialect(
        name="responses",
        engine_path="/v1/chat/completions",
        plan=plan,
        stream_relay=relay,
        json_answer=json_answer,
        error_body=responses_error_bytes,
        error_event=error_event,
        keepalive=KEEPALIVE_COMMENT,
        store_answer=store.put_json,
        explain_rejection=explain_overflow,
    )


async def explain_overflow(
    counter: PromptCounter, plan: RequestPlan, error: GatewayError
) -> GatewayError:
    """The engine's prompt-too-long 400 on ``/v1/responses``: its true numbers
    (`gateway.dialects.explain_sized_overflow`), and for a request that asked for
    ``truncation: "auto"`` the sentence that this server does not truncate (`NO_TRUNCATION`),
    so the client is not left to think its input was cut to fit. Any other error passes on."""
    error = await explain_sized_overflow(counter, plan, error)
    overflow = overflow_of(error)
    if overflow is None or _extra(plan).get("truncation") != "auto":
        return error
    restated = PromptTooLong(error, overflow)
    restated.message = error.message + NO_TRUNCATION
    return restated


def _extra(plan: RequestPlan) -> dict[str, Any]:
    translated = plan.translated if isinstance(plan, TranslatedPlan) else None
    return translated.extra if translated is not None else {}


def _input_items(body: Any) -> list[Any]:
    raw = body.get("input") if isinstance(body, dict) else None
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    return list(raw) if isinstance(raw, list) else []


def _tenant_and_store(request: web.Request) -> tuple[str, ResponseStore]:
    context = request[CONTEXT]
    assert context.caller is not None, "authentication runs first"
    if not context.live.settings.responses.store:
        note = " This server does not store responses."
        raise _not_found(request.match_info["response_id"], note=note)
    return context.caller.tenant.name, request.app[STORE]


async def get_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{response_id}``: the caller's stored response, else 404."""
    tenant, store = _tenant_and_store(request)
    response_id = request.match_info["response_id"]
    entry = store.get(tenant, response_id)
    if entry is None:
        raise _not_found(response_id)
    return web.Response(body=entry.response_json, content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    """``DELETE /v1/responses/{response_id}``: forget the caller's stored response, else 404."""
    tenant, store = _tenant_and_store(request)
    response_id = request.match_info["response_id"]
    if not store.delete(tenant, response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    """``POST /v1/responses/{response_id}/cancel``: 404 unless the caller's; else 400, since
    only ``background`` responses can be cancelled (OpenAI API reference) and none run here."""
    tenant, store = _tenant_and_store(request)
    response_id = request.match_info["response_id"]
    if store.get(tenant, response_id) is None:
        raise _not_found(response_id)
    raise BadRequest(
        "Only responses created with background=true can be cancelled.", param="response_id"
    )


LISTED_IN_LOOP_BYTES = 8 * 1024
"""Stored inputs up to this size (bytes of JSON, a short conversation: under a millisecond to
list) are listed in the event loop; a larger one in the plan worker (`gateway.plan_worker`),
since listing decodes every item once (about 10 µs each) and a single item can hold megabytes:
16 listings of 64 KiB at once, 7 ms each, had held ``/health`` up to 1.2 s."""
PAGE_PARAMS = ("limit", "order", "after", "before")
"""The query parameters a page of input items reads (the first of each when repeated)."""


async def list_input_items(request: web.Request) -> web.Response:
    """``GET /v1/responses/{response_id}/input_items``: a page of the items that produced the
    caller's stored response (`gateway.translate.responses_items.items_page`): its input and,
    for a response that continued another through ``previous_response_id``, the conversation
    before it.

    Raises:
        NotFound: no stored response of the caller's tenant has that id (another tenant's
            included), or the store is off.
        BadRequest: a bad ``limit``, ``order`` or cursor (`items_page`).
        PlanWorkerFailed: a large entry's worker died twice (503).
    """
    tenant, store = _tenant_and_store(request)
    response_id = request.match_info["response_id"]
    entry = store.get(tenant, response_id)
    if entry is None:
        raise _not_found(response_id)
    query = {name: request.query[name] for name in PAGE_PARAMS if name in request.query}
    if len(entry.input_json) <= LISTED_IN_LOOP_BYTES:
        page = items_page(entry.input_json, query)
    else:
        context = request[CONTEXT]
        assert context.caller is not None, "authentication runs first"
        live = context.live
        job = Job(
            INPUT_ITEMS,
            None,
            query,
            live.settings,
            context.caller.tenant,
            context.request_id,
            live.salt_secret,
        )
        page = await request.app[PLAN_WORKER].list_items(job, entry.input_json)
    return web.Response(body=page, content_type="application/json")
