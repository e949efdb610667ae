"""Anthropic Messages and OpenAI Responses requests translated onto the chat route (pure)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.config import ConfigError, parse_settings
from gateway.dialects import PlanInput
from gateway.errors import BadRequest, NotFound
from gateway.rewrite import plan_request
from gateway.translate.anthropic_request import translate_messages
from gateway.translate.plan import plan_translated
from gateway.translate.responses_request import translate_responses

pytestmark = pytest.mark.fast

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
CTX = 254_976


def recorded(name: str) -> dict[str, Any]:
    """The request body of a recorded client exchange."""
    body = json.loads((FIXTURES / name).read_text())["request"]["body"]
    assert isinstance(body, dict)
    return body


def claude_code_body() -> dict[str, Any]:
    return recorded("claude-code-first-request-tool_use-sse.json")


def codex_body() -> dict[str, Any]:
    return recorded("codex-first-request-function_call-sse.json")


# ------------------------------------------------------------------------- Anthropic


def test_claude_code_recorded_body_translates() -> None:
    """Claude Code's recorded first request becomes a streamed chat body with its 24 tools."""
    out = translate_messages(claude_code_body())
    chat = out.chat
    assert out.stream is True and chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True}
    assert len(chat["tools"]) == 24 and out.dropped_tools == []
    assert all(t["type"] == "function" and "parameters" in t["function"] for t in chat["tools"])
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "user"]
    assert "max_tokens" not in chat and out.requested_output == 32000  # sized when planned
    assert "chat_template_kwargs" not in chat  # adaptive: the tenant's default decides
    for name in ("metadata", "context_management", "output_config", "thinking"):
        assert name not in chat


def test_billing_header_block_is_removed() -> None:
    """The per-session x-anthropic-billing-header system block never reaches the prompt."""
    body = claude_code_body()
    first = translate_messages(body).chat["messages"][0]["content"]
    body["system"][0]["text"] = (
        "x-anthropic-billing-header: cc_version=9.9.9.abc; cc_entrypoint=cli;"
    )
    second = translate_messages(body).chat["messages"][0]["content"]
    assert "x-anthropic-billing-header" not in first
    assert first == second  # same prefix across sessions: prefix caching works
    assert first.startswith("You are a Claude agent")


def test_system_string_and_leading_system_messages_join_the_system_prompt() -> None:
    """A string system and role:system messages before the first turn form one system message."""
    body = {
        "model": "m",
        "max_tokens": 10,
        "system": "Be brief.",
        "messages": [
            {"role": "system", "content": "Also be kind."},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "Later note."}]},
        ],
    }
    chat = translate_messages(body).chat
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\n\nAlso be kind."},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "Later note."},
    ]


def test_tool_round_trip_history() -> None:
    """tool_use and thinking blocks become tool_calls and reasoning; tool_result a tool message."""
    body = {
        "model": "m",
        "max_tokens": 100,
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Need a tool.", "signature": "abc"},
                    {"type": "redacted_thinking", "data": "xxx"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "sunny"}],
                    },
                    {"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
    }
    messages = translate_messages(body).chat["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": "Checking.",
        "reasoning": "Need a tool.",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert messages[3] == {"role": "user", "content": "thanks"}


def test_tool_result_error_is_marked() -> None:
    """An is_error tool result reaches the model marked as an error."""
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}
                ],
            }
        ],
    }
    assert translate_messages(body).chat["messages"] == [
        {"role": "tool", "tool_call_id": "t", "content": "Error: boom"}
    ]


@pytest.mark.parametrize(
    ("thinking", "expected"),
    [
        ({"type": "enabled", "budget_tokens": 2048}, {"enable_thinking": True}),
        ({"type": "disabled"}, {"enable_thinking": False}),
        ({"type": "adaptive"}, None),
        (None, None),
    ],
)
def test_thinking_mapping(thinking: Any, expected: Any) -> None:
    """enabled/disabled decide the mode; adaptive or absent leave it to the tenant's default."""
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": "x"}],
    }
    if thinking is not None:
        body["thinking"] = thinking
    body["output_config"] = {"effort": "high"}
    chat = translate_messages(body).chat
    assert chat.get("chat_template_kwargs") == expected
    assert "reasoning_effort" not in chat  # effort does not switch the mode
    if thinking and thinking.get("budget_tokens"):
        assert chat["thinking_token_budget"] == 2048


def planned_budget(body: dict[str, Any], context: int, tenant_max: int = 32_768) -> int:
    """The output budget the engine body of Anthropic ``body`` carries, on ``context``."""
    settings = parse_settings({"engine": {"max_model_len": context}})
    tenant = settings.tenant("acme")
    tenant = dataclasses.replace(tenant, max_tokens=tenant_max)
    given = PlanInput(body, settings, tenant, "r1", b"s" * 32)
    plan = plan_translated(given, translate_messages(body))
    assert plan.default_output is not None
    budget = json.loads(plan.body)[plan.default_output]
    assert plan.max_output == budget
    assert isinstance(budget, int)
    return budget


