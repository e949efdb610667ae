"""The Anthropic Messages and OpenAI Responses dialects on both engines: real vLLM (CPU build,
the tiny model of `tests.realengine.model`) and the simulator, with the real gateway in front and
the official ``anthropic`` and ``openai`` SDKs as clients (ids ``[real]`` and ``[sim]``).

The gateway translates both dialects onto the engine's chat route, so these tests show that the
translation is understood by real vLLM: its chat template, reasoning parser, tool parser and
context checks. Assertions are about the APIs' shape and meaning, not token text.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import ALIAS, KEY_A, Gateway, wait_until
from tests.realengine.launcher import MAX_MODEL_LEN, LaunchedEngine

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
WEATHER = "What is the weather like in Paris today?"
A_TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name"}},
        "required": ["city"],
    },
}
R_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": A_TOOL["input_schema"],
    "strict": False,
}


OPEN: list[Any] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """SDK clients made by a test are closed after it (no socket left to the collector)."""
    yield
    while OPEN:
        OPEN.pop().close()


def messages_client(gw: Gateway) -> anthropic.Anthropic:
    made = anthropic.Anthropic(base_url=gw.base_url, api_key=KEY_A, max_retries=0, timeout=60)
    OPEN.append(made)
    return made


def responses_client(gw: Gateway) -> openai.OpenAI:
    made = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0, timeout=60)
    OPEN.append(made)
    return made


def recorded(name: str) -> dict[str, Any]:
    body = json.loads((FIXTURES / name).read_text())["request"]["body"]
    assert isinstance(body, dict)
    return body


# ----------------------------------------------------------------------------- Messages


def test_messages_stream_with_thinking(engine_gateway: Gateway) -> None:
    """messages.stream: a thinking block then a text block, end_turn, engine usage."""
    with messages_client(engine_gateway).messages.stream(
        model=ALIAS,
        max_tokens=64,
        messages=[{"role": "user", "content": "Say hello."}],
        thinking={"type": "enabled", "budget_tokens": 32},
    ) as stream:
        final = stream.get_final_message()
    kinds = [block.type for block in final.content]
    assert kinds[0] == "thinking" and "text" in kinds
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0


def test_messages_non_stream_thinking_off(engine_gateway: Gateway) -> None:
    """messages.create with thinking disabled: no thinking block."""
    message = messages_client(engine_gateway).messages.create(
        model=ALIAS,
        max_tokens=32,
        messages=[{"role": "user", "content": "Say hello."}],
        thinking={"type": "disabled"},
    )
    assert [block.type for block in message.content] == ["text"]


def test_messages_tool_round_trip(engine_gateway: Gateway) -> None:
    """The model calls get_weather (tool_use, input parsed); the tool_result gets an answer."""
    c = messages_client(engine_gateway)
    first = c.messages.create(
        model=ALIAS,
        max_tokens=128,
        tools=[A_TOOL],  # type: ignore[list-item]
        messages=[{"role": "user", "content": WEATHER}],
        thinking={"type": "disabled"},
    )
    assert first.stop_reason == "tool_use"
    call = next(block for block in first.content if block.type == "tool_use")
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    second = c.messages.create(
        model=ALIAS,
        max_tokens=64,
        tools=[A_TOOL],  # type: ignore[list-item]
        thinking={"type": "disabled"},
        messages=[
            {"role": "user", "content": WEATHER},
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},  # type: ignore[misc]
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}],
            },
        ],
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert any(block.type == "text" for block in second.content)


def test_messages_count_tokens(engine_gateway: Gateway) -> None:
    """count_tokens: the engine's own count; tools and a system prompt add tokens."""
    c = messages_client(engine_gateway)
    plain = c.messages.count_tokens(model=ALIAS, messages=[{"role": "user", "content": WEATHER}])
    more = c.messages.count_tokens(
        model=ALIAS,
        system="You are terse.",
        tools=[A_TOOL],  # type: ignore[list-item]
        messages=[{"role": "user", "content": WEATHER}],
    )
    assert 0 < plain.input_tokens < more.input_tokens < MAX_MODEL_LEN


def test_claude_code_request_too_long_for_the_context(engine_gateway: Gateway) -> None:
    """Claude Code's ~28k-token first request on an 8k context: its max_tokens 32000 is clamped
    (no max_tokens error) and real vLLM's overflow reads `prompt is too long: N tokens > 8191
    maximum` (the longest prompt served); the simulator, counting message text only, answers it in full."""
    body = recorded("claude-code-first-request-tool_use-sse.json")
    r = httpx.post(
        engine_gateway.url("/v1/messages?beta=true"),
        headers={"Authorization": f"Bearer {KEY_A}", "anthropic-version": "2023-06-01"},
        json=body,
        timeout=120,
    )
    if r.status_code == 200:  # the simulator counts message text only, not tool schemas
        assert r.content.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        return
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("prompt is too long: ")
    assert error["message"].endswith(f" tokens > {MAX_MODEL_LEN - 1} maximum")


