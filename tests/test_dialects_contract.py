"""The tenant contract on /v1/messages and /v1/responses: cache isolation, limits with honest
retry times in each API's shape, fair admission across dialects, exact charges (cut streams
included) and disconnect aborts. Real gateway, real simulator (its ``--record`` shows what
reached the engine)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from tests.conftest import KEY_A, KEY_B, Gateway, wait_until

MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def messages_body(
    content: str = "x", *, stream: bool = False, max_tokens: int = 10
) -> dict[str, Any]:
    return {
        "model": "qwen3.8-27b",
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": content}],
    }


def responses_body(
    content: str = "x", *, stream: bool = False, max_tokens: int = 10
) -> dict[str, Any]:
    return {
        "model": "qwen3.8-27b",
        "max_output_tokens": max_tokens,
        "stream": stream,
        "input": content,
    }


def chat_records(gw: Gateway) -> list[dict[str, Any]]:
    assert gw.sim is not None
    return [r for r in gw.sim.model_records() if r["path"] == "/v1/chat/completions"]


def route_logs(gw: Gateway, route: str) -> list[dict[str, Any]]:
    return [e for e in gw.access_logs() if e.get("route") == route]


def test_cache_salt_per_tenant_on_every_dialect(sim_factory: Any, gateway_factory: Any) -> None:
    """One tenant's chat, Messages and Responses requests share its cache_salt; another
    tenant's differs; the engine request id is the gateway's, unique per request."""
    gw = gateway_factory(sim_factory("--completion-tokens", "3"))
    chat = {"model": "qwen3.8-27b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
    for key in (KEY_A, KEY_B):
        assert (
            httpx.post(gw.url("/v1/chat/completions"), headers=auth(key), json=chat).status_code
            == 200
        )
        assert (
            httpx.post(gw.url(MESSAGES), headers=auth(key), json=messages_body()).status_code == 200
        )
        assert (
            httpx.post(gw.url(RESPONSES), headers=auth(key), json=responses_body()).status_code
            == 200
        )
    salts = [r["body"]["cache_salt"] for r in chat_records(gw)]
    assert len(set(salts[:3])) == 1 and len(set(salts[3:])) == 1 and salts[0] != salts[3]
    ids = [r["body"]["request_id"] for r in chat_records(gw)]
    assert len(set(ids)) == 6
    for route in (MESSAGES, RESPONSES):  # metrics are labelled by the client's route
        assert gw.metric("gateway_requests_total", route=route, code="200") == 2
        assert gw.metric("gateway_tokens_total", tenant="acme") > 0


def test_tpm_limit_in_each_dialect_shape(sim_factory: Any, gateway_factory: Any) -> None:
    """A tenant over its tokens-per-minute budget: reserved from max_tokens /
    max_output_tokens, refused with 429 and an honest Retry-After in each API's shape."""
    gw = gateway_factory(
        sim_factory("--completion-tokens", "3"), {"tenants": {"acme": {"tpm": 600}}}
    )
    first = httpx.post(
        gw.url(MESSAGES), headers=auth(KEY_A), json=messages_body("x" * 1600, max_tokens=150)
    )
    assert first.status_code == 200
    # ~410 tokens were charged (drained at 10 a second); 11 + 585 fits an empty budget of 600
    # but not what is left, also after the engine's exact count of the prompt is asked.
    refused = httpx.post(gw.url(MESSAGES), headers=auth(KEY_A), json=messages_body(max_tokens=585))
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    retry = int(refused.headers["retry-after"])
    assert 1 <= retry <= 60
    assert refused.headers["anthropic-ratelimit-tokens-limit"] == "600"
    refused = httpx.post(
        gw.url(RESPONSES), headers=auth(KEY_A), json=responses_body(max_tokens=585)
    )
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-limit-tokens"] == "600"
    # Codex sends no max_output_tokens: the tenant's cap is reserved (here more than the budget).
    capped = httpx.post(
        gw.url(RESPONSES), headers=auth(KEY_B), json={"model": "qwen3.8-27b", "input": "x"}
    )
    assert capped.status_code == 200


def test_count_tokens_is_rate_limited(sim_factory: Any, gateway_factory: Any) -> None:
    """count_tokens counts against the requests-per-minute limit (429 rate_limit_error)."""
    gw = gateway_factory(sim_factory(), {"tenants": {"acme": {"rpm": 1}}})
    body = {"model": "qwen3.8-27b", "messages": [{"role": "user", "content": "x"}]}
    url = gw.url(MESSAGES + "/count_tokens")
    assert httpx.post(url, headers={"x-api-key": KEY_A}, json=body).status_code == 200
    refused = httpx.post(url, headers={"x-api-key": KEY_A}, json=body)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1


