"""Limits and fair admission end to end: gateway and simulator processes, a real redis-server."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ALIAS, KEY_A, KEY_B, Gateway, Sim, wait_until
from tests.test_ratelimit_redis import REDIS_SERVER, RedisServer

AUTH_A = {"Authorization": f"Bearer {KEY_A}"}
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}
LIMIT_HEADERS = [
    f"x-ratelimit-{part}-{kind}"
    for kind in ("requests", "tokens")
    for part in ("limit", "remaining", "reset")
]

GatewayFactory = Callable[..., Gateway]
SimFactory = Callable[..., Sim]


def chat(content: str, sim: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A chat body whose only message is ``content`` (a marker to find it in the sim record)."""
    body: dict[str, Any] = {"model": ALIAS, "messages": [{"role": "user", "content": content}]}
    if sim:
        body["sim"] = sim
    body.update(extra)
    return body


def post(gw: Gateway, body: dict[str, Any], headers: dict[str, str] = AUTH_A) -> httpx.Response:
    return httpx.post(gw.url("/v1/chat/completions"), json=body, headers=headers, timeout=30)


def stream_events(
    gw: Gateway, body: dict[str, Any], headers: dict[str, str] = AUTH_A
) -> tuple[httpx.Response, list[Any]]:
    """POST a streaming request and read it to the end: the response and its ``data:`` payloads.

    The response is read, so ``.json()`` works for an error answered before the stream began.
    """
    r = httpx.post(
        gw.url("/v1/chat/completions"), json={**body, "stream": True}, headers=headers, timeout=30
    )
    events: list[Any] = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return r, events


def records_for(sim: Sim, content: str) -> list[dict[str, Any]]:
    """What the simulator received whose first message is ``content``."""
    return [
        r
        for r in sim.model_records()
        if (r.get("body") or {}).get("messages", [{}])[0].get("content") == content
    ]


def in_flight(gw: Gateway) -> int:
    """The gateway's engine slots in use, from /ready."""
    return int(httpx.get(gw.url("/ready"), timeout=5).json()["in_flight"])


def settled(gw: Gateway, tenant: str) -> bool:
    return gw.metric("gateway_requests_in_flight", tenant=tenant) == 0 and in_flight(gw) == 0


# ---------------------------------------------------------------------------------------- C11


def _abort_stream(gw: Gateway, content: str) -> None:
    """Read three events of a long stream, then hang up."""
    body = chat(content, {"tokens_per_second": 50, "completion_tokens": 5000}, max_tokens=5000)
    with httpx.stream(
        "POST", gw.url("/v1/chat/completions"), json={**body, "stream": True},
        headers=AUTH_A, timeout=30,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 3:
                    break


def _abort_non_stream(gw: Gateway, content: str) -> None:
    body = chat(content, {"tokens_per_second": 50, "completion_tokens": 5000}, max_tokens=5000)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.url("/v1/chat/completions"), json=body, headers=AUTH_A, timeout=0.3)


def _engine_drops(gw: Gateway, content: str) -> None:
    r, events = stream_events(gw, chat(content, {"drop_after": 5}))
    assert r.status_code == 200
    assert "error" in events[-1]


def _engine_closes(gw: Gateway, content: str) -> None:
    assert post(gw, chat(content, {"refuse": "close"})).status_code >= 500


def _engine_503(gw: Gateway, content: str) -> None:
    assert post(gw, chat(content, {"refuse": "503"})).status_code >= 500


@pytest.mark.parametrize(
    "trouble",
    [_abort_stream, _abort_non_stream, _engine_drops, _engine_closes, _engine_503],
    ids=["client-aborts-stream", "client-aborts-non-stream", "engine-drops", "engine-closes",
         "engine-503"],
)  # fmt: skip
def test_c11_no_slot_leak(
    sim_factory: SimFactory,
    gateway_factory: GatewayFactory,
    trouble: Callable[[Gateway, str], None],
) -> None:
    """C11: concurrency=1, 20 rounds of a failed request then a short one: every one succeeds."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"tenants": {"acme": {"concurrency": 1}}})
    for round_ in range(20):
        trouble(gw, f"c11-{round_}")
        assert wait_until(lambda: settled(gw, "acme"), 5), f"slot still held in round {round_}"
        r = post(gw, chat(f"c11-short-{round_}", max_tokens=4))
        assert r.status_code == 200, r.text
    assert gw.metric("gateway_rate_limited_total", tenant="acme") == 0
    assert settled(gw, "acme")


def test_c11_engine_down_and_back_leaks_nothing(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """C11: the engine process refusing connections and coming back leaves no slot behind."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"tenants": {"acme": {"concurrency": 1}}})
    for round_ in range(3):
        sim.stop()
        r = post(gw, chat(f"c11-down-{round_}", max_tokens=4))
        assert r.status_code in (502, 503)
        sim.restart()
        assert wait_until(lambda: httpx.get(gw.url("/ready")).status_code == 200, 10)
        r = post(gw, chat(f"c11-up-{round_}", max_tokens=4))
        assert r.status_code == 200, r.text
    assert gw.metric("gateway_rate_limited_total", tenant="acme") == 0
    assert wait_until(lambda: settled(gw, "acme"), 5)


