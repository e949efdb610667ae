"""`gateway.translate.responses_items`: pages of a stored response's input items as OpenAI's
"List input items" gives them: cursors that always move forward (ids unique within a listing,
whatever ids the client sent), ``has_more`` in the direction of paging, the items' shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import BadRequest
from gateway.translate.responses_items import item_id, items_page
from gateway.translate.responses_store import compact

pytestmark = pytest.mark.fast


def page(items: list[Any], **query: str) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(items_page(compact(items), query))
    return value


def walk(items: list[Any], **query: str) -> list[str]:
    """Every id, page after page by ``after`` (as the SDK's auto-pagination does)."""
    ids: list[str] = []
    got = page(items, **query)
    while True:
        ids += [item["id"] for item in got["data"]]
        assert len(ids) <= len(items), "the cursor went back"
        if not got["has_more"]:
            return ids
        got = page(items, **query, after=got["last_id"])


def message(text: str, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text, **extra}


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_repeated_ids_still_page_forward_to_the_end(order: str) -> None:
    """A client that sent a previous response's output items again (their ids twice in the
    conversation), or its own ids twice: every item is listed once, under ids that are all
    different, and paging by ``after`` reaches the end."""
    items = [message("a", id="x"), message("b"), message("c", id="x"), message("d", id="x")]
    ids = walk(items, order=order, limit="1")
    assert len(ids) == len(set(ids)) == 4
    texts = [page(items, order=order, limit="4")["data"][i]["content"][0]["text"] for i in range(4)]
    assert texts == (["a", "b", "c", "d"] if order == "asc" else ["d", "c", "b", "a"])
    assert ids[0 if order == "asc" else 3] == "x"  # the first one keeps its own id


@settings(max_examples=60, deadline=None)
@given(
    own=st.lists(st.sampled_from(["x", "y", None, "msg_1", "z" * 300]), min_size=1, max_size=12),
    limit=st.integers(1, 5),
    order=st.sampled_from(["asc", "desc"]),
)
def test_paging_lists_every_item_once(own: list[str | None], limit: int, order: str) -> None:
    """Any mix of repeated, missing and made-looking own ids: paging forward lists each item
    exactly once, and the ids are the same on the next call."""
    items = [message(str(i), **({} if i_d is None else {"id": i_d})) for i, i_d in enumerate(own)]
    ids = walk(items, order=order, limit=str(limit))
    assert len(ids) == len(set(ids)) == len(items)
    assert walk(items, order=order, limit=str(limit)) == ids
    assert max(map(len, ids)) <= 256  # every cursor fits in a URL


def test_own_ids_shaped_as_made_ones_never_make_two_items_one() -> None:
    """Own ids chosen to be what the gateway would make for a later item, and that id with the
    suffix a clash gets: every item is still listed once, under ids all different."""
    third = {"role": "user", "content": "third"}
    made = item_id(2, third, compact(third).decode())
    items = [message("a", id=made), message("b", id=f"{made}_2"), third]
    for order in ("asc", "desc"):
        ids = walk(items, order=order, limit="1")
        assert len(ids) == len(set(ids)) == 3


def test_a_page_before_an_item_says_whether_more_come_before_it() -> None:
    """``before`` alone pages backwards: the items just before the one named, and ``has_more``
    while items remain before them."""
    items = [message(f"i{i}", id=f"i{i}") for i in range(6)]
    got = page(items, before="i0", limit="2")  # newest first: i5 i4 i3 i2 i1 i0
    assert [i["id"] for i in got["data"]] == ["i2", "i1"] and got["has_more"]
    got = page(items, before="i4", limit="2")
    assert [i["id"] for i in got["data"]] == ["i5"] and not got["has_more"]
    got = page(items, order="asc", before="i5", limit="2")
    assert [i["id"] for i in got["data"]] == ["i3", "i4"] and got["has_more"]
    got = page(items, order="asc", after="i1", before="i4", limit="5")
    assert [i["id"] for i in got["data"]] == ["i2", "i3"] and not got["has_more"]


def test_items_are_listed_in_openais_shapes() -> None:
    """A message's string content becomes one content part (``output_text`` for the
    assistant's), messages and tool items get ``status`` ``completed`` unless they have one,
    an item without ``type`` is a message; other items are listed as stored."""
    items = [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": "hello"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok", "status": "incomplete"},
        {"type": "reasoning", "summary": []},
    ]
    data = page(items, order="asc")["data"]
    assert data[0]["type"] == "message" and data[0]["status"] == "completed"
    assert data[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert data[1]["content"] == [{"type": "output_text", "text": "hello", "annotations": []}]
    assert data[2]["status"] == "completed" and data[3]["status"] == "incomplete"
    assert "status" not in data[4] and data[4]["summary"] == []
    assert [d["id"][:4] for d in data] == ["msg_", "msg_", "item", "item", "item"]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "1e2"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"order": "ASC"}, "order"),
        ({"after": "nope"}, "after"),
        ({"before": "nope"}, "before"),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(query: dict[str, str], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        items_page(compact([message("a")]), query)
    assert refused.value.param == param and "nope" not in refused.value.message
