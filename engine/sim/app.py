"""The simulator's aiohttp application: 1Cat-vLLM's routes for a generate model, and its answers.

Routes and framework behaviour follow vllm-protocol.md section 3 (inventory, API key, FastAPI's
404/405 bodies), answers sections 5-8, disconnects section 6. Run it under a runner created with
`handler_cancellation=True` so that a client leaving cancels its handler at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from engine.sim.framing import EventWriter
from engine.sim.metrics import CONTENT_TYPE, SimMetrics
from engine.sim.options import Behaviour, SimOptions
from engine.sim.protocol import ApiError, parse_chat, parse_completion, parse_json
from engine.sim.record import Recorder, Trace
from engine.sim.scheduler import Scheduler, Slot
from engine.sim.tokens import (
    CONTENT_VOCAB,
    Answer,
    chat_answer,
    chat_prompt_tokens,
    completion_answer,
    text_tokens,
)
from engine.sim.wire import (
    DONE,
    IN_STREAM_ERROR,
    ChunkEncoder,
    chat_body,
    chat_message,
    completion_body,
    dumps,
)

VERSION = "1.3.0"
# vLLM's API key middleware guards only these path prefixes (section 3.2).
PROTECTED_PREFIXES = ("/v1", "/v2", "/inference")
# uvicorn sets no body limit; chat bodies of a 254,976-token prompt exceed aiohttp's 1 MiB default.
CLIENT_MAX_SIZE = 1 << 30
# The only 503 body vLLM sends on API routes (elastic EP scaling, section 3.3).
SCALING_BODY = {"error": "The model is currently scaling. Please try again later."}
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
# Qwen3 vocabulary size: token ids of /tokenize stay in the model's range.
VOCAB_SIZE = 151643

OPTIONS = web.AppKey("options", SimOptions)
METRICS = web.AppKey("metrics", SimMetrics)
SCHEDULER = web.AppKey("scheduler", Scheduler)
RECORDER = web.AppKey("recorder", Recorder)
KEY_DIGESTS = web.AppKey("key_digests", tuple)
TRACE = "sim_trace"
JSON_BODY = "sim_json"


def fingerprint(options: SimOptions) -> str:
    """`system_fingerprint`: ``vllm-<version>-<8 hex of the config hash>`` (section 5.1)."""
    config = f"{options.model}|{options.max_model_len}".encode()
    return f"vllm-{VERSION}-{hashlib.sha256(config).hexdigest()[:8]}"


def _json_response(
    value: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=dumps(value), status=status, content_type="application/json", headers=headers
    )


def _close_connection(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.close()


async def _request_json(request: web.Request) -> Any:
    """The body parsed as vLLM's JSON routes do (ApiError 400 otherwise); cached on the request."""
    if JSON_BODY not in request:
        raw = await request.read()
        request[JSON_BODY] = parse_json(raw, request.headers.get("Content-Type", ""))
    return request[JSON_BODY]


def _behaviour(request: web.Request, body: Any) -> Behaviour:
    defaults = request.app[OPTIONS].behaviour
    if not isinstance(body, dict):
        return defaults
    try:
        return defaults.with_request(body.get("sim"))
    except ValueError as exc:
        raise ApiError(400, "BadRequestError", str(exc), "sim") from None


def _request_id(request: web.Request, body: dict[str, Any]) -> str:
    """The header X-Request-Id, else the body's `request_id`, else 32 hex (section 2)."""
    header = request.headers.get("X-Request-Id")
    if header:
        return header
    from_body = body.get("request_id")
    return from_body if isinstance(from_body, str) and from_body else uuid.uuid4().hex


