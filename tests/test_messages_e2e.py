"""POST /v1/messages and /v1/messages/count_tokens through the real gateway and the simulator,
driven by the official `anthropic` SDK and by Claude Code's recorded requests."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from pydantic import TypeAdapter

from engine.sim.tokens import chat_prompt_tokens
from tests.conftest import (
    KEY_A,
    KEY_B,
    KEY_C,
    Gateway,
    _stop,
    start_gateway,
    start_sim,
    wait_until,
)

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
TOOL = {
    "name": "get_weather",
    "description": "Weather of a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CONFIG = {
    "model": {"accepted": ["claude-local", "my-coder"]},
    "tenants": {
        "carol": {"thinking_allowed": False},
        "beta": {"thinking_default": False},
    },
}


def recorded(name: str) -> dict[str, Any]:
    body = json.loads((FIXTURES / name).read_text())["request"]["body"]
    assert isinstance(body, dict)
    return body


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    """A simulator that answers one tool round trip (tools: get_weather) and a gateway."""
    path = Path(tempfile.mkdtemp(prefix="q38a-", dir="/tmp"))
    sim = start_sim(
        path,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "qwen3_coder",
        "--completion-tokens",
        "12",
    )
    gateway = start_gateway(path, sim, CONFIG)
    try:
        yield gateway
    finally:
        _stop(gateway.proc)
        sim.stop()
        shutil.rmtree(path, ignore_errors=True)


OPEN: list[Any] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """SDK clients made by a test are closed after it (no socket left to the collector)."""
    yield
    while OPEN:
        OPEN.pop().close()


def client(gw: Gateway, key: str = KEY_A, **kwargs: Any) -> anthropic.Anthropic:
    """The SDK with x-api-key auth (its default), no retries."""
    made = anthropic.Anthropic(base_url=gw.base_url, api_key=key, max_retries=0, **kwargs)
    OPEN.append(made)
    return made


def last_engine_body(gw: Gateway) -> dict[str, Any]:
    assert gw.sim is not None
    records = [r for r in gw.sim.model_records() if r["path"] == "/v1/chat/completions"]
    body = records[-1]["body"]
    assert isinstance(body, dict)
    return body


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        name = next(line[7:] for line in lines if line.startswith("event: "))
        data = json.loads(next(line[6:] for line in lines if line.startswith("data: ")))
        out.append((name, data))
    return out


# ----------------------------------------------------------------------------- answers


def test_create_non_stream_with_thinking(gw: Gateway) -> None:
    """messages.create: a thinking block and a text block, usage equal to the engine's."""
    message = client(gw).messages.create(
        model="claude-local",
        max_tokens=200,
        messages=[{"role": "user", "content": "Hello"}],
        thinking={"type": "enabled", "budget_tokens": 64},
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.model == "qwen3.8-27b" and message.stop_reason == "end_turn"
    body = last_engine_body(gw)
    assert body["chat_template_kwargs"]["enable_thinking"] is True
    assert body["thinking_token_budget"] == 64 and body["max_tokens"] == 200
    assert body["model"] == "qwen3.8-27b"
    assert wait_until(lambda: gw.access_logs()[-1].get("route") == "/v1/messages", 5)
    log = [e for e in gw.access_logs() if e.get("route") == "/v1/messages"][-1]
    assert (log["prompt_tokens"], log["completion_tokens"]) == (
        message.usage.input_tokens,
        message.usage.output_tokens,
    )


def test_stream_thinking_disabled(gw: Gateway) -> None:
    """messages.stream with thinking disabled: text only, every event valid, message_stop last."""
    with client(gw).messages.stream(
        model="my-coder",
        max_tokens=100,
        messages=[{"role": "user", "content": "Hello"}],
        thinking={"type": "disabled"},
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [block.type for block in final.content] == ["text"]
    assert final.content[0].text.startswith("Simulated")  # type: ignore[union-attr]
    assert last_engine_body(gw)["chat_template_kwargs"]["enable_thinking"] is False
    assert final.usage.output_tokens == 12
    counted = client(gw).messages.count_tokens(
        model="my-coder", messages=[{"role": "user", "content": "Hello"}]
    )
    # message_start carried the gateway's estimate; the final message keeps the engine's count
    assert final.usage.input_tokens == counted.input_tokens


@pytest.mark.parametrize(
    ("key", "thinking", "expected"),
    [
        (KEY_A, {"type": "adaptive"}, True),
        (KEY_B, {"type": "adaptive"}, False),
        (KEY_B, None, False),
    ],
)
def test_adaptive_thinking_follows_the_tenant_default(
    gw: Gateway, key: str, thinking: Any, expected: bool
) -> None:
    """adaptive or absent thinking: the tenant's default decides (acme: on, beta: off)."""
    kwargs: dict[str, Any] = {"thinking": thinking} if thinking else {}
    client(gw, key).messages.create(
        model="claude-local",
        max_tokens=50,
        messages=[{"role": "user", "content": "x"}],
        extra_body={"output_config": {"effort": "high"}},
        **kwargs,
    )
    assert last_engine_body(gw)["chat_template_kwargs"]["enable_thinking"] is expected


def test_tool_round_trip(gw: Gateway) -> None:
    """tools: the engine calls the tool (a tool_use block, stop_reason tool_use), and the
    tool_result of the next turn reaches the engine."""
    c = client(gw)
    first = c.messages.create(
        model="claude-local",
        max_tokens=300,
        tools=[TOOL],  # type: ignore[list-item]
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        extra_body={"sim_ignored": True},
        extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
    )
    body = last_engine_body(gw)
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert "sim_ignored" not in body
    assert first.stop_reason == "tool_use"
    assert [b.name for b in first.content if b.type == "tool_use"] == ["get_weather"]
    history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    history.append(
        {
            "role": "assistant",
            "content": [b.model_dump() for b in first.content if b.type != "tool_use"],
        }
    )
    history.append(
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
        }
    )
    history[1]["content"].append(
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    )
    second = c.messages.create(
        model="claude-local",
        max_tokens=300,
        tools=[TOOL],
        messages=history,  # type: ignore[list-item]
    )
    assert second.stop_reason == "end_turn"
    messages = last_engine_body(gw)["messages"]
    assert messages[-1] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert messages[-2]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }


def test_count_tokens_uses_tokenize_without_a_slot(gw: Gateway) -> None:
    """count_tokens: the engine's /tokenize count of the translated prompt; no generation."""
    assert gw.sim is not None
    before = len(gw.sim.records())
    count = client(gw).messages.count_tokens(
        model="claude-local",
        system="Be brief.",
        messages=[{"role": "user", "content": "Hello there"}],
        tools=[TOOL],  # type: ignore[list-item]
    )
    records = [r for r in gw.sim.records()[before:] if r.get("path") not in ("/health", "/metrics")]
    assert [r["path"] for r in records] == ["/tokenize"]
    sent = records[0]["body"]
    assert sent["messages"][0] == {"role": "system", "content": "Be brief."}
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    # the simulator's token rule: the messages and the tools, as the chat template writes both
    assert count.input_tokens == chat_prompt_tokens(sent["messages"], sent["tools"])
    assert count.input_tokens > 3 + (4 + 3) + (4 + 3)


def test_bearer_auth_beta_query_and_no_version_header(gw: Gateway) -> None:
    """Authorization: Bearer works too; ?beta=true and a missing anthropic-version are fine."""
    r = httpx.post(
        gw.url("/v1/messages?beta=true"),
        headers={"Authorization": f"Bearer {KEY_A}"},
        json={
            "model": "claude-local",
            "max_tokens": 20,
            "messages": [{"role": "user", "content": "x"}],
        },
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["type"] == "message"
    assert r.headers["anthropic-ratelimit-requests-limit"] == "10000"
    assert r.headers["anthropic-ratelimit-tokens-reset"].endswith("Z")
    assert "x-ratelimit-limit-requests" not in r.headers


# ------------------------------------------------------------------------ recorded bodies


def test_claude_code_recorded_request_replayed(gw: Gateway) -> None:
    """Claude Code's recorded first request: a valid event stream; billing block gone,
    cache_salt and request id set by the gateway, max_tokens 32000 kept (it fits)."""
    body = recorded("claude-code-first-request-tool_use-sse.json")
    body["model"] = "qwen3.8-27b"
    r = httpx.post(
        gw.url("/v1/messages?beta=true"),
        headers={"Authorization": f"Bearer {KEY_A}", "anthropic-version": "2023-06-01"},
        json=body,
        timeout=60,
    )
    assert r.status_code == 200
    events = sse_events(r.content)
    for _, data in events:
        EVENT.validate_python(data)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    assert r.headers["anthropic-ratelimit-tokens-limit"] == "100000000"
    sent = last_engine_body(gw)
    assert "x-anthropic-billing-header" not in json.dumps(sent)
    assert sent["max_tokens"] == 32000 and len(sent["tools"]) == 24
    assert len(sent["cache_salt"]) == 64 and sent["request_id"] == r.headers["x-request-id"]


def test_claude_code_nonstreaming_fallback_replayed(gw: Gateway) -> None:
    """Claude Code's non-streaming fallback request gets one Message object with one tool call
    of an offered tool: the simulator's rule (engine/sim/README.md) picks the shell tool,
    ``Bash``, when the prompt names none."""
    body = recorded("claude-code-nonstreaming-fallback.json")
    r = httpx.post(
        gw.url("/v1/messages?beta=true"), headers={"x-api-key": KEY_A}, json=body, timeout=60
    )
    assert r.status_code == 200
    message = anthropic.types.Message.model_validate(r.json())
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    offered = [tool["name"] for tool in body["tools"]]
    assert "Bash" in offered
    assert [b.name for b in uses] == ["Bash"]


# -------------------------------------------------------------------------------- errors


def error_of(exc: anthropic.APIStatusError) -> tuple[int, str]:
    body = exc.response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return exc.status_code, body["error"]["type"]


def test_errors_bad_key_model_and_request(gw: Gateway) -> None:
    """401 authentication_error, 404 not_found_error, 400 invalid_request_error, in
    Anthropic's envelope."""
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        client(gw, "sk-q38-wrongwrongwrongwrongwrongwrongwrong").messages.create(
            model="claude-local", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert error_of(bad_key.value) == (401, "authentication_error")
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client(gw).messages.create(
            model="gpt-9", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert error_of(unknown.value) == (404, "not_found_error")
    r = httpx.post(
        gw.url("/v1/messages"),
        headers={"x-api-key": KEY_A},
        json={"model": "claude-local", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 400
    assert r.json()["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: Field required",
    }
    r = httpx.post(gw.url("/v1/messages"), headers={"x-api-key": KEY_A}, content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_error_permission_for_thinking(gw: Gateway) -> None:
    """403 permission_error: thinking asked by a tenant that may not think."""
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        client(gw, KEY_C).messages.create(
            model="claude-local",
            max_tokens=20,
            messages=[{"role": "user", "content": "x"}],
            thinking={"type": "enabled", "budget_tokens": 10},
        )
    assert error_of(denied.value) == (403, "permission_error")


def test_thinking_budget_must_leave_room_in_max_tokens(gw: Gateway) -> None:
    """Anthropic's rule: ``thinking.budget_tokens`` at or above ``max_tokens`` is a 400
    invalid_request_error naming max_tokens, before the engine; below it, served."""
    before = len(gw.sim.model_records()) if gw.sim is not None else 0
    for budget in (5, 1024):
        with pytest.raises(anthropic.BadRequestError) as refused:
            client(gw).messages.create(
                model="claude-local",
                max_tokens=5,
                messages=[{"role": "user", "content": "x"}],
                thinking={"type": "enabled", "budget_tokens": budget},
            )
        assert error_of(refused.value) == (400, "invalid_request_error")
        assert "thinking.budget_tokens" in str(refused.value)
    assert gw.sim is not None and len(gw.sim.model_records()) == before
    ok = client(gw).messages.create(
        model="claude-local",
        max_tokens=2000,
        messages=[{"role": "user", "content": "x"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert ok.stop_reason in ("end_turn", "max_tokens")


def test_errors_too_large_rate_limited_overloaded_and_api_error(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """413 request_too_large, 429 rate_limit_error with retry-after and anthropic-ratelimit-*
    headers, 529 overloaded_error when the engine is down, 500-class api_error."""
    sim = sim_factory("--completion-tokens", "4")
    gw = gateway_factory(
        sim,
        {"server": {"max_body_bytes": 4096}, "tenants": {"acme": {"rpm": 1}}},
    )
    c = client(gw)
    with pytest.raises(anthropic.APIStatusError) as big:
        c.messages.create(
            model="qwen3.8-27b", max_tokens=5, messages=[{"role": "user", "content": "x" * 8000}]
        )
    assert error_of(big.value) == (413, "request_too_large")
    ok = {"model": "qwen3.8-27b", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    c.messages.create(**ok)  # type: ignore[arg-type]
    with pytest.raises(anthropic.RateLimitError) as limited:
        c.messages.create(**ok)  # type: ignore[arg-type]
    assert error_of(limited.value) == (429, "rate_limit_error")
    headers = limited.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["anthropic-ratelimit-requests-limit"] == "1"
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    sim.stop()
    assert wait_until(lambda: httpx.get(gw.url("/ready")).status_code == 503, 10)
    r = httpx.post(gw.url("/v1/messages"), headers={"x-api-key": KEY_B}, json=ok)
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    assert int(r.headers["retry-after"]) >= 1


def test_prompt_too_long_in_anthropic_wording(sim_factory: Any, gateway_factory: Any) -> None:
    """A prompt over the context: 400 `prompt is too long: N tokens > M maximum`, and
    max_tokens was clamped below the context (never more than max_model_len)."""
    sim = sim_factory("--max-model-len", "2048")
    gw = gateway_factory(sim, {"engine": {"max_model_len": 2048}})
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client(gw).messages.create(
            model="qwen3.8-27b",
            max_tokens=32000,
            messages=[{"role": "user", "content": "word " * 3000}],
            timeout=30,
        )
    status, etype = error_of(too_long.value)
    assert (status, etype) == (400, "invalid_request_error")
    message = too_long.value.response.json()["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(" tokens > 2047 maximum")
    assert last_engine_body(gw)["max_tokens"] <= 2048


def test_mid_stream_failure_is_an_error_event(sim_factory: Any, gateway_factory: Any) -> None:
    """An engine drop mid-stream ends with `event: error` (api_error), never a bare close,
    and the tokens streamed are charged."""
    sim = sim_factory("--drop-after", "3", "--completion-tokens", "20")
    gw = gateway_factory(sim)
    r = httpx.post(
        gw.url("/v1/messages"),
        headers={"x-api-key": KEY_A},
        json={
            "model": "qwen3.8-27b",
            "max_tokens": 50,
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        },
        timeout=30,
    )
    events = sse_events(r.content)
    assert events[0][0] == "message_start"
    assert events[-1] == (
        "error",
        {
            "type": "error",
            "error": {"type": "api_error", "message": events[-1][1]["error"]["message"]},
        },
    )
    assert "message_stop" not in [name for name, _ in events]
    assert wait_until(lambda: any(e.get("route") == "/v1/messages" for e in gw.access_logs()), 5)
    log = [e for e in gw.access_logs() if e.get("route") == "/v1/messages"][-1]
    assert log["status"] == 200 and log["completion_tokens"] >= 1
    assert (log["reason"], log["error_status"]) == ("engine_disconnect", 502)


def test_in_stream_engine_error_is_an_error_event(sim_factory: Any, gateway_factory: Any) -> None:
    """The engine's own in-stream error event becomes Anthropic's `event: error`."""
    sim = sim_factory("--error-after", "2")
    gw = gateway_factory(sim)
    with (
        client(gw).messages.stream(
            model="qwen3.8-27b", max_tokens=50, messages=[{"role": "user", "content": "x"}]
        ) as stream,
        pytest.raises(anthropic.APIStatusError),
    ):
        for _ in stream:
            pass


def test_ping_keepalive_during_prefill(sim_factory: Any, gateway_factory: Any) -> None:
    """A long prefill: message_start at once, then `event: ping` while the engine is silent."""
    sim = sim_factory("--prefill-ms", "6000", "--completion-tokens", "3")
    gw = gateway_factory(sim)
    r = httpx.post(
        gw.url("/v1/messages"),
        headers={"x-api-key": KEY_A},
        json={
            "model": "qwen3.8-27b",
            "max_tokens": 50,
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        },
        timeout=30,
    )
    names = [name for name, _ in sse_events(r.content)]
    assert names[0] == "message_start" and names[1] == "ping" and names[-1] == "message_stop"