def test_max_tokens_clamped_to_context() -> None:
    """Claude Code's 32,000 is cut to what fits in a small context, never above max_model_len,
    and never to less than asked because of the prompt estimate alone: with no room by the
    estimate the budget asked for stands (at most the context) until the engine's count sizes
    it (`gateway.budget.fit_default_output`)."""
    body = claude_code_body()
    assert 1 <= planned_budget(body, 40_000) < 32000
    assert planned_budget(body, 8192) == 8192  # the prompt alone is over: the engine's 400 says so
    assert planned_budget({**body, "max_tokens": 16}, 8192) == 16
    assert planned_budget({**body, "max_tokens": 16}, CTX, tenant_max=4) == 16  # asked, not default


def test_tools_choice_and_hosted_tools() -> None:
    """Custom tools pass, hosted tools are dropped and named, tool_choice maps to chat's."""
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [
            {"name": "f", "description": "d", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "temperature": 0.2,
        "top_k": 5,
        "metadata": {"user_id": "u"},
        "cache_salt": "client-salt",
        "priority": -10,
        "request_id": "mine",
    }
    out = translate_messages(body)
    assert out.chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
        }
    ]
    assert out.dropped_tools == ["web_search"]
    assert out.chat["tool_choice"] == "required" and out.chat["parallel_tool_calls"] is False
    assert out.chat["stop"] == ["END"] and out.chat["temperature"] == 0.2 and out.chat["top_k"] == 5
    for name in ("cache_salt", "priority", "request_id", "metadata"):
        assert name not in out.chat


def test_named_tool_choice_and_json_format() -> None:
    """tool_choice tool names the function; output_config.format becomes response_format."""
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f"},
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    }
    chat = translate_messages(body).chat
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}


def test_a_messages_request_without_model_is_for_the_served_model() -> None:
    """An absent model is accepted on Messages as on the OpenAI APIs: the one served model."""
    translated = translate_messages(
        {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    )
    assert "model" not in translated.chat


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": 7, "max_tokens": 5, "messages": []}, "model"),
        ({"model": "m", "max_tokens": 5}, "messages"),
        (
            {"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
            "max_tokens",
        ),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]},
            "messages.0.role",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "base64", "data": "AA"}}],
                    }
                ],
            },
            "messages.0.content.0.type",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "thinking": {"type": "on"},
            },
            "thinking.type",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "stream": "yes",
            },
            "stream",
        ),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 5}]},
            "messages.0.content",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 5},
            "temperature",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "top_p": -0.5},
            "top_p",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "metadata": [1]},
            "metadata",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "metadata": {"user_id": [1]},
            },
            "metadata.user_id",
        ),
    ],
)
def test_bad_messages_requests_name_the_parameter(body: dict[str, Any], param: str) -> None:
    """Each malformed request is a 400 whose param names the offending field."""
    with pytest.raises(BadRequest) as info:
        translate_messages(body)
    assert info.value.param == param
    assert info.value.status == 400


def test_count_tokens_body_needs_no_max_tokens() -> None:
    """A count_tokens body (no max_tokens, no stream) translates to messages and tools only."""
    body = claude_code_body()
    body.pop("max_tokens")
    body.pop("stream")
    out = translate_messages(body, count_only=True)
    assert "max_tokens" not in out.chat and "stream" not in out.chat
    assert len(out.chat["tools"]) == 24


# ------------------------------------------------------------------------- Responses


def test_codex_recorded_body_translates() -> None:
    """Codex's recorded request: developer prompts join the system, namespace flattened,
    web_search dropped, no output budget (the tenant cap applies)."""
    out = translate_responses(codex_body())
    chat = out.chat
    assert out.stream is True
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "user"]
    assert chat["messages"][0]["content"].startswith(
        "You are a coding agent running in the Codex CLI"
    )
    names = [t["function"]["name"] for t in chat["tools"]]
    assert "exec_command" in names and "spawn_agent" in names and len(names) == 12
    assert out.extra["namespaces"]["spawn_agent"] == "multi_agent_v1"
    assert out.dropped_tools == ["web_search"]
    assert "max_tokens" not in chat and out.requested_output is None
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is True
    for name in ("include", "prompt_cache_key", "client_metadata", "store", "reasoning"):
        assert name not in chat
    assert "reasoning_effort" not in chat  # summary only: the tenant's default decides


@pytest.mark.parametrize(("effort", "expected"), [("none", "none"), ("high", "high"), (None, None)])
def test_reasoning_effort(effort: str | None, expected: str | None) -> None:
    """reasoning.effort "none" turns thinking off (via reasoning_effort), others on."""
    body: dict[str, Any] = {"input": "hi", "reasoning": {"summary": "auto"}}
    if effort is not None:
        body["reasoning"]["effort"] = effort
    assert translate_responses(body).chat.get("reasoning_effort") == expected


