"""The gateway app in-process against the simulator's app: the model path, branch by branch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.state import ADMISSION, RELOADER
from tests.conftest import ALIAS
from tests.inprocess import (
    AUTH_A,
    Stack,
    chat_body,
    open_stack,
    sse_data,
    until,
    write_config,
)


@pytest.fixture
async def stack(aiohttp_client: Any) -> AsyncIterator[Stack]:
    """The simulator (no pacing) and a gateway (tenants acme, beta) in this event loop."""
    async with open_stack(aiohttp_client) as s:
        yield s


async def test_a_reload_never_changes_a_stream_in_flight(stack: Stack) -> None:
    """An alias changed by a reload in the middle of a stream: the stream keeps the old alias."""
    body = chat_body(stream=True, sim={"tokens_per_second": 50, "completion_tokens": 12})
    r = await stack.client.post("/v1/chat/completions", json=body, headers=AUTH_A)
    assert r.status == 200
    first = await r.content.readuntil(b"\n\n")
    write_config(stack.directory, {"model": {"alias": "renamed"}})
    assert await stack.app[RELOADER].reload()
    rest = await r.read()
    chunks = [json.loads(d) for d in sse_data(first + rest) if d != "[DONE]"]
    assert len(chunks) > 3
    assert {c["model"] for c in chunks} == {ALIAS}
    after = await stack.client.post(
        "/v1/chat/completions", json=chat_body(model="renamed"), headers=AUTH_A
    )
    assert after.status == 200 and (await after.json())["model"] == "renamed"


async def test_a_reload_never_changes_a_queued_request(aiohttp_client: Any) -> None:
    """An alias changed while a request waits for the engine: its answer keeps the old alias."""
    async with open_stack(aiohttp_client, {"engine": {"max_concurrency": 1}}) as stack:
        slow = chat_body(stream=True, sim={"tokens_per_second": 40, "completion_tokens": 12})
        first = await stack.client.post("/v1/chat/completions", json=slow, headers=AUTH_A)
        assert first.status == 200
        second = asyncio.ensure_future(
            stack.client.post("/v1/chat/completions", json=chat_body(), headers=AUTH_A)
        )
        assert await until(lambda: stack.app[ADMISSION].depth == 1)
        write_config(stack.directory, {"engine": {"max_concurrency": 1}, "model": {"alias": "x"}})
        assert await stack.app[RELOADER].reload()
        await first.read()
        answer = await second
        assert answer.status == 200 and (await answer.json())["model"] == ALIAS