async def _entry_faults(request: web.Request, behaviour: Behaviour) -> web.StreamResponse | None:
    """Apply the faults that act before any answer: refuse, hang, slow headers."""
    trace: Trace = request[TRACE]
    if behaviour.refuse == "close":
        trace.outcome, trace.status = "error", 0
        _close_connection(request)
        return web.Response()
    if behaviour.refuse == "503":
        return _json_response(SCALING_BODY, 503)
    if behaviour.hang:
        await asyncio.Event().wait()
    if behaviour.headers_delay_s:
        await asyncio.sleep(behaviour.headers_delay_s)
    return None


class _Pacer:
    """Spaces tokens `1 / tokens_per_second` apart on a fixed schedule (no drift); at rate 0
    yields to the event loop every 16 tokens so concurrent streams share it."""

    def __init__(self, tokens_per_second: float) -> None:
        self._interval = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
        self._next: float | None = None
        self._count = 0

    async def wait(self) -> None:
        self._count += 1
        if not self._interval:
            if self._count % 16 == 0:
                await asyncio.sleep(0)
            return
        now = time.monotonic()
        if self._next is None:
            self._next = now
        elif self._next > now:
            await asyncio.sleep(self._next - now)
        self._next += self._interval


def _fault_at(behaviour: Behaviour) -> tuple[int, str | None]:
    """(tokens before the cut, "drop" | "error" | None); a drop wins a tie."""
    drop, error = behaviour.drop_after, behaviour.error_after
    if drop is not None and (error is None or drop <= error):
        return drop, "drop"
    if error is not None:
        return error, "error"
    return 1 << 62, None


async def _generate(
    answers: Sequence[Answer],
    behaviour: Behaviour,
    slot: Slot,
    trace: Trace,
    emit: Callable[[int, int, Answer], Any] | None,
) -> str | None:
    """Produce the answers' tokens at the behaviour's pace, choices interleaved step by step.

    `emit(index, step, answer)` is awaited per token when streaming. Returns the fault that
    cut the answer ("drop", "error") or None when every token was produced.
    """
    limit, fault = _fault_at(behaviour)
    pacer = _Pacer(behaviour.tokens_per_second)
    produced = 0
    for step in range(max(len(a.tokens) for a in answers)):
        if produced >= limit:
            return fault
        await pacer.wait()
        for index, answer in enumerate(answers):
            if step >= len(answer.tokens):
                continue
            slot.token()
            if emit is not None:
                await emit(index, step, answer)
            produced += 1
            trace.tokens_sent = produced
            if produced >= limit:
                return fault
    return fault


def _engine_reason(answers: Sequence[Answer]) -> str:
    """The engine's finish reason for metrics: tool calls end on a plain stop token."""
    reason = answers[0].finish_reason
    return "stop" if reason == "tool_calls" else reason


async def _stream(
    request: web.Request,
    behaviour: Behaviour,
    answers: Sequence[Answer],
    encoder: ChunkEncoder,
    *,
    chat: bool,
    include_usage: bool,
    prompt_tokens: int,
    arrival: float,
) -> web.StreamResponse:
    """Answer as an SSE stream: headers at once, role chunks after prefill, one chunk per
    token, final chunks, optional usage chunk, ``[DONE]`` (sections 5.3-5.6)."""
    trace: Trace = request[TRACE]
    response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
    await response.prepare(request)
    writer = EventWriter(response, behaviour)

    async def emit(index: int, step: int, answer: Answer) -> None:
        token = answer.tokens[step]
        if chat:
            payload = encoder.token(index, token, answer, step + 1)
        else:
            payload = encoder.text(index, token, answer, step + 1)
        if payload is not None:
            await writer.send(payload)

    try:
        await asyncio.sleep(behaviour.silence_s)
        async with request.app[SCHEDULER].admit(prompt_tokens, arrival) as slot:
            await asyncio.sleep(behaviour.prefill_ms / 1000)
            if chat:
                for index in range(len(answers)):
                    await writer.send(encoder.role(index))
            fault = await _generate(answers, behaviour, slot, trace, emit)
            if fault == "drop":
                await writer.flush()
                slot.finish("error")
                trace.outcome = "error"
                _close_connection(request)
                return response
            if fault == "error":
                await writer.send(IN_STREAM_ERROR)
                slot.finish("error")
                trace.outcome = "error"
            else:
                if include_usage:
                    await writer.send(encoder.usage(trace.tokens_sent))
                slot.finish(_engine_reason(answers))
                trace.outcome = "finished"
            if not behaviour.no_done:
                await writer.send(DONE)
            await writer.flush()
    except ConnectionError:
        trace.outcome = "aborted"
    return response


