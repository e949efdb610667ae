"""Retries attach instead of duplicating (`gateway.retries`), in-process against the simulator.

Each test drives the gateway app with pytest-aiohttp's client over the simulator's app on a
Unix socket (`tests.inprocess`); the simulator's record of model requests is the count of
generations, the finish hooks' contexts the ledger's records.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from gateway import ledger, relay
from gateway.flight import Flight
from gateway.retries import FLIGHTS
from gateway.state import ACCOUNTING, BODY_MEMORY, FINISH_HOOKS, METRICS, RequestContext
from tests.conftest import ALIAS, KEY_B
from tests.inprocess import AUTH_A, Stack, chat_body, open_stack, sse_data, until

pytestmark = pytest.mark.fast

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}
SLOW = {"tokens_per_second": 20, "completion_tokens": 30}


@pytest.fixture
async def stack(aiohttp_client: Any) -> AsyncIterator[Stack]:
    """The simulator (no pacing unless a body asks) and a gateway with a short orphan grace."""
    config = {"retries": {"orphan_grace_s": 1.0}}
    async with open_stack(aiohttp_client, config) as s:
        yield s


def recorded(stack: Stack) -> list[RequestContext]:
    """Collect the finished model requests that would write a ledger record."""
    seen: list[RequestContext] = []
    stack.app[FINISH_HOOKS].append(lambda c: seen.append(c) if c.call is not None else None)
    return seen


def matches(stack: Stack, match: str, outcome: str) -> float:
    """``gateway_retries_total`` for one match and outcome."""
    registry = stack.app[METRICS].registry
    value = registry.get_sample_value("gateway_retries_total", {"match": match, "outcome": outcome})
    return value or 0.0


def generations(stack: Stack) -> int:
    """Model requests the simulator received."""
    assert stack.sim is not None
    return len(stack.sim.model_records())


async def test_idempotency_key_replays_finished_answer(stack: Stack) -> None:
    """The same key and body after the answer replays it: same body, one generation, one record."""
    seen = recorded(stack)
    headers = {**AUTH_A, "Idempotency-Key": "order-1"}
    body = chat_body(max_tokens=8)
    first = await stack.client.post(CHAT, json=body, headers=headers)
    assert first.status == 200
    text = await first.read()
    second = await stack.client.post(CHAT, json=body, headers=headers)
    assert second.status == 200
    assert await second.read() == text
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.headers["x-request-id"] != first.headers["x-request-id"]
    assert generations(stack) == 1
    assert len(seen) == 1
    assert matches(stack, "key", "replay") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_attached_and_replayed_requests_leave_no_body_memory_held(
    stack: Stack, stream: bool
) -> None:
    """A follower's body hold is released when it ends, like a leader's: after a replay, an
    attach by key and an SDK retry's attach, ``gateway_body_memory_bytes`` is back at 0 (each
    follower used to keep its body's estimate for good, until the bound refused everyone)."""
    memory = stack.app[BODY_MEMORY]
    headers = {**AUTH_A, "Idempotency-Key": f"held-{stream}"}
    body = chat_body(stream=stream, max_tokens=30, sim=SLOW)
    first = asyncio.ensure_future(stack.client.post(CHAT, json=body, headers=headers))
    assert await until(lambda: len(stack.app[FLIGHTS]) == 1)
    await asyncio.sleep(0.2)
    attached = await stack.client.post(CHAT, json=body, headers=headers)
    await attached.read()
    await (await first).read()
    replayed = await stack.client.post(CHAT, json=body, headers=headers)
    await replayed.read()
    assert replayed.headers["Idempotent-Replayed"] == "true"
    sdk = chat_body(stream=False, max_tokens=31, sim=SLOW)
    leader = asyncio.ensure_future(
        stack.client.post(CHAT, json=sdk, headers={**AUTH_A, "x-stainless-retry-count": "0"})
    )
    assert await until(lambda: len(stack.app[FLIGHTS]) == 2)
    await asyncio.sleep(0.2)
    retry = await stack.client.post(
        CHAT, json=sdk, headers={**AUTH_A, "x-stainless-retry-count": "1"}
    )
    await retry.read()
    await (await leader).read()
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert generations(stack) == 2
    assert matches(stack, "key", "attach") == 1 and matches(stack, "sdk_retry", "attach") == 1
    assert await until(lambda: memory.held == 0)


