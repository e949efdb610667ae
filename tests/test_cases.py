"""Regression tests for the failure cases of other gateways (cases C01-C10, C14-C16)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import time
from typing import Any
from urllib.parse import urlparse

import aiohttp
import httpx
import openai
import pytest

from tests.conftest import ALIAS, KEY_A, KEY_B, Gateway, Sim, wait_until

AUTH = {"Authorization": f"Bearer {KEY_A}"}


def body(sim: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": ALIAS, "messages": [{"role": "user", "content": "hello"}]}
    if sim:
        out["sim"] = sim
    out.update(extra)
    return out


def sdk_args(payload: dict[str, Any]) -> dict[str, Any]:
    """Split a body into openai SDK arguments: the simulator's ``sim`` object goes in extra_body."""
    args = {k: v for k, v in payload.items() if k not in ("sim", "chat_template_kwargs", "stream")}
    extra = {k: payload[k] for k in ("sim", "chat_template_kwargs") if k in payload}
    return {**args, "extra_body": extra}


def sse(
    gw: Gateway, payload: dict[str, Any], key: str = KEY_A, **kw: Any
) -> tuple[httpx.Response, list[tuple[float, bytes]], bytes]:
    """POST a streaming request; return the response, timestamped data payloads and raw bytes."""
    payload = {**payload, "stream": True}
    events: list[tuple[float, bytes]] = []
    raw = b""
    with httpx.stream(
        "POST",
        gw.url("/v1/chat/completions"),
        json=payload,
        headers={"Authorization": f"Bearer {key}", **kw.pop("headers", {})},
        timeout=60,
    ) as r:
        buf = b""
        for data in r.iter_raw():
            now = time.monotonic()
            raw += data
            buf += data
            while b"\n\n" in buf:
                block, buf = buf.split(b"\n\n", 1)
                for line in block.split(b"\n"):
                    if line.startswith(b"data: "):
                        events.append((now, line[6:]))
    return r, events, raw


def direct(sim: Sim, payload: dict[str, Any]) -> list[bytes]:
    """The same streaming request sent straight to the simulator: its data payloads."""

    async def go() -> list[bytes]:
        connector = aiohttp.UnixConnector(path=sim.socket)
        async with (
            aiohttp.ClientSession(connector=connector) as s,
            s.post("http://engine/v1/chat/completions", json=payload) as r,
        ):
            text = (await r.read()).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        return [
            line[6:]
            for block in text.split(b"\n\n")
            for line in block.split(b"\n")
            if line.startswith(b"data: ")
        ]

    return asyncio.run(go())


def deltas(events: list[tuple[float, bytes]] | list[bytes]) -> list[dict[str, Any]]:
    out = []
    for item in events:
        payload = item[1] if isinstance(item, tuple) else item
        if payload == b"[DONE]":
            continue
        obj = json.loads(payload)
        for choice in obj.get("choices") or ():
            out.append(choice.get("delta") or {})
    return out


def joined(events: list[Any], name: str) -> str:
    return "".join(d.get(name) or "" for d in deltas(events))


# ------------------------------------------------------------------------- streaming fidelity


