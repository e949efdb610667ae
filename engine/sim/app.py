"""The simulator's aiohttp application: 1Cat-vLLM's routes for a generate model, one handler each.

Routes follow vllm-protocol.md section 3 (inventory), bodies sections 5-8. Run the application
under a runner created with `handler_cancellation=True`, so that a client leaving cancels its
handler at once (section 6).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from typing import Any

from aiohttp import web

from engine.sim.errors import ApiError
from engine.sim.generate import complete_answer, entry_faults, stream_answer
from engine.sim.keys import KEY_DIGESTS, METRICS, OPTIONS, RECORDER, SCHEDULER, TRACE
from engine.sim.metrics import CONTENT_TYPE, SimMetrics
from engine.sim.middleware import (
    auth_middleware,
    error_middleware,
    json_response,
    record_middleware,
    request_id_header,
    uvicorn_headers,
)
from engine.sim.options import Behaviour, SimOptions
from engine.sim.protocol import check_model, parse_chat, parse_completion, parse_json
from engine.sim.record import Recorder
from engine.sim.scheduler import Scheduler
from engine.sim.tokens import (
    CONTENT_VOCAB,
    chat_answer,
    chat_prompt_tokens,
    completion_answer,
    text_tokens,
)
from engine.sim.wire import ChunkEncoder, chat_body, chat_message, completion_body

VERSION = "1.3.0"
# uvicorn sets no body limit; chat bodies of a 254,976-token prompt exceed aiohttp's 1 MiB default.
CLIENT_MAX_SIZE = 1 << 30
# Qwen3 vocabulary size: token ids of /tokenize stay in the model's range.
VOCAB_SIZE = 151643


def fingerprint(options: SimOptions) -> str:
    """`system_fingerprint`: ``vllm-<version>-<8 hex of the config hash>`` (section 5.1)."""
    config = f"{options.model}|{options.max_model_len}".encode()
    return f"vllm-{VERSION}-{hashlib.sha256(config).hexdigest()[:8]}"


async def _request_json(request: web.Request) -> Any:
    """The body parsed as vLLM's JSON routes do (ApiError 400 otherwise); kept in the Trace."""
    trace = TRACE.get()
    if not trace.parsed:
        raw = await request.read()
        trace.body = parse_json(raw, request.headers.get("Content-Type", ""))
        trace.parsed = True
    return trace.body


def _behaviour(request: web.Request, body: Any) -> Behaviour:
    """The process-wide behaviour with the body's `"sim"` object over it; without it under
    ``--request-control off``. Raises ApiError 400 (param `sim`) on a bad `sim` object."""
    options = request.app[OPTIONS]
    defaults = options.behaviour
    if not options.request_control or not isinstance(body, dict):
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


