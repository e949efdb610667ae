"""The OpenAI Responses API on the model path: the ``responses`` dialect and stored responses.

``POST /v1/responses`` is a `gateway.dialects.Dialect` like chat: its body is translated onto
the engine's chat route (`gateway.translate.responses_request`), planned by the same
`gateway.rewrite.plan_request` (reservation from ``max_output_tokens``, else the tenant's cap)
and its answer translated back (`gateway.translate.responses_stream`). Errors keep OpenAI's
envelope with string codes (`gateway.translate.responses_errors`).

Stored responses (``[responses] store``, off by default): a request with ``store`` not false is
kept in a `ResponseStore` once complete; ``GET /v1/responses/{id}``, ``DELETE`` and
``previous_response_id`` see only the creating tenant's responses (another tenant gets 404);
``POST /v1/responses/{id}/cancel`` answers 400, as OpenAI does for a response that was not
created with ``background`` (which this server does not run). ``GET
/v1/responses/{id}/input_items`` lists the items that produced a stored response, a page at a
time (`list_input_items`). With the store off,
``previous_response_id`` is a 400 and the retrieval routes answer 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
import re
from typing import Any

from aiohttp import web

from gateway.body import STEP_BYTES
from gateway.body_memory import held_estimate
from gateway.config import Settings
from gateway.dialects import Dialect, PlanInput
from gateway.errors import BadRequest, GatewayError, NotFound, quotable
from gateway.rewrite import RequestPlan
from gateway.sse import SseRelay
from gateway.state import CONTEXT
from gateway.translate.chat_events import answer_events
from gateway.translate.plan import TranslatedPlan, plan_translated
from gateway.translate.relay import TranslatingRelay, Writer
from gateway.translate.responses_errors import failure_code, responses_error_bytes
from gateway.translate.responses_request import translate_responses
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


def _not_found(response_id: str, param: str = "response_id") -> NotFound:
    """404 for an id the caller has no stored response under, naming where it came from
    (``param``: the route's ``response_id``, or the body's ``previous_response_id``); the id is
    quoted when it has the shape of this server's ids (`gateway.translate.common.new_id`), else
    only when `quotable`."""
    shown = response_id if _ID_RE.fullmatch(response_id) else quotable(response_id)
    return NotFound(f"Response with id '{shown}' not found.", param=param)


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
    )


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
        raise _not_found(request.match_info["response_id"])
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


INPUT_ITEMS_DEFAULT_LIMIT = 20
INPUT_ITEMS_MAX_LIMIT = 100
"""``limit`` of ``GET /v1/responses/{id}/input_items``: 1 to 100, 20 when absent (OpenAI API
reference, "List input items")."""


async def list_input_items(request: web.Request) -> web.Response:
    """``GET /v1/responses/{response_id}/input_items``: the items that produced the caller's
    stored response, in OpenAI's list shape ``{"object": "list", "data": [...], "first_id",
    "last_id", "has_more"}`` (OpenAI API reference, "List input items").

    The items are the response's input and, for a response that continued another through
    ``previous_response_id``, the conversation before it (the input and output it was made
    from), oldest first; ``order`` is ``desc`` (newest first) unless ``asc``. A page holds
    ``limit`` items (1-100, default 20) after the item ``after`` names or before the one
    ``before`` names. ``include`` is accepted and changes nothing: nothing beyond the items is
    stored. Each item is listed as `listed_item` makes it, with the id `item_id` gives it.

    Raises:
        NotFound: no stored response of the caller's tenant has that id (another tenant's
            included), or the store is off.
        BadRequest: ``limit`` is not an integer from 1 to 100, ``order`` is neither ``asc``
            nor ``desc``, or ``after`` or ``before`` names no item of the response.
    """
    tenant, store = _tenant_and_store(request)
    response_id = request.match_info["response_id"]
    entry = store.get(tenant, response_id)
    if entry is None:
        raise _not_found(response_id)
    query = request.query
    limit = _page_limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("'order' must be 'asc' or 'desc'.", param="order")
    text = entry.input_json.decode()
    spans = await _item_spans(text)
    if order == "desc":
        spans.reverse()
    ids = [span[0] for span in spans]
    start, end = 0, len(spans)
    if "after" in query:
        start = _position(ids, query["after"], "after") + 1
    if "before" in query:
        end = _position(ids, query["before"], "before")
    if "before" in query and "after" not in query:
        start = max(start, end - limit)  # the page just before the item named
    page = [
        listed_item(item_id, json.loads(text[begin:stop]))
        for item_id, begin, stop in spans[start : min(end, start + limit)]
    ]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + len(page) < end,
        }
    )


_ITEM_DECODER = json.JSONDecoder()
_ITEMS_PER_STEP = 256
"""Items `_item_spans` decodes between two runs of the event loop (about 10 µs each)."""


async def _item_spans(text: str) -> list[tuple[str, int, int]]:
    """Each item of a stored input (``text``, its compact JSON array, `compact`): its id
    (`item_id`) and where its JSON starts and stops in ``text``. Decoded one item at a time and
    dropped, other requests run after each `gateway.body.STEP_BYTES` of it or each
    `_ITEMS_PER_STEP` items: a stored conversation can hold megabytes and tens of thousands of
    items, and only a page of it is listed."""
    spans: list[tuple[str, int, int]] = []
    position, last = 1, len(text) - 1  # inside the brackets; compact JSON has no spaces
    pause = STEP_BYTES
    while position < last:
        item, stop = _ITEM_DECODER.raw_decode(text, position)
        spans.append((item_id(len(spans), item, text[position:stop]), position, stop))
        position = stop + 1  # past the comma
        if position > pause or len(spans) % _ITEMS_PER_STEP == 0:
            pause = position + STEP_BYTES
            await asyncio.sleep(0)
    return spans


def item_id(index: int, item: Any, encoded: str) -> str:
    """The id an input item is listed with: its own ``id`` when it has one, else ``msg_`` (a
    message) or ``item_`` and 32 hex digits of SHA-256 of its place in the conversation and its
    compact JSON (``encoded``). The same item has the same id on every call, and under every
    later response that continues the conversation (it keeps its place and its JSON there)."""
    own = item.get("id") if isinstance(item, dict) else None
    if isinstance(own, str) and own:
        return own
    digest = hashlib.sha256(f"{index}:{encoded}".encode()).hexdigest()[:32]
    message = isinstance(item, dict) and item.get("type", "message") == "message"
    return ("msg_" if message else "item_") + digest


def listed_item(listed_id: str, item: Any) -> dict[str, Any]:
    """One stored input item as OpenAI lists it, with the id ``listed_id``: a message gets
    ``type`` ``message``, its text content as one content part (``input_text``, or
    ``output_text`` for an assistant's) and ``status`` ``completed``; other items are listed as
    stored."""
    listed = dict(item) if isinstance(item, dict) else {"type": "message", "content": item}
    if "type" not in listed:
        listed["type"] = "message"
    if listed["type"] == "message":
        listed.setdefault("role", "user")
        content = listed.get("content")
        if isinstance(content, str):
            part = "output_text" if listed["role"] == "assistant" else "input_text"
            text: dict[str, Any] = {"type": part, "text": content}
            if part == "output_text":
                text["annotations"] = []
            listed["content"] = [text]
        listed.setdefault("status", "completed")
    listed["id"] = listed_id
    return listed


def _page_limit(given: str | None) -> int:
    """``limit`` as an int within 1-100 (`INPUT_ITEMS_MAX_LIMIT`), the default when absent.

    Raises:
        BadRequest: anything else (the value is not quoted).
    """
    if given is None:
        return INPUT_ITEMS_DEFAULT_LIMIT
    if given.isascii() and given.isdigit() and len(given) <= 3:
        limit = int(given)
        if 1 <= limit <= INPUT_ITEMS_MAX_LIMIT:
            return limit
    raise BadRequest(
        f"'limit' must be an integer from 1 to {INPUT_ITEMS_MAX_LIMIT}.", param="limit"
    )


def _position(ids: list[str], wanted: str, param: str) -> int:
    """Where the item ``wanted`` is in ``ids`` (the first of that id).

    Raises:
        BadRequest: no item of the response has that id (the value is not quoted).
    """
    try:
        return ids.index(wanted)
    except ValueError:
        raise BadRequest(f"'{param}' names no item of this response.", param=param) from None
