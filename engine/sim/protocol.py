"""Checks of chat and completion request bodies, in vLLM's order and with vLLM's error bodies.

Sources: vllm-protocol.md sections 4 (fields), 7 (errors) and 9.2 (thinking switch), which read
1Cat-vLLM v1.3.0 (`entrypoints/openai/server_utils.py`, `renderers/params.py`,
`sampling_params.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.sim.errors import ApiError, validation_error, validation_error_text, vllm_error
from engine.sim.fields import check_sampling, read_field
from engine.sim.options import SimOptions
from engine.sim.tokens import chat_prompt_tokens, text_tokens
from engine.sim.tools import ToolError, ToolPlan, plan_tools

STREAM_OPTIONS_MESSAGE = "Stream options can only be defined when `stream=True`."
UNTRUSTED_TEMPLATE_MESSAGE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
# Defaults of vLLM's request models when the field is absent (OpenAI API reference too).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def parse_json(raw: bytes, content_type: str) -> Any:
    """Decode a POST body as vLLM's JSON routes do; raises ApiError (400) otherwise."""
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise validation_error_text("Unsupported Media Type: Only 'application/json' is allowed")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise validation_error(
            {
                "type": "json_invalid",
                "loc": ("body", 0),
                "msg": "JSON decode error",
                "ctx": {"error": str(exc)},
            }
        ) from None


def _object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise validation_error(
            {
                "type": "model_attributes_type",
                "loc": ("body",),
                "msg": "Input should be a valid dictionary or object to extract fields from",
            }
        )
    return body


def _stream_flags(body: Mapping[str, Any], options: SimOptions) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage) following vLLM's `should_include_usage`."""
    stream = bool(read_field(body, "stream", bool))
    stream_options = read_field(body, "stream_options", dict)
    if stream_options and not stream:
        raise validation_error(
            {
                "type": "value_error",
                "loc": ("body",),
                "msg": f"Value error, {STREAM_OPTIONS_MESSAGE}",
            }
        )
    stream_options = stream_options or {}
    if options.enable_force_include_usage:
        include_usage = True
    else:
        include_usage = bool(stream_options.get("include_usage"))
    continuous = include_usage and bool(stream_options.get("continuous_usage_stats"))
    return stream, include_usage, continuous


def check_model(body: Mapping[str, Any], options: SimOptions) -> None:
    """404 NotFoundError unless `model` is absent, empty or a served name (section 7.3)."""
    model = read_field(body, "model", str)
    if model and model not in options.served_model_names:
        raise ApiError(404, "NotFoundError", f"The model `{model}` does not exist.", "model")


def _output_budget(
    requested: int | None, param: str, prompt_tokens: int, text_prompt: bool, max_model_len: int
) -> int:
    """Check the prompt against the context the way `renderers/params.py` does.

    Returns the output budget: `requested`, else all the context left (section 4.2). A text
    prompt is tokenized with truncation at (allowed + 1) tokens, hence vLLM's "at least".
    """
    wanted = requested or 0
    if wanted > max_model_len:
        raise vllm_error(
            f"{param}={wanted} cannot be greater than max_model_len=max_total_tokens="
            f"{max_model_len}. Please request fewer output tokens.",
            param,
            wanted,
        )
    allowed = max_model_len - wanted
    if prompt_tokens > allowed:
        shown = allowed + 1 if text_prompt else prompt_tokens
        at_least = "at least " if text_prompt else ""
        raise vllm_error(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {wanted} output tokens and your prompt contains {at_least}{shown} input "
            f"tokens, for a total of {at_least}{shown + wanted} tokens. Please reduce the length "
            "of the input prompt or the number of requested output tokens.",
            "input_tokens",
            shown,
        )
    return requested if requested is not None else max_model_len - prompt_tokens


def _at_least_one(value: int, name: str) -> None:
    # SamplingParams._verify_args
    if value < 1:
        raise vllm_error(f"{name} must be at least 1, got {value}.", name, value)


def thinking_enabled(
    defaults: Mapping[str, Any], request_kwargs: Mapping[str, Any] | None, effort: object
) -> bool:
    """The effective `enable_thinking` the Qwen template sees (vllm-protocol.md section 9.2).

    Server defaults, overlaid key by key by the request's `chat_template_kwargs` (null and
    "auto" ignored), then `reasoning_effort` ("none" = off) unless the request set
    `enable_thinking` itself. The template only closes the think block for a literal `false`.
    """
    overrides = {k: v for k, v in (request_kwargs or {}).items() if v not in (None, "auto")}
    merged = {**defaults, **overrides}
    if effort is not None and "enable_thinking" not in overrides:
        merged["enable_thinking"] = effort != "none"
    return merged.get("enable_thinking", True) is not False