def test_c01_buffered_stream_events_arrive_in_real_time(stack: Gateway) -> None:
    """C01: SSE headers, no compression or length, and each event forwarded as it is written."""
    sim = {"prefill_ms": 500, "tokens_per_second": 4, "token_bytes": 250, "completion_tokens": 12}
    r, events, _ = sse(
        stack,
        body(sim, chat_template_kwargs={"enable_thinking": False}),
        headers={"Accept-Encoding": "gzip"},
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    assert r.headers["x-accel-buffering"] == "no"
    assert "content-length" not in r.headers and "content-encoding" not in r.headers
    content_times = [t for t, p in events if b'"content":"' in p and b'"content":""' not in p]
    gaps = [b - a for a, b in itertools.pairwise(content_times)]
    assert len(gaps) >= 8
    # 250 ms apart at the engine; a buffering proxy would deliver bursts (gaps near 0).
    assert all(gap > 0.15 for gap in gaps), gaps


def test_c02_comment_lines_never_wrapped_in_data(stack: Gateway) -> None:
    """C02: keepalive comments: every data line is JSON or [DONE]; the SDK finishes."""
    _, events, _ = sse(stack, body({"keepalive": True}))
    for _, payload in events:
        assert payload == b"[DONE]" or isinstance(json.loads(payload), dict)
    client = openai.OpenAI(base_url=stack.url("/v1"), api_key=KEY_A)
    chunks = list(
        client.chat.completions.create(**sdk_args(body({"keepalive": True})), stream=True)
    )
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "fault",
    [{"split_writes": 3}, {"coalesce": 3}, {"byte_writes": True, "completion_tokens": 16}],
)
def test_c03_events_split_across_reads(stack: Gateway, fault: dict[str, Any]) -> None:
    """C03: split and coalesced writes give identical events, exact usage, one [DONE]."""
    usage = {"include_usage": True}
    _, clean, _ = sse(stack, body({"completion_tokens": 16}, stream_options=usage))
    _, split, raw = sse(stack, body({"completion_tokens": 16, **fault}, stream_options=usage))
    strip = [json.loads(p) if p != b"[DONE]" else p for _, p in split]
    base = [json.loads(p) if p != b"[DONE]" else p for _, p in clean]
    assert len(strip) == len(base)
    for a, b in zip(strip, base, strict=True):
        if isinstance(a, dict):
            a.pop("id"), a.pop("created"), b.pop("id"), b.pop("created")  # type: ignore[union-attr]
    assert strip == base
    assert raw.count(b"[DONE]") == 1


def test_c03_tenant_charged_exact_usage(stack: Gateway) -> None:
    """C03: a split stream charges the tenant exactly the engine's usage numbers."""
    before_p = stack.metric("gateway_tokens_total", tenant="beta", type="prompt")
    before_c = stack.metric("gateway_tokens_total", tenant="beta", type="completion")
    _, events, _ = sse(
        stack,
        body({"split_writes": 4}, stream_options={"include_usage": True}),
        key=KEY_B,
    )
    usage = next(json.loads(p)["usage"] for _, p in events if b'"usage"' in p)
    assert (
        stack.metric("gateway_tokens_total", tenant="beta", type="prompt") - before_p
        == usage["prompt_tokens"]
    )
    assert (
        stack.metric("gateway_tokens_total", tenant="beta", type="completion") - before_c
        == usage["completion_tokens"]
    )


@pytest.mark.parametrize(
    "fault", [{"framing": "crlf"}, {"framing": "cr"}, {"framing": "crlf", "split_crlf": True}]
)
def test_c04_crlf_framing(stack: Gateway, fault: dict[str, Any]) -> None:
    """C04: CRLF, bare CR, and split CR/LF framing deliver the same content, usage counted."""
    _, lf, _ = sse(stack, body(stream_options={"include_usage": True}))
    _, other, raw = sse(stack, body(fault, stream_options={"include_usage": True}))
    assert joined(other, "content") == joined(lf, "content")
    assert joined(other, "reasoning_content") == joined(lf, "reasoning_content")
    assert any(b'"usage"' in p for _, p in other)
    assert b"\r" not in raw


TEXT = "你好，世界！🌍 Emoji 👩‍💻 ok 日本語テキスト 🎉"


@pytest.mark.parametrize("fault", [{"split_utf8": True}, {"byte_writes": True}])
def test_c05_utf8_split_inside_characters(stack: Gateway, fault: dict[str, Any]) -> None:
    """C05: content and reasoning with CJK and emoji, writes cut inside characters: exact text."""
    sim = {"text": TEXT, "reasoning_text": "思考中 🤔 " + TEXT, **fault}
    _, events, raw = sse(stack, body(sim))
    assert joined(events, "content").strip() == TEXT
    assert joined(events, "reasoning_content").strip() == ("思考中 🤔 " + TEXT)
    assert "\ufffd".encode() not in raw


