"""One conformance suite, two engines: what an OpenAI SDK user sees through the gateway.

Every test runs against real vLLM (the CPU build serving the tiny model of
`tests.realengine.model`) and against the simulator, each started by the project's launcher,
with the real gateway in front and the official ``openai`` SDK as the client (ids ``[real]`` and
``[sim]``). Assertions are about the API's shape and meaning, not either engine's token text;
the tool tests name the one tool the tiny model knows, ``get_weather(city)``.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from engine.command import build_launch
from engine.config import load_settings
from tests.conftest import ALIAS, KEY_A, Gateway
from tests.realengine.launcher import CPU_CONFIG, MAX_MODEL_LEN

HELLO = [{"role": "user", "content": "Say hello."}]
WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
]
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def client(gw: Gateway) -> openai.OpenAI:
    """The official SDK pointed at the gateway, key of tenant acme, no retries."""
    return openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0, timeout=60)


def reasoning_of(part: Any) -> str:
    """``reasoning_content`` of a message or delta (an extra field for the SDK's types)."""
    return str((part.model_extra or {}).get("reasoning_content") or "")


def collect(stream: Any) -> dict[str, Any]:
    """Fold a chat stream into what a client assembles: per choice text, reasoning, tool calls,
    finish reason; plus the usage chunk and the number of chunks."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    chunks = 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            assert not chunk.choices, "usage arrives in its own chunk, with no choices"
            usage = chunk.usage
        for choice in chunk.choices:
            seen = choices.setdefault(
                choice.index, {"content": "", "reasoning": "", "calls": {}, "finish": None}
            )
            delta = choice.delta
            seen["content"] += delta.content or ""
            seen["reasoning"] += reasoning_of(delta)
            for call in delta.tool_calls or []:
                slot = seen["calls"].setdefault(call.index, {"id": "", "name": "", "args": ""})
                slot["id"] += call.id or ""
                if call.function is not None:
                    slot["name"] += call.function.name or ""
                    slot["args"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                assert seen["finish"] is None, "one finish_reason per choice"
                seen["finish"] = choice.finish_reason
    return {"choices": choices, "usage": usage, "chunks": chunks}


def assert_usage(usage: Any) -> None:
    """Usage as OpenAI defines it: positive counts that add up."""
    assert usage is not None
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# ------------------------------------------------------------------------------- chat, thinking


def test_chat_non_stream_thinking_on(engine_gateway: Gateway) -> None:
    """Thinking on: reasoning_content holds the reasoning, content the answer, finish stop."""
    r = client(engine_gateway).chat.completions.create(model=ALIAS, messages=HELLO)
    assert r.model == ALIAS and r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    message = r.choices[0].message
    assert message.role == "assistant"
    assert reasoning_of(message) and message.content
    assert "<think>" not in message.content and "</think>" not in message.content
    assert "reasoning" not in (message.model_extra or {})
    assert not message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert_usage(r.usage)


def test_chat_stream_thinking_on(engine_gateway: Gateway) -> None:
    """Thinking on, streamed: reasoning deltas, then content, one finish_reason, no usage unasked."""
    stream = client(engine_gateway).chat.completions.create(
        model=ALIAS, messages=HELLO, stream=True
    )
    seen = collect(stream)
    assert list(seen["choices"]) == [0]
    choice = seen["choices"][0]
    assert choice["reasoning"] and choice["content"].strip()
    assert "</think>" not in choice["content"] + choice["reasoning"]
    assert choice["finish"] == "stop" and not choice["calls"]
    assert seen["usage"] is None


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize(
    "switch",
    [THINKING_OFF, {"reasoning_effort": "none"}],
    ids=["chat_template_kwargs", "reasoning_effort"],
)
def test_chat_thinking_off(engine_gateway: Gateway, switch: dict[str, Any], stream: bool) -> None:
    """Thinking off (template switch or reasoning_effort none): an answer and no reasoning."""
    sdk = client(engine_gateway)
    if stream:
        seen = collect(
            sdk.chat.completions.create(model=ALIAS, messages=HELLO, stream=True, extra_body=switch)
        )["choices"][0]
        content, reasoning, finish = seen["content"], seen["reasoning"], seen["finish"]
    else:
        r = sdk.chat.completions.create(model=ALIAS, messages=HELLO, extra_body=switch)
        message = r.choices[0].message
        content, reasoning, finish = (
            message.content,
            reasoning_of(message),
            r.choices[0].finish_reason,
        )
    assert content and content.strip() and not reasoning
    assert "<think>" not in content and "</think>" not in content
    assert finish == "stop"


def test_chat_reasoning_effort_turns_thinking_on(engine_gateway: Gateway) -> None:
    """reasoning_effort other than none turns thinking on, even where the default is off."""
    r = client(engine_gateway).chat.completions.create(
        model=ALIAS, messages=HELLO, reasoning_effort="low"
    )
    assert reasoning_of(r.choices[0].message) and r.choices[0].message.content


# ---------------------------------------------------------------------------------------- usage


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_stream_usage_when_asked_matches_non_stream(
    engine_gateway: Gateway, thinking: bool
) -> None:
    """include_usage: one final usage chunk, equal to the non-streamed usage of the same request."""
    sdk = client(engine_gateway)
    switch = {"chat_template_kwargs": {"enable_thinking": thinking}}
    seen = collect(
        sdk.chat.completions.create(
            model=ALIAS,
            messages=HELLO,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=switch,
        )
    )
    assert_usage(seen["usage"])
    full = sdk.chat.completions.create(model=ALIAS, messages=HELLO, extra_body=switch)
    assert seen["usage"].prompt_tokens == full.usage.prompt_tokens
    assert seen["usage"].completion_tokens == full.usage.completion_tokens


def test_stream_without_include_usage_has_no_usage_chunk(engine_gateway: Gateway) -> None:
    """include_usage false: no usage anywhere in the stream (the gateway asked for it, not you)."""
    seen = collect(
        client(engine_gateway).chat.completions.create(
            model=ALIAS,
            messages=HELLO,
            stream=True,
            stream_options={"include_usage": False},
            extra_body=THINKING_OFF,
        )
    )
    assert seen["usage"] is None and seen["choices"][0]["content"]


def test_stream_continuous_usage_when_asked(engine_gateway: Gateway) -> None:
    """continuous_usage_stats asked for: running usage on every chunk, ending at the total."""
    stream = client(engine_gateway).chat.completions.create(
        model=ALIAS,
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body=THINKING_OFF,
    )
    chunks = list(stream)
    running = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert running and len(running) == len([c for c in chunks if c.choices])
    assert running == sorted(running)
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert_usage(chunks[-1].usage)
    assert running[-1] == chunks[-1].usage.completion_tokens


# -------------------------------------------------------------------------------------- choices


def test_two_choices_non_stream(engine_gateway: Gateway) -> None:
    """n=2: two complete choices, indices 0 and 1, usage over both."""
    r = client(engine_gateway).chat.completions.create(
        model=ALIAS, messages=HELLO, n=2, extra_body=THINKING_OFF
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    for choice in r.choices:
        assert choice.message.content and choice.finish_reason == "stop"
    assert_usage(r.usage)


def test_two_choices_stream(engine_gateway: Gateway) -> None:
    """n=2 streamed: both choices get content and exactly one finish_reason each."""
    seen = collect(
        client(engine_gateway).chat.completions.create(
            model=ALIAS,
            messages=HELLO,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=THINKING_OFF,
        )
    )
    assert sorted(seen["choices"]) == [0, 1]
    for choice in seen["choices"].values():
        assert choice["content"] and choice["finish"] == "stop"
    assert_usage(seen["usage"])


# ---------------------------------------------------------------------------------------- tools


def _one_weather_call(calls: list[tuple[str, str, str]]) -> None:
    """Exactly one call: an id, get_weather, JSON arguments with a string city."""
    assert len(calls) == 1, calls
    call_id, name, arguments = calls[0]
    assert call_id and name == "get_weather"
    args = json.loads(arguments)
    assert isinstance(args, dict) and isinstance(args.get("city"), str) and args["city"]


# tool_choice -> the finish_reason OpenAI (and vLLM) report: a forced named function is "stop".
# An explicit output budget: the gateway's default (context minus a bytes/3 prompt estimate) can
# exceed an 8,192-token context when an engine counts tool schemas more densely than the
# estimate (the simulator counts each punctuation mark of a schema as a token).
TOOL_TURN_MAX_TOKENS = 512
TOOL_CHOICES = {
    "auto": ("auto", "tool_calls"),
    "required": ("required", "tool_calls"),
    "named": ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
}


@pytest.mark.parametrize("choice", list(TOOL_CHOICES))
def test_tool_call_non_stream(engine_gateway: Gateway, choice: str) -> None:
    """tool_choice auto/required/named: one get_weather call with JSON arguments."""
    tool_choice, finish = TOOL_CHOICES[choice]
    r = client(engine_gateway).chat.completions.create(
        model=ALIAS,
        messages=WEATHER,
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=TOOL_TURN_MAX_TOKENS,
        tool_choice=tool_choice,  # type: ignore[arg-type]
        extra_body=THINKING_OFF,
    )
    message = r.choices[0].message
    calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    _one_weather_call(calls)
    assert r.choices[0].finish_reason == finish
    assert "<tool_call>" not in (message.content or "")


@pytest.mark.parametrize("choice", list(TOOL_CHOICES))
def test_tool_call_stream(engine_gateway: Gateway, choice: str) -> None:
    """Streamed tool calls assemble into one get_weather call; thinking still streams first."""
    tool_choice, finish = TOOL_CHOICES[choice]
    seen = collect(
        client(engine_gateway).chat.completions.create(
            model=ALIAS,
            messages=WEATHER,
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=TOOL_TURN_MAX_TOKENS,
            tool_choice=tool_choice,  # type: ignore[arg-type]
            stream=True,
        )
    )["choices"][0]
    calls = [(c["id"], c["name"], c["args"]) for c in seen["calls"].values()]
    _one_weather_call(calls)
    assert seen["finish"] == finish
    assert "<tool_call>" not in seen["content"]


def test_tool_round_trip_ends_in_an_answer(engine_gateway: Gateway) -> None:
    """The tool's result sent back: the model answers in content, no further call."""
    sdk = client(engine_gateway)
    first = sdk.chat.completions.create(
        model=ALIAS,
        messages=WEATHER,
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=TOOL_TURN_MAX_TOKENS,
        extra_body=THINKING_OFF,
    )
    call = (first.choices[0].message.tool_calls or [None])[0]
    assert call is not None
    messages: list[Any] = [
        *WEATHER,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "celsius": 21}'},
    ]
    second = sdk.chat.completions.create(
        model=ALIAS,
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=TOOL_TURN_MAX_TOKENS,
        extra_body=THINKING_OFF,
    )
    answer = second.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason == "stop"


