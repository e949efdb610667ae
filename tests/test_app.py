"""The gateway app in-process against the simulator's app: routes, the model path branch by branch.

Each test builds the app with `create_app`, serves the simulator's app on a Unix socket in the
same event loop (`tests.inprocess`), and talks to the gateway with pytest-aiohttp's client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, MutableMapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from gateway.state import ADMISSION, FINISH_HOOKS, METRICS, RELOADER, RequestContext
from tests.clock import FakeClock
from tests.conftest import ALIAS, KEY_A, KEY_B
from tests.inprocess import (
    AUTH_A,
    Stack,
    chat_body,
    open_stack,
    sse_data,
    until,
    write_config,
)

pytestmark = pytest.mark.fast

CHAT = "/v1/chat/completions"
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}


@pytest.fixture
async def stack(aiohttp_client: Any) -> AsyncIterator[Stack]:
    """The simulator (no pacing) and a gateway (tenants acme, beta) in this event loop."""
    async with open_stack(aiohttp_client) as s:
        yield s


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every structlog entry of the test, as dicts."""
    with capture_logs() as entries:
        yield entries


def access(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    """The access lines among captured entries."""
    return [e for e in logs if e.get("event") == "request"]


def sample(stack: Stack, name: str, **labels: str) -> float:
    """The value of one sample of the gateway's registry (0 when absent)."""
    value = stack.app[METRICS].registry.get_sample_value(name, labels)
    return value or 0.0


def finished(stack: Stack) -> list[RequestContext]:
    """Register a finish hook; the list fills with each finished request's context."""
    seen: list[RequestContext] = []
    stack.app[FINISH_HOOKS].append(seen.append)
    return seen


# ------------------------------------------------------------------------------ plain routes


async def test_health_is_public_and_ready_reports_the_engine(stack: Stack) -> None:
    """/health and /ready need no credential; /ready says the engine is ready with keys loaded."""
    assert (await stack.client.get("/health")).status == 200
    r = await stack.client.get("/ready")
    body = await r.json()
    assert r.status == 200 and body["ready"] is True and body["engine"] == "ready"
    assert body["keys_loaded"] == 3 and body["in_flight"] == 0


async def test_models_lists_the_alias_with_rate_limit_headers(stack: Stack) -> None:
    """/v1/models is the alias alone in OpenAI's list shape, with the tenant's limit headers."""
    r = await stack.client.get("/v1/models", headers=AUTH_A)
    body = await r.json()
    assert r.status == 200 and [m["id"] for m in body["data"]] == [ALIAS]
    assert "x-ratelimit-limit-requests" in r.headers


async def test_usage_carries_the_tenants_limit_headers_and_reserves_nothing(
    stack: Stack,
) -> None:
    """/v1/usage answers with the six ``x-ratelimit-*`` headers as of now, like every
    authenticated response, and reading them takes no request or token from the budget."""
    r = await stack.client.post(CHAT, json=chat_body(max_tokens=1), headers=AUTH_A)
    assert r.status == 200
    names = [
        f"x-ratelimit-{part}-{kind}"
        for kind in ("requests", "tokens")
        for part in ("limit", "remaining", "reset")
    ]
    first = await stack.client.get("/v1/usage", headers=AUTH_A)
    second = await stack.client.get("/v1/usage", headers=AUTH_A)
    assert first.status == second.status == 200
    assert all(name in first.headers for name in names), dict(first.headers)
    for name in ("x-ratelimit-limit-requests", "x-ratelimit-limit-tokens"):
        assert first.headers[name] == r.headers[name]
    after = (r, first, second)
    requests = [int(a.headers["x-ratelimit-remaining-requests"]) for a in after]
    tokens = [int(a.headers["x-ratelimit-remaining-tokens"]) for a in after]
    assert requests[1] >= requests[0] and requests[2] >= requests[1]
    assert tokens[1] >= tokens[0] and tokens[2] >= tokens[1]


async def test_unknown_model_card_is_404_model_not_found(stack: Stack) -> None:
    """/v1/models/{id} of another name is 404 ``model_not_found`` naming the field."""
    r = await stack.client.get("/v1/models/other", headers=AUTH_A)
    error = (await r.json())["error"]
    assert r.status == 404 and error["code"] == "model_not_found" and error["param"] == "model"


async def test_unknown_route_needs_a_credential_before_its_404(stack: Stack) -> None:
    """An unknown path is 401 without a credential (nothing learnt), 404 with one."""
    assert (await stack.client.get("/v2/nothing")).status == 401
    r = await stack.client.get("/v2/nothing", headers=AUTH_A)
    assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"


async def test_wrong_method_is_405_with_allow(stack: Stack) -> None:
    """GET on the chat route is 405 in OpenAI's shape with the allowed method in ``Allow``."""
    r = await stack.client.get(CHAT, headers=AUTH_A)
    assert r.status == 405 and "POST" in r.headers["Allow"]
    assert (await r.json())["error"]["code"] == "method_not_allowed"


# --------------------------------------------------------------- the model path, before the engine


async def test_body_that_is_not_json_is_400_and_costs_nothing(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """A body that is not JSON is 400 in OpenAI's shape; nothing reaches the engine or the log's
    token fields."""
    r = await stack.client.post(CHAT, data=b"{nope", headers=AUTH_A)
    assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
    line = access(logs)[-1]
    assert line["status"] == 400 and line["reason"] == "bad_request"
    assert "prompt_tokens" not in line and stack.sim is not None
    assert stack.sim.model_records() == []


async def test_body_over_the_limit_is_413(aiohttp_client: Any) -> None:
    """A body longer than ``server.max_body_bytes`` is 413 ``request_too_large``."""
    async with open_stack(aiohttp_client, {"server": {"max_body_bytes": 2048}}) as stack:
        body = chat_body(messages=[{"role": "user", "content": "x" * 4096}])
        r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
        assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"


async def test_unknown_model_in_the_body_is_404(stack: Stack) -> None:
    """A ``model`` that is not the alias is 404 ``model_not_found`` before any engine call."""
    r = await stack.client.post(CHAT, json=chat_body(model="gpt-4"), headers=AUTH_A)
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_engine_not_ready_is_503_with_retry_after(aiohttp_client: Any) -> None:
    """With no engine listening a model request is 503 ``engine_unavailable`` + Retry-After."""
    async with open_stack(aiohttp_client, sim=False) as stack:
        r = await stack.client.post(CHAT, json=chat_body(), headers=AUTH_A)
        assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
        assert (await r.json())["error"]["code"] == "engine_unavailable"


async def test_rate_limit_is_429_until_the_clock_refills_it(aiohttp_client: Any) -> None:
    """With rpm 1 the second request is 429 ``requests``; 60 s later on the clock it passes."""
    clock = FakeClock()
    config = {"tenants": {"acme": {"rpm": 1}}}
    async with open_stack(aiohttp_client, config, clock=clock) as stack:
        assert (await stack.client.post(CHAT, json=chat_body(), headers=AUTH_A)).status == 200
        r = await stack.client.post(CHAT, json=chat_body(), headers=AUTH_A)
        assert r.status == 429 and (await r.json())["error"]["type"] == "requests"
        assert int(r.headers["Retry-After"]) == 60
        clock.advance(60)
        assert (await stack.client.post(CHAT, json=chat_body(), headers=AUTH_A)).status == 200


async def test_a_body_that_stops_arriving_is_408(aiohttp_client: Any) -> None:
    """An upload that pauses longer than ``server.body_timeout_s`` is 408 and the connection
    is closed; nothing reaches the engine."""
    async with open_stack(aiohttp_client, {"server": {"body_timeout_s": 0.1}}) as stack:

        async def stalled() -> AsyncIterator[bytes]:
            yield b'{"messages": ['
            await asyncio.sleep(2)
            yield b"]}"

        r = await stack.client.post(CHAT, data=stalled(), headers=AUTH_A)
        assert r.status == 408 and r.headers.get("Connection", "").lower() == "close"
        assert (await r.json())["error"]["code"] == "request_timeout"
        assert stack.sim is not None and stack.sim.model_records() == []


# -------------------------------------------------------------------------- JSON answers


async def test_json_answer_is_rewritten_counted_and_handed_to_finish_hooks(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """A JSON answer shows the alias; its usage is in the access line, the token counter and
    the `ModelCall` the finish hooks receive (tenant, key id, endpoint, status, timings)."""
    seen = finished(stack)
    r = await stack.client.post(CHAT, json=chat_body(), headers=AUTH_A)
    body = await r.json()
    assert r.status == 200 and body["model"] == ALIAS
    usage = body["usage"]
    line = access(logs)[-1]
    assert line["tenant"] == "acme" and line["key_id"] == "KEY_A" and line["stream"] is False
    assert (line["prompt_tokens"], line["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert sample(stack, "gateway_tokens_total", tenant="acme", type="completion") == float(
        usage["completion_tokens"]
    )
    context = seen[-1]
    call = context.call
    assert call is not None and context.status == 200 and context.route == CHAT
    assert call.dialect.name == "chat" and call.caller.principal.tenant == "acme"
    assert call.usage.settled and call.usage.prompt_tokens == usage["prompt_tokens"]
    assert call.queued_s == 0.0 and context.duration_s is not None


async def test_engine_4xx_passes_through_with_its_status_and_message(stack: Stack) -> None:
    """The engine's 400 reaches the client with the engine's message; not an upstream error."""
    r = await stack.client.post(CHAT, json=chat_body(chat_template="x"), headers=AUTH_A)
    error = (await r.json())["error"]
    assert r.status == 400 and "chat template" in error["message"].lower()
    assert error["type"] == "invalid_request_error"
    assert sample(stack, "gateway_upstream_errors_total", kind="status_5xx") == 0


async def test_engine_refusal_is_charged_nothing(stack: Stack) -> None:
    """A request the engine refuses with an error status (here a 20,000-word prompt) costs no
    tokens: not in the metrics, not against the tenant's token budget, not in the usage."""
    seen = finished(stack)
    huge = [{"role": "user", "content": "word " * 20000}]
    body = chat_body(messages=huge, chat_template="x")  # the engine's 400, after the limits
    r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    assert r.status == 400
    call = seen[-1].call
    assert call is not None and call.usage.source == "rejected"
    assert (call.usage.prompt_tokens, call.usage.completion_tokens) == (0, 0)
    assert sample(stack, "gateway_tokens_total", tenant="acme", type="prompt") == 0
    r = await stack.client.post(CHAT, json=chat_body(max_tokens=1), headers=AUTH_A)
    assert r.status == 200
    limit = int(r.headers["x-ratelimit-limit-tokens"])
    remaining = int(r.headers["x-ratelimit-remaining-tokens"])
    assert limit - remaining < 1000


async def test_engine_503_is_503_and_counted(stack: Stack) -> None:
    """An engine that answers 503 makes a 503 with Retry-After, counted as ``status_5xx``."""
    r = await stack.client.post(CHAT, json=chat_body(sim={"refuse": "503"}), headers=AUTH_A)
    assert r.status == 503 and "Retry-After" in r.headers
    assert sample(stack, "gateway_upstream_errors_total", kind="status_5xx") == 1


@pytest.mark.parametrize(
    ("fields", "status"),
    [({"chat_template": "x"}, 400), ({"sim": {"refuse": "503"}}, 503)],
    ids=["engine_400", "engine_503"],
)
async def test_a_stream_the_engine_refuses_is_a_json_error_then_streams_work(
    stack: Stack, fields: dict[str, Any], status: int
) -> None:
    """A streamed request the engine refuses gets the engine's status as a JSON error with the
    request id and the rate-limit headers, no SSE headers (the stream's response, made while the
    engine worked, is never sent), and the next stream on the same client is whole."""
    r = await stack.client.post(CHAT, json=chat_body(stream=True, **fields), headers=AUTH_A)
    assert r.status == status
    assert r.headers["Content-Type"].startswith("application/json")
    assert "X-Accel-Buffering" not in r.headers and r.headers["x-request-id"]
    assert "x-ratelimit-remaining-requests" in r.headers
    assert (await r.json())["error"]["message"]
    r = await stack.client.post(CHAT, json=chat_body(stream=True, max_tokens=4), headers=AUTH_A)
    text = await r.text()
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    assert text.rstrip().endswith("data: [DONE]") and '"content"' in text
    assert stack.app[ADMISSION].in_flight == 0


async def test_engine_closing_the_connection_is_502_disconnect(stack: Stack) -> None:
    """An engine that closes the connection without answering (and is still up) is 502,
    counted as ``disconnect``; it is never retried."""
    r = await stack.client.post(CHAT, json=chat_body(sim={"refuse": "close"}), headers=AUTH_A)
    assert r.status == 502 and (await r.json())["error"]["code"] == "upstream_error"
    assert sample(stack, "gateway_upstream_errors_total", kind="disconnect") == 1
    assert stack.sim is not None and len(stack.sim.model_records()) == 1


async def test_engine_silent_past_the_read_timeout_is_504(aiohttp_client: Any) -> None:
    """An engine that accepts a stream and never answers is 504 after ``engine.read_timeout_s``;
    a non-streaming request (no read timeout: its answer is silent until complete) is 504 at
    its total limit; the slot is given back."""
    config = {"engine": {"read_timeout_s": 0.2, "request_timeout_s": 0.5}}
    async with open_stack(aiohttp_client, config) as stack:
        body = chat_body(stream=True, sim={"hang": True})
        r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
        assert r.status == 504 and (await r.json())["error"]["code"] == "upstream_timeout"
        assert sample(stack, "gateway_upstream_errors_total", kind="timeout") == 1
        r = await stack.client.post(CHAT, json=chat_body(sim={"hang": True}), headers=AUTH_A)
        assert r.status == 504 and (await r.json())["error"]["code"] == "upstream_timeout"
        assert "time limit of 0.5 s" in (await r.json())["error"]["message"]
        assert sample(stack, "gateway_upstream_errors_total", kind="timeout") == 2
        assert stack.app[ADMISSION].in_flight == 0


# -------------------------------------------------------------------------------- streams


async def test_stream_relays_every_event_then_done(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """A stream arrives whole with the alias and one ``[DONE]``; the access line has its ttft."""
    body = chat_body(stream=True, sim={"completion_tokens": 8})
    r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    data = sse_data(await r.read())
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    assert {json.loads(d)["model"] for d in data[:-1]} == {ALIAS}
    assert await until(lambda: bool(access(logs)))
    line = access(logs)[-1]
    assert line["status"] == 200 and line["stream"] is True and "ttft_ms" in line


async def test_stream_cut_by_the_engine_ends_with_one_error_event(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """An engine that drops the stream: the client gets one 502 error event and no ``[DONE]``;
    the tokens streamed are charged; counted as ``disconnect``."""
    body = chat_body(stream=True, sim={"completion_tokens": 20, "drop_after": 4})
    r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    data = sse_data(await r.read())
    assert "[DONE]" not in data
    assert json.loads(data[-1])["error"]["code"] == "upstream_error"
    assert await until(lambda: bool(access(logs)))
    line = access(logs)[-1]
    assert line["status"] == 200 and line["completion_tokens"] >= 3
    assert (line["reason"], line["error_status"]) == ("engine_disconnect", 502)
    assert sample(stack, "gateway_requests_total", tenant="acme", route=CHAT, code="200") >= 1
    assert sample(stack, "gateway_upstream_errors_total", kind="disconnect") == 1


async def test_stream_error_event_from_the_engine_is_relayed_and_counted(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """vLLM's in-stream error event reaches the client as sent, counted as ``stream_error``; the
    access line keeps the 200 sent and gives the event's status as ``error_status``."""
    body = chat_body(stream=True, sim={"completion_tokens": 20, "error_after": 3})
    r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    data = sse_data(await r.read())
    assert any("error" in json.loads(d) for d in data if d != "[DONE]")
    assert await until(lambda: bool(access(logs)))
    line = access(logs)[-1]
    assert (line["status"], line["reason"], line["error_status"]) == (200, "stream_error", 500)
    assert sample(stack, "gateway_upstream_errors_total", kind="stream_error") == 1


async def test_stream_silent_past_the_read_timeout_ends_with_a_504_event(
    aiohttp_client: Any,
) -> None:
    """Headers sent, then silence longer than ``engine.read_timeout_s``: one 504 error event."""
    async with open_stack(aiohttp_client, {"engine": {"read_timeout_s": 0.2}}) as stack:
        body = chat_body(stream=True, sim={"silence_s": 2})
        r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
        data = sse_data(await r.read())
        assert json.loads(data[-1])["error"]["code"] == "upstream_timeout"
        assert sample(stack, "gateway_upstream_errors_total", kind="timeout") == 1


async def test_client_leaving_a_stream_is_499_and_the_engine_stops(
    stack: Stack, logs: list[MutableMapping[str, Any]]
) -> None:
    """A client that goes away mid-stream: logged 499, counted, its slots given back, and the
    engine sees its request aborted (the socket closed)."""
    body = chat_body(stream=True, sim={"tokens_per_second": 50, "completion_tokens": 200})
    r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    await r.content.readuntil(b"\n\n")
    r.close()
    assert await until(lambda: bool(access(logs)))
    line = access(logs)[-1]
    assert line["status"] == 499 and line["reason"] == "client_disconnect"
    assert sample(stack, "gateway_client_disconnects_total", tenant="acme") == 1
    assert stack.app[ADMISSION].in_flight == 0
    assert sample(stack, "gateway_in_flight_requests", tenant="acme") == 0
    sim = stack.sim
    assert sim is not None
    assert await until(lambda: [r["outcome"] for r in sim.model_records()] == ["aborted"])


async def test_a_long_queue_wait_sends_queued_comments_then_the_answer(
    aiohttp_client: Any,
) -> None:
    """A stream waiting for the engine gets its headers and ``: queued`` comments, then events."""
    config = {"engine": {"max_concurrency": 1, "queued_comment_after_s": 0.05}}
    async with open_stack(aiohttp_client, config) as stack:
        slow = chat_body(stream=True, sim={"tokens_per_second": 40, "completion_tokens": 12})
        first = await stack.client.post(CHAT, json=slow, headers=AUTH_A)
        second = await stack.client.post(CHAT, json=chat_body(stream=True), headers=AUTH_B)
        assert second.status == 200
        raw = await second.read()
        assert raw.startswith(b": queued\n\n") and sse_data(raw)[-1] == "[DONE]"
        await first.read()


async def test_queue_timeout_after_queued_comments_ends_with_an_error_event(
    aiohttp_client: Any,
) -> None:
    """A stream whose queue time runs out after its headers went out ends with one 503 event."""
    config = {
        "engine": {"max_concurrency": 1, "queued_comment_after_s": 0.05, "queue_timeout_s": 0.3}
    }
    async with open_stack(aiohttp_client, config) as stack:
        slow = chat_body(stream=True, sim={"tokens_per_second": 20, "completion_tokens": 30})
        first = await stack.client.post(CHAT, json=slow, headers=AUTH_A)
        second = await stack.client.post(CHAT, json=chat_body(stream=True), headers=AUTH_B)
        raw = await second.read()
        assert raw.startswith(b": queued")
        assert json.loads(sse_data(raw)[-1])["error"]["code"] == "engine_unavailable"
        first.close()


# ------------------------------------------------------------------- reloads in flight


async def test_a_reload_never_changes_a_stream_in_flight(stack: Stack) -> None:
    """An alias changed by a reload in the middle of a stream: the stream keeps the old alias."""
    body = chat_body(stream=True, sim={"tokens_per_second": 50, "completion_tokens": 12})
    r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
    assert r.status == 200
    first = await r.content.readuntil(b"\n\n")
    write_config(stack.directory, {"model": {"alias": "renamed"}})
    assert await stack.app[RELOADER].reload()
    rest = await r.read()
    chunks = [json.loads(d) for d in sse_data(first + rest) if d != "[DONE]"]
    assert len(chunks) > 3
    assert {c["model"] for c in chunks} == {ALIAS}
    after = await stack.client.post(CHAT, json=chat_body(model="renamed"), headers=AUTH_A)
    assert after.status == 200 and (await after.json())["model"] == "renamed"


async def test_a_reload_never_changes_a_queued_request(aiohttp_client: Any) -> None:
    """An alias changed while a request waits for the engine: its answer keeps the old alias."""
    async with open_stack(aiohttp_client, {"engine": {"max_concurrency": 1}}) as stack:
        slow = chat_body(stream=True, sim={"tokens_per_second": 40, "completion_tokens": 12})
        first = await stack.client.post(CHAT, json=slow, headers=AUTH_A)
        assert first.status == 200
        second = asyncio.ensure_future(stack.client.post(CHAT, json=chat_body(), headers=AUTH_A))
        assert await until(lambda: stack.app[ADMISSION].depth == 1)
        write_config(stack.directory, {"engine": {"max_concurrency": 1}, "model": {"alias": "x"}})
        assert await stack.app[RELOADER].reload()
        await first.read()
        answer = await second
        assert answer.status == 200 and (await answer.json())["model"] == ALIAS


@pytest.mark.parametrize(
    ("method", "path", "status", "kind"),
    [
        ("GET", "/v1/messages", 405, "invalid_request_error"),
        ("POST", "/v1/messages/unknown", 404, "not_found_error"),
    ],
)
async def test_unknown_messages_paths_speak_anthropic(
    stack: Stack, method: str, path: str, status: int, kind: str
) -> None:
    """Under /v1/messages an unknown path or method takes the x-api-key credential and answers
    in Anthropic's envelope; a bad x-api-key there is Anthropic's authentication_error."""
    r = await stack.client.request(method, path, headers={"x-api-key": KEY_A})
    body = await r.json()
    assert r.status == status and body["type"] == "error"
    assert body["error"]["type"] == kind
    r = await stack.client.request(method, path, headers={"x-api-key": "sk-wrong"})
    body = await r.json()
    assert r.status == 401 and body["error"]["type"] == "authentication_error"
