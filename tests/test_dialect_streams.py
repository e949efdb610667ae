"""Chat answers translated into Anthropic and Responses events and objects, checked against the
official SDKs' models (pure: no I/O)."""

from __future__ import annotations

import json
from typing import Any

import anthropic.types as at
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.errors import (
    BadRequest,
    EngineUnavailable,
    GatewayError,
    InvalidApiKey,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
)
from gateway.translate.anthropic_errors import anthropic_error
from gateway.translate.anthropic_stream import PING_EVENT, AnthropicWriter
from gateway.translate.chat_events import ChunkReader, answer_events
from gateway.translate.responses_errors import failure_code, responses_error
from gateway.translate.responses_store import ResponseStore
from gateway.translate.responses_stream import ResponsesWriter

pytestmark = pytest.mark.fast

ANTHROPIC_EVENT = TypeAdapter(at.RawMessageStreamEvent)
RESPONSES_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any
) -> dict[str, Any]:
    """One vLLM chat.completion.chunk."""
    choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    choice.update(extra)
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [choice],
    }


def usage_chunk(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def engine_stream(
    *, thinking: bool = True, tools: bool = False, finish: str | None = None
) -> list[dict[str, Any]]:
    """A vLLM-like chunk sequence: role, reasoning, the blank line, text or two tool calls."""
    chunks = [chunk({"role": "assistant", "content": ""})]
    if thinking:
        chunks += [chunk({"reasoning": "Let me"}), chunk({"reasoning": " think."})]
    chunks.append(chunk({"content": "\n\n"}))
    if tools:
        for index, (call_id, name, frags) in enumerate(
            [("call_a", "get_weather", ['{"city": ', '"Paris"}']), ("call_b", "get_time", ["{}"])]
        ):
            chunks.append(
                chunk(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": call_id,
                                "type": "function",
                                "function": {"name": name, "arguments": ""},
                            }
                        ]
                    }
                )
            )
            for frag in frags:
                chunks.append(
                    chunk({"tool_calls": [{"index": index, "function": {"arguments": frag}}]})
                )
        chunks.append(chunk({}, finish or "tool_calls"))
    else:
        chunks += [
            chunk({"content": "Hello"}),
            chunk({"content": " 世界 🌍"}),
            chunk({}, finish or "stop"),
        ]
    chunks.append(usage_chunk(42, len(chunks) - 1))
    return chunks


def parse_sse(data: bytes) -> list[tuple[str | None, Any]]:
    """SSE bytes as (event name, parsed data) pairs; comments are skipped."""
    out = []
    for block in data.decode().split("\n\n"):
        if not block or block.startswith(":"):
            continue
        name = None
        payload = None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                payload = json.loads(line[6:])
        out.append((name, payload))
    return out


def run_anthropic(
    chunks: list[dict[str, Any]], **kwargs: Any
) -> tuple[AnthropicWriter, list[tuple[str | None, Any]]]:
    writer = AnthropicWriter("qwen3.8-27b", input_estimate=50, **kwargs)
    reader = ChunkReader()
    data = b"".join(writer.feed(reader.read(c)) for c in chunks) + writer.finish()
    return writer, parse_sse(data)


def run_responses(
    chunks: list[dict[str, Any]], extra: dict[str, Any] | None = None
) -> tuple[ResponsesWriter, list[tuple[str | None, Any]]]:
    writer = ResponsesWriter("qwen3.8-27b", extra or {})
    reader = ChunkReader()
    data = b"".join(writer.feed(reader.read(c)) for c in chunks) + writer.finish()
    return writer, parse_sse(data)


# ------------------------------------------------------------------------- Anthropic


def test_anthropic_stream_thinking_then_text() -> None:
    """message_start, a thinking block with signature, a text block, message_delta, message_stop;
    every event validates as the SDK's RawMessageStreamEvent."""
    _, events = run_anthropic(engine_stream())
    for name, data in events:
        assert name == data["type"]
        ANTHROPIC_EVENT.validate_python(data)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert [d["type"] for d in deltas] == [
        "thinking_delta",
        "thinking_delta",
        "signature_delta",
        "text_delta",
        "text_delta",
    ]
    assert "".join(d.get("text", "") for d in deltas) == "Hello 世界 🌍"  # the blank line dropped
    final = events[-2][1]
    assert final["delta"]["stop_reason"] == "end_turn"
    assert final["usage"] == {"input_tokens": 42, "output_tokens": 6}  # the engine's counts