async def _complete(
    request: web.Request,
    behaviour: Behaviour,
    answers: Sequence[Answer],
    render: Callable[[], bytes],
    *,
    prompt_tokens: int,
    arrival: float,
) -> web.StreamResponse:
    """Answer with one JSON body once every token is produced; a client leaving cancels it."""
    trace: Trace = request[TRACE]
    await asyncio.sleep(behaviour.silence_s)
    async with request.app[SCHEDULER].admit(prompt_tokens, arrival) as slot:
        await asyncio.sleep(behaviour.prefill_ms / 1000)
        fault = await _generate(answers, behaviour, slot, trace, None)
        if fault == "drop":
            slot.finish("error")
            trace.outcome, trace.status = "error", 0
            _close_connection(request)
            return web.Response()
        if fault == "error":
            slot.finish("error")
            raise ApiError(500, "InternalServerError", "Internal server error")
        slot.finish(_engine_reason(answers))
    return web.Response(body=render(), content_type="application/json")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    options = request.app[OPTIONS]
    body = await _request_json(request)
    behaviour = _behaviour(request, body)
    early = await _entry_faults(request, behaviour)
    if early is not None:
        return early
    spec = parse_chat(body, options)
    request_id = "chatcmpl-" + _request_id(request, body)
    created = int(time.time())
    answers = [
        chat_answer(
            behaviour,
            choice=i,
            thinking=spec.thinking,
            max_tokens=spec.max_tokens,
            stream=spec.stream,
        )
        for i in range(spec.n)
    ]
    if spec.stream:
        encoder = ChunkEncoder(
            chat=True,
            request_id=request_id,
            created=created,
            model=options.served_name,
            fingerprint=fingerprint(options),
            prompt_tokens=spec.prompt_tokens,
            include_usage=spec.include_usage,
            continuous_usage=spec.continuous_usage,
            reasoning_field=behaviour.reasoning_field,
            drop_think_end=options.tool_call_parser is not None,
        )
        return await _stream(
            request,
            behaviour,
            answers,
            encoder,
            chat=True,
            include_usage=spec.include_usage,
            prompt_tokens=spec.prompt_tokens,
            arrival=arrival,
        )

    def render() -> bytes:
        messages = [
            (
                chat_message(
                    answer,
                    thinking=spec.thinking,
                    include_reasoning=spec.include_reasoning,
                    field=behaviour.reasoning_field,
                ),
                answer,
            )
            for answer in answers
        ]
        return chat_body(
            request_id=request_id,
            created=created,
            model=options.served_name,
            fingerprint=fingerprint(options),
            messages=messages,
            prompt_tokens=spec.prompt_tokens,
        )

    return await _complete(
        request, behaviour, answers, render, prompt_tokens=spec.prompt_tokens, arrival=arrival
    )