async def test_reused_key_with_another_body_is_409_in_each_dialect(stack: Stack) -> None:
    """A key reused with a different body is 409, OpenAI's shape on chat, Anthropic's on messages."""
    headers = {**AUTH_A, "Idempotency-Key": "k-409"}
    ok = await stack.client.post(CHAT, json=chat_body(max_tokens=4), headers=headers)
    assert ok.status == 200
    other = await stack.client.post(CHAT, json=chat_body(max_tokens=5), headers=headers)
    assert other.status == 409
    assert other.headers["x-should-retry"] == "false"
    error = (await other.json())["error"]
    assert error["code"] == "idempotency_key_reused"
    assert error["type"] == "invalid_request_error"
    body = {"model": ALIAS, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": headers["Authorization"][7:], "Idempotency-Key": "k-409m"}
    assert (await stack.client.post(MESSAGES, json=body, headers=headers)).status == 200
    conflict = await stack.client.post(MESSAGES, json={**body, "max_tokens": 5}, headers=headers)
    assert conflict.status == 409
    shaped = await conflict.json()
    assert shaped["type"] == "error"
    assert shaped["error"]["type"] == "invalid_request_error"
    assert "different request (another body or route)" in shaped["error"]["message"]
    assert "k-409m" not in json.dumps(shaped)
    assert generations(stack) == 2
    assert matches(stack, "key", "conflict") == 2


async def test_key_is_per_tenant(stack: Stack) -> None:
    """Another tenant's request with the same key and body runs on its own."""
    body = chat_body(max_tokens=4)
    for auth in (AUTH_A, AUTH_B):
        reply = await stack.client.post(CHAT, json=body, headers={**auth, "Idempotency-Key": "x"})
        assert reply.status == 200
        assert "Idempotent-Replayed" not in reply.headers
    assert generations(stack) == 2


async def test_stream_attach_gets_whole_stream_from_its_start(stack: Stack) -> None:
    """A retry attaching mid-stream gets the stream from its first byte: the same bytes."""
    seen = recorded(stack)
    headers = {**AUTH_A, "Idempotency-Key": "stream-1"}
    body = chat_body(stream=True, max_tokens=30, sim=SLOW)
    first = await stack.client.post(CHAT, json=body, headers=headers)
    assert first.status == 200
    head = await first.content.readuntil(b"\n\n")
    head += await first.content.readuntil(b"\n\n")
    second = await stack.client.post(CHAT, json=body, headers=headers)
    assert second.status == 200
    assert second.headers["Idempotent-Replayed"] == "true"
    rest = await first.read()
    attached = await second.read()
    assert attached == head + rest
    assert sse_data(attached)[-1] == "[DONE]"
    assert generations(stack) == 1
    assert await until(lambda: len(seen) == 1)
    assert seen[0].call is not None and seen[0].call.attaches == 1
    assert matches(stack, "key", "attach") == 1


async def test_first_client_gone_attached_one_still_served(stack: Stack) -> None:
    """The first client closing does not cancel a generation another connection reads."""
    seen = recorded(stack)
    body = chat_body(stream=True, max_tokens=30, sim=SLOW)
    keyed = {**AUTH_A, "Idempotency-Key": "first-gone"}
    first = await stack.client.post(CHAT, json=body, headers=keyed)
    await first.content.readuntil(b"\n\n")
    second = await stack.client.post(CHAT, json=body, headers=keyed)
    assert second.status == 200
    first.close()
    events = sse_data(await second.read())
    assert events[-1] == "[DONE]"
    assert generations(stack) == 1
    assert await until(lambda: len(seen) == 1)
    call = seen[0].call
    assert call is not None and call.attaches == 1 and call.usage.completion_tokens == 30
    assert seen[0].status == 200 and seen[0].reason == "retry_detached"
    assert matches(stack, "key", "attach") == 1


async def test_an_attached_client_that_leaves_is_a_499_however_it_is_noticed(
    stack: Stack,
) -> None:
    """A follower whose client leaves mid-stream (its handler cancelled, no failed write) is
    logged 499 ``client_disconnect`` and counted, as a leader's client is; the generation goes
    on and the leader's client gets it whole."""
    contexts: list[RequestContext] = []
    stack.app[FINISH_HOOKS].append(contexts.append)
    registry = stack.app[METRICS].registry
    body = chat_body(stream=True, max_tokens=30, sim=SLOW)
    keyed = {**AUTH_A, "Idempotency-Key": "follower-leaves"}
    first = await stack.client.post(CHAT, json=body, headers=keyed)
    await first.content.readuntil(b"\n\n")
    follower = {**keyed, "X-Request-Id": "follower-1"}
    second = await stack.client.post(CHAT, json=body, headers=follower)
    assert second.status == 200 and second.headers["Idempotent-Replayed"] == "true"
    await second.content.readuntil(b"\n\n")
    second.close()
    assert await until(lambda: any(c.request_id == "follower-1" for c in contexts))
    gone = next(c for c in contexts if c.request_id == "follower-1")
    assert (gone.status, gone.reason) == (499, "client_disconnect")
    assert registry.get_sample_value("gateway_client_disconnects_total", {"tenant": "acme"}) == 1
    assert sse_data(await first.read())[-1] == "[DONE]"
    assert await until(lambda: len(contexts) == 2)
    leader = next(c for c in contexts if c.request_id != "follower-1")
    assert leader.status == 200 and leader.call is not None and leader.call.attaches == 1
    assert generations(stack) == 1


async def test_first_client_gone_while_its_headers_wait_keeps_the_generation(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keyed stream whose client leaves while its headers wait for the engine's first event
    (`relay.HEADERS_HOLD_S`, widened here) goes on detached: the retry attaches and gets the
    whole stream of the one generation, not a 200 with no events."""
    monkeypatch.setattr(relay, "HEADERS_HOLD_S", 0.4)
    seen = recorded(stack)
    body = chat_body(stream=True, max_tokens=30, sim={"silence_s": 1.0, "completion_tokens": 5})
    keyed = {**AUTH_A, "Idempotency-Key": "gone-while-held"}
    first = asyncio.ensure_future(stack.client.post(CHAT, json=body, headers=keyed))
    assert await until(lambda: len(stack.app[FLIGHTS]) == 1)
    await asyncio.sleep(0.15)  # the engine's headers are in, the client's are held
    first.cancel()
    await asyncio.sleep(0.4)  # the hold ends on a client gone
    second = await stack.client.post(CHAT, json=body, headers=keyed)
    assert second.status == 200
    assert second.headers.get("Idempotent-Replayed") == "true"
    events = sse_data(await second.read())
    assert events[-1] == "[DONE]" and len(events) >= 6
    assert generations(stack) == 1
    assert await until(lambda: len(seen) == 1)
    assert seen[0].status == 200 and seen[0].reason == "retry_detached"


async def test_plain_stream_records_nothing_past_its_headers(stack: Stack) -> None:
    """A stream without a key keeps no bytes for retries once its headers went out (the SDKs
    retry a stream only before them): a marked retry then runs on its own."""
    body = chat_body(stream=True, max_tokens=30, sim=SLOW)
    first = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    await first.content.readuntil(b"\n\n")
    await first.content.readuntil(b"\n\n")
    assert stack.app[FLIGHTS].bytes == 0
    retry = {**AUTH_A, "x-stainless-retry-count": "1"}
    second = await stack.client.post(CHAT, json=body, headers=retry)
    assert "Idempotent-Replayed" not in second.headers
    await asyncio.gather(first.read(), second.read())
    assert generations(stack) == 2


async def test_all_clients_gone_cancels_after_grace(stack: Stack) -> None:
    """When every attached client left, the generation is cancelled after the orphan grace."""
    seen = recorded(stack)
    body = chat_body(stream=True, max_tokens=200, sim={"tokens_per_second": 20})
    headers = {**AUTH_A, "Idempotency-Key": "gone"}
    first = await stack.client.post(CHAT, json=body, headers=headers)
    await first.content.readuntil(b"\n\n")
    second = await stack.client.post(CHAT, json=body, headers=headers)
    await second.content.readuntil(b"\n\n")
    first.close()
    second.close()
    assert await until(lambda: len(seen) == 1, timeout=5.0)
    assert seen[0].status == 499
    call = seen[0].call
    assert call is not None and 0 < (call.usage.completion_tokens or 0) < 200
    assert len(stack.app[FLIGHTS]) == 0


async def test_unmarked_identical_body_runs_separately_while_first_is_connected(
    stack: Stack,
) -> None:
    """Two connected clients sending the same body each get their own generation."""
    body = chat_body(stream=True, max_tokens=30, sim=SLOW)
    first = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    await first.content.readuntil(b"\n\n")
    second = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    assert "Idempotent-Replayed" not in second.headers
    await asyncio.gather(first.read(), second.read())
    assert generations(stack) == 2


@pytest.mark.parametrize("first_headers", [AUTH_A, {**AUTH_A, "x-stainless-retry-count": "0"}])
async def test_unmarked_identical_non_streamed_body_runs_separately_while_first_is_connected(
    stack: Stack, first_headers: dict[str, str]
) -> None:
    """Non-streamed, too: a second client sending the same body while the first one still waits
    for its answer gets its own generation, not a replay of the first one's."""
    body = chat_body(max_tokens=30, sim=SLOW)
    first = asyncio.ensure_future(stack.client.post(CHAT, json=body, headers=first_headers))
    assert await until(lambda: len(stack.app[FLIGHTS]) == 1 or generations(stack) == 1)
    second = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    assert second.status == 200
    assert "Idempotent-Replayed" not in second.headers
    assert (await second.json())["usage"]["completion_tokens"] == 30
    assert (await first).status == 200
    assert generations(stack) == 2


async def test_unmarked_resend_attaches_to_orphaned_generation(stack: Stack) -> None:
    """An unmarked resend after an SDK's non-streamed request lost its client attaches to it."""
    body = chat_body(max_tokens=30, sim=SLOW)
    sdk = {**AUTH_A, "x-stainless-retry-count": "0"}
    first = asyncio.ensure_future(stack.client.post(CHAT, json=body, headers=sdk))
    assert await until(lambda: len(stack.app[FLIGHTS]) == 1)
    await asyncio.sleep(0.3)
    first.cancel()
    await asyncio.sleep(0.2)
    second = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    assert second.status == 200
    assert second.headers.get("Idempotent-Replayed") == "true"
    assert (await second.json())["usage"]["completion_tokens"] == 30
    assert generations(stack) == 1
    assert matches(stack, "resend", "attach") == 1


async def test_stream_without_key_is_cancelled_when_its_client_leaves(
    aiohttp_client: Any,
) -> None:
    """A stream without a key is aborted at the engine as soon as its client leaves: no grace."""
    async with open_stack(aiohttp_client, {"retries": {"orphan_grace_s": 60}}) as stack:
        seen = recorded(stack)
        body = chat_body(stream=True, max_tokens=200, sim={"tokens_per_second": 20})
        first = await stack.client.post(CHAT, json=body, headers=AUTH_A)
        await first.content.readuntil(b"\n\n")
        first.close()
        assert await until(lambda: len(seen) == 1, timeout=20)
        assert seen[0].status == 499
        assert stack.sim is not None
        assert await until(lambda: generations(stack) == 1)
        assert [r["outcome"] for r in stack.sim.model_records()] == ["aborted"]


async def test_queued_leader_leaving_keeps_its_place_for_the_attached(aiohttp_client: Any) -> None:
    """A queued stream whose client left while a retry with its key waits: the retry keeps the
    place and gets the queued stream's every byte, from one generation."""
    config = {"engine": {"queued_comment_after_s": 0.1}, "server": {"sse_keepalive_s": 0.1}}
    async with open_stack(aiohttp_client, config) as stack:
        blocker = chat_body(max_tokens=20, sim={"tokens_per_second": 20, "completion_tokens": 20})
        hold = asyncio.ensure_future(stack.client.post(CHAT, json=blocker, headers=AUTH_B))
        assert await until(lambda: len(stack.app[FLIGHTS]) == 1)
        headers = {**AUTH_A, "Idempotency-Key": "queued"}
        body = chat_body(stream=True, max_tokens=5, sim={"completion_tokens": 5})
        first = await stack.client.post(CHAT, json=body, headers=headers)
        assert b": queued" in await first.content.readuntil(b"\n\n")
        second = await stack.client.post(CHAT, json=body, headers=headers)
        first.close()
        events = sse_data(await second.read())
        assert events[-1] == "[DONE]"
        assert (await hold).status == 200
        assert generations(stack) == 2
        assert matches(stack, "key", "attach") == 1


async def test_bad_idempotency_key_is_400_without_quoting_it(stack: Stack) -> None:
    """An Idempotency-Key that is too long or not printable ASCII is a 400 that does not quote it."""
    for value in ("k" * 256, "caf\u00e9"):
        reply = await stack.client.post(
            CHAT,
            json=chat_body(max_tokens=2),
            headers={**AUTH_A, "Idempotency-Key": value.encode().decode("latin-1")},
        )
        assert reply.status == 400
        error = (await reply.json())["error"]
        assert error["param"] == "Idempotency-Key" and "kkkk" not in error["message"]
    assert generations(stack) == 0


def test_an_older_ledger_gains_the_attaches_column(tmp_path: Any) -> None:
    """A ledger file without ``attaches`` gains it at the first open, 0 for its old rows."""
    path = tmp_path / "usage.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE usage (ts REAL NOT NULL, day TEXT NOT NULL, tenant TEXT NOT NULL, "
        "key_id TEXT NOT NULL, subject TEXT, endpoint TEXT NOT NULL, status INTEGER NOT NULL, "
        "prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
        "reasoning_tokens INTEGER, queue_s REAL, ttft_s REAL, duration_s REAL NOT NULL, "
        "request_id TEXT NOT NULL, record_id TEXT, engine TEXT);"
        "INSERT INTO usage VALUES (1, '1970-01-01', 't', 'k', NULL, '/v1/chat/completions', "
        "200, 1, 1, NULL, NULL, NULL, 0.1, 'old', 'r1', NULL);"
    )
    conn.commit()
    conn.close()
    opened = ledger.connect(path)
    rows = opened.execute("SELECT request_id, attaches FROM usage").fetchall()
    opened.close()
    assert rows == [("old", 0)]


async def test_engine_5xx_is_not_replayed(stack: Stack) -> None:
    """An engine failure is not kept: the same key runs again."""
    headers = {**AUTH_A, "Idempotency-Key": "fails"}
    body = chat_body(max_tokens=8, sim={"error_after": 2})
    first = await stack.client.post(CHAT, json=body, headers=headers)
    assert first.status >= 500
    second = await stack.client.post(CHAT, json=body, headers=headers)
    assert second.status >= 500
    assert "Idempotent-Replayed" not in second.headers
    assert generations(stack) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_engine_4xx_is_replayed_as_the_same_error(stack: Stack, stream: bool) -> None:
    """An engine 4xx with a key is kept: the retry gets the same error without the engine."""
    headers = {**AUTH_A, "Idempotency-Key": f"engine-400-{stream}"}
    body = chat_body(max_tokens=8, stream=stream, sim={"no_such_fault": 1})
    first = await stack.client.post(CHAT, json=body, headers=headers)
    assert first.status == 400
    error = await first.read()
    second = await stack.client.post(CHAT, json=body, headers=headers)
    assert second.status == 400
    assert second.headers["Idempotent-Replayed"] == "true"
    assert await second.read() == error
    assert generations(stack) == 1
    assert len(stack.app[FLIGHTS]) == 1
    flight = next(iter(stack.app[FLIGHTS]._keys.values()))
    assert flight.task is None and flight.error is None  # nothing refers to the request


async def test_non_streamed_retries_share_one_generation(stack: Stack) -> None:
    """Non-streamed: a retry while the first runs gets the same answer; one record, attaches 1."""
    seen = recorded(stack)
    body = chat_body(max_tokens=20, sim={"tokens_per_second": 20, "completion_tokens": 20})
    first = asyncio.ensure_future(stack.client.post(CHAT, json=body, headers=AUTH_A))
    assert await until(lambda: len(stack.app[FLIGHTS]) == 1)
    await asyncio.sleep(0.2)
    second = await stack.client.post(
        CHAT, json=body, headers={**AUTH_A, "x-stainless-retry-count": "1"}
    )
    one = await (await first).json()
    two = await second.json()
    assert one == two
    assert generations(stack) == 1
    assert await until(lambda: len(seen) == 1)
    assert seen[0].call is not None and seen[0].call.attaches == 1
    accounting = stack.app[ACCOUNTING]
    assert accounting.ledger is not None
    accounting.ledger.flush()
    path = stack.app[ACCOUNTING].ledger.path  # type: ignore[union-attr]
    rows = sqlite3.connect(path).execute("SELECT attaches FROM usage").fetchall()
    assert rows == [(1,)]


async def test_buffer_is_bounded(aiohttp_client: Any) -> None:
    """A stream longer than retries.buffer_bytes holds at most the bound; a key then gets 409."""
    config = {"retries": {"buffer_bytes": 65_536}}
    async with open_stack(aiohttp_client, config) as stack:
        headers = {**AUTH_A, "Idempotency-Key": "big"}
        sim = {"completion_tokens": 400, "token_bytes": 1000, "tokens_per_second": 200}
        body = chat_body(stream=True, max_tokens=400, sim=sim)
        first = await stack.client.post(CHAT, json=body, headers=headers)
        flights = stack.app[FLIGHTS]
        peak = 0
        size = 0
        async for chunk in first.content.iter_any():
            size += len(chunk)
            peak = max(peak, flights.bytes)
        assert size > 300_000
        assert peak <= 65_536
        again = await stack.client.post(CHAT, json=body, headers=headers)
        assert again.status == 409
        assert (await again.json())["error"]["code"] == "idempotency_replay_unavailable"
        assert generations(stack) == 1


@pytest.mark.parametrize("route", [CHAT, MESSAGES])
async def test_follower_past_the_bound_ends_with_its_dialects_error_event(
    aiohttp_client: Any, route: str
) -> None:
    """A follower more than retries.buffer_bytes behind (an event larger than the bound arrives
    before it wrote it) gets its dialect's error event and a clean end, no ``[DONE]``, logged
    once; the leader still gets the whole answer."""
    config = {"retries": {"buffer_bytes": 65_536}}
    sim = {
        "prefill_ms": 400,
        "completion_tokens": 3,
        "token_bytes": 70_000,
        "tokens_per_second": 10,
    }
    async with open_stack(aiohttp_client, config, **sim) as stack:
        headers = {**AUTH_A, "Idempotency-Key": f"behind-{route}"}
        body = {**DIALECT_BODIES[route], "stream": True, "max_tokens": 3}
        with capture_logs() as entries:
            leading = asyncio.ensure_future(stack.client.post(route, json=body, headers=headers))
            assert await until(lambda: stack.app[FLIGHTS].bytes > 0 or leading.done(), 0.3)
            await asyncio.sleep(0.1)  # the leader is at the engine, in its prefill
            second = await stack.client.post(route, json=body, headers=headers)
            first = await leading
            assert first.status == second.status == 200
            assert second.headers["Idempotent-Replayed"] == "true"
            attached, whole = await asyncio.gather(second.read(), first.read())
        assert len(attached) < len(whole)
        text = attached.decode()
        if route == CHAT:
            last = json.loads(sse_data(attached)[-1])
            assert last["error"]["code"] == "idempotency_replay_unavailable"
            assert "[DONE]" not in text
            assert sse_data(whole)[-1] == "[DONE]"
        else:
            assert text.rstrip().rsplit("\n\n", 1)[-1].startswith("event: error")
            assert "message_stop" not in text and "message_stop" in whole.decode()
        assert "retries.buffer_bytes" in text
        warned = [e for e in entries if e["event"] == "retry_follower_behind"]
        assert len(warned) == 1
        (line,) = [
            e for e in entries if e["event"] == "request" and e.get("reason") == "client_stalled"
        ]
        assert (line["status"], line["error_status"]) == (200, 409)
        assert generations(stack) == 1


def test_flight_trims_to_its_bound() -> None:
    """A cut flight keeps only what an attached follower has not written, within the bound."""
    taken: list[int] = []

    class Budget:
        def take(self, size: int) -> bool:
            taken.append(size)
            return True

        def give(self, size: int) -> None:
            taken.append(-size)

    flight = Flight(
        request_id="r",
        tenant="t",
        digest=b"d",
        key=None,
        stream=True,
        limit=1000,
        budget=Budget(),
        clock=lambda: 0.0,
    )
    follower = flight.join()
    for _ in range(3):
        flight.sent(b"x" * 252)  # 300 bytes counted each with CHUNK_OVERHEAD_BYTES
    assert len(flight.pending(follower)) == 756
    flight.sent(b"x" * 252)
    flight.sent(b"x" * 252)
    assert flight.cut and not flight.attachable
    assert flight.size == 600
    assert len(flight.pending(follower)) == 504
    for _ in range(20):
        flight.sent(b"y" * 252)
        assert flight.size <= 1000 + 300
    assert follower.lost
    assert flight.size <= 1000
    assert sum(taken) == flight.held() <= 1000


DIALECT_BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20},
    "/v1/completions": {"model": ALIAS, "prompt": "hi", "max_tokens": 20},
    "/v1/responses": {"model": ALIAS, "input": "hi", "max_output_tokens": 20},
    MESSAGES: {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20},
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("route", list(DIALECT_BODIES))
async def test_every_dialect_attaches_with_a_key(
    aiohttp_client: Any, route: str, stream: bool
) -> None:
    """On each API, streamed or not, a retry with the key while the answer runs gets the same
    bytes from one generation, and one after it ends gets them replayed; one ledger record."""
    async with open_stack(aiohttp_client, tokens_per_second=20, completion_tokens=20) as stack:
        seen = recorded(stack)
        headers = {**AUTH_A, "Idempotency-Key": f"dialect-{route}"}
        body = {**DIALECT_BODIES[route], "stream": stream}
        first = asyncio.ensure_future(stack.client.post(route, json=body, headers=headers))
        assert await until(lambda: len(stack.app[FLIGHTS]) == 1)
        await asyncio.sleep(0.3)
        second = await stack.client.post(route, json=body, headers=headers)
        leader = await first
        one, two = await leader.read(), await second.read()
        assert leader.status == second.status == 200
        assert second.headers["Idempotent-Replayed"] == "true"
        assert one == two and len(one) > 100
        third = await stack.client.post(route, json=body, headers=headers)
        assert await third.read() == one
        assert generations(stack) == 1
        assert await until(lambda: len(seen) == 1)
        assert seen[0].call is not None and seen[0].call.attaches == 1  # the replay came later
        assert matches(stack, "key", "attach") == matches(stack, "key", "replay") == 1


