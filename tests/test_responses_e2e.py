"""POST /v1/responses and stored responses through the real gateway and the simulator, driven by
the official `openai` SDK and by Codex's recorded request."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests.conftest import KEY_A, KEY_B, KEY_C, Gateway, _stop, start_gateway, start_sim, wait_until

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    """A simulator (tool parser on, 12-token answers) and a gateway with stored responses on."""
    path = Path(tempfile.mkdtemp(prefix="q38r-", dir="/tmp"))
    sim = start_sim(
        path,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "qwen3_coder",
        "--completion-tokens",
        "12",
    )
    gateway = start_gateway(
        path,
        sim,
        {
            "model": {"accepted": ["gpt-5-codex"]},
            "responses": {"store": True, "store_ttl_s": 600},
            "tenants": {"carol": {"rpm": 1}},
        },
    )
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


def client(gw: Gateway, key: str = KEY_A) -> openai.OpenAI:
    made = openai.OpenAI(base_url=gw.url("/v1"), api_key=key, max_retries=0)
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
        if lines:
            name = next(line[7:] for line in lines if line.startswith("event: "))
            out.append(
                (name, json.loads(next(line[6:] for line in lines if line.startswith("data: "))))
            )
    return out


def test_create_non_stream(gw: Gateway) -> None:
    """responses.create: reasoning and message items, usage equal to the engine's counts."""
    response = client(gw).responses.create(
        model="gpt-5-codex", input="Hello", instructions="Be brief.", max_output_tokens=100
    )
    assert response.status == "completed" and response.output_text.startswith("Simulated")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    body = last_engine_body(gw)
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["max_tokens"] == 100 and body["chat_template_kwargs"]["enable_thinking"] is True
    assert response.usage is not None and response.usage.output_tokens == 12
    assert wait_until(lambda: gw.access_logs()[-1].get("route") == "/v1/responses", 5)
    log = gw.access_logs()[-1]
    assert (log["prompt_tokens"], log["completion_tokens"]) == (
        response.usage.input_tokens,
        response.usage.output_tokens,
    )


def test_stream_reasoning_effort_none(gw: Gateway) -> None:
    """responses.stream with reasoning.effort "none": thinking off, response.completed last."""
    with client(gw).responses.stream(
        model="qwen3.8-27b", input="Hello", reasoning={"effort": "none"}
    ) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_response()
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    assert [item.type for item in final.output] == ["message"]
    assert last_engine_body(gw)["chat_template_kwargs"]["enable_thinking"] is False
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 0


def test_tool_round_trip(gw: Gateway) -> None:
    """A function tool and a function_call_output round trip reach the engine as chat."""
    c = client(gw)
    c.responses.create(model="qwen3.8-27b", input="Weather?", tools=[TOOL], store=False)  # type: ignore[list-item]
    assert last_engine_body(gw)["tools"][0]["function"]["name"] == "get_weather"
    follow = c.responses.create(
        model="qwen3.8-27b",
        tools=[TOOL],  # type: ignore[list-item]
        input=[
            {"role": "user", "content": "Weather?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        store=False,
    )
    assert follow.status == "completed"
    messages = last_engine_body(gw)["messages"]
    assert messages[-1] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert messages[-2]["tool_calls"][0]["id"] == "c1"


def test_codex_recorded_request_replayed(gw: Gateway) -> None:
    """Codex's recorded request: a valid event stream ending with response.completed; tools
    flattened, web_search dropped, cache_salt and request id set by the gateway."""
    body = json.loads((FIXTURES / "codex-first-request-function_call-sse.json").read_text())[
        "request"
    ]["body"]
    r = httpx.post(
        gw.url("/v1/responses"), headers={"Authorization": f"Bearer {KEY_A}"}, json=body, timeout=60
    )
    assert r.status_code == 200
    events = sse_events(r.content)
    for _, data in events:
        EVENT.validate_python(data)
    assert events[-1][0] == "response.completed"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    sent = last_engine_body(gw)
    names = [t["function"]["name"] for t in sent["tools"]]
    assert "spawn_agent" in names and "web_search" not in names
    assert len(sent["cache_salt"]) == 64 and sent["request_id"] == r.headers["x-request-id"]
    for name in ("include", "prompt_cache_key", "client_metadata", "store"):
        assert name not in sent


def test_stored_responses_are_tenant_scoped(gw: Gateway) -> None:
    """A stored response: retrievable and chainable by its tenant, 404 for another (naming
    ``previous_response_id`` when the body's id is unknown), deletable."""
    a, b = client(gw, KEY_A), client(gw, KEY_B)
    first = a.responses.create(model="qwen3.8-27b", input="Remember 42.", store=True)
    assert a.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as unknown:
        b.responses.create(model="qwen3.8-27b", input="What number?", previous_response_id=first.id)
    assert unknown.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(first.id)
    a.responses.create(model="qwen3.8-27b", input="What number?", previous_response_id=first.id)
    contents = [m["content"] for m in last_engine_body(gw)["messages"]]
    assert contents[0] == "Remember 42." and contents[-1] == "What number?"
    with pytest.raises(openai.BadRequestError):
        a.responses.cancel(first.id)
    a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)


def test_input_items_list_the_conversation_a_page_at_a_time(gw: Gateway) -> None:
    """``responses.input_items.list`` through the SDK: the items that produced a stored
    response (the conversation it continued, then its own input), newest first unless
    ``order=asc``, in pages the SDK follows by ``after``; the same ids on every call; another
    tenant's 404; a bad ``limit``, ``order`` or cursor a 400 naming the parameter."""
    a, b = client(gw, KEY_A), client(gw, KEY_B)
    first = a.responses.create(
        model="qwen3.8-27b",
        input=[
            {"role": "system", "content": "Be brief."},
            {"id": "msg_mine", "type": "message", "role": "user", "content": "Remember 42."},
            {"role": "user", "content": [{"type": "input_text", "text": "Also 7."}]},
        ],
        store=True,
    )
    second = a.responses.create(
        model="qwen3.8-27b", input="What numbers?", previous_response_id=first.id, store=True
    )
    listed = list(a.responses.input_items.list(second.id, order="asc", limit=2))
    expected = 3 + len(first.output) + 1
    assert len(listed) == expected, listed
    outputs = [item.type for item in first.output]  # reasoning, then the answer
    assert [item.type for item in listed] == ["message"] * 3 + outputs + ["message"]
    assert listed[1].id == "msg_mine"
    assert len({item.id for item in listed}) == expected
    messages = [item for item in listed if item.type == "message"]
    texts = [item.content[0].text for item in messages]  # type: ignore[union-attr]
    assert texts[:3] == ["Be brief.", "Remember 42.", "Also 7."]
    assert texts[-1] == "What numbers?"
    assert messages[-1].content[0].type == "input_text"  # type: ignore[union-attr]
    assert messages[3].role == "assistant"  # type: ignore[union-attr]
    newest = a.responses.input_items.list(second.id, limit=1)
    assert [item.id for item in newest.data] == [listed[-1].id] and newest.has_more
    again = [item.id for item in a.responses.input_items.list(second.id, order="asc")]
    assert again == [item.id for item in listed]
    # The first response's items have the ids they have under the second.
    page = a.responses.input_items.list(first.id, order="asc", after=listed[0].id)
    assert [item.id for item in page.data] == [item.id for item in listed[1:3]]
    assert not page.has_more and page.last_id == listed[2].id
    with pytest.raises(openai.NotFoundError):
        b.responses.input_items.list(second.id)
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "sideways"}, {"after": "msg_nope"}):
        with pytest.raises(openai.BadRequestError) as refused:
            a.responses.input_items.list(second.id, **bad)  # type: ignore[arg-type]
        assert refused.value.param == next(iter(bad)), bad
        assert "nope" not in str(refused.value.body)