# ---------------------------------------------------------------------------------------- C12


def test_c12_streams_count_against_tpm(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """C12: streams without stream_options are charged their usage, so tpm=1000 refuses the 3rd."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"tenants": {"acme": {"tpm": 1000}}})
    statuses = []
    for i in range(5):
        body = chat(f"c12-{i}", {"completion_tokens": 400}, max_tokens=400)
        r, events = stream_events(gw, body)
        statuses.append(r.status_code)
        if r.status_code == 200:
            assert events[-1] == "[DONE]"
            chunks = [e for e in events if e != "[DONE]"]
            assert all(not e.get("usage") for e in chunks), "usage shown to a client not asking"
            assert all(e.get("choices") for e in chunks)
        else:
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "tokens"
    assert statuses == [200, 200, 429, 429, 429]
    (first,) = records_for(sim, "c12-0")
    assert first["body"]["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }
    for i in (2, 3, 4):
        assert records_for(sim, f"c12-{i}") == []


def test_c12_n_choices_reserved_and_charged(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """C12: n=4 reserves four outputs (too large for tpm=1000) and is charged all four's usage."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"tenants": {"acme": {"tpm": 1000}, "beta": {"tpm": 4000}}})
    body = chat("c12-n4", {"completion_tokens": 400}, max_tokens=400, n=4)
    r, _ = stream_events(gw, body)
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "tokens"
    assert "too large" in r.json()["error"]["message"]
    assert records_for(sim, "c12-n4") == []

    r, events = stream_events(gw, body, headers=AUTH_B)
    assert r.status_code == 200
    assert {c["index"] for e in events if e != "[DONE]" for c in e["choices"]} == {0, 1, 2, 3}
    models = httpx.get(gw.url("/v1/models"), headers=AUTH_B, timeout=10)
    remaining = int(models.headers["x-ratelimit-remaining-tokens"])
    # 4 x 400 completion tokens plus the prompt were charged, less what drained since (66/s);
    # without counting the stream it would be about 4000.
    assert 4000 - 1600 - 60 <= remaining <= 4000 - 1600 + 200


@pytest.mark.parametrize("limit", ["tpm", "tokens_per_day"])
def test_a_request_that_can_never_pass_is_not_retried_by_the_sdks(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, limit: str
) -> None:
    """A request larger than the whole tpm or daily quota can never pass as it is: its 429
    carries ``x-should-retry: false`` and no Retry-After, so the official SDKs (default
    ``max_retries``) raise it at once instead of retrying after a minute, and nothing reaches
    the engine."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"tenants": {"acme": {limit: 1000}}})
    r = post(gw, chat("never-raw", max_tokens=4000))
    assert r.status_code == 429, r.text
    assert r.headers["x-should-retry"] == "false"
    assert "Retry-After" not in r.headers
    assert "cannot pass as it is" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, timeout=30)
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError, match="cannot pass as it is"):
        client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "never-sdk"}], max_tokens=4000
        )
    assert time.monotonic() - started < 5  # one attempt: with retries, 2 x Retry-After
    assert records_for(sim, "never-raw") == records_for(sim, "never-sdk") == []


def test_c12_non_stream_never_carries_stream_options(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """C12: a non-streaming request reaches the engine without stream_options, even if sent."""
    sim = sim_factory()
    gw = gateway_factory(sim)
    for i, extra in enumerate(({}, {"stream_options": {"include_usage": True}})):
        r = post(gw, chat(f"c12-plain-{i}", max_tokens=4, **extra))
        assert r.status_code == 200, r.text
        (rec,) = records_for(sim, f"c12-plain-{i}")
        assert "stream_options" not in rec["body"]


# ---------------------------------------------------------------------------------------- C13


def test_c13_rpm_429_is_honest_and_sdk_retry_succeeds(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """C13: rpm=2, the third gets 429 with an honest Retry-After; B unaffected; SDK retry works."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"tenants": {"acme": {"rpm": 2}}})
    first = post(gw, chat("c13-1", max_tokens=4))
    started = time.monotonic()
    second = post(gw, chat("c13-2", max_tokens=4))
    third = post(gw, chat("c13-3", max_tokens=4))
    assert [first.status_code, second.status_code] == [200, 200]
    assert third.status_code == 429
    error = third.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert error["type"] == "requests"
    assert set(error) == {"message", "type", "param", "code"}
    retry_after = int(third.headers["Retry-After"])
    # The first request took the budget at time ~started; one more frees 30 s after it.
    assert 28 <= retry_after <= 30
    for name in LIMIT_HEADERS:
        assert name in third.headers
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert records_for(sim, "c13-3") == []

    other = post(gw, chat("c13-b", max_tokens=4), headers=AUTH_B)
    assert other.status_code == 200

    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=2)
    answer = client.chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": "c13-sdk"}], max_tokens=4
    )
    waited = time.monotonic() - started
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    assert 29 <= waited <= retry_after + 5
    assert len(records_for(sim, "c13-sdk")) == 1
    assert gw.metric("gateway_rate_limited_total", tenant="acme", limit="requests") >= 2