def test_c05_tool_arguments_utf8(stack: Gateway) -> None:
    """C05: tool-call arguments cut inside UTF-8 characters arrive as exact JSON."""
    sim = {"tool_calls": True, "split_utf8": True}
    _, events, raw = sse(stack, body(sim))
    args: dict[int, str] = {}
    for d in deltas(events):
        for call in d.get("tool_calls") or ():
            args[call["index"]] = args.get(call["index"], "") + (
                call.get("function", {}).get("arguments") or ""
            )
    assert len(args) == 2
    for text in args.values():
        json.loads(text)
    assert "\ufffd".encode() not in raw


def test_c06a_finish_without_done_gets_exactly_one_done(stack: Gateway) -> None:
    """C06a: the engine finishes without [DONE]: the client gets exactly one [DONE]."""
    _, events, raw = sse(stack, body({"no_done": True}))
    assert raw.count(b"data: [DONE]") == 1 and events[-1][1] == b"[DONE]"


def test_c06b_drop_mid_stream_is_an_error_event(stack: Gateway) -> None:
    """C06b: engine drops after 10 chunks: error event, no [DONE], SDK raises, tokens charged."""
    errors_before = stack.metric("gateway_upstream_errors_total", kind="disconnect")
    tokens_before = stack.metric("gateway_tokens_total", tenant="acme", type="completion")
    _, events, raw = sse(stack, body({"drop_after": 10}))
    assert b"[DONE]" not in raw
    last = json.loads(events[-1][1])
    assert set(last["error"]) == {"message", "type", "param", "code"}
    client = openai.OpenAI(base_url=stack.url("/v1"), api_key=KEY_A, max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(**sdk_args(body({"drop_after": 10})), stream=True):
            pass
    assert stack.metric("gateway_upstream_errors_total", kind="disconnect") - errors_before == 2

    def charged() -> float:
        return (
            stack.metric("gateway_tokens_total", tenant="acme", type="completion") - tokens_before
        )

    # a cut request is settled once the engine's abort landed, just after the client's last byte
    assert wait_until(lambda: charged() >= 2 * 9, 5), charged()


def test_c06c_usage_only_chunk_passed_through(stack: Gateway) -> None:
    """C06c: finish on the last content chunk, a usage-only chunk, then [DONE]: all passed, one [DONE]."""
    _, events, raw = sse(stack, body(stream_options={"include_usage": True}))
    usage_chunk = json.loads(events[-2][1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] > 0
    assert raw.count(b"[DONE]") == 1


def test_c07_tool_call_deltas_forwarded_unchanged(stack: Gateway) -> None:
    """C07: two parallel tool calls: deltas identical to the engine's; SDK arguments exact JSON."""
    assert stack.sim is not None
    payload = body(
        {"tool_calls": True}, stream=True, chat_template_kwargs={"enable_thinking": False}
    )
    engine_deltas = _tool_deltas(direct(stack.sim, payload))
    _, events, _ = sse(stack, payload)
    assert _tool_deltas(events) == engine_deltas
    client = openai.OpenAI(base_url=stack.url("/v1"), api_key=KEY_A)
    calls: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(**sdk_args(payload), stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                calls[call.index] = calls.get(call.index, "") + (
                    (call.function and call.function.arguments) or ""
                )
    assert sorted(calls) == [0, 1] and finish == "tool_calls"
    assert all(isinstance(json.loads(v), dict) for v in calls.values())


def _tool_deltas(events: list[Any]) -> list[Any]:
    """Tool-call deltas with the per-request random call ids blanked."""
    out = []
    for d in deltas(events):
        for call in d.get("tool_calls") or ():
            if "id" in call:
                call["id"] = "call_x"
            out.append(call)
    return out


# ---------------------------------------------------------------------------- thinking, fields


@pytest.mark.parametrize("variant", ["reasoning", "reasoning_content", "both"])
def test_c08_reasoning_field_variants(stack: Gateway, variant: str) -> None:
    """C08: whatever name the engine uses, clients see the reasoning once as reasoning_content."""
    assert stack.sim is not None
    _, events, raw = sse(stack, body({"reasoning_field": variant}))
    engine = direct(
        stack.sim,
        {
            **body({"reasoning_field": "reasoning"}),
            "stream": True,
            "chat_template_kwargs": {"enable_thinking": True},
        },
    )
    assert b'"reasoning":' not in raw
    assert joined(events, "reasoning_content") == joined(engine, "reasoning")
    reasoning_chunks = [d for d in deltas(events) if d.get("reasoning_content")]
    assert len(reasoning_chunks) == len([d for d in deltas(engine) if d.get("reasoning")])
    assert "<think>" not in joined(events, "content")


def test_c08_non_stream_and_follow_up_turn(stack: Gateway) -> None:
    """C08: non-stream reasoning is reasoning_content; sending it back in history works."""
    r = httpx.post(stack.url("/v1/chat/completions"), headers=AUTH, json=body(), timeout=30)
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] and "reasoning" not in message
    follow = body()
    follow["messages"] = [
        *follow["messages"],
        {
            "role": "assistant",
            "content": message["content"],
            "reasoning_content": message["reasoning_content"],
        },
        {"role": "user", "content": "and then?"},
    ]
    assert (
        httpx.post(
            stack.url("/v1/chat/completions"), headers=AUTH, json=follow, timeout=30
        ).status_code
        == 200
    )


@pytest.mark.parametrize("setting", [False, True, None])
def test_c09_thinking_switch_reaches_engine(stack: Gateway, setting: bool | None) -> None:
    """C09: enable_thinking (via the SDK's extra_body) and vLLM extras reach the engine intact."""
    assert stack.sim is not None
    extra: dict[str, Any] = {"top_k": 7, "min_p": 0.05, "repetition_penalty": 1.05}
    if setting is not None:
        extra["chat_template_kwargs"] = {"enable_thinking": setting}
    client = openai.OpenAI(base_url=stack.url("/v1"), api_key=KEY_A)
    r = client.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": f"c09 {setting}"}],
        extra_body=extra,
    )
    rec = [
        x
        for x in stack.sim.model_records()
        if x["body"] and x["body"]["messages"][0]["content"] == f"c09 {setting}"
    ][-1]
    sent = rec["body"]
    expected = True if setting is None else setting
    assert sent["chat_template_kwargs"] == {"enable_thinking": expected}
    assert (sent["top_k"], sent["min_p"], sent["repetition_penalty"]) == (7, 0.05, 1.05)
    assert sent["model"] == ALIAS
    has_reasoning = bool((r.choices[0].message.model_extra or {}).get("reasoning_content"))
    assert has_reasoning is expected


# ------------------------------------------------------------------- resources and accounting


def _outcome(sim: Sim, marker: str) -> dict[str, Any] | None:
    for rec in sim.model_records():
        if (
            rec["body"]
            and rec["body"]["messages"][0]["content"] == marker
            and rec.get("outcome") != "started"
        ):
            return rec
    return None


def test_c10a_stream_disconnect_aborts_engine(stack: Gateway) -> None:
    """C10a: a client leaving a stream after 5 chunks aborts the engine within ~1 s; logged 499."""
    assert stack.sim is not None
    marker = "c10a"
    payload = body(
        {"tokens_per_second": 20, "completion_tokens": 8000}, max_tokens=8000, stream=True
    )
    payload["messages"][0]["content"] = marker
    before = stack.metric("gateway_client_disconnects_total", tenant="acme")
    with httpx.stream(
        "POST", stack.url("/v1/chat/completions"), json=payload, headers=AUTH, timeout=30
    ) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 5:
                    break
    left = time.monotonic()
    assert wait_until(lambda: _outcome(stack.sim, marker) is not None, 5)  # type: ignore[arg-type]
    rec = _outcome(stack.sim, marker)
    assert rec is not None and rec["outcome"] == "aborted" and rec["tokens_sent"] < 100
    assert time.monotonic() - left < 3
    assert wait_until(lambda: stack.metric("gateway_requests_in_flight", tenant="acme") == 0, 3)
    assert stack.metric("gateway_client_disconnects_total", tenant="acme") - before == 1
    assert wait_until(lambda: any(e.get("status") == 499 for e in stack.access_logs()), 3)


def test_c10b_non_stream_disconnect_aborts_engine(stack: Gateway) -> None:
    """C10b: a non-streaming client closing after 2 s aborts the engine; tokens charged."""
    assert stack.sim is not None
    marker = "c10b"
    payload = body({"tokens_per_second": 20, "completion_tokens": 8000}, max_tokens=8000)
    payload["messages"][0]["content"] = marker
    before = stack.metric("gateway_tokens_total", tenant="acme", type="completion")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.url("/v1/chat/completions"), json=payload, headers=AUTH, timeout=2)
    assert wait_until(lambda: _outcome(stack.sim, marker) is not None, 5)  # type: ignore[arg-type]
    rec = _outcome(stack.sim, marker)
    assert rec is not None and rec["outcome"] == "aborted"
    assert wait_until(lambda: stack.metric("gateway_requests_in_flight", tenant="acme") == 0, 3)
    assert stack.metric("gateway_tokens_total", tenant="acme", type="prompt") > 0
    assert stack.metric("gateway_tokens_total", tenant="acme", type="completion") >= before