async def _begin(
    request: web.Request,
) -> tuple[dict[str, Any], Behaviour, web.StreamResponse | None]:
    """Read a generation request: its body, its behaviour, and the answer of an entry fault
    (refuse, hang, late headers) when one applies, in which case nothing else is done."""
    body = await _request_json(request)
    behaviour = _behaviour(request, body)
    return body, behaviour, await entry_faults(request, behaviour)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions`: checks in vLLM's order, then the answer, streamed or not."""
    arrival = time.monotonic()
    options = request.app[OPTIONS]
    body, behaviour, early = await _begin(request)
    if early is not None:
        return early
    spec = parse_chat(body, options)
    messages = body.get("messages") or [{}]
    if (
        behaviour.tool_call
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") == "tool"
    ):
        behaviour = dataclasses.replace(behaviour, tool_call=None)  # the round trip is done
    request_id = "chatcmpl-" + _request_id(request, body)
    created = int(time.time())
    answers = [
        chat_answer(
            behaviour,
            choice=i,
            thinking=spec.thinking,
            max_tokens=spec.max_tokens,
            tools=spec.tools,
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
            tool_parser=options.tool_call_parser is not None,
            include_reasoning=spec.include_reasoning,
        )
        return await stream_answer(
            request,
            behaviour,
            answers,
            encoder,
            chat=True,
            include_usage=spec.include_usage,
            prompt_tokens=[spec.prompt_tokens] * spec.n,
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

    return await complete_answer(
        request,
        behaviour,
        answers,
        render,
        prompt_tokens=[spec.prompt_tokens] * spec.n,
        arrival=arrival,
    )


async def _completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`: n choices per prompt, indexed prompt by prompt (section 8.3)."""
    arrival = time.monotonic()
    options = request.app[OPTIONS]
    body, behaviour, early = await _begin(request)
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
    # one engine sequence per (prompt, choice), each counting its own prompt
    sequences = [count for count in spec.prompt_tokens for _ in range(spec.n)]
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
            tool_parser=False,
        )
        return await stream_answer(
            request,
            behaviour,
            answers,
            encoder,
            chat=False,
            include_usage=spec.include_usage,
            prompt_tokens=sequences,
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

    return await complete_answer(
        request, behaviour, answers, render, prompt_tokens=sequences, arrival=arrival
    )


async def _health(request: web.Request) -> web.StreamResponse:
    """`/health` and `/ping`: empty 200; process-wide refuse, hang and headers_delay_s apply,
    a refusal with 503 as vLLM's dead engine answers: an empty 503 (section 2). With
    ``--health-delay-busy-s`` the answer waits that long while a request is generating."""
    options = request.app[OPTIONS]
    behaviour = options.behaviour
    if options.health_delay_busy_s > 0 and request.app[SCHEDULER].running > 0:
        await asyncio.sleep(options.health_delay_busy_s)
    if behaviour.refuse == "503":
        return web.Response(status=503)
    early = await entry_faults(request, behaviour)
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
    return json_response({"object": "list", "data": cards})


async def _version(request: web.Request) -> web.Response:
    return json_response({"version": VERSION})


async def _load(request: web.Request) -> web.Response:
    # server load is only tracked with --enable-server-load-tracking (section 8.4)
    return json_response({"server_load": 0})


async def _metrics(request: web.Request) -> web.Response:
    """`GET /metrics` (section 1.3), after ``--metrics-delay-s``."""
    delay = request.app[OPTIONS].metrics_delay_s
    if delay > 0:
        await asyncio.sleep(delay)
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


async def _tokenize(request: web.Request) -> web.Response:
    """`POST /tokenize` (section 8.2) with the simulator's token rule; ids are placeholders."""
    options = request.app[OPTIONS]
    body = await _request_json(request)
    if not isinstance(body, dict):
        raise ApiError(400, "Bad Request", "body must be a JSON object")
    check_model(body, options)
    messages = body.get("messages")
    prompt = body.get("prompt")
    if isinstance(messages, list):
        count = chat_prompt_tokens(messages, body.get("tools"))
    elif isinstance(prompt, str):
        count = text_tokens(prompt)
    else:
        raise ApiError(400, "Bad Request", "either `prompt` or `messages` is required")
    tokens = [(i * 7919 + 11) % VOCAB_SIZE for i in range(count)]
    return json_response(
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
    return json_response({"prompt": "".join(CONTENT_VOCAB[t % len(CONTENT_VOCAB)] for t in tokens)})


def build_app(options: SimOptions) -> web.Application:
    """The simulator application for `options`, with a fresh metrics registry.

    Routes: GET /health, GET|POST /ping, GET /version, GET /load, GET /v1/models,
    POST /v1/chat/completions, POST /v1/completions, POST /tokenize, POST /detokenize, and any
    method on paths starting with /metrics. Serve it with
    `web.AppRunner(app, handler_cancellation=True)`.
    """
    app = web.Application(
        middlewares=[record_middleware, auth_middleware, error_middleware],
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
    if options.enable_request_id_headers:
        app.on_response_prepare.append(request_id_header)
    app.on_response_prepare.append(uvicorn_headers)
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