def test_anthropic_stream_tool_use() -> None:
    """Two tool calls become tool_use blocks with input_json_delta; stop_reason tool_use."""
    writer, events = run_anthropic(engine_stream(tools=True))
    for _, data in events:
        ANTHROPIC_EVENT.validate_python(data)
    blocks = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use", "tool_use"]
    assert (
        blocks[1]["id"] == "call_a"
        and blocks[1]["name"] == "get_weather"
        and blocks[1]["input"] == {}
    )
    partial = "".join(
        d["delta"]["partial_json"]
        for n, d in events
        if n == "content_block_delta" and d["index"] == 1
    )
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    message = at.Message.model_validate(writer.message())
    assert message.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("finish", "stop_reason", "stops", "expected"),
    [
        ("length", None, (), ("max_tokens", None)),
        ("stop", "END", ("END",), ("stop_sequence", "END")),
        ("stop", None, (), ("end_turn", None)),
    ],
)
def test_anthropic_stop_reasons(
    finish: str, stop_reason: Any, stops: tuple[str, ...], expected: tuple[str, Any]
) -> None:
    """length -> max_tokens, a matched stop string -> stop_sequence, else end_turn."""
    chunks = engine_stream(thinking=False)
    chunks[-2] = chunk({}, finish, stop_reason=stop_reason)
    _, events = run_anthropic(chunks, stops=stops)
    delta = events[-2][1]["delta"]
    assert (delta["stop_reason"], delta["stop_sequence"]) == expected


def test_anthropic_non_stream_message_validates() -> None:
    """A non-streamed chat answer becomes an SDK-valid Message with thinking, text and usage."""
    body = {
        "id": "chatcmpl-1",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "reasoning": "Hmm.",
                    "content": "\n\nHi there",
                    "tool_calls": [],
                },
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }
    writer = AnthropicWriter("qwen3.8-27b", input_estimate=99, stream=False)
    assert writer.feed(answer_events(body)) == b""
    message = at.Message.model_validate(writer.message())
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[1].text == "Hi there"  # type: ignore[union-attr]
    assert message.usage.input_tokens == 10 and message.usage.output_tokens == 5
    assert message.stop_reason == "end_turn"


def test_anthropic_error_event_and_ping() -> None:
    """A mid-stream failure is one `event: error` in Anthropic's shape; ping is a valid event."""
    writer = AnthropicWriter("m", input_estimate=1)
    start = writer.feed(ChunkReader().read(chunk({"content": "Hi"})))
    events = parse_sse(start + writer.error("api_error", "The engine dropped the stream."))
    assert events[-1] == (
        "error",
        {
            "type": "error",
            "error": {"type": "api_error", "message": "The engine dropped the stream."},
        },
    )
    assert parse_sse(PING_EVENT) == [("ping", {"type": "ping"})]


@pytest.mark.parametrize(
    ("error", "status", "etype"),
    [
        (BadRequest("bad"), 400, "invalid_request_error"),
        (InvalidApiKey(), 401, "authentication_error"),
        (PermissionDenied("no"), 403, "permission_error"),
        (NotFound("gone"), 404, "not_found_error"),
        (PayloadTooLarge("big"), 413, "request_too_large"),
        (
            RateLimited(
                "requests",
                "slow down",
                2.5,
                {"x-ratelimit-limit-requests": "60", "x-ratelimit-reset-requests": "2.5s"},
            ),
            429,
            "rate_limit_error",
        ),
        (EngineUnavailable("full", retry_after_s=3), 529, "overloaded_error"),
        (GatewayError("boom"), 500, "api_error"),
    ],
)
def test_anthropic_error_classes(error: GatewayError, status: int, etype: str) -> None:
    """Every gateway error has Anthropic's status, envelope and type name on /v1/messages."""
    got_status, body, headers = anthropic_error(error)
    assert got_status == status
    assert body == {"type": "error", "error": {"type": etype, "message": error.message}}
    if status != 413:  # the SDK's union lacks request_too_large, which the API documents
        at.ErrorResponse.model_validate(body)
    if status == 429:
        assert headers["Retry-After"] == "3"
        assert headers["anthropic-ratelimit-requests-limit"] == "60"
        assert headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    if status == 529:
        assert headers["Retry-After"] == "3"