# --------------------------------------------------------------------------------- front door

ENGINE_ROUTES = [
    "/invocations", "/tokenize", "/detokenize", "/pause", "/sleep", "/wake_up",
    "/reset_prefix_cache", "/collective_rpc", "/scale_elastic_ep", "/generative_scoring",
    "/server_info", "/start_profile", "/v1/load_lora_adapter", "/v1/messages/batches", "/v1/responses/resp_1/items",
    "/inference/v1/generate", "/docs", "/openapi.json", "/version", "/metrics",
    "/v1//chat/completions", "/v1/chat/completions/render", "/V1/chat/completions", "/ping",
]  # fmt: skip


def test_c14_engine_routes_never_forwarded(stack: Gateway) -> None:
    """C14: engine-only routes: 401 without a key, 404 with one, and the engine sees none."""
    assert stack.sim is not None
    before = len(stack.sim.model_records())
    for path in ENGINE_ROUTES:
        for method in ("GET", "POST"):
            r = httpx.request(method, stack.url(path), json={})
            assert r.status_code == 401, (method, path, r.status_code)
            r = httpx.request(method, stack.url(path), json={}, headers=AUTH)
            assert r.status_code == 404, (method, path, r.status_code)
            if path.startswith("/v1/messages/"):  # Anthropic's API, Anthropic's envelope
                assert r.json()["error"]["type"] == "not_found_error"
            else:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert len(stack.sim.model_records()) == before


