"""`gateway.body_memory`: the estimate of a body's parsed form stays at or above what CPython
really allocates for it (tracemalloc), and the bound refuses past it as a full queue does, in
the route's API shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tracemalloc
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gateway.body import STEP_BYTES
from gateway.body_memory import BodyHold, BodyMemory, held_estimate, held_estimate_in_steps
from gateway.errors import EngineUnavailable, PayloadTooLarge, RateLimited
from gateway.metrics import Metrics
from gateway.state import BODY_MEMORY
from tests.conftest import ALIAS, KEY_A, KEY_B
from tests.inprocess import AUTH_A, open_stack, until

pytestmark = pytest.mark.fast

N = 20_000
SHAPES: dict[str, Any] = {
    "ascii": {"messages": [{"role": "user", "content": "a" * 400_000}]},
    "one_cjk": {"messages": [{"role": "user", "content": "a" * 400_000 + "漢"}]},
    "one_emoji": {"messages": [{"role": "user", "content": "a" * 400_000 + "😀"}]},
    "cjk": {"messages": [{"role": "user", "content": "漢" * 130_000}]},
    "latin1": {"messages": [{"role": "user", "content": "é" * 200_000}]},
    "messages": {"messages": [{"role": "user", "content": f"m{i}"} for i in range(N)]},
    "empty_lists": {"x": [[] for _ in range(2 * N)]},
    "empty_dicts": {"x": [{} for _ in range(2 * N)]},
    "small_dicts": {"x": [{"a": 1000, "b": "xy", "c": [1.5]} for _ in range(N)]},
    "ints": {"x": list(range(1000, 1000 + 3 * N))},
    "floats": {"x": [1.5] * 3 * N},
    "short_strings": {"x": [f"{i % 100:02d}" for i in range(3 * N)]},
    "wide_dict": {"x": {f"k{i}": i for i in range(N)}},
    "schemas": {
        "tools": [
            {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": ["a", "b"]}}}
            for _ in range(N // 4)
        ]
    },
}


def parsed_bytes(raw: bytes) -> int:
    """Bytes CPython allocates for ``json.loads`` of ``raw`` and keeps (the parsed objects)."""
    text = raw.decode()
    tracemalloc.start()
    try:
        value = json.loads(text)
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del value
    return size


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_estimate_is_at_least_the_parsed_size_of_each_shape(name: str) -> None:
    """held_estimate is at or above the measured parsed size of text, messages, schemas,
    numbers and the parse-expensive shapes, and within 4x of it except for shared strings."""
    raw = json.dumps(SHAPES[name], ensure_ascii=False).encode()
    real, estimate = parsed_bytes(raw), held_estimate(raw)
    assert estimate >= real, f"{name}: estimate {estimate} < parsed {real}"
    if name != "latin1":  # Latin-1 text: 2 UTF-8 bytes, 1 stored byte a character
        assert estimate <= 4 * real, f"{name}: estimate {estimate} > 4 x parsed {real}"


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=12) | st.dictionaries(st.text(max_size=8), inner, max_size=12)
    ),
    max_leaves=300,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=JSON, ascii_only=st.booleans())
def test_estimate_bounds_the_parsed_size_of_generated_bodies(value: Any, ascii_only: bool) -> None:
    """For generated JSON (any nesting, numbers, text of any script, escaped or not) the
    estimate is at or above the parsed size (tracemalloc), give or take the decoder's 256
    bytes of bookkeeping."""
    raw = json.dumps({"v": [value, value]}, ensure_ascii=ascii_only).encode()
    assert held_estimate(raw) + 256 >= parsed_bytes(raw)


@pytest.mark.parametrize("marker", ["\\ud83d", "\\u00e9", "😀", "é", '{"k": [1, 2]}'])
@pytest.mark.parametrize("offset", range(-5, 2))
def test_the_estimate_in_steps_is_the_estimate(marker: str, offset: int) -> None:
    """A body over one step is estimated in steps (the event loop runs between them) to the
    same number as in one pass, whatever straddles the seam between two steps: an escaped
    surrogate, an escape, a character past U+FFFF, a non-ASCII one, structure."""
    text = marker.encode()
    start = STEP_BYTES + offset
    raw = b'{"a": "' + b"x" * (start - 7) + text + b"x" * STEP_BYTES + b'"}'
    assert raw[start : start + len(text)] == text
    assert asyncio.run(held_estimate_in_steps(raw)) == held_estimate(raw)
    plain = raw.replace(text, b"x" * len(text))
    assert held_estimate(plain) <= held_estimate(raw)  # the marker is what the seam must find


def bound(limit: int = 10_000) -> BodyMemory:
    return BodyMemory(limit, Metrics(CollectorRegistry()), lambda: 2.0, upload_idle_s=60.0)


def test_holds_add_up_and_release_frees_them() -> None:
    """Holds of several requests add up to ``held``; a release frees exactly one's bytes."""
    memory = bound()
    a, b = BodyHold("acme", 1.0), BodyHold("beta", 1.0)
    memory.take(a, 3000, "acme")
    memory.take(b, 4000, "beta")
    memory.take(a, 1000, "acme")  # parsed smaller than it read
    assert memory.held == 5000
    memory.release(a)
    memory.release(a)
    assert memory.held == 4000 and a.size == 0