# ------------------------------------------------------------------------------- Redis, shared


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A throwaway redis-server; skipped when the binary is missing."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    workdir = Path(tempfile.mkdtemp(prefix="q38r-", dir="/tmp"))
    server = RedisServer(workdir)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def test_two_gateways_share_one_budget_through_redis(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, redis_server: RedisServer
) -> None:
    """Two gateway processes on one Redis enforce one rpm and one concurrency budget."""
    sim = sim_factory()
    shared = {
        "ratelimit": {"backend": "redis", "redis_url": redis_server.url, "key_prefix": "e2e"},
        "tenants": {"acme": {"rpm": 4}, "beta": {"concurrency": 1}},
    }
    one = gateway_factory(sim, shared, name="gw1")
    two = gateway_factory(sim, shared, name="gw2")
    statuses = [post(gw, chat(f"shared-{i}", max_tokens=4)).status_code
                for i, gw in enumerate((one, two, one, two, one, two))]  # fmt: skip
    assert statuses == [200, 200, 200, 200, 429, 429]
    assert one.metric("gateway_ratelimit_backend_up", backend="redis") == 1

    slow = chat("shared-slow", {"tokens_per_second": 20, "completion_tokens": 200}, max_tokens=200)
    with httpx.stream(
        "POST", one.url("/v1/chat/completions"), json={**slow, "stream": True},
        headers=AUTH_B, timeout=30,
    ) as running:  # fmt: skip
        assert running.status_code == 200
        refused = post(two, chat("shared-second", max_tokens=4), headers=AUTH_B)
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "concurrency"
    assert wait_until(lambda: settled(one, "beta"), 5)
    assert post(two, chat("shared-after", max_tokens=4), headers=AUTH_B).status_code == 200


def test_gateway_keeps_serving_when_redis_dies(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, redis_server: RedisServer
) -> None:
    """Redis killed: requests still succeed under local limits, the metric says so, logs once."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"ratelimit": {"backend": "redis", "redis_url": redis_server.url}})
    assert post(gw, chat("redis-before", max_tokens=4)).status_code == 200
    redis_server.stop()
    for i in range(3):
        r = post(gw, chat(f"redis-during-{i}", max_tokens=4))
        assert r.status_code == 200, r.text
        assert "x-ratelimit-remaining-requests" in r.headers
    assert gw.metric("gateway_ratelimit_backend_up", backend="redis") == 0
    downs = [e for e in gw.logs() if e.get("event") == "ratelimit_backend_down"]
    assert len(downs) == 1
    redis_server.start()
    assert wait_until(lambda: gw.metric("gateway_ratelimit_backend_up", backend="redis") == 1, 5)
    assert post(gw, chat("redis-after", max_tokens=4)).status_code == 200
    assert [e["event"] for e in gw.logs() if e.get("event") == "ratelimit_backend_up"] == [
        "ratelimit_backend_up"
    ]


# ----------------------------------------------------------------------------------- fairness


def test_flooding_tenant_cannot_starve_another(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """A sends 30 requests, B sends 3 half a second later: B's finish long before A's backlog."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"engine": {"max_concurrency": 1, "queue_size": 64}})
    pace = {"tokens_per_second": 100, "completion_tokens": 10}

    async def one(client: httpx.AsyncClient, key: str, content: str) -> float:
        r = await client.post(
            gw.url("/v1/chat/completions"),
            json=chat(content, pace, max_tokens=10),
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text
        return time.monotonic()

    async def run() -> tuple[list[float], list[float], float]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            start = time.monotonic()
            a = [asyncio.create_task(one(client, KEY_A, f"fair-a-{i}")) for i in range(30)]
            await asyncio.sleep(0.5)
            b = [asyncio.create_task(one(client, KEY_B, f"fair-b-{i}")) for i in range(3)]
            return list(await asyncio.gather(*a)), list(await asyncio.gather(*b)), start

    a_done, b_done, start = asyncio.run(run())
    a_done.sort()
    # Each request holds the engine ~0.1 s: A's backlog takes ~3 s; B's three are interleaved.
    # On failure the whole timeline is shown: whether B waited behind A (a fairness fault) or
    # everything was slow alike (a loaded machine) is read from it.
    timeline = (
        f"B done at {[round(t - start, 2) for t in sorted(b_done)]} s, "
        f"A done at {[round(t - start, 2) for t in a_done]} s"
    )
    assert max(b_done) < a_done[-10], timeline
    assert max(b_done) - start < 0.5 + 6 * 0.1 + 1.0, timeline
    assert gw.metric("gateway_queue_wait_seconds_count", tenant="beta") == 3