def test_cut_stream_charges_what_the_engine_generated(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """An engine drop mid-stream on each dialect: the tokens charged equal the tokens the engine
    sent, and the prompt is charged."""
    sim = sim_factory("--drop-after", "5", "--completion-tokens", "30")
    gw = gateway_factory(sim)
    for route, body in (
        (MESSAGES, messages_body(stream=True, max_tokens=50)),
        (RESPONSES, responses_body(stream=True, max_tokens=50)),
    ):
        r = httpx.post(gw.url(route), headers=auth(KEY_A), json=body, timeout=30)
        assert r.status_code == 200
        assert wait_until(lambda route=route: len(route_logs(gw, route)) == 1, 5)
        log = route_logs(gw, route)[0]
        sent = chat_records(gw)[-1]["tokens_sent"]
        assert log["completion_tokens"] == sent
        assert log["prompt_tokens"] > 0


def test_client_disconnect_aborts_the_engine_request(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """A client that goes away mid-stream on each dialect: the engine request is aborted and
    what was generated is charged."""
    sim = sim_factory("--tokens-per-second", "20", "--completion-tokens", "200")
    gw = gateway_factory(sim)
    for route, body in (
        (MESSAGES, messages_body(stream=True, max_tokens=300)),
        (RESPONSES, responses_body(stream=True, max_tokens=300)),
    ):
        with httpx.stream("POST", gw.url(route), headers=auth(KEY_A), json=body, timeout=30) as r:
            for line in r.iter_lines():
                if "delta" in line:
                    break
        assert wait_until(
            lambda: chat_records(gw) and chat_records(gw)[-1]["outcome"] == "aborted", 10
        )
        assert wait_until(lambda route=route: len(route_logs(gw, route)) == 1, 5)
        log = route_logs(gw, route)[0]
        assert log["status"] == 499
        assert log["completion_tokens"] >= 1


def test_fair_queue_across_dialects(sim_factory: Any, gateway_factory: Any) -> None:
    """Tenant A floods /v1/messages; tenant B's /v1/responses requests, sent later, finish long
    before A's backlog: one fair queue for every dialect."""
    sim = sim_factory("--tokens-per-second", "100", "--completion-tokens", "10")
    gw = gateway_factory(sim, {"engine": {"max_concurrency": 1, "queue_size": 64}})

    async def one(client: httpx.AsyncClient, key: str, route: str, body: dict[str, Any]) -> float:
        r = await client.post(gw.url(route), json=body, headers=auth(key))
        assert r.status_code == 200, r.text
        return time.monotonic()

    async def run() -> tuple[list[float], list[float]]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as c:
            a = [
                asyncio.create_task(one(c, KEY_A, MESSAGES, messages_body(f"a{i}")))
                for i in range(20)
            ]
            await asyncio.sleep(0.5)
            b = [
                asyncio.create_task(one(c, KEY_B, RESPONSES, responses_body(f"b{i}")))
                for i in range(3)
            ]
            return list(await asyncio.gather(*a)), list(await asyncio.gather(*b))

    a_done, b_done = asyncio.run(run())
    a_done.sort()
    assert max(b_done) < a_done[-6]


def test_keepalive_comments_on_responses_during_prefill(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """A long prefill on /v1/responses: response.created at once, SSE comments while silent."""
    gw = gateway_factory(sim_factory("--prefill-ms", "6000", "--completion-tokens", "3"))
    r = httpx.post(
        gw.url(RESPONSES), headers=auth(KEY_A), json=responses_body(stream=True), timeout=30
    )
    text = r.text
    assert text.startswith("event: response.created")
    assert ": keepalive\n\n" in text
    assert text.index(": keepalive") < text.index("response.output_item.added")
    last = [block for block in text.split("\n\n") if block.startswith("event: ")][-1]
    assert json.loads(last.split("data: ", 1)[1])["type"] == "response.completed"


def test_full_queue_is_overloaded_on_messages(sim_factory: Any, gateway_factory: Any) -> None:
    """The engine busy and the queue full with other tenants' requests: /v1/messages answers 529
    overloaded_error with Retry-After, /v1/responses 503 in OpenAI's shape."""
    sim = sim_factory("--tokens-per-second", "5", "--completion-tokens", "60")
    gw = gateway_factory(sim, {"engine": {"max_concurrency": 1, "queue_size": 1}})

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as c:
            busy = asyncio.create_task(
                c.post(gw.url(MESSAGES), headers=auth(KEY_A), json=messages_body(max_tokens=60))
            )
            await asyncio.sleep(0.5)
            queued = asyncio.create_task(
                c.post(gw.url(RESPONSES), headers=auth(KEY_A), json=responses_body(max_tokens=60))
            )
            await asyncio.sleep(0.5)
            over = await c.post(gw.url(MESSAGES), headers=auth(KEY_B), json=messages_body())
            over_r = await c.post(gw.url(RESPONSES), headers=auth(KEY_B), json=responses_body())
            for task in (busy, queued):
                task.cancel()
            await asyncio.gather(busy, queued, return_exceptions=True)
            return over, over_r

    over, over_r = asyncio.run(run())
    assert over.status_code == 529
    assert over.json()["error"]["type"] == "overloaded_error"
    assert int(over.headers["retry-after"]) >= 1
    assert over_r.status_code == 503 and over_r.json()["error"]["code"] == "engine_unavailable"