# ---------------------------------------------------------------------------- Responses


def test_responses_stream_with_reasoning(engine_gateway: Gateway, engine: LaunchedEngine) -> None:
    """responses.stream: a reasoning item and a message, response.completed with usage (the
    engine's reasoning count: real vLLM counts, the simulator, like 1Cat-vLLM, does not)."""
    with responses_client(engine_gateway).responses.stream(
        model=ALIAS, input="Say hello.", max_output_tokens=64, reasoning={"effort": "medium"}
    ) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_response()
    assert names[0] == "response.created" and names[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert final.output[0].type == "reasoning"
    assert final.usage is not None
    reasoning = final.usage.output_tokens_details.reasoning_tokens
    assert reasoning > 0 if engine.kind == "real" else reasoning == 0


def ledger_reasoning(gw: Gateway, request_id: str) -> int | None:
    """The ledger's reasoning_tokens of ``request_id`` once its record is written (10 s)."""
    path = gw.config_path.parent / "gw-usage.sqlite3"
    found: list[tuple[int | None]] = []

    def written() -> bool:
        if not path.exists():
            return False
        connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            found[:] = connection.execute(
                "SELECT reasoning_tokens FROM usage WHERE request_id = ?", (request_id,)
            ).fetchall()
        finally:
            connection.close()
        return bool(found)

    assert wait_until(written, 10), f"no ledger record for {request_id}"
    return found[0][0]


def test_reasoning_tokens_are_one_number_for_the_apis_and_the_ledger(
    engine_gateway: Gateway, engine: LaunchedEngine
) -> None:
    """One answer's reasoning tokens: chat's usage, Responses' usage and the ledger agree."""
    client = openai.OpenAI(
        base_url=engine_gateway.url("/v1"), api_key=KEY_A, max_retries=0, timeout=60
    )
    OPEN.append(client)
    raw = client.responses.with_raw_response.create(
        model=ALIAS, input="Say hello.", max_output_tokens=64, reasoning={"effort": "medium"}
    )
    response = raw.parse()
    assert response.usage is not None
    reported = response.usage.output_tokens_details.reasoning_tokens
    assert (ledger_reasoning(engine_gateway, raw.headers["x-request-id"]) or 0) == reported
    chat = client.chat.completions.with_raw_response.create(
        model=ALIAS, messages=[{"role": "user", "content": "Say hello."}], max_tokens=64
    )
    answer = chat.parse()
    details = answer.usage.completion_tokens_details if answer.usage else None
    in_chat = details.reasoning_tokens if details is not None else None
    assert ledger_reasoning(engine_gateway, chat.headers["x-request-id"]) == in_chat
    if engine.kind == "real":
        assert reported > 0 and in_chat is not None and in_chat > 0


def test_responses_non_stream_reasoning_none(engine_gateway: Gateway) -> None:
    """responses.create with reasoning.effort "none": text only."""
    response = responses_client(engine_gateway).responses.create(
        model=ALIAS, input="Say hello.", max_output_tokens=32, reasoning={"effort": "none"}
    )
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text


def test_responses_tool_round_trip(engine_gateway: Gateway) -> None:
    """The model calls get_weather (a function_call item); its output gets an answer."""
    c = responses_client(engine_gateway)
    first = c.responses.create(
        model=ALIAS,
        input=WEATHER,
        tools=[R_TOOL],
        reasoning={"effort": "none"},
        max_output_tokens=128,  # type: ignore[list-item]
    )
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    second = c.responses.create(
        model=ALIAS,
        tools=[R_TOOL],  # type: ignore[list-item]
        reasoning={"effort": "none"},
        max_output_tokens=64,
        input=[
            {"role": "user", "content": WEATHER},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
        ],
    )
    assert second.output_text


def test_codex_request_on_the_engine(engine_gateway: Gateway) -> None:
    """Codex's recorded request: a complete stream, or (over this small context) a 400 with
    code context_length_exceeded, which Codex understands."""
    body = recorded("codex-first-request-function_call-sse.json")
    r = httpx.post(
        engine_gateway.url("/v1/responses"),
        headers={"Authorization": f"Bearer {KEY_A}"},
        json=body,
        timeout=120,
    )
    if r.status_code == 400:
        assert r.json()["error"]["code"] == "context_length_exceeded"
    else:
        assert r.status_code == 200 and b"event: response.completed" in r.content