async def _completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    options = request.app[OPTIONS]
    body = await _request_json(request)
    behaviour = _behaviour(request, body)
    early = await _entry_faults(request, behaviour)
    if early is not None:
        return early
    spec = parse_completion(body, options)
    request_id = "cmpl-" + _request_id(request, body)
    created = int(time.time())
    answers = [
        completion_answer(behaviour, choice=p * spec.n + i, max_tokens=budget)
        for p, budget in enumerate(spec.max_tokens)
        for i in range(spec.n)
    ]
    prompt_tokens = sum(spec.prompt_tokens)
    if spec.stream:
        encoder = ChunkEncoder(
            chat=False,
            request_id=request_id,
            created=created,
            model=options.served_name,
            fingerprint=fingerprint(options),
            prompt_tokens=prompt_tokens,
            include_usage=spec.include_usage,
            continuous_usage=spec.continuous_usage,
            reasoning_field=behaviour.reasoning_field,
            drop_think_end=False,
        )
        return await _stream(
            request,
            behaviour,
            answers,
            encoder,
            chat=False,
            include_usage=spec.include_usage,
            prompt_tokens=prompt_tokens,
            arrival=arrival,
        )

    def render() -> bytes:
        return completion_body(
            request_id=request_id,
            created=created,
            model=options.served_name,
            fingerprint=fingerprint(options),
            answers=answers,
            prompt_tokens=prompt_tokens,
        )

    return await _complete(
        request, behaviour, answers, render, prompt_tokens=prompt_tokens, arrival=arrival
    )


async def _health(request: web.Request) -> web.StreamResponse:
    early = await _entry_faults(request, request.app[OPTIONS].behaviour)
    return web.Response() if early is None else early