ENGINE_OVERFLOW = (
    "This model's maximum context length is 8192 tokens. However, you requested 1 output tokens "
    "and your prompt contains at least 28321 input tokens, for a total of at least 28322 tokens. "
    "Please reduce the length of the input prompt or the number of requested output tokens. "
    "(parameter=input_tokens, value=28321)"
)


def test_context_overflow_wording() -> None:
    """The engine's prompt-too-long 400 reads as Anthropic's (its lower bound kept as one) and carries OpenAI's string code."""
    error = BadRequest(ENGINE_OVERFLOW, param="input_tokens")
    assert (
        anthropic_error(error)[1]["error"]["message"]
        == "prompt is too long: at least 28321 tokens > 8191 maximum"
    )
    status, body, _ = responses_error(error)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert failure_code(error) == "context_length_exceeded"


def test_responses_error_codes_are_strings() -> None:
    """Auth and rate-limit errors on /v1/responses keep OpenAI's string codes."""
    assert responses_error(InvalidApiKey())[1]["error"]["code"] == "invalid_api_key"
    limited = RateLimited("tokens", "slow", 1.0)
    assert responses_error(limited)[1]["error"]["code"] == "rate_limit_exceeded"
    assert failure_code(limited) == "rate_limit_exceeded"
    assert failure_code(EngineUnavailable("down", retry_after_s=1)) == "server_error"


# ------------------------------------------------------------------------- Responses