def test_past_the_bound_a_tenant_at_its_share_gets_429_others_503_and_too_large_413() -> None:
    """A tenant already holding its weighted share is refused 429 ``memory`` (its own backlog),
    a tenant holding nothing 503, both with Retry-After; a body over the whole bound 413."""
    memory = bound()
    first = BodyHold("acme", 1.0)
    memory.take(first, 6000, "acme")
    memory.take(BodyHold("beta", 1.0), 3000, "beta")
    with pytest.raises(RateLimited) as own:
        memory.take(BodyHold("acme", 1.0), 2000, "acme")
    assert own.value.limit == "memory" and own.value.headers["Retry-After"] == "4"
    with pytest.raises(EngineUnavailable) as other:
        memory.take(BodyHold("carol", 1.0), 2000, "carol")
    assert other.value.status == 503 and other.value.headers["Retry-After"] == "2"
    with pytest.raises(PayloadTooLarge):
        memory.take(BodyHold("carol", 1.0), 10_001, "carol")
    assert memory.held == 9000  # refusals take nothing


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        ("/v1/chat/completions", "openai"),
        ("/v1/messages", "anthropic"),
        ("/v1/responses", "openai"),
    ],
)
async def test_a_body_larger_than_the_bound_parsed_is_a_413_in_the_routes_shape(
    aiohttp_client: Any, path: str, shape: str
) -> None:
    """A 300 KB body of empty objects (about 11 MB parsed) under a 1 MiB bound: 413 in the
    route's API shape, before it is parsed; the bound is free again afterwards."""
    config = {"server": {"bodies_max_bytes": 1 << 20}}
    async with open_stack(aiohttp_client, config) as stack:
        body = {"model": ALIAS, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        body["metadata"] = {"x": [{} for _ in range(75_000)]}
        headers = {"Authorization": f"Bearer {KEY_A}", "x-api-key": KEY_A}
        r = await stack.client.post(path, data=json.dumps(body), headers=headers)
        assert r.status == 413
        error = await r.json()
        if shape == "anthropic":
            assert error["type"] == "error" and error["error"]["type"] == "request_too_large"
        else:
            assert error["error"]["code"] == "request_too_large"
        assert "too large to hold" in json.dumps(error)
        ok = await stack.client.post(
            "/v1/chat/completions",
            json={"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]},
            headers=headers,
        )
        assert ok.status == 200


async def test_a_compressed_body_counts_what_it_decoded_into_while_it_uploads(
    aiohttp_client: Any,
) -> None:
    """A gzip body's ``Content-Length`` says nothing of what it decodes into (1 KB here decodes
    into 900 KB, held as they arrive): while it uploads it counts as twice what it decoded into
    so far, and its hold is freed when its client leaves."""
    config = {"server": {"max_body_bytes": 1 << 20, "bodies_max_bytes": 4 << 20}}
    async with open_stack(aiohttp_client, config) as stack:
        memory = stack.client.app[BODY_MEMORY]
        gzip = zlib.compressobj(9, zlib.DEFLATED, 31)
        decoded = b'{"messages": [{"role": "user", "content": "' + b"a" * 900_000
        start = gzip.compress(decoded) + gzip.flush(zlib.Z_SYNC_FLUSH)
        never = asyncio.Event()

        async def stalled() -> AsyncIterator[bytes]:
            yield start
            await never.wait()

        headers = {
            **AUTH_A,
            "Content-Type": "application/json",
            "Content-Encoding": "gzip",
            "Content-Length": str(len(start) + 100),
        }
        upload = asyncio.ensure_future(
            stack.client.post("/v1/chat/completions", data=stalled(), headers=headers)
        )
        assert await until(lambda: memory.held == 2 * len(decoded)), memory.held
        assert memory.reading == memory.held
        upload.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await upload
        assert await until(lambda: memory.held == 0)
        assert memory.reading == 0


def test_uploads_count_what_arrived_within_their_tenants_share() -> None:
    """Bodies still arriving: one alone may grow to the bound; a tenant's uploads together stop
    at its weighted share (half, alone) with 429 ``memory`` and ``Retry-After`` the upload idle
    timeout; past the bound, Retry-After is the queue's when bodies already read hold the bytes
    that must free, the idle timeout when only uploads in progress do."""
    alone = bound()
    one = BodyHold("acme", 1.0, reading=True)
    alone.take(one, 9000, "acme")
    assert alone.held == alone.reading == 9000
    alone.read(one)
    assert alone.reading == 0 and alone.held == 9000

    memory = bound()
    first, second = BodyHold("acme", 1.0, reading=True), BodyHold("acme", 1.0, reading=True)
    memory.take(first, 3000, "acme")
    memory.take(second, 2000, "acme")  # 5000: its share of 10,000, no other tenant holding
    with pytest.raises(RateLimited) as uploads:
        memory.take(BodyHold("acme", 1.0, reading=True), 1, "acme")
    assert uploads.value.limit == "memory" and uploads.value.headers["Retry-After"] == "60"
    memory.take(BodyHold("beta", 1.0), 4000, "beta")  # read and parsed: freed as it finishes
    assert memory.held == 9000 and memory.reading == 5000
    with pytest.raises(EngineUnavailable) as queued:
        memory.take(BodyHold("carol", 1.0), 5000, "carol")  # 4000 must free: beta holds them
    assert queued.value.headers["Retry-After"] == "2"
    with pytest.raises(EngineUnavailable) as stalled:
        memory.take(BodyHold("carol", 1.0), 6000, "carol")  # 5000 must free: uploads hold 5000
    assert stalled.value.headers["Retry-After"] == "60"
    assert memory.held == 9000  # refusals take nothing
    memory.release(first)
    memory.read(second)
    assert memory.reading == 0 and memory.held == 6000


async def test_stalled_uploads_of_one_tenant_do_not_lock_out_another(
    aiohttp_client: Any,
) -> None:
    """Tenant A opens 17 uploads that send headers with ``Content-Length`` at
    ``max_body_bytes`` and then 12 bytes: they hold twice what arrived (408 bytes), not twice
    what they promise, and tenant B is served. A's 700 KB upload that stalls counts in full;
    a second is refused 429 past A's half of the 3 MiB bound. B's real 900 KB body, twice its
    size not fitting what A holds, is refused 503 ``memory`` with ``Retry-After`` the upload
    idle timeout (only uploads in progress hold the bound); once A leaves, all is free."""
    config = {"server": {"max_body_bytes": 1 << 20, "bodies_max_bytes": 3 << 20}}
    async with open_stack(aiohttp_client, config) as stack:
        memory = stack.client.app[BODY_MEMORY]
        never = asyncio.Event()
        head = b'{"model": "q'

        def upload(first: bytes) -> asyncio.Future[Any]:
            async def stalled() -> AsyncIterator[bytes]:
                yield first
                await never.wait()

            headers = {**AUTH_A, "Content-Type": "application/json", "Content-Length": str(1 << 20)}
            return asyncio.ensure_future(
                stack.client.post("/v1/chat/completions", data=stalled(), headers=headers)
            )

        uploads = [upload(head) for _ in range(17)]
        assert await until(lambda: memory.held == 17 * 2 * len(head)), memory.held
        small = {"model": ALIAS, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        headers_b = {"Authorization": f"Bearer {KEY_B}"}
        r = await stack.client.post("/v1/chat/completions", json=small, headers=headers_b)
        assert r.status == 200, await r.text()

        part = b" " * 700_000
        uploads.append(upload(part))
        assert await until(lambda: memory.held == 17 * 2 * len(head) + 2 * len(part))
        second = upload(part)
        refused = await second
        assert refused.status == 429 and (await refused.json())["error"]["type"] == "memory"
        assert refused.headers["Retry-After"] == "60"

        large = dict(small, messages=[{"role": "user", "content": "a" * 900_000}])
        r = await stack.client.post("/v1/chat/completions", json=large, headers=headers_b)
        error = await r.json()
        assert r.status == 503 and "memory bound" in error["error"]["message"], error
        assert r.headers["Retry-After"] == "60"
        r = await stack.client.post("/v1/chat/completions", json=small, headers=headers_b)
        assert r.status == 200, await r.text()

        for task in uploads:
            task.cancel()
        for task in uploads:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert await until(lambda: memory.held == 0)
        assert memory.reading == 0


async def test_past_the_bound_messages_answers_429_for_the_holder_and_529_for_another(
    aiohttp_client: Any,
) -> None:
    """One request holding about 730 KB of a 1 MiB bound at the engine (a tool schema of
    3,800 empty objects, 15 KB of JSON): the same tenant's next one is a 429
    ``rate_limit_error`` and another tenant's a 529 ``overloaded_error`` in Anthropic's shape,
    both with retry-after; once it ends the bound is free and they go through."""
    config = {"server": {"bodies_max_bytes": 1 << 20}}
    async with open_stack(aiohttp_client, config) as stack:
        schema = {"type": "object", "properties": {"a": {"type": "string", "enum": [{}] * 3800}}}
        # The holder speaks chat, whose unknown fields reach the engine ("sim": a paced stream).
        slow = {
            "model": ALIAS,
            "messages": [{"role": "user", "content": "Go."}],
            "tools": [{"type": "function", "function": {"name": "t", "parameters": schema}}],
            "tool_choice": "none",
            "stream": True,
            "sim": {"completion_tokens": 60, "tokens_per_second": 20},
        }
        quick = {
            "model": ALIAS,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "Go."}],
            "tools": [{"name": "t", "description": "d", "input_schema": schema}],
            "tool_choice": {"type": "none"},
        }
        memory = stack.client.app[BODY_MEMORY]

        async def hold() -> int:
            r = await stack.client.post("/v1/chat/completions", json=slow, headers=AUTH_A)
            await r.read()  # the stream ends after 3 s of paced tokens
            return r.status

        holder = asyncio.ensure_future(hold())
        assert await until(lambda: memory.held > 700_000)
        for key, status, kind in (
            (KEY_A, 429, "rate_limit_error"),
            (KEY_B, 529, "overloaded_error"),
        ):
            r = await stack.client.post("/v1/messages", json=quick, headers={"x-api-key": key})
            error = await r.json()
            assert r.status == status, error
            assert error["type"] == "error" and error["error"]["type"] == kind
            assert (
                "memory bound" in error["error"]["message"] and int(r.headers["retry-after"]) >= 1
            )
        assert await holder == 200
        assert await until(lambda: memory.held == 0)
        r = await stack.client.post("/v1/messages", json=quick, headers={"x-api-key": KEY_B})
        assert r.status == 200


async def test_a_continued_conversation_counts_the_stored_history_it_holds(
    aiohttp_client: Any,
) -> None:
    """previous_response_id holds the stored conversation decoded and in the engine body: it
    counts against the bound, so the third turn of a conversation of 900-item inputs under a
    1 MiB bound is a 413 although the turn's own body fits."""
    config = {"server": {"bodies_max_bytes": 1 << 20}, "responses": {"store": True}}
    async with open_stack(aiohttp_client, config) as stack:
        items = [{"role": "user", "content": f"m{i}"} for i in range(900)]
        previous = None
        statuses = []
        answer: dict[str, Any] = {}
        for _ in range(3):
            body: dict[str, Any] = {"model": ALIAS, "input": items, "max_output_tokens": 5}
            if previous is not None:
                body["previous_response_id"] = previous
            r = await stack.client.post("/v1/responses", json=body, headers=AUTH_A)
            statuses.append(r.status)
            answer = await r.json()
            previous = answer.get("id")
        assert statuses == [200, 200, 413], statuses
        assert "too large to hold" in answer["error"]["message"]
        assert stack.client.app[BODY_MEMORY].held == 0