async def test_count_tokens_does_not_read_idempotency_keys(stack: Stack) -> None:
    """``count_tokens`` generates nothing, so it ignores ``Idempotency-Key``: one key with two
    bodies counts each, a malformed key is not refused, and nothing is recorded that would make
    the same key on ``/v1/messages`` a 409."""
    count = "/v1/messages/count_tokens"
    auth = {"x-api-key": AUTH_A["Authorization"][7:]}
    short = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]}
    long = {"model": ALIAS, "messages": [{"role": "user", "content": "hi " * 50}]}
    counted = []
    for body, key in ((short, "ct-1"), (long, "ct-1"), (short, "k" * 300)):
        reply = await stack.client.post(count, json=body, headers={**auth, "Idempotency-Key": key})
        assert reply.status == 200, await reply.text()
        assert "Idempotent-Replayed" not in reply.headers
        counted.append((await reply.json())["input_tokens"])
    assert counted[0] == counted[2] < counted[1]
    messages = {**short, "max_tokens": 2}
    reply = await stack.client.post(
        "/v1/messages", json=messages, headers={**auth, "Idempotency-Key": "ct-1"}
    )
    assert reply.status == 200
    assert sum(matches(stack, "key", outcome) for outcome in ("attach", "replay", "conflict")) == 0


