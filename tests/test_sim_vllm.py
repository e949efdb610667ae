"""The simulator held to what real vLLM does: merged events, tool calls, field checks, headers,
n choices as sequences, the stall fault and per-token metrics (the launcher's production flags)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.test_sim import (
    BASE,
    CHAT,
    MODEL,
    SimProcess,
    chat,
    chunks,
    deltas,
    launch,
    metric,
    payloads,
    session_for,
    stream,
)

pytestmark = pytest.mark.fast

TOKENS = 12
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 2},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "hourly": {"type": "boolean"},
            },
            "required": ["city", "days", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def prod() -> Iterator[SimProcess]:
    """The simulator with the flags the launcher gives the real engine (tool parser, reasoning
    parser, one sequence at a time), pacing off."""
    directory = Path(tempfile.mkdtemp(prefix="simv-", dir="/tmp"))
    proc = launch(
        directory,
        "--served-model-name", MODEL,
        "--max-model-len", "4096",
        "--reasoning-parser", "qwen3",
        "--enable-auto-tool-choice",
        "--tool-call-parser", "qwen3_coder",
        "--max-num-seqs", "1",
        "--tokens-per-second", "0",
        "--completion-tokens", str(TOKENS),
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def client(prod: SimProcess) -> AsyncIterator[aiohttp.ClientSession]:
    """A session to the production-flagged simulator."""
    async with session_for(prod) as session:
        yield session


def thinking(**extra: Any) -> dict[str, Any]:
    """A chat body with thinking on."""
    return chat(chat_template_kwargs={"enable_thinking": True}, **extra)


# Stream shape


async def test_json_and_sse_headers_are_uvicorns(client: aiohttp.ClientSession) -> None:
    """Lowercase headers in uvicorn's order, `server: uvicorn`, `vary: Origin`, on bodies,
    errors and streams alike."""
    for body, expected in (
        (chat(), [b"date", b"server", b"content-length", b"content-type", b"vary"]),
        (
            chat(temperature="hot"),
            [b"date", b"server", b"content-length", b"content-type", b"vary"],
        ),
        (chat(stream=True), [b"date", b"server", b"content-type", b"vary", b"transfer-encoding"]),
    ):
        async with client.post(BASE + CHAT, json=body) as resp:
            await resp.read()
            assert [name for name, _ in resp.raw_headers] == expected
            assert (resp.headers["server"], resp.headers["vary"]) == ("uvicorn", "Origin")


async def test_include_reasoning_false_streams_no_reasoning(client: aiohttp.ClientSession) -> None:
    """include_reasoning false: no reasoning delta, every content delta carries
    "reasoning": null, the first one led by the "\\n\\n" after </think>; usage counts all."""
    body = thinking(include_reasoning=False, stream_options={"include_usage": True})
    _, raw = await stream(client, body)
    sent = deltas(raw)[1:]
    assert all("reasoning" in d and d["reasoning"] is None for d in sent[:-1]) and sent[-1] == {}
    assert sent[0]["content"].startswith("\n\n")
    assert chunks(raw)[-1]["usage"]["completion_tokens"] == TOKENS


async def test_tool_parser_hides_think_end_and_merges_the_separator(
    client: aiohttp.ClientSession,
) -> None:
    """With the tool parser, </think> and the "\\n\\n" give no chunk of their own: the
    reasoning is followed by one content delta "\\n\\n<word>"; the final delta is {}."""
    _, raw = await stream(client, thinking())
    sent = deltas(raw)[1:]
    kinds = [list(d) for d in sent]
    reasoning = TOKENS // 3
    assert kinds == [["reasoning"]] * reasoning + [["content"]] * (TOKENS - reasoning - 3) + [[]]
    assert sent[reasoning]["content"].startswith("\n\n") and len(sent[reasoning]["content"]) > 2


async def test_tokens_per_event_merges_tokens(client: aiohttp.ClientSession) -> None:
    """tokens_per_event 4: each event carries 4 tokens (its running usage moves by 4), the
    text is the same as one token per event, usage counts every token."""
    usage = {"include_usage": True, "continuous_usage_stats": True}
    _, single = await stream(client, chat(stream_options=usage))
    _, merged = await stream(client, chat(stream_options=usage, sim={"tokens_per_event": 4}))
    steps = [c["usage"]["completion_tokens"] for c in chunks(merged) if c["choices"]]
    assert steps == [0, 4, 8, TOKENS]

    def text(raw: bytes) -> str:
        return "".join(d.get("content") or "" for d in deltas(raw))

    assert text(merged) == text(single)
    assert chunks(merged)[-1]["usage"]["completion_tokens"] == TOKENS


async def test_lagging_reader_gets_merged_events_and_exact_counters(prod: SimProcess) -> None:
    """A reader that stalls gets several tokens per event (vLLM's API server merges what it
    has not sent), and vllm:generation_tokens_total moves by exactly the tokens generated."""
    tokens = 3000
    body = json.dumps(
        chat(
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            sim={"completion_tokens": tokens, "token_bytes": 256},
        )
    ).encode()
    async with session_for(prod) as session:
        before = await metric(session, "vllm:generation_tokens_total")
    raw = b""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(prod.socket)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        await asyncio.sleep(1.0)  # read nothing: the engine's writes back up
        sock.settimeout(10)
        while chunk := await asyncio.to_thread(sock.recv, 1 << 16):
            raw += chunk
    finally:
        sock.close()
    body_bytes = raw.split(b"\r\n\r\n", 1)[1]
    events = [json.loads(p) for p in payloads(body_bytes) if p.startswith(b"{")]
    steps = [e["usage"]["completion_tokens"] for e in events if e.get("choices")]
    assert steps[-1] == tokens and len(steps) < tokens // 2
    assert max(b - a for a, b in itertools.pairwise(steps)) > 10
    async with session_for(prod) as session:
        assert await metric(session, "vllm:generation_tokens_total") - before == tokens


async def test_n_choices_run_one_after_the_other_with_one_sequence(
    client: aiohttp.ClientSession,
) -> None:
    """n=2 with --max-num-seqs 1: both role chunks first, then every token of choice 0, then
    choice 1 (one running, one waiting meanwhile); each choice counts its prompt once."""
    prompt_before = await metric(client, "vllm:prompt_tokens_total")
    _, raw = await stream(client, chat(n=2, stream_options={"include_usage": True}))
    order = [c["choices"][0]["index"] for c in chunks(raw) if c["choices"]]
    assert order == [0, 1] + [0] * TOKENS + [1] * TOKENS
    usage = chunks(raw)[-1]["usage"]
    assert usage["completion_tokens"] == 2 * TOKENS
    assert await metric(client, "vllm:prompt_tokens_total") - prompt_before == (
        2 * usage["prompt_tokens"]
    )
    slow = chat(n=2, stream=True, sim={"tokens_per_second": 20, "completion_tokens": 40})
    async with client.post(BASE + CHAT, json=slow) as resp:
        await resp.content.readline()
        await asyncio.sleep(0.3)
        assert await metric(client, "vllm:num_requests_running") == 1
        assert await metric(client, "vllm:num_requests_waiting") == 1


# Tool calls


async def test_auto_tool_choice_calls_the_first_tool_with_valid_arguments(
    client: aiohttp.ClientSession,
) -> None:
    """tools (auto): a call of the first tool, required parameters filled with values of their
    types within the schema; no content; finish_reason tool_calls; text after a tool result."""
    body = chat(tools=[WEATHER, TIME])
    async with client.post(BASE + CHAT, json=body) as resp:
        choice = (await resp.json())["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call["id"])
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {
        "city": "Paris",
        "days": 2,
        "unit": "celsius",
    }
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "21 C"},
    ]
    async with client.post(BASE + CHAT, json=chat(tools=[WEATHER], messages=history)) as resp:
        answer = (await resp.json())["choices"][0]
    assert answer["finish_reason"] == "stop" and "tool_calls" not in answer["message"]
    assert answer["message"]["content"]


async def test_streamed_tool_call_header_then_arguments_per_parameter(
    client: aiohttp.ClientSession,
) -> None:
    """Streamed call: header {id, type, index, function: {name}} without `arguments`, then
    per parameter an opening piece, the value and a closing piece, as the qwen3_coder parser."""
    _, raw = await stream(client, chat(tools=[WEATHER], tool_choice="required"))
    calls = [d["tool_calls"][0] for d in deltas(raw) if "tool_calls" in d]
    header = calls[0]
    assert list(header) == ["id", "type", "index", "function"]
    assert header["function"] == {"name": "get_weather"} and header["index"] == 0
    pieces = [c["function"]["arguments"] for c in calls[1:]]
    assert pieces == ['{"city": "', "Paris", '"', ', "days": ', "2", ', "unit": "', "celsius", '"}']
    final = chunks(raw)[-1]["choices"][0]
    assert (final["delta"], final["finish_reason"]) == ({}, "tool_calls")


async def test_named_tool_choice_is_guided_json(client: aiohttp.ClientSession) -> None:
    """A named tool_choice calls that tool; finish_reason stop and content "" (vLLM builds the
    message so); "required" also has content ""."""
    named = {"type": "function", "function": {"name": "get_time"}}
    async with client.post(BASE + CHAT, json=chat(tools=[WEATHER, TIME], tool_choice=named)) as r:
        choice = (await r.json())["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_time", "arguments": "{}"}
    ]
    async with client.post(BASE + CHAT, json=chat(tools=[WEATHER], tool_choice="required")) as r:
        choice = (await r.json())["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""


@pytest.mark.parametrize(
    ("extra", "kind", "param", "text"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "BadRequestError", "tool_choice", "does not match any"),
        ({"tool_choice": "required"}, "BadRequestError", "tool_choice", "`tools` must be set"),
        ({"tools": []}, "BadRequestError", "tools", "must not be an empty array"),
        ({"tools": [WEATHER], "tool_choice": "bogus"}, "BadRequestError", "tool_choice",
         "Invalid value for `tool_choice`"),
        ({"tools": [[[[]]]]}, "Bad Request", None, "valid dictionary"),
        ({"tools": [{"type": "function"}]}, "Bad Request", None, "Field required"),
    ],
)  # fmt: skip
async def test_bad_tools_are_vllms_400(
    client: aiohttp.ClientSession, extra: dict[str, Any], kind: str, param: str | None, text: str
) -> None:
    """tools / tool_choice vLLM refuses get its 400, error type and parameter."""
    async with client.post(BASE + CHAT, json=chat(**extra)) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert (error["type"], error["param"], error["code"]) == (kind, param, 400)
    assert text in error["message"]


# Field checks and defaults


@pytest.mark.parametrize(
    ("field", "value", "kind", "text"),
    [
        ("temperature", "hot", "Bad Request", "float_parsing"),
        ("top_p", "x", "Bad Request", "float_parsing"),
        ("logprobs", "maybe", "Bad Request", "bool_parsing"),
        ("logprobs", [1], "Bad Request", "bool_type"),
        ("max_tokens", "abc", "Bad Request", "int_parsing"),
        ("seed", 1.5, "Bad Request", "int_from_float"),
        ("stop", 5, "Bad Request", "list_type"),
        ("user", 5, "Bad Request", "string_type"),
        ("temperature", -1, "BadRequestError", "temperature must be non-negative, got -1.0."),
        ("top_p", 2, "BadRequestError", "top_p must be in (0, 1], got 2.0."),
        ("top_k", -5, "BadRequestError", "top_k must be 0 (disable), or at least 1, got -5."),
        ("min_p", 2, "BadRequestError", "min_p must be in [0, 1], got 2.0."),
        ("presence_penalty", 5, "BadRequestError", "presence_penalty must be in [-2, 2]"),
        ("repetition_penalty", 0, "BadRequestError", "must be greater than zero"),
        ("top_logprobs", 3, "BadRequestError", "`logprobs` must be set to true"),
    ],
)
async def test_wrong_field_types_and_ranges_are_400(
    client: aiohttp.ClientSession, field: str, value: object, kind: str, text: str
) -> None:
    """A field of the wrong type or out of range is vLLM's 400, the field named."""
    async with client.post(BASE + CHAT, json=chat(**{field: value})) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == kind and error["code"] == 400
    assert text in error["message"] and field in error["message"]