async def _models(request: web.Request) -> web.Response:
    """`GET /v1/models`: one card per served name (section 8.1)."""
    options = request.app[OPTIONS]
    now = int(time.time())
    cards = [
        {
            "id": name,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": options.model,
            "parent": None,
            "max_model_len": options.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": now,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        for name in options.served_model_names
    ]
    return _json_response({"object": "list", "data": cards})


async def _version(request: web.Request) -> web.Response:
    return _json_response({"version": VERSION})


async def _load(request: web.Request) -> web.Response:
    # server load is only tracked with --enable-server-load-tracking (section 8.4)
    return _json_response({"server_load": 0})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


async def _tokenize(request: web.Request) -> web.Response:
    """`POST /tokenize` (section 8.2) with the simulator's token rule; ids are placeholders."""
    options = request.app[OPTIONS]
    body = await _request_json(request)
    if not isinstance(body, dict):
        raise ApiError(400, "Bad Request", "body must be a JSON object")
    model = body.get("model")
    if model and model not in options.served_model_names:
        raise ApiError(404, "NotFoundError", f"The model `{model}` does not exist.", "model")
    messages = body.get("messages")
    prompt = body.get("prompt")
    if isinstance(messages, list):
        count = chat_prompt_tokens(messages)
    elif isinstance(prompt, str):
        count = text_tokens(prompt)
    else:
        raise ApiError(400, "Bad Request", "either `prompt` or `messages` is required")
    tokens = [(i * 7919 + 11) % VOCAB_SIZE for i in range(count)]
    return _json_response(
        {
            "count": count,
            "max_model_len": options.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }
    )


async def _detokenize(request: web.Request) -> web.Response:
    """`POST /detokenize`: each id stands for the content word `id mod len(CONTENT_VOCAB)`."""
    body = await _request_json(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ApiError(400, "Bad Request", "`tokens` must be a list of integers")
    return _json_response(
        {"prompt": "".join(CONTENT_VOCAB[t % len(CONTENT_VOCAB)] for t in tokens)}
    )


def _authorized(header: str | None, digests: Sequence[bytes]) -> bool:
    """vLLM's check: ``Bearer <key>`` (scheme case-insensitive), SHA-256 digests compared in
    constant time against every configured key."""
    if not header:
        return False
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    match = False
    for expected in digests:
        match |= hmac.compare_digest(digest, expected)
    return match


def _body_for_record(request: web.Request, raw: bytes) -> Any:
    parsed = request.get(JSON_BODY)
    if parsed is not None:
        return parsed
    try:
        return json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        return None


@web.middleware
async def _record_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """Outermost: keep the request's `Trace` and write its `--record` line when it ends."""
    trace = Trace()
    request[TRACE] = trace
    recorder = request.app.get(RECORDER)
    raw = await request.read() if recorder is not None and request.can_read_body else b""
    try:
        response: web.StreamResponse = await handler(request)
    except BaseException:
        trace.outcome = trace.outcome or "aborted"
        raise
    else:
        if trace.status is None:
            trace.status = response.status
        if trace.outcome is None:
            trace.outcome = "finished" if response.status < 400 else "error"
        return response
    finally:
        if recorder is not None:
            recorder.write(
                method=request.method,
                path=request.raw_path,
                headers=dict(request.headers),
                body=_body_for_record(request, raw),
                trace=trace,
            )


@web.middleware
async def _auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """vLLM's `--api-key` check: 401 ``{"error":"Unauthorized"}`` on guarded paths only."""
    digests = request.app[KEY_DIGESTS]
    if (
        digests
        and request.method != "OPTIONS"
        and request.path.startswith(PROTECTED_PREFIXES)
        and not _authorized(request.headers.get("Authorization"), digests)
    ):
        return _json_response({"error": "Unauthorized"}, 401)
    response: web.StreamResponse = await handler(request)
    return response


@web.middleware
async def _error_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """ApiError as vLLM's error object; unknown path and method as FastAPI's `detail` bodies."""
    try:
        response: web.StreamResponse = await handler(request)
    except ApiError as exc:
        return _json_response(exc.body(), exc.status)
    except web.HTTPMethodNotAllowed as exc:
        allow = ", ".join(sorted(exc.allowed_methods))
        return _json_response({"detail": "Method Not Allowed"}, 405, {"Allow": allow})
    except web.HTTPNotFound:
        return _json_response({"detail": "Not Found"}, 404)
    return response


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    # vLLM runs under uvicorn, which names itself in every response
    response.headers["Server"] = "uvicorn"


async def _add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    # --enable-request-id-headers: the client's X-Request-Id, else a new one
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex


def build_app(options: SimOptions) -> web.Application:
    """The simulator application for `options`, with a fresh metrics registry.

    Routes: GET /health, GET|POST /ping, GET /version, GET /load, GET /v1/models,
    POST /v1/chat/completions, POST /v1/completions, POST /tokenize, POST /detokenize, and any
    method on paths starting with /metrics. Serve it with
    `web.AppRunner(app, handler_cancellation=True)`.
    """
    app = web.Application(
        middlewares=[_record_middleware, _auth_middleware, _error_middleware],
        client_max_size=CLIENT_MAX_SIZE,
    )
    metrics = SimMetrics(options.served_name)
    app[OPTIONS] = options
    app[METRICS] = metrics
    app[SCHEDULER] = Scheduler(metrics, options.max_num_seqs, options.kv_cache_tokens)
    app[KEY_DIGESTS] = tuple(hashlib.sha256(k.encode("utf-8")).digest() for k in options.api_keys)
    if options.record is not None:
        recorder = Recorder(options.record)
        app[RECORDER] = recorder

        async def close_recorder(app: web.Application) -> None:
            recorder.close()

        app.on_cleanup.append(close_recorder)
    app.on_response_prepare.append(_server_header)
    if options.enable_request_id_headers:
        app.on_response_prepare.append(_add_request_id_header)
    router = app.router
    router.add_get("/health", _health, allow_head=False)
    router.add_get("/ping", _health, allow_head=False)
    router.add_post("/ping", _health)
    router.add_get("/version", _version, allow_head=False)
    router.add_get("/load", _load, allow_head=False)
    router.add_get("/v1/models", _models, allow_head=False)
    router.add_post("/v1/chat/completions", _chat_completions)
    router.add_post("/v1/completions", _completions)
    router.add_post("/tokenize", _tokenize)
    router.add_post("/detokenize", _detokenize)
    router.add_route("*", "/metrics{tail:.*}", _metrics)
    return app