def test_c14_dialect_routes_are_served_not_forwarded(stack: Gateway) -> None:
    """C14: /v1/messages and /v1/responses are the gateway's own routes (401 without a key, a
    400 in their API's shape for an empty body); the engine only ever sees its chat route."""
    assert stack.sim is not None
    before = len(stack.sim.model_records())
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses"):
        assert httpx.post(stack.url(path), json={}).status_code == 401
        r = httpx.post(stack.url(path), json={}, headers=AUTH)
        assert r.status_code == 400, (path, r.status_code)
        assert (r.json()["type"] == "error") if "messages" in path else ("error" in r.json())
        assert httpx.get(stack.url(path), headers=AUTH).status_code == 405
    assert len(stack.sim.model_records()) == before


def test_c15_long_silences_are_not_cut(stack: Gateway) -> None:
    """C15 (shortened): late headers, a long silence after headers, slow reasoning: none is cut."""
    r = httpx.post(
        stack.url("/v1/chat/completions"),
        headers=AUTH,
        json=body({"headers_delay_s": 3}),
        timeout=30,
    )
    assert r.status_code == 200
    _, _, raw = sse(stack, body({"silence_s": 3}))
    assert raw.endswith(b"data: [DONE]\n\n")
    _, _, raw = sse(stack, body({"tokens_per_second": 1, "completion_tokens": 4}))
    assert raw.endswith(b"data: [DONE]\n\n")


