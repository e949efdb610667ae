"""One page of a stored response's input items, as OpenAI's "List input items" returns it.

``GET /v1/responses/{id}/input_items`` (OpenAI API reference, "List input items") lists the
items that produced a stored response, a page at a time: ``{"object": "list", "data": [...],
"first_id", "last_id", "has_more"}``. `items_page` makes that page from the entry's stored
input (its compact JSON array, `gateway.translate.responses_store.compact`): newest first
unless ``order=asc``, ``limit`` items (1-100, default 20) after the item ``after`` names or
before the one ``before`` names. Every item is decoded once to find where it ends and whether
it has an id of its own, and dropped; only the page's items are decoded again and kept. The
gateway runs it in its event loop for a small entry and in the plan worker for a large one
(`gateway.responses_api.list_input_items`).

Ids: an item's own ``id``, else one made from its place and its JSON (`item_id`), so the same
item has the same id on every call and under every later response that continues the
conversation. Ids within one listing are unique (a cursor names one item): an own id already
used earlier in the conversation (a client that sent a previous response's output items again
as input), or longer than `MAX_OWN_ID_CHARS`, is listed with the made id instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from gateway.errors import BadRequest

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
"""``limit``: 1 to 100, 20 when absent (OpenAI API reference, "List input items")."""
MAX_OWN_ID_CHARS = 256
"""The longest own ``id`` an item is listed with; a longer one gets a made id, since a cursor
must fit in a URL (aiohttp reads request lines up to 8,190 bytes)."""
COMPLETED_TYPES = frozenset({"message", "function_call", "function_call_output"})
"""Item types OpenAI lists with a ``status`` (``completed`` when the item has none)."""

_DECODER = json.JSONDecoder()


def items_page(stored: bytes, query: Mapping[str, str]) -> bytes:
    """The page ``query`` asks for (``limit``, ``order``, ``after``, ``before``; others are
    ignored, ``include`` among them: nothing beyond the items is stored) of the stored input
    ``stored``, as UTF-8 JSON.

    ``has_more`` says whether items remain beyond the page in the direction of paging: after
    it, or before it for a page asked with ``before`` alone.

    Raises:
        BadRequest: ``limit`` is not an integer from 1 to 100, ``order`` is neither ``asc`` nor
            ``desc``, or ``after`` or ``before`` names no item (client values are not quoted).
    """
    limit = _limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("'order' must be 'asc' or 'desc'.", param="order")
    text = stored.decode()
    spans = _spans(text)
    if order == "desc":
        spans.reverse()
    ids = {listed_id: place for place, (listed_id, _, _) in enumerate(spans)}
    start, end = 0, len(spans)
    if "after" in query:
        start = _position(ids, query["after"], "after") + 1
    if "before" in query:
        end = _position(ids, query["before"], "before")
    backwards = "before" in query and "after" not in query
    if backwards:
        start = max(start, end - limit)  # the page just before the item named
    stop = min(end, start + limit)
    page = [listed_item(i, json.loads(text[a:b])) for i, a, b in spans[start:stop]]
    return json.dumps(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start > 0 if backwards else stop < end,
        },
        ensure_ascii=False,
    ).encode()


def item_id(index: int, item: Any, encoded: str) -> str:
    """The id made for an item without one of its own: ``msg_`` (a message) or ``item_`` and 32
    hex digits of SHA-256 of its place in the conversation (``index``) and its compact JSON
    (``encoded``)."""
    digest = hashlib.sha256(f"{index}:{encoded}".encode()).hexdigest()[:32]
    message = isinstance(item, dict) and item.get("type", "message") == "message"
    return ("msg_" if message else "item_") + digest


def listed_item(listed_id: str, item: Any) -> dict[str, Any]:
    """One stored input item as OpenAI lists it, with the id ``listed_id``: a message gets
    ``type`` ``message`` and its text content as one content part (``input_text``, or
    ``output_text`` for an assistant's); the `COMPLETED_TYPES` get ``status`` ``completed``
    when they have none; everything else is listed as stored."""
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
    if listed["type"] in COMPLETED_TYPES:
        listed.setdefault("status", "completed")
    listed["id"] = listed_id
    return listed


def _spans(text: str) -> list[tuple[str, int, int]]:
    """Each item of the compact JSON array ``text``: its listed id (unique, see the module
    doc) and where its JSON starts and stops in ``text``."""
    spans: list[tuple[str, int, int]] = []
    used: set[str] = set()
    position, last = 1, len(text) - 1  # inside the brackets; compact JSON has no spaces
    while position < last:
        item, stop = _DECODER.raw_decode(text, position)
        own = item.get("id") if isinstance(item, dict) else None
        usable = isinstance(own, str) and 0 < len(own) <= MAX_OWN_ID_CHARS
        listed = own if usable and own not in used else None
        if listed is None:
            made = listed = item_id(len(spans), item, text[position:stop])
            suffix = len(spans)
            while listed in used:  # a client's own ids shaped as made ones
                listed = f"{made}_{suffix}"
                suffix += 1
        used.add(listed)
        spans.append((listed, position, stop))
        position = stop + 1  # past the comma
    return spans


def _limit(given: str | None) -> int:
    """``limit`` as an int within 1-`MAX_LIMIT`, `DEFAULT_LIMIT` when absent.

    Raises:
        BadRequest: anything else.
    """
    if given is None:
        return DEFAULT_LIMIT
    if given.isascii() and given.isdigit() and len(given) <= 8:
        limit = int(given)
        if 1 <= limit <= MAX_LIMIT:
            return limit
    raise BadRequest(f"'limit' must be an integer from 1 to {MAX_LIMIT}.", param="limit")


def _position(ids: Mapping[str, int], wanted: str, param: str) -> int:
    """The place of the item listed as ``wanted``.

    Raises:
        BadRequest: no item is listed with that id.
    """
    place = ids.get(wanted)
    if place is None:
        raise BadRequest(f"'{param}' names no item of this response.", param=param)
    return place