def test_replayed_history_items() -> None:
    """Replayed reasoning, function_call and function_call_output items become chat history."""
    body = {
        "instructions": "Be terse.",
        "max_output_tokens": 300,
        "input": [
            {"role": "user", "content": "weather in Paris?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Use the tool."}],
                "encrypted_content": None,
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "noon"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Sunny."}],
            },
            {"type": "message", "role": "developer", "content": "late note"},
        ],
    }
    out = translate_responses(body)
    messages = out.chat["messages"]
    assert messages[0] == {"role": "system", "content": "Be terse."}
    assert messages[2]["reasoning"] == "Use the tool."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert messages[4] == {"role": "tool", "tool_call_id": "c2", "content": "noon"}
    assert messages[5] == {"role": "assistant", "content": "Sunny."}
    assert messages[6] == {"role": "user", "content": "late note"}
    assert "max_tokens" not in out.chat and out.requested_output == 300


def test_text_format_and_named_tool_choice() -> None:
    """text.format json_schema becomes response_format; a function tool_choice names it."""
    body = {
        "input": "x",
        "tools": [
            {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
        ],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {
            "format": {
                "type": "json_schema",
                "name": "out",
                "schema": {"type": "object"},
                "strict": True,
            }
        },
        "cache_salt": "x",
        "priority": 5,
        "request_id": "r",
    }
    chat = translate_responses(body).chat
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"]["name"] == "out"
    for name in ("cache_salt", "priority", "request_id"):
        assert name not in chat


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": 5}, "input"),
        ({"input": "x", "background": True}, "background"),
        (
            {
                "input": [
                    {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "data:"}],
                    }
                ]
            },
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": "x", "tools": [{"type": "teleport"}]}, "tools[0].type"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ],
)
def test_bad_responses_requests_name_the_parameter(body: dict[str, Any], param: str) -> None:
    """Each malformed Responses request is a 400 whose param names the offending field."""
    with pytest.raises(BadRequest) as info:
        translate_responses(body)
    assert info.value.param == param


def test_previous_history_goes_first() -> None:
    """Items of a stored conversation precede the new input."""
    history = [
        {"type": "message", "role": "user", "content": "first"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok"}],
        },
    ]
    chat = translate_responses({"input": "second"}, history=history).chat
    assert [m["content"] for m in chat["messages"]] == ["first", "ok", "second"]


# ------------------------------------------------------------------------- configuration


def test_accepted_model_names() -> None:
    """[model] accepted lets a request name another model; "*" accepts any; others are 404."""
    settings = parse_settings({"model": {"accepted": ["claude-sonnet-4-5"]}})
    tenant = settings.tenant("default")
    body = {"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "x"}]}
    plan = plan_request(
        body, "chat", settings=settings, tenant=tenant, request_id="r", salt_secret=b"s"
    )
    assert json.loads(plan.body)["model"] == settings.engine.model
    with pytest.raises(NotFound):
        plan_request(
            {**body, "model": "gpt-5"},
            "chat",
            settings=settings,
            tenant=tenant,
            request_id="r",
            salt_secret=b"s",
        )
    anything = parse_settings({"model": {"accepted": ["*"]}})
    assert anything.model.accepts("gpt-5")


@pytest.mark.parametrize("value", ["x", [1], [""]])
def test_accepted_must_be_a_list_of_names(value: Any) -> None:
    """A malformed [model] accepted fails at load, naming the key."""
    with pytest.raises(ConfigError, match=r"model\.accepted"):
        parse_settings({"model": {"accepted": value}})


def test_responses_store_settings() -> None:
    """[responses] store is off by default and bounded when on."""
    assert parse_settings({}).responses.store is False
    on = parse_settings({"responses": {"store": True, "store_max_items": 5, "store_ttl_s": 60}})
    assert (on.responses.store, on.responses.store_max_items, on.responses.store_ttl_s) == (
        True,
        5,
        60.0,
    )
    with pytest.raises(ConfigError):
        parse_settings({"responses": {"store_max_items": 0}})


def test_system_messages_alone_are_refused_saying_so() -> None:
    """A Messages body with only a system-role message is a 400 that says a user or assistant
    message is needed, not that the list is empty."""
    body = {"max_tokens": 5, "messages": [{"role": "system", "content": "be brief"}]}
    with pytest.raises(BadRequest) as info:
        translate_messages(body)
    assert "user or assistant" in str(info.value) and "system" in str(info.value)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_huge_output_limit_is_refused_without_quoting_it_whole(field: str) -> None:
    """A 35-digit output limit is a 400 naming the field that quotes no more than 15
    characters of the value (errors quote short prefixes only)."""
    settings = parse_settings({})
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], field: 10**35 - 1}
    with pytest.raises(BadRequest) as info:
        plan_request(
            body,
            "chat",
            settings=settings,
            tenant=settings.tenant("default"),
            request_id="r",
            salt_secret=b"s",
        )
    assert info.value.param == field
    assert "9" * 16 not in str(info.value)