async def test_an_attached_stream_ending_in_an_error_is_logged_with_its_status(
    stack: Stack,
) -> None:
    """A generation cut by the engine ends the leader's stream and the attached one's with the
    same error event; both access lines say so (``error_status`` 502, a warning), not only the
    leader's."""
    headers = {**AUTH_A, "Idempotency-Key": "cut-1"}
    body = chat_body(stream=True, max_tokens=30, sim={**SLOW, "drop_after": 6})
    with capture_logs() as entries:
        first = await stack.client.post(CHAT, json=body, headers=headers)
        assert first.status == 200
        head = await first.content.readuntil(b"\n\n")
        second = await stack.client.post(CHAT, json=body, headers=headers)
        assert second.headers["Idempotent-Replayed"] == "true"
        rest, attached = await asyncio.gather(first.read(), second.read())
        whole = head + rest
        assert await until(lambda: sum(e["event"] == "request" for e in entries) == 2)
    assert attached == whole
    assert "error" in json.loads(sse_data(attached)[-1])
    lines = {e.get("reason"): e for e in entries if e["event"] == "request"}
    follower = lines["retry_attached"]
    leader = next(e for reason, e in lines.items() if reason != "retry_attached")
    assert (leader["status"], leader["error_status"]) == (200, 502), leader
    assert (follower["status"], follower["error_status"]) == (200, 502), follower
    assert follower["log_level"] == "warning"
    assert generations(stack) == 1
