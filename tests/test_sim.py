"""The engine simulator as a process: vLLM's wire protocol, token rule, faults, record, metrics."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sim.tokens import TOOL_CALLS

REPO = Path(__file__).resolve().parent.parent
MODEL = "qwen3.8-27b"
ROOT = "/models/Qwen3.8-27B-QUASAR-NVFP4"
KEY = "sim-test-key-0123456789"
MAX_MODEL_LEN = 4096
TOKENS = 12  # --completion-tokens of the test simulators
CHAT = "/v1/chat/completions"
BASE = "http://engine"


@dataclass
class SimProcess:
    """A simulator process started by these tests."""

    socket: str
    record: Path
    proc: subprocess.Popen[bytes]

    def records(self) -> list[dict[str, Any]]:
        """The record file's lines so far."""
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines() if line]

    async def record_for(self, request_id: str, timeout: float = 5.0) -> dict[str, Any]:
        """The record line of the request sent with this X-Request-Id (waits for it)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.records():
                headers = {k.lower(): v for k, v in line["headers"].items()}
                if headers.get("x-request-id") == request_id:
                    return line
            assert time.monotonic() < deadline, f"no record line for {request_id}"
            await asyncio.sleep(0.02)

    def stop(self) -> int:
        """SIGTERM, then the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)