def test_c15_read_timeout_gives_504_and_aborts(sim_factory: Any, gateway_factory: Any) -> None:
    """C15: a stream silent past engine.read_timeout_s, or a request past its total limit, gets 504 (JSON or error event) and the engine is aborted."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"engine": {"read_timeout_s": 1.0, "request_timeout_s": 2.0}})
    r = httpx.post(
        gw.url("/v1/chat/completions"), headers=AUTH, json=body({"headers_delay_s": 3}), timeout=30
    )
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    _, events, raw = sse(gw, body({"silence_s": 3}))
    assert json.loads(events[-1][1])["error"]["code"] == "upstream_timeout"
    assert b"[DONE]" not in raw
    assert wait_until(
        lambda: sum(1 for x in sim.model_records() if x.get("outcome") == "aborted") >= 2, 5
    )


def _chat_body_of_size(size: int) -> bytes:
    """A valid chat body of about ``size`` bytes with CJK written as \\uXXXX escapes."""
    unit = "\\u4f60\\u597d"  # 12 bytes
    count = max(1, (size - 120) // len(unit))
    content = unit * count
    return f'{{"model":"{ALIAS}","max_tokens":1,"messages":[{{"role":"user","content":"{content}"}}]}}'.encode()


@pytest.mark.parametrize("mib", [0.9, 1.5, 6])
def test_c16_large_bodies_forwarded_intact(stack: Gateway, mib: float) -> None:
    """C16: bodies up to max_body_bytes are accepted and reach the engine intact."""
    assert stack.sim is not None
    raw = _chat_body_of_size(int(mib * 1024 * 1024))
    r = httpx.post(
        stack.url("/v1/chat/completions"),
        headers={**AUTH, "Content-Type": "application/json"},
        content=raw,
        timeout=60,
    )
    assert r.status_code in (200, 400), r.text  # the engine may find it longer than the context
    sent = json.loads(raw)["messages"][0]["content"]
    rec = stack.sim.model_records()[-1]
    assert rec["body"]["messages"][0]["content"] == sent


def test_c16_oversized_body_is_413_unread(stack: Gateway) -> None:
    """C16: 64 MiB with Content-Length is refused with 413 in OpenAI shape; the engine is not called."""
    assert stack.sim is not None
    before = len(stack.sim.model_records())
    raw = _chat_body_of_size(64 * 1024 * 1024)
    r = httpx.post(
        stack.url("/v1/chat/completions"),
        headers={**AUTH, "Content-Type": "application/json"},
        content=raw,
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert len(stack.sim.model_records()) == before


def test_c16_endless_chunked_upload_is_cut_at_the_limit(stack: Gateway) -> None:
    """C16: a chunked upload that never ends gets 413 once past the limit, read no further."""
    url = urlparse(stack.base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + KEY_A.encode()
        + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"a" * 65536
    frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    sent = 0
    pending = b""
    response = b""
    sock.setblocking(False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sent < 128 * 1024 * 1024:
        with contextlib.suppress(BlockingIOError):
            response += sock.recv(65536)
        if b"\r\n\r\n" in response:
            break
        if not pending:
            pending = frame
        try:
            n = sock.send(pending)
        except BlockingIOError:
            time.sleep(0.005)
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        pending = pending[n:]
        sent += n
    sock.close()
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert sent < 40 * 1024 * 1024