def test_errors_in_openai_shape_with_string_codes(gw: Gateway) -> None:
    """401 invalid_api_key, 429 rate_limit_exceeded, 404 model, 400 naming the parameter."""
    with pytest.raises(openai.AuthenticationError) as bad:
        client(gw, "sk-q38-wrongwrongwrongwrongwrongwrongwrong").responses.create(
            model="qwen3.8-27b", input="x"
        )
    assert bad.value.code == "invalid_api_key"
    c = client(gw, KEY_C)
    c.responses.create(model="qwen3.8-27b", input="x")
    with pytest.raises(openai.RateLimitError) as limited:
        c.responses.create(model="qwen3.8-27b", input="x")
    assert limited.value.code == "rate_limit_exceeded"
    assert int(limited.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.NotFoundError) as unknown:
        client(gw).responses.create(model="gpt-4o", input="x")
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad_input:
        client(gw).responses.create(
            model="qwen3.8-27b", input=[{"type": "item_reference", "id": "x"}]
        )  # type: ignore[list-item]
    assert bad_input.value.param == "input[0].type"


def test_store_off_refuses_previous_response_id(sim_factory: Any, gateway_factory: Any) -> None:
    """With stored responses off (the default): previous_response_id is a 400, GET a 404 that
    says the server stores none."""
    gw = gateway_factory(sim_factory())
    c = client(gw)
    response = c.responses.create(model="qwen3.8-27b", input="x", store=True)
    assert response.store is False
    for read in (c.responses.retrieve, c.responses.input_items.list):
        with pytest.raises(openai.NotFoundError) as missing:
            read(response.id)
        assert "does not store responses" in missing.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        c.responses.create(model="qwen3.8-27b", input="y", previous_response_id=response.id)
    assert refused.value.param == "previous_response_id"


def test_context_length_exceeded(sim_factory: Any, gateway_factory: Any) -> None:
    """A prompt over the context: 400 with code context_length_exceeded (what Codex reads)."""
    sim = sim_factory("--max-model-len", "2048")
    gw = gateway_factory(sim, {"engine": {"max_model_len": 2048}})
    with pytest.raises(openai.BadRequestError) as too_long:
        client(gw).responses.create(
            model="qwen3.8-27b", input="word " * 3000, max_output_tokens=32000
        )
    assert too_long.value.code == "context_length_exceeded"


def test_engine_drop_is_response_failed(sim_factory: Any, gateway_factory: Any) -> None:
    """An engine drop mid-stream ends with response.failed (server_error), never a bare close."""
    sim = sim_factory("--drop-after", "3", "--completion-tokens", "20")
    gw = gateway_factory(sim)
    r = httpx.post(
        gw.url("/v1/responses"),
        headers={"Authorization": f"Bearer {KEY_A}"},
        json={"model": "qwen3.8-27b", "input": "x", "stream": True},
        timeout=30,
    )
    events = sse_events(r.content)
    for _, data in events:
        EVENT.validate_python(data)
    assert events[0][0] == "response.created" and events[-1][0] == "response.failed"
    assert events[-1][1]["response"]["error"]["code"] == "server_error"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