async def test_lax_values_vllm_accepts(client: aiohttp.ClientSession) -> None:
    """pydantic's lax mode, as in vLLM: "0.5", true, "yes", "2" are a number, a boolean, an
    integer."""
    body = chat(temperature="0.5", top_p=True, logprobs="yes", n="2", max_tokens=3.0)
    async with client.post(BASE + CHAT, json=body) as resp:
        assert resp.status == 200
        assert len((await resp.json())["choices"]) == 2


async def test_default_lengths(client: aiohttp.ClientSession) -> None:
    """/v1/completions without max_tokens stops at 16 tokens (length); chat without it runs to
    the answer's end-of-sequence (stop)."""
    long = {"completion_tokens": 40}
    async with client.post(BASE + "/v1/completions", json={"prompt": "hi", "sim": long}) as r:
        choice = (await r.json())["choices"][0]
        assert (choice["finish_reason"], (await r.json())["usage"]["completion_tokens"]) == (
            "length",
            16,
        )
    async with client.post(BASE + CHAT, json=chat(sim=long)) as resp:
        body = await resp.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 40


# Stall, abort and counters


async def test_stall_after_keeps_running_with_health_200(
    client: aiohttp.ClientSession, prod: SimProcess
) -> None:
    """stall_after 3: three tokens, then nothing while the request stays running, /health
    answers 200 and the token counters stand still; the client leaving aborts it."""
    generated = await metric(client, "vllm:generation_tokens_total")
    aborted = await metric(client, "vllm:request_success_total", finished_reason="abort")
    async with session_for(prod) as other:
        resp = await other.post(BASE + CHAT, json=chat(stream=True, sim={"stall_after": 3}))
        received = b""
        while received.count(b"data: ") < 1 + 3:
            received += await asyncio.wait_for(resp.content.readany(), 5)
        prompt = await metric(client, "vllm:prompt_tokens_total")
        await asyncio.sleep(0.5)
        async with client.get(BASE + "/health") as health:
            assert health.status == 200
        assert await metric(client, "vllm:num_requests_running") == 1
        assert await metric(client, "vllm:generation_tokens_total") == generated + 3
        assert await metric(client, "vllm:prompt_tokens_total") == prompt
        with pytest.raises(asyncio.TimeoutError):  # nothing more arrives
            await asyncio.wait_for(resp.content.readany(), 0.3)
        resp.close()
    deadline = time.monotonic() + 1.0
    while await metric(client, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the stalled request was not aborted"
        await asyncio.sleep(0.02)
    assert await metric(client, "vllm:request_success_total", finished_reason="abort") == (
        aborted + 1
    )


async def test_abort_stops_generation_within_a_token(
    client: aiohttp.ClientSession, prod: SimProcess
) -> None:
    """A client leaving mid-stream stops generation at once: generation_tokens_total, counted
    per token as generated, moves during the stream and not after the abort."""
    body = chat(stream=True, sim={"tokens_per_second": 50, "completion_tokens": 2000})
    async with session_for(prod) as other:
        resp = await other.post(BASE + CHAT, json=body)
        await resp.content.readline()
        first = await metric(client, "vllm:generation_tokens_total")
        await asyncio.sleep(0.3)
        second = await metric(client, "vllm:generation_tokens_total")
        assert 5 <= second - first <= 30
        resp.close()
    await asyncio.sleep(0.2)
    stopped = await metric(client, "vllm:generation_tokens_total")
    await asyncio.sleep(0.3)
    assert await metric(client, "vllm:generation_tokens_total") == stopped
    assert await metric(client, "vllm:num_requests_running") == 0