# ------------------------------------------------------------------- completions, models, limits


def test_legacy_completions_non_stream_and_stream(engine_gateway: Gateway) -> None:
    """/v1/completions: text under the alias, usage, and the same streamed."""
    sdk = client(engine_gateway)
    r = sdk.completions.create(model=ALIAS, prompt="Say hello.\n\n", max_tokens=12)
    assert r.model == ALIAS and r.object == "text_completion"
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")
    assert_usage(r.usage)
    chunks = list(
        sdk.completions.create(
            model=ALIAS,
            prompt="Say hello.\n\n",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert_usage(chunks[-1].usage)


def test_models_list_and_retrieve(engine_gateway: Gateway) -> None:
    """models.list() shows the alias only; retrieve() gives its card; another name is 404."""
    sdk = client(engine_gateway)
    assert [m.id for m in sdk.models.list().data] == [ALIAS]
    card = sdk.models.retrieve(ALIAS)
    assert card.id == ALIAS and card.object == "model"
    assert (card.model_extra or {}).get("max_model_len") == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("gpt-4o")


def test_prompt_longer_than_the_context_is_the_engines_400(engine_gateway: Gateway) -> None:
    """A prompt over max_model_len: the engine's 400 in OpenAI shape, not a 5xx."""
    long_prompt = "Paris " * (MAX_MODEL_LEN * 2)
    with pytest.raises(openai.BadRequestError) as caught:
        client(engine_gateway).chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": long_prompt}]
        )
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body.get("message")
    assert str(MAX_MODEL_LEN) in str(body["message"])
    assert engine_gateway.metric("gateway_requests_total", status="500") == 0


def test_cpu_engine_config_launches_upstream_vllm_cpu() -> None:
    """deploy/etc/engine.cpu.toml loads and asks for the CPU attention backend, eager mode and
    a 1 GiB KV cache, the flags upstream vLLM's CPU build accepts."""
    launch = build_launch(load_settings(CPU_CONFIG).engine)
    argv = list(launch.argv)
    assert argv[argv.index("--attention-backend") + 1] == "CPU_ATTN"
    assert "FLASH_ATTN_V100" not in argv and "--enforce-eager" in argv
    assert launch.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