@dataclass(frozen=True)
class ChatRequest:
    """A chat request that passed vLLM's checks; token counts in simulator tokens."""

    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int
    prompt_tokens: int
    thinking: bool
    include_reasoning: bool
    tools: ToolPlan | None = None


@dataclass(frozen=True)
class CompletionRequest:
    """A completion request that passed vLLM's checks; one prompt token count per prompt."""

    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: tuple[int, ...]
    prompt_tokens: tuple[int, ...]


def _tool_plan(
    body: Mapping[str, Any], messages: list[Any], options: SimOptions
) -> ToolPlan | None:
    """The request's tool calls (`engine.sim.tools`), its errors as vLLM answers them."""
    try:
        return plan_tools(
            body,
            messages,
            auto_allowed=options.enable_auto_tool_choice and options.tool_call_parser is not None,
        )
    except ToolError as exc:
        if exc.validation:
            raise validation_error(
                {"type": "value_error", "loc": tuple(str(exc.param).split(".")), "msg": str(exc)}
            ) from None
        if exc.param is None:
            raise ApiError(400, "BadRequestError", str(exc)) from None
        raise ApiError(
            400, "BadRequestError", f"{exc} (parameter={exc.param})", exc.param
        ) from None


def parse_chat(raw: object, options: SimOptions) -> ChatRequest:
    """Check a /v1/chat/completions body; raises ApiError with vLLM's status and body."""
    body = _object(raw)
    messages = body.get("messages")
    if messages is None:
        raise validation_error(
            {"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}
        )
    messages = read_field(body, "messages", list)
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise validation_error(
                {
                    "type": "missing",
                    "loc": ("body", "messages", position, "role"),
                    "msg": "Field required",
                }
            )
    stream, include_usage, continuous = _stream_flags(body, options)
    check_sampling(body, chat=True)
    n = read_field(body, "n", int)
    max_tokens = read_field(body, "max_tokens", int)
    max_completion_tokens = read_field(body, "max_completion_tokens", int)
    template_kwargs = read_field(body, "chat_template_kwargs", dict)
    effort = read_field(body, "reasoning_effort", str)
    check_model(body, options)
    if not options.trust_request_chat_template and (
        body.get("chat_template") is not None
        or (template_kwargs or {}).get("chat_template") is not None
    ):
        raise ApiError(400, "BadRequestError", UNTRUSTED_TEMPLATE_MESSAGE)
    tools = _tool_plan(body, messages, options)
    if max_completion_tokens is not None:
        requested, param = max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = max_tokens, "max_tokens"
    prompt_tokens = chat_prompt_tokens(messages, body.get("tools"))
    budget = _output_budget(requested, param, prompt_tokens, True, options.max_model_len)
    _at_least_one(1 if n is None else n, "n")
    _at_least_one(budget, "max_tokens")
    return ChatRequest(
        n=1 if n is None else n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens=budget,
        prompt_tokens=prompt_tokens,
        thinking=thinking_enabled(options.default_chat_template_kwargs, template_kwargs, effort),
        include_reasoning=read_field(body, "include_reasoning", bool) is not False,
        tools=tools,
    )


def _prompts(body: Mapping[str, Any]) -> list[tuple[int, bool]]:
    """(token count, is text) per prompt of a completions body."""
    prompt = body.get("prompt")
    if prompt is None:
        raise validation_error(
            {"type": "missing", "loc": ("body", "prompt"), "msg": "Field required"}
        )
    if isinstance(prompt, str):
        return [(text_tokens(prompt), True)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [(text_tokens(p), True) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [(len(prompt), False)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [(len(p), False) for p in prompt]
    raise validation_error(
        {
            "type": "value_error",
            "loc": ("body", "prompt"),
            "msg": "Value error, prompt must be a string, a list of strings or token ids",
        }
    )


def parse_completion(raw: object, options: SimOptions) -> CompletionRequest:
    """Check a /v1/completions body; raises ApiError with vLLM's status and body.

    `max_tokens` defaults to 16 on this route (vLLM's `CompletionRequest`, like OpenAI's).
    """
    body = _object(raw)
    prompts = _prompts(body)
    stream, include_usage, continuous = _stream_flags(body, options)
    n = read_field(body, "n", int)
    max_tokens = read_field(body, "max_tokens", int)
    if "max_tokens" not in body:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    check_sampling(body, chat=False)
    check_model(body, options)
    budgets = tuple(
        _output_budget(max_tokens, "max_tokens", count, is_text, options.max_model_len)
        for count, is_text in prompts
    )
    _at_least_one(1 if n is None else n, "n")
    for budget in budgets:
        _at_least_one(budget, "max_tokens")
    return CompletionRequest(
        n=1 if n is None else n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens=budgets,
        prompt_tokens=tuple(count for count, _ in prompts),
    )