def test_responses_stream_reasoning_then_text() -> None:
    """created, in_progress, a reasoning item, a message item, completed with usage; every
    event validates as the SDK's ResponseStreamEvent and sequence numbers count up."""
    writer, events = run_responses(engine_stream())
    parsed = [RESPONSES_EVENT.validate_python(d) for _, d in events]
    assert [n for n, _ in events][:2] == ["response.created", "response.in_progress"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names[-1] == "response.completed"
    assert "response.reasoning_text.delta" in names and "response.output_text.delta" in names
    final = parsed[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[1].content[0].text == "Hello 世界 🌍"
    assert final.usage.input_tokens == 42 and final.usage.output_tokens == 6
    # no engine figure: reasoning tokens are the engine's count only (README, one rule)
    assert final.usage.output_tokens_details.reasoning_tokens == 0
    assert writer.output_text() == "Hello 世界 🌍"


def test_responses_reasoning_tokens_are_the_engines_count() -> None:
    """output_tokens_details.reasoning_tokens is the engine's completion_tokens_details figure,
    the number the ledger records, whatever the events' merging."""
    counted = engine_stream()
    counted[-1]["usage"]["completion_tokens_details"] = {"reasoning_tokens": 4}
    split = run_responses(counted)[1][-1][1]["response"]["usage"]
    merged = [counted[0], chunk({"reasoning": "Let me think."}), *counted[3:]]
    together = run_responses(merged)[1][-1][1]["response"]["usage"]
    assert split == together and split["output_tokens_details"]["reasoning_tokens"] == 4


def test_responses_stream_function_calls_with_namespace() -> None:
    """Tool calls become function_call items (namespace restored), arguments streamed."""
    _, events = run_responses(engine_stream(tools=True), {"namespaces": {"get_time": "clock"}})
    for _, data in events:
        RESPONSES_EVENT.validate_python(data)
    final = Response.model_validate(events[-1][1]["response"])
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [
        ("call_a", "get_weather", '{"city": "Paris"}'),
        ("call_b", "get_time", "{}"),
    ]
    assert calls[1].namespace == "clock" and calls[0].namespace is None
    deltas = [d["delta"] for n, d in events if n == "response.function_call_arguments.delta"]
    assert "".join(deltas) == '{"city": "Paris"}{}'


def test_responses_incomplete_and_failed() -> None:
    """A length finish ends with response.incomplete; a failure with response.failed."""
    _, events = run_responses(engine_stream(thinking=False, finish="length"))
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    writer = ResponsesWriter("m", {})
    data = parse_sse(writer.fail("server_error", "The engine dropped the stream."))
    assert [n for n, _ in data] == ["response.created", "response.in_progress", "response.failed"]
    failed = RESPONSES_EVENT.validate_python(data[-1][1])
    assert failed.response.error.code == "server_error"


def test_responses_non_stream_object() -> None:
    """A non-streamed answer becomes an SDK-valid Response carrying echoed fields."""
    body = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hi",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }
    extra = {
        "metadata": {"k": "v"},
        "instructions": "Be brief.",
        "tools": [{"type": "function", "name": "f", "parameters": {}}],
    }
    writer = ResponsesWriter("qwen3.8-27b", extra, stream=False)
    assert writer.feed(answer_events(body)) == b""
    response = Response.model_validate(writer.finalize())
    assert response.status == "completed" and response.output_text == "Hi"
    assert response.metadata == {"k": "v"} and response.instructions == "Be brief."
    assert response.usage is not None and response.usage.total_tokens == 7


# ------------------------------------------------------------------------- store


def test_store_scoped_bounded_and_expiring() -> None:
    """Another tenant cannot see an entry; count, bytes and time bound the store."""
    now = [0.0]
    store = ResponseStore(max_items=2, max_bytes=10_000, ttl_s=60, clock=lambda: now[0])
    store.put("a", {"id": "r1", "output": []}, ["in"])
    assert store.get("b", "r1") is None and not store.delete("b", "r1")
    assert store.get("a", "r1") is not None
    store.put("a", {"id": "r2", "output": []}, [])
    store.put("a", {"id": "r3", "output": []}, [])
    assert store.get("a", "r1") is None and len(store) == 2  # the oldest left
    assert not store.put("a", {"id": "big", "output": ["x" * 20_000]}, [])
    now[0] = 61
    assert store.get("a", "r2") is None and len(store) == 0 and store.bytes == 0


def test_store_history_chains_input_and_output() -> None:
    """history() gives the stored input items followed by the response's output items."""
    store = ResponseStore(max_items=5, max_bytes=10_000, ttl_s=60, clock=lambda: 0.0)
    store.put(
        "a",
        {"id": "r1", "output": [{"type": "message", "role": "assistant", "content": []}]},
        [{"role": "user", "content": "q"}],
    )
    history = store.history("a", "r1")
    assert history is not None and [h.get("role") for h in history] == ["user", "assistant"]
    assert store.history("b", "r1") is None


def test_store_evicts_from_the_tenant_holding_the_most() -> None:
    """A tenant within its share keeps its entry while another tenant fills the store; entries
    are held as compact JSON, counted with their overhead."""
    store = ResponseStore(max_items=100, max_bytes=12_000, ttl_s=60, clock=lambda: 0.0)
    payload = {"output": ["x" * 900]}
    assert store.put("b", {"id": "b1", **payload}, [])
    for i in range(30):
        assert store.put("a", {"id": f"a{i}", **payload}, [])
    entry = store.get("b", "b1")
    assert entry is not None and entry.response["output"] == payload["output"]
    assert isinstance(entry.response_json, bytes)
    assert store.get("a", "a0") is None and store.get("a", "a29") is not None
    assert store.bytes <= store.max_bytes
    assert store.bytes == store.tenant_bytes("a") + store.tenant_bytes("b")
    full = ResponseStore(max_items=3, max_bytes=1 << 20, ttl_s=60, clock=lambda: 0.0)
    full.put("b", {"id": "b1", "output": []}, [])
    for i in range(5):
        full.put("a", {"id": f"a{i}", "output": []}, [])
    assert full.get("b", "b1") is not None and len(full) == 3