def _connectable(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def launch(
    directory: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True
) -> SimProcess:
    """Start ``python -m engine.sim`` on ``directory/e.sock`` with a record file."""
    sock = str(directory / "e.sock")
    record = directory / "record.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.sim", "--socket", sock, "--record", str(record), *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    sim = SimProcess(sock, record, proc)
    deadline = time.monotonic() + 15
    while wait and not _connectable(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            sim.stop()
            raise RuntimeError("simulator did not start")
        time.sleep(0.02)
    return sim


@pytest.fixture(scope="module")
def tmpdir_short() -> Iterator[Path]:
    """A short private directory for this module's sockets and records."""
    path = Path(tempfile.mkdtemp(prefix="sim-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def sim(tmpdir_short: Path) -> Iterator[SimProcess]:
    """The simulator as the launcher starts it (vLLM flags, some unknown), pacing off."""
    directory = tmpdir_short / "a"
    directory.mkdir()
    proc = launch(
        directory,
        "--model",
        ROOT,
        "--served-model-name",
        MODEL,
        "alias-two",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-dtype",
        "fp8_e5m2",
        "--reasoning-parser",
        "qwen3",
        "--attention-backend",
        "FLASH_ATTN_V100",
        "--disable-fastapi-docs",
        "--gpu-memory-utilization",
        "0.92",
        "--language-model-only",
        "--limit-mm-per-prompt",
        '{"image":0,"video":0}',
        "--generation-config",
        "auto",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--enable-prompt-tokens-details",
        "--trust-request-chat-template",
        "--flag-of-a-future-vllm",
        "1",
        "--tokens-per-second",
        "0",
        "--completion-tokens",
        str(TOKENS),
    )
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def guarded(tmpdir_short: Path) -> Iterator[SimProcess]:
    """A simulator with an API key from the environment, a tool parser, forced usage, one slot
    and default chat template kwargs that no longer switch thinking off."""
    directory = tmpdir_short / "b"
    directory.mkdir()
    proc = launch(
        directory,
        "--uds",
        str(directory / "e.sock"),
        "--default-chat-template-kwargs",
        '{"preserve_thinking": true}',
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "qwen3_coder",
        "--enable-force-include-usage",
        "--enable-request-id-headers",
        "--max-num-seqs",
        "1",
        "--tokens-per-second",
        "0",
        "--completion-tokens",
        str(TOKENS),
        env={"VLLM_API_KEY": KEY},
    )
    yield proc
    assert proc.stop() == 0


def session_for(proc: SimProcess, key: str | None = None) -> aiohttp.ClientSession:
    """A client session over the simulator's Unix socket."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=proc.socket), headers=headers)


@pytest.fixture
async def client(sim: SimProcess) -> AsyncIterator[aiohttp.ClientSession]:
    """A session to the default simulator."""
    async with session_for(sim) as session:
        yield session


@pytest.fixture
async def keyed(guarded: SimProcess) -> AsyncIterator[aiohttp.ClientSession]:
    """A session to the guarded simulator carrying the right key."""
    async with session_for(guarded, KEY) as session:
        yield session


def chat(content: str = "hi", sim: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A chat body with one user message (and a `sim` object when given)."""
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    if sim is not None:
        body["sim"] = sim
    body.update(extra)
    return body


def payloads(raw: bytes, separator: bytes = b"\n\n") -> list[bytes]:
    """The `data:` payloads of an SSE byte stream (comment lines skipped)."""
    out = []
    for event in raw.split(separator):
        for line in event.splitlines():
            if line.startswith(b"data: "):
                out.append(line[len(b"data: ") :])
    return out


def chunks(raw: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of a stream, [DONE] excluded."""
    return [json.loads(p) for p in payloads(raw) if p != b"[DONE]"]


def deltas(raw: bytes) -> list[dict[str, Any]]:
    """The `delta` of every chunk that has choices."""
    return [c["choices"][0]["delta"] for c in chunks(raw) if c.get("choices")]


async def stream(
    session: aiohttp.ClientSession, body: dict[str, Any], path: str = CHAT
) -> tuple[aiohttp.ClientResponse, bytes]:
    """POST a streaming request and read the whole answer."""
    async with session.post(BASE + path, json={**body, "stream": True}) as resp:
        return resp, await resp.read()


async def pieces(
    session: aiohttp.ClientSession, body: dict[str, Any]
) -> tuple[list[bytes], list[float]]:
    """POST a streaming request; the reads as they arrived and when (seconds after sending)."""
    start = time.monotonic()
    out: list[bytes] = []
    times: list[float] = []
    async with session.post(BASE + CHAT, json={**body, "stream": True}) as resp:
        async for data in resp.content.iter_any():
            out.append(data)
            times.append(time.monotonic() - start)
    return out, times


async def metric(session: aiohttp.ClientSession, name: str, **labels: str) -> float:
    """The value of one sample of the simulator's /metrics (0 when absent)."""
    async with session.get(BASE + "/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def rid() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex


# Routes and framework behaviour


async def test_health_version_load_and_ping(client: aiohttp.ClientSession) -> None:
    """/health and /ping answer an empty 200; /version says 1.3.0; /load reports 0."""
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        async with client.request(method, BASE + path) as resp:
            assert (resp.status, await resp.read()) == (200, b"")
            assert resp.headers["Server"] == "uvicorn" and "X-Request-Id" not in resp.headers
    async with client.get(BASE + "/version") as resp:
        assert await resp.json() == {"version": "1.3.0"}
    async with client.get(BASE + "/load") as resp:
        assert await resp.json() == {"server_load": 0}


async def test_models_lists_one_card_per_served_name(client: aiohttp.ClientSession) -> None:
    """/v1/models has vLLM's card shape, `root` = --model, the effective max_model_len."""
    async with client.get(BASE + "/v1/models") as resp:
        body = await resp.json()
    assert body["object"] == "list"
    assert [card["id"] for card in body["data"]] == [MODEL, "alias-two"]
    card = body["data"][0]
    assert list(card) == [
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    ]
    assert (card["root"], card["max_model_len"], card["owned_by"]) == (ROOT, MAX_MODEL_LEN, "vllm")
    assert re.fullmatch(r"modelperm-[0-9a-f]{32}", card["permission"][0]["id"])


async def test_unknown_paths_and_methods_get_fastapi_bodies(
    client: aiohttp.ClientSession,
) -> None:
    """Unmounted paths are 404 {"detail":"Not Found"}; a wrong method 405 with Allow."""
    for path in ("/invocations", "/v1/models/qwen3.8-27b", "/docs", "/sleep"):
        async with client.post(BASE + path) as resp:
            assert (resp.status, await resp.json()) == (404, {"detail": "Not Found"})
    async with client.post(BASE + "/v1/models") as resp:
        assert (resp.status, await resp.json()) == (405, {"detail": "Method Not Allowed"})
        assert resp.headers["Allow"] == "GET"


async def test_api_key_guards_only_v1_v2_inference(guarded: SimProcess) -> None:
    """With VLLM_API_KEY, /v1* needs `Bearer <key>` (any scheme case); other paths do not."""
    async with session_for(guarded) as anonymous:
        for path in ("/v1/models", "/v1/nothing-here", "/v2/rerank", "/inference/v1/generate"):
            async with anonymous.get(BASE + path) as resp:
                assert (resp.status, await resp.read()) == (401, b'{"error":"Unauthorized"}')
        for path in ("/health", "/metrics", "/version"):
            async with anonymous.get(BASE + path) as resp:
                assert resp.status == 200
        async with anonymous.post(BASE + "/tokenize", json={"prompt": "abcd"}) as resp:
            assert (await resp.json())["count"] == 1
        headers = {"Authorization": f"bearer {KEY}"}
        async with anonymous.get(BASE + "/v1/models", headers=headers) as resp:
            assert resp.status == 200 and re.fullmatch(
                r"[0-9a-f]{32}", resp.headers["X-Request-Id"]
            )
        async with anonymous.get(BASE + "/v1/nothing-here", headers=headers) as resp:
            assert resp.status == 404
    async with session_for(guarded, KEY + "x") as wrong, wrong.get(BASE + "/v1/models") as resp:
        assert resp.status == 401


# Chat: bodies, thinking, usage


async def test_non_stream_chat_body_has_every_field_in_order(
    client: aiohttp.ClientSession,
) -> None:
    """The non-streaming body is vLLM's model_dump(): all fields, nulls included, in order;
    a message without tool calls has no `tool_calls` key, as on the real engine."""
    async with client.post(BASE + CHAT, json=chat(), headers={"X-Request-Id": "abc"}) as resp:
        assert resp.content_type == "application/json"
        body = await resp.json()
    assert list(body) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
        "kv_transfer_params",
    ]
    assert (body["id"], body["object"], body["model"]) == ("chatcmpl-abc", "chat.completion", MODEL)
    choice = body["choices"][0]
    assert list(choice) == [
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "routed_experts",
    ]
    assert list(choice["message"]) == [
        "role",
        "content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        "reasoning",
    ]
    assert choice["message"]["reasoning"] is None
    assert choice["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 8,
        "total_tokens": 8 + TOKENS,
        "completion_tokens": TOKENS,
        "prompt_tokens_details": None,
    }
    assert re.fullmatch(r"vllm-1\.3\.0-[0-9a-f]{8}", body["system_fingerprint"])


async def test_prompt_token_rule_and_tokenize_agree(client: aiohttp.ClientSession) -> None:
    """prompt_tokens = 3 + sum(4 + ceil(UTF-8 bytes / 4)), for strings and text parts alike."""
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "héllo 世界 🚀"}]},
    ]
    expected = 3 + (4 + math.ceil(15 / 4)) + (4 + math.ceil(len("héllo 世界 🚀".encode()) / 4))
    async with client.post(BASE + CHAT, json={"messages": messages}) as resp:
        assert (await resp.json())["usage"]["prompt_tokens"] == expected
    async with client.post(BASE + "/tokenize", json={"messages": messages}) as resp:
        body = await resp.json()
    assert (body["count"], len(body["tokens"]), body["max_model_len"]) == (
        expected,
        expected,
        MAX_MODEL_LEN,
    )


async def test_stream_thinking_off_by_default(client: aiohttp.ClientSession) -> None:
    """Default stream: role chunk first, content deltas, final chunk (delta {}) with the
    fingerprint, no reasoning key anywhere, no usage chunk, [DONE] last; vLLM's headers."""
    async with client.post(
        BASE + CHAT, json=chat(stream=True), headers={"X-Request-Id": "r1"}
    ) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        names = [name for name, _ in resp.raw_headers]
        raw = await resp.read()
    assert names == [b"date", b"server", b"content-type", b"vary", b"transfer-encoding"]
    assert (resp.headers["server"], resp.headers["vary"]) == ("uvicorn", "Origin")
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"[DONE]") == 1
    found = chunks(raw)
    created = found[0]["created"]
    role = (
        '{"id":"chatcmpl-r1","object":"chat.completion.chunk","created":'
        + str(created)
        + ',"model":"'
        + MODEL
        + '","choices":[{"index":0,"delta":{"role":"assistant",'
        '"content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,'
        '"prompt_text":null}'
    )
    assert payloads(raw)[0] == role.encode()
    assert b"reasoning" not in raw and all(c.get("usage") is None for c in found)
    middle = found[1:-1]
    assert len(middle) == TOKENS - 1
    assert all(
        list(c["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "token_ids"]
        for c in middle
    )
    final = found[-1]
    assert final["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
        "token_ids": None,
    }
    assert list(final) == ["id", "object", "created", "model", "choices", "system_fingerprint"]
    assert {c["id"] for c in found} == {"chatcmpl-r1"}


@pytest.mark.parametrize(
    ("extra", "thinking"),
    [
        ({}, False),
        ({"chat_template_kwargs": {"enable_thinking": True}}, True),
        ({"reasoning_effort": "high"}, True),
        ({"reasoning_effort": "none"}, False),
        ({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"}, False),
        ({"chat_template_kwargs": {"enable_thinking": None}, "reasoning_effort": "low"}, True),
    ],
)
async def test_thinking_precedence_of_the_fork(
    client: aiohttp.ClientSession, extra: dict[str, Any], thinking: bool
) -> None:
    """Fork default off; request kwargs override it; reasoning_effort only when the request
    did not set enable_thinking (vllm-protocol.md section 9.2)."""
    async with client.post(BASE + CHAT, json=chat(**extra)) as resp:
        message = (await resp.json())["choices"][0]["message"]
    if thinking:
        assert message["reasoning"].endswith("\n") and message["content"].startswith("\n\n")
    else:
        assert message["reasoning"] is None and not message["content"].startswith("\n")


async def test_replaced_server_default_leaves_thinking_on(keyed: aiohttp.ClientSession) -> None:
    """--default-chat-template-kwargs replaces the fork default: enable_thinking undefined = on."""
    async with keyed.post(BASE + CHAT, json=chat()) as resp:
        assert (await resp.json())["choices"][0]["message"]["reasoning"]


async def test_stream_thinking_on_sends_reasoning_then_content(
    client: aiohttp.ClientSession,
) -> None:
    """Thinking on: `reasoning` deltas (never reasoning_content), an empty content delta for
    </think> (no tool parser), then content starting with "\\n\\n"; one token per chunk, the
    end-of-sequence token a final delta {}."""
    body = chat(chat_template_kwargs={"enable_thinking": True})
    _, raw = await stream(client, body)
    found = deltas(raw)[1:]
    kinds = [next(iter(d), None) for d in found]
    reasoning = TOKENS // 3
    assert kinds == ["reasoning"] * reasoning + ["content"] * (TOKENS - reasoning - 1) + [None]
    assert b"reasoning_content" not in raw
    assert found[reasoning - 1] == {"reasoning": "\n"} and found[reasoning] == {"content": ""}
    assert found[reasoning + 1] == {"content": "\n\n"}


async def test_tool_parser_drops_the_think_end_chunk(keyed: aiohttp.ClientSession) -> None:
    """With --tool-call-parser (real vLLM, observed) the </think> token yields no chunk and the
    "\\n\\n" after it is merged into the first content delta, both still counted in usage;
    --enable-force-include-usage adds the usage chunk unasked."""
    _, raw = await stream(keyed, chat())
    found = chunks(raw)
    token_chunks = [c for c in found[1:] if c["choices"]]
    sent = [c["choices"][0]["delta"] for c in token_chunks]
    reasoning = TOKENS // 3
    assert len(token_chunks) == TOKENS - 2 and {"content": ""} not in sent
    assert sent[reasoning - 1] == {"reasoning": "\n"}
    assert sent[reasoning]["content"].startswith("\n\n") and len(sent[reasoning]["content"]) > 2
    assert found[-1]["usage"]["completion_tokens"] == TOKENS and found[-1]["choices"] == []


async def test_usage_chunk_only_when_asked(client: aiohttp.ClientSession) -> None:
    """include_usage adds one usage-only chunk (choices [], fingerprint) after the final chunk,
    which then carries no fingerprint; continuous_usage_stats puts usage on every chunk."""
    _, raw = await stream(client, chat(stream_options={"include_usage": True}))
    found = chunks(raw)
    usage = found[-1]
    assert list(usage) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "system_fingerprint",
    ]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 8,
        "total_tokens": 8 + TOKENS,
        "completion_tokens": TOKENS,
    }
    assert "system_fingerprint" not in found[-2]
    assert len([c for c in found if c["choices"]]) - 1 == TOKENS
    options = {"include_usage": True, "continuous_usage_stats": True}
    _, raw = await stream(client, chat(stream_options=options))
    running = [c["usage"]["completion_tokens"] for c in chunks(raw)[:-1]]
    assert running == list(range(TOKENS + 1))


async def test_n_choices_are_indexed_and_counted(client: aiohttp.ClientSession) -> None:
    """n=2: a role chunk per choice, tokens interleaved, usage counts both choices."""
    _, raw = await stream(client, chat(n=2, stream_options={"include_usage": True}))
    found = chunks(raw)
    assert [c["choices"][0]["index"] for c in found[:4]] == [0, 1, 0, 1]
    assert found[-1]["usage"]["completion_tokens"] == 2 * TOKENS
    async with client.post(BASE + CHAT, json=chat(n=2)) as resp:
        body = await resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"]["content"] != body["choices"][1]["message"]["content"]


async def test_max_tokens_caps_with_length_and_max_completion_tokens_wins(
    client: aiohttp.ClientSession,
) -> None:
    """max_completion_tokens beats max_tokens; a cap below the answer ends with `length` on
    the last token's chunk."""
    async with client.post(BASE + CHAT, json=chat(max_tokens=3, max_completion_tokens=5)) as r:
        body = await r.json()
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (
        5,
        "length",
    )
    _, raw = await stream(client, chat(max_tokens=4))
    found = chunks(raw)
    assert len(found) == 5 and found[-1]["choices"][0]["finish_reason"] == "length"
    assert found[-1]["choices"][0]["delta"]["content"]


async def test_text_override_streams_token_by_token(client: aiohttp.ClientSession) -> None:
    """`sim.text` is cut by the documented rule and joins back to the exact text."""
    text = "Grüße, 世界! 👩‍💻 ok"
    _, raw = await stream(client, chat(sim={"text": text}))
    content = [d.get("content", "") for d in deltas(raw)[1:]]
    assert "".join(content) == text
    assert content[:5] == ["Gr", "ü", "ß", "e", ","]


# Errors


async def test_unknown_model_is_404_and_omitted_model_is_accepted(
    client: aiohttp.ClientSession,
) -> None:
    """An unknown model gets vLLM's 404 NotFoundError; any served name or none is accepted."""
    async with client.post(BASE + CHAT, json=chat(model="gpt-4o")) as resp:
        assert resp.status == 404
        assert await resp.json() == {
            "error": {
                "message": "The model `gpt-4o` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }
    for body in ({"messages": [{"role": "user", "content": "x"}]}, chat(model="alias-two")):
        async with client.post(BASE + CHAT, json=body) as resp:
            assert (await resp.json())["model"] == MODEL


async def test_prompt_too_long_has_vllms_message(client: aiohttp.ClientSession) -> None:
    """prompt > max_model_len - requested output: 400 with vLLM's exact message; the bound
    itself is accepted."""
    async with client.post(BASE + CHAT, json=chat("x" * 20000, max_tokens=100)) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    allowed = MAX_MODEL_LEN - 100
    assert error == {
        "message": f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you "
        f"requested 100 output tokens and your prompt contains at least {allowed + 1} input "
        f"tokens, for a total of at least {MAX_MODEL_LEN + 1} tokens. Please reduce the length "
        f"of the input prompt or the number of requested output tokens. "
        f"(parameter=input_tokens, value={allowed + 1})",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
    async with client.post(BASE + CHAT, json=chat(max_tokens=MAX_MODEL_LEN - 8)) as resp:
        assert resp.status == 200
    async with client.post(BASE + CHAT, json=chat(max_tokens=MAX_MODEL_LEN - 7)) as resp:
        assert (await resp.json())["error"]["param"] == "input_tokens"


async def test_output_budget_over_context_is_400(client: aiohttp.ClientSession) -> None:
    """max_completion_tokens above max_model_len: 400 naming the parameter."""
    async with client.post(BASE + CHAT, json=chat(max_completion_tokens=5000)) as resp:
        error = (await resp.json())["error"]
    assert error["message"] == (
        f"max_completion_tokens=5000 cannot be greater than max_model_len=max_total_tokens="
        f"{MAX_MODEL_LEN}. Please request fewer output tokens. "
        "(parameter=max_completion_tokens, value=5000)"
    )
    assert (resp.status, error["type"], error["param"]) == (
        400,
        "BadRequestError",
        "max_completion_tokens",
    )


async def test_validation_errors_are_400_bad_request(client: aiohttp.ClientSession) -> None:
    """stream_options without stream, a missing `messages`, bad JSON, a non-JSON content type,
    a non-integer `n` and a bad `sim` object are 400s (validation type "Bad Request"); lax
    spellings pydantic accepts ("true", "2") are accepted."""
    async with client.post(BASE + CHAT, json=chat(stream_options={"include_usage": True})) as r:
        error = (await r.json())["error"]
    assert (r.status, error["type"], error["code"]) == (400, "Bad Request", 400)
    assert "Stream options can only be defined when `stream=True`." in error["message"]
    async with client.post(BASE + CHAT, json={"model": MODEL}) as r:
        assert (r.status, (await r.json())["error"]["type"]) == (400, "Bad Request")
    headers = {"Content-Type": "application/json"}
    async with client.post(BASE + CHAT, data=b"{not json", headers=headers) as r:
        assert (r.status, (await r.json())["error"]["type"]) == (400, "Bad Request")
    async with client.post(BASE + CHAT, data=json.dumps(chat()).encode()) as r:
        assert "Unsupported Media Type" in (await r.json())["error"]["message"]
    async with client.post(BASE + CHAT, json=chat(n="two")) as r:
        assert (r.status, (await r.json())["error"]["type"]) == (400, "Bad Request")
    async with client.post(BASE + CHAT, json=chat(stream="true", n="2")) as r:
        assert r.content_type == "text/event-stream"
        assert {c["choices"][0]["index"] for c in chunks(await r.read()) if c["choices"]} == {0, 1}
    for bad in ({"bogus": 1}, {"split_writes": 0}, {"framing": "lfcr"}, {"hang": "yes"}):
        async with client.post(BASE + CHAT, json=chat(sim=bad)) as r:
            assert (r.status, (await r.json())["error"]["param"]) == (400, "sim")


async def test_auto_tool_choice_needs_the_server_flags(
    client: aiohttp.ClientSession, keyed: aiohttp.ClientSession
) -> None:
    """`tools` imply tool_choice auto, refused unless the server has a tool parser."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    async with client.post(BASE + CHAT, json=chat(tools=tools)) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["message"].startswith('"auto" tool choice requires')
    async with keyed.post(BASE + CHAT, json=chat(tools=tools)) as resp:
        assert resp.status == 200


# /v1/completions


async def test_completions_bodies_and_chunks(client: aiohttp.ClientSession) -> None:
    """/v1/completions: text_completion objects, `text` deltas, max_tokens defaulting to 16."""
    async with client.post(BASE + "/v1/completions", json={"prompt": "Say hi"}) as resp:
        body = await resp.json()
    assert list(body) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
    ]
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == 2 and body["choices"][0]["finish_reason"] == "stop"
    big = {"prompt": "x", "max_tokens": 30, "sim": {"completion_tokens": 20}}
    async with client.post(BASE + "/v1/completions", json=big) as resp:
        assert (await resp.json())["usage"]["completion_tokens"] == 16 + 4
    async with client.post(BASE + "/v1/completions", json={"prompt": "x", "sim": big["sim"]}) as r:
        assert (await r.json())["choices"][0]["finish_reason"] == "length"
    _, raw = await stream(client, {"prompt": "Say hi"}, "/v1/completions")
    found = chunks(raw)
    assert len(found) == TOKENS and all(c["object"] == "text_completion" for c in found)
    assert list(found[0]["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "prompt_token_ids",
        "token_ids",
    ]
    assert found[-1]["choices"][0]["finish_reason"] == "stop" and "system_fingerprint" in found[-1]
    assert "".join(c["choices"][0]["text"] for c in found) == body["choices"][0]["text"]


# Faults per case


async def test_c01_paced_padded_events_after_prefill(client: aiohttp.ClientSession) -> None:
    """C01: headers at once, the first event after the prefill, then one padded event per
    token interval."""
    fault = {"prefill_ms": 400, "tokens_per_second": 8, "completion_tokens": 5, "token_bytes": 100}
    start = time.monotonic()
    arrivals: list[float] = []
    sizes: list[int] = []
    async with client.post(BASE + CHAT, json=chat(sim=fault, stream=True)) as resp:
        headers_at = time.monotonic() - start
        async for line in resp.content:
            if line.startswith(b"data: {"):
                arrivals.append(time.monotonic() - start)
                sizes.append(len(line))
    assert headers_at < 0.3 and 0.38 < arrivals[0] < 0.9
    gaps = [b - a for a, b in itertools.pairwise(arrivals[1:])]
    assert all(0.06 < gap < 0.3 for gap in gaps), gaps
    assert all(size > 200 for size in sizes[1:-1])


async def test_c02_keepalive_comments_between_events(client: aiohttp.ClientSession) -> None:
    """C02: a `: keepalive` comment before the first event and between all events."""
    _, raw = await stream(client, chat(sim={"keepalive": True}))
    parts = raw.split(b"\n\n")[:-1]
    assert parts[0] == b": keepalive"
    assert parts[0::2] == [b": keepalive"] * (len(parts) // 2)
    assert all(p.startswith(b"data: ") for p in parts[1::2])


async def test_c03_split_and_coalesced_writes(client: aiohttp.ClientSession) -> None:
    """C03: split_writes cuts each event into pieces; coalesce puts several events in one
    write; the bytes are the same as unfaulted (tokens paced slower than the cut writes, so
    that each still gets an event of its own)."""
    fault = {"split_writes": 3, "write_gap_ms": 5, "tokens_per_second": 25}
    reads, _ = await pieces(client, chat(sim=fault))
    joined = b"".join(reads)
    assert any(not r.endswith(b"\n\n") for r in reads) and len(reads) >= 2 * (TOKENS + 2)
    assert len(chunks(joined)) == TOKENS + 1 and joined.endswith(b"data: [DONE]\n\n")
    fault = {"coalesce": 3, "tokens_per_second": 20}
    reads, _ = await pieces(client, chat(sim=fault))
    assert max(r.count(b"data: ") for r in reads) == 3
    assert b"".join(reads).count(b"data: ") == TOKENS + 2


@pytest.mark.parametrize(
    ("fault", "separator"),
    [({"framing": "crlf"}, b"\r\n\r\n"), ({"framing": "cr"}, b"\r\r")],
)
async def test_c04_crlf_and_cr_framing(
    client: aiohttp.ClientSession, fault: dict[str, Any], separator: bytes
) -> None:
    """C04: events end with the chosen line ending and never with a bare LF pair."""
    _, raw = await stream(client, chat(sim=fault))
    assert raw.endswith(b"data: [DONE]" + separator) and b"\n\n" not in raw
    events = [e for e in raw.split(separator) if e]
    assert len(events) == TOKENS + 2 and all(e.startswith(b"data: ") for e in events)


async def test_c04_crlf_terminator_split_across_writes(client: aiohttp.ClientSession) -> None:
    """C04: split_crlf puts a write boundary between the \\r and \\n of every CRLF."""
    fault = {
        "framing": "crlf",
        "split_crlf": True,
        "write_gap_ms": 5,
        "completion_tokens": 3,
        "tokens_per_second": 10,
    }
    reads, _ = await pieces(client, chat(sim=fault))
    assert sum(r.endswith(b"\r") for r in reads) >= 4
    assert b"".join(reads).count(b"\r\n\r\n") == 3 + 2


@pytest.mark.parametrize("fault", [{"split_utf8": True}, {"byte_writes": True}])
async def test_c05_writes_cut_inside_utf8_characters(
    client: aiohttp.ClientSession, fault: dict[str, Any]
) -> None:
    """C05: writes cut inside multi-byte characters (or one byte each) still join to the
    exact text."""
    text = "世界 🚀 é"
    body = chat(sim={"text": text, "write_gap_ms": 3, **fault})
    reads, _ = await pieces(client, body)

    def decodes(data: bytes) -> bool:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    assert sum(not decodes(r) for r in reads) >= 3
    joined = b"".join(reads)
    assert "".join(d.get("content", "") for d in deltas(joined)[1:]) == text


async def test_c06_stream_without_done(client: aiohttp.ClientSession) -> None:
    """C06a: no_done ends the stream normally after the final chunk, with no [DONE]."""
    _, raw = await stream(client, chat(sim={"no_done": True}))
    assert b"[DONE]" not in raw
    assert chunks(raw)[-1]["choices"][0]["finish_reason"] == "stop"


async def test_drop_after_done(client: aiohttp.ClientSession) -> None:
    """drop_after_done sends the whole answer, [DONE] included, then closes the connection
    without the body's end (the 0-size chunk)."""
    received = b""
    body = chat(sim={"drop_after_done": True, "completion_tokens": 3}, stream=True)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with client.post(BASE + CHAT, json=body) as r:
            async for data in r.content.iter_any():
                received += data
    assert received.endswith(b"data: [DONE]\n\n")
    assert chunks(received)[-1]["choices"][0]["finish_reason"] == "stop"


async def test_hold_after_done(client: aiohttp.ClientSession) -> None:
    """hold_after_done_s sends the whole answer, [DONE] included, at once, and the body's end
    only that long after."""
    body = chat(sim={"hold_after_done_s": 1.0, "completion_tokens": 3}, stream=True)
    received = b""
    done_at = None
    async with client.post(BASE + CHAT, json=body) as r:
        started = time.monotonic()
        async for data in r.content.iter_any():
            received += data
            if done_at is None and received.endswith(b"data: [DONE]\n\n"):
                done_at = time.monotonic()
    ended = time.monotonic()
    assert done_at is not None and done_at - started < 0.5
    assert 0.9 <= ended - done_at < 2.0
    assert chunks(received)[-1]["choices"][0]["finish_reason"] == "stop"


async def test_c06_drop_after_tokens(client: aiohttp.ClientSession, sim: SimProcess) -> None:
    """C06b: drop_after closes the connection mid-body after N tokens; recorded as an error."""
    request_id = rid()
    received = b""
    body = chat(sim={"drop_after": 5}, stream=True)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with client.post(BASE + CHAT, json=body, headers={"X-Request-Id": request_id}) as r:
            async for data in r.content.iter_any():
                received += data
    assert len(chunks(received)) == 1 + 5 and b"[DONE]" not in received
    line = await sim.record_for(request_id)
    assert (line["outcome"], line["tokens_sent"], line["status"]) == ("error", 5, 200)


async def test_c06_error_event_mid_stream(client: aiohttp.ClientSession) -> None:
    """vLLM's in-stream error: spaced JSON error object after N tokens, then [DONE]."""
    resp, raw = await stream(client, chat(sim={"error_after": 3}))
    assert resp.status == 200
    assert payloads(raw)[-2:] == [
        b'{"error": {"message": "Internal server error", "type": "InternalServerError", '
        b'"param": null, "code": 500}}',
        b"[DONE]",
    ]
    assert len(payloads(raw)) == 1 + 3 + 2
    async with client.post(BASE + CHAT, json=chat(sim={"error_after": 3})) as resp:
        assert (resp.status, (await resp.json())["error"]["type"]) == (500, "InternalServerError")


async def test_c07_parallel_tool_call_deltas(client: aiohttp.ClientSession) -> None:
    """C07: two calls (index 0 and 1); each header has vLLM's id and no `arguments` key, the
    arguments follow parameter by parameter, some pieces cut inside a JSON string;
    finish_reason tool_calls; the non-streaming message carries the whole calls."""
    _, raw = await stream(client, chat(sim={"tool_calls": True}))
    calls = [d["tool_calls"][0] for d in deltas(raw) if "tool_calls" in d]
    headers = [c for c in calls if "id" in c]
    assert [(h["index"], h["function"]["name"]) for h in headers] == [
        (0, TOOL_CALLS[0][0]),
        (1, TOOL_CALLS[1][0]),
    ]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", h["id"]) for h in headers)
    assert all(h["function"] == {"name": h["function"]["name"]} for h in headers)
    for index, (_, arguments) in enumerate(TOOL_CALLS):
        parts = [c["function"]["arguments"] for c in calls if c["index"] == index and "id" not in c]
        assert (
            parts[0] == '{"' + next(iter(arguments)) + '": "'
            and len(parts) > 5
            and json.loads("".join(parts)) == arguments
        )
        assert any(p.count('"') % 2 == 1 for p in parts)
    final = chunks(raw)[-1]["choices"][0]
    assert (final["delta"], final["finish_reason"]) == ({}, "tool_calls")
    async with client.post(BASE + CHAT, json=chat(sim={"tool_calls": True})) as resp:
        choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    whole = choice["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in whole] == [a for _, a in TOOL_CALLS]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", c["id"]) for c in whole)


@pytest.mark.parametrize("variant", ["reasoning_content", "both"])
async def test_c08_reasoning_field_variants(client: aiohttp.ClientSession, variant: str) -> None:
    """C08: older vLLM field names on deltas and messages: reasoning_content only, or both."""
    body = chat(sim={"reasoning_field": variant}, chat_template_kwargs={"enable_thinking": True})
    _, raw = await stream(client, body)
    thoughts = [d for d in deltas(raw) if "reasoning" in d or "reasoning_content" in d]
    assert len(thoughts) == TOKENS // 3
    if variant == "both":
        assert all(d["reasoning"] == d["reasoning_content"] for d in thoughts)
    else:
        assert all(list(d) == ["reasoning_content"] for d in thoughts)
    async with client.post(BASE + CHAT, json=body) as resp:
        message = (await resp.json())["choices"][0]["message"]
    assert message["reasoning_content"].endswith("\n")
    assert ("reasoning" in message) is (variant == "both")


async def test_c10_stream_disconnect_aborts(client: aiohttp.ClientSession, sim: SimProcess) -> None:
    """C10a: a client closing a 20 tokens/s stream stops generation within a token interval;
    recorded as aborted with the tokens sent, counted as finished_reason abort."""
    aborted = await metric(client, "vllm:request_success_total", finished_reason="abort")
    request_id = rid()
    body = chat(
        max_tokens=4000, stream=True, sim={"tokens_per_second": 20, "completion_tokens": 8000}
    )
    async with client.post(BASE + CHAT, json=body, headers={"X-Request-Id": request_id}) as resp:
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen == 5:
                break
        resp.close()
    left = time.monotonic()
    record = await sim.record_for(request_id)
    assert time.monotonic() - left < 1.0
    assert record["outcome"] == "aborted" and 4 <= record["tokens_sent"] <= 7
    assert (
        await metric(client, "vllm:request_success_total", finished_reason="abort") == aborted + 1
    )
    assert await metric(client, "vllm:num_requests_running") == 0


async def test_c10_non_stream_disconnect_aborts(
    client: aiohttp.ClientSession, sim: SimProcess
) -> None:
    """C10b: a non-streaming client leaving after 1 s cancels generation at once."""
    request_id = rid()
    body = chat(max_tokens=4000, sim={"tokens_per_second": 20, "completion_tokens": 8000})
    with pytest.raises(asyncio.TimeoutError):
        await client.post(
            BASE + CHAT,
            json=body,
            headers={"X-Request-Id": request_id},
            timeout=aiohttp.ClientTimeout(total=1.0),
        )
    left = time.monotonic()
    line = await sim.record_for(request_id)
    assert time.monotonic() - left < 1.0
    assert (line["outcome"], line["status"]) == ("aborted", 0)
    assert 10 <= line["tokens_sent"] <= 30


async def test_c15_slow_headers_long_silence_and_hang(
    client: aiohttp.ClientSession, sim: SimProcess
) -> None:
    """C15: headers_delay_s holds the whole answer; silence_s sends headers at once and the
    first event later; hang never answers and is recorded as aborted when the client leaves."""
    start = time.monotonic()
    async with client.post(BASE + CHAT, json=chat(sim={"headers_delay_s": 0.5})) as resp:
        assert resp.status == 200 and time.monotonic() - start >= 0.5
    start = time.monotonic()
    async with client.post(BASE + CHAT, json=chat(sim={"silence_s": 0.5}, stream=True)) as resp:
        assert time.monotonic() - start < 0.3
        await resp.content.readline()
        assert time.monotonic() - start >= 0.5
        await resp.read()
    request_id = rid()
    with pytest.raises(asyncio.TimeoutError):
        await client.post(
            BASE + CHAT,
            json=chat(sim={"hang": True}),
            headers={"X-Request-Id": request_id},
            timeout=aiohttp.ClientTimeout(total=0.5),
        )
    line = await sim.record_for(request_id)
    assert (line["outcome"], line["tokens_sent"], line["status"]) == ("aborted", 0, 0)


async def test_c16_large_bodies_are_read_whole(keyed: aiohttp.ClientSession) -> None:
    """C16: a 0.9 MiB body of \\uXXXX escapes is read whole (its prompt_tokens follow the
    rule); a 6 MiB one is read and refused as too long, not as too large."""
    chars = 0.9 * 2**20 // 6
    data = json.dumps(chat("字" * int(chars), max_tokens=8)).encode()
    headers = {"Content-Type": "application/json"}
    async with keyed.post(BASE + CHAT, data=data, headers=headers) as resp:
        assert resp.status == 200
        expected = 3 + 4 + math.ceil(3 * int(chars) / 4)
        assert (await resp.json())["usage"]["prompt_tokens"] == expected
    data = json.dumps(chat("字" * (6 * 2**20 // 6), max_tokens=8)).encode()
    async with keyed.post(BASE + CHAT, data=data, headers=headers) as resp:
        assert (resp.status, (await resp.json())["error"]["param"]) == (400, "input_tokens")


async def test_refuse_with_503_or_a_closed_connection(
    client: aiohttp.ClientSession, sim: SimProcess
) -> None:
    """refuse 503 answers the scaling 503 at once; refuse close drops the connection unanswered."""
    async with client.post(BASE + CHAT, json=chat(sim={"refuse": "503"})) as resp:
        assert resp.status == 503
    request_id = rid()
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await client.post(
            BASE + CHAT, json=chat(sim={"refuse": "close"}), headers={"X-Request-Id": request_id}
        )
    line = await sim.record_for(request_id)
    assert (line["outcome"], line["status"]) == ("error", 0)


# Record and metrics


async def test_record_line_per_request(client: aiohttp.ClientSession, sim: SimProcess) -> None:
    """--record writes method, path, headers, parsed body, outcome, tokens, status and times per
    request, flushed while the simulator runs."""
    request_id = rid()
    body = chat(sim={"completion_tokens": 5})
    async with client.post(BASE + CHAT, json=body, headers={"X-Request-Id": request_id}) as resp:
        assert resp.status == 200
    line = await sim.record_for(request_id)
    assert list(line) == [
        "method", "path", "headers", "body", "outcome", "tokens_sent", "status",
        "received_at", "ended_at",
    ]  # fmt: skip
    assert (line["method"], line["path"], line["body"]) == ("POST", CHAT, body)
    assert time.time() - 60 < line["received_at"] <= line["ended_at"] <= time.time()
    assert (line["outcome"], line["tokens_sent"], line["status"]) == ("finished", 5, 200)
    request_id = rid()
    async with client.post(
        BASE + CHAT, json=chat(model="nope"), headers={"X-Request-Id": request_id}
    ):
        pass
    line = await sim.record_for(request_id)
    assert (line["outcome"], line["tokens_sent"], line["status"]) == ("error", 0, 404)


async def test_metrics_families_labels_and_counts(
    client: aiohttp.ClientSession, guarded: SimProcess
) -> None:
    """/metrics parses as Prometheus text with the vllm:* families labelled model_name and
    engine="0"; a request moves the token and success counters; a second one waits its slot."""
    async with client.get(BASE + "/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert families[name].samples[0].labels["model_name"] == MODEL
        assert families[name].samples[0].labels["engine"] == "0"
    before = {
        name: await metric(client, name)
        for name in (
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_count",
        )
    }
    stops = await metric(client, "vllm:request_success_total", finished_reason="stop")
    await stream(client, chat())
    assert (
        await metric(client, "vllm:prompt_tokens_total") == before["vllm:prompt_tokens_total"] + 8
    )
    assert await metric(client, "vllm:generation_tokens_total") == (
        before["vllm:generation_tokens_total"] + TOKENS
    )
    assert await metric(client, "vllm:time_to_first_token_seconds_count") == (
        before["vllm:time_to_first_token_seconds_count"] + 1
    )
    assert await metric(client, "vllm:request_success_total", finished_reason="stop") == stops + 1
    async with session_for(guarded, KEY) as keyed:
        slow = chat(sim={"tokens_per_second": 10, "completion_tokens": 8})
        first = asyncio.create_task(keyed.post(BASE + CHAT, json=slow))
        await asyncio.sleep(0.2)
        second = asyncio.create_task(keyed.post(BASE + CHAT, json=slow))
        await asyncio.sleep(0.2)
        assert await metric(keyed, "vllm:num_requests_running") == 1
        assert await metric(keyed, "vllm:num_requests_waiting") == 1
        assert 0 < await metric(keyed, "vllm:kv_cache_usage_perc") < 0.001
        for task in (first, second):
            (await task).release()
        assert await metric(keyed, "vllm:num_requests_waiting") == 0


# Process lifecycle


async def _refused_everywhere(proc: SimProcess) -> None:
    async with session_for(proc) as session:
        async with session.get(BASE + "/health") as resp:
            assert (resp.status, await resp.read()) == (503, b"")
        async with session.post(BASE + CHAT, json=chat()) as resp:
            assert resp.status == 503 and "scaling" in (await resp.json())["error"]


def test_load_time_refuses_then_sigterm_removes_the_socket() -> None:
    """The socket refuses connections during --load-s, serves after it, and SIGTERM exits 0
    and removes the socket file; a path already taken makes start-up fail; a process-wide
    --refuse 503 makes /health an empty 503 (a dead engine) and model routes 503."""
    directory = Path(tempfile.mkdtemp(prefix="simlc-", dir="/tmp"))
    try:
        proc = launch(directory, "--load-s", "1.0", wait=False)
        deadline = time.monotonic() + 10
        while not os.path.exists(proc.socket):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert not _connectable(proc.socket)
        deadline = time.monotonic() + 10
        while not _connectable(proc.socket):
            assert time.monotonic() < deadline and proc.proc.poll() is None
            time.sleep(0.05)
        assert proc.stop() == 0 and not os.path.exists(proc.socket)
        Path(proc.socket).write_text("taken")
        second = launch(directory, wait=False)
        assert second.proc.wait(10) == 1
        os.unlink(proc.socket)
        refusing = launch(directory, "--refuse", "503")
        try:
            asyncio.run(_refused_everywhere(refusing))
        finally:
            assert refusing.stop() == 0
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_sim_object_numbers_are_bounded() -> None:
    """A request's ``sim`` object comes from any client of a gateway in front: a count, rate or
    time past `MAX_SIM_NUMBER` (or NaN) is refused with a short message instead of exhausting
    the simulator's memory, and an integer no float holds does not crash the conversion."""
    from engine.sim.options import MAX_SIM_NUMBER, Behaviour

    base = Behaviour()
    for raw in (
        {"completion_tokens": 10**400},
        {"completion_tokens": MAX_SIM_NUMBER + 1},
        {"tokens_per_second": 10**400},
        {"prefill_ms": float("nan")},
        {"drop_after": 2**64},
    ):
        with pytest.raises(ValueError) as caught:
            base.with_request(raw)
        assert len(str(caught.value)) < 120, caught.value
    assert (
        base.with_request({"completion_tokens": MAX_SIM_NUMBER}).completion_tokens == MAX_SIM_NUMBER
    )
