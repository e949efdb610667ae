"""Request rewriting: alias, thinking resolution, sampling defaults, usage, isolation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.config import parse_settings
from gateway.errors import BadRequest, NotFound, PermissionDenied
from gateway.rewrite import (
    SAMPLING_NON_THINKING,
    SAMPLING_THINKING,
    cache_salt,
    plan_request,
)

pytestmark = pytest.mark.fast

SETTINGS = parse_settings(
    {
        "engine": {"model": "engine-name"},
        "tenants": {
            "default": {"max_tokens": 1000},
            "quiet": {"thinking_default": False},
            "nothink": {"thinking_allowed": False},
        },
    }
)
MESSAGES = [{"role": "user", "content": "hello"}]


def plan(
    body: dict[str, Any], tenant: str = "acme", kind: str = "chat"
) -> tuple[Any, dict[str, Any]]:
    p = plan_request(
        body,
        kind,  # type: ignore[arg-type]
        settings=SETTINGS,
        tenant=SETTINGS.tenant(tenant),
        request_id="rid-1",
        salt_secret=b"secret",
    )
    return p, json.loads(p.body)


def test_alias_and_absent_model_map_to_engine_model() -> None:
    """The alias or no model both reach the engine as engine.model."""
    assert plan({"model": "qwen3.8-27b", "messages": MESSAGES})[1]["model"] == "engine-name"
    assert plan({"messages": MESSAGES})[1]["model"] == "engine-name"


def test_other_model_is_404() -> None:
    """Any other model id is 404 model_not_found, naming the field."""
    with pytest.raises(NotFound) as err:
        plan({"model": "gpt-4o", "messages": MESSAGES})
    assert err.value.code == "model_not_found" and err.value.param == "model"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"chat_template_kwargs": {"enable_thinking": False}, "enable_thinking": True}, False),
        ({"enable_thinking": False, "reasoning_effort": "high"}, False),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "low"}, True),
        ({}, True),
    ],
)
def test_thinking_precedence(body: dict[str, Any], expected: bool) -> None:
    """Thinking: chat_template_kwargs, then enable_thinking, then reasoning_effort, then default."""
    p, out = plan({"messages": MESSAGES, **body})
    assert p.thinking is expected
    assert out["chat_template_kwargs"]["enable_thinking"] is expected
    assert "enable_thinking" not in out


def test_tenant_default_and_forbidden_thinking() -> None:
    """A tenant default applies when the client is silent; a forbidding tenant gets 403 if asked."""
    assert plan({"messages": MESSAGES}, tenant="quiet")[0].thinking is False
    assert plan({"messages": MESSAGES}, tenant="nothink")[0].thinking is False
    with pytest.raises(PermissionDenied):
        plan({"messages": MESSAGES, "reasoning_effort": "high"}, tenant="nothink")


def test_sampling_defaults_per_mode_and_client_wins() -> None:
    """Unset sampling fields get the Qwen card values for the mode; client values are kept."""
    _, on = plan({"messages": MESSAGES})
    assert {k: on[k] for k in SAMPLING_THINKING} == dict(SAMPLING_THINKING)
    _, off = plan({"messages": MESSAGES, "temperature": 0.1, "enable_thinking": False})
    assert off["temperature"] == 0.1
    assert off["presence_penalty"] == SAMPLING_NON_THINKING["presence_penalty"]
    assert off["top_p"] == SAMPLING_NON_THINKING["top_p"]


def test_c09_extras_pass_through_untouched() -> None:
    """C09: vLLM extras and unknown fields pass through; the kwarg dict keeps other keys."""
    body = {
        "messages": MESSAGES,
        "top_k": 5,
        "min_p": 0.2,
        "repetition_penalty": 1.1,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": True},
    }
    _, out = plan(body)
    assert (out["top_k"], out["min_p"], out["repetition_penalty"]) == (5, 0.2, 1.1)
    assert out["tools"] == body["tools"]
    assert out["chat_template_kwargs"] == {"enable_thinking": False, "preserve_thinking": True}


def test_stream_usage_always_requested_upstream() -> None:
    """Streams always ask the engine for usage on every chunk; what the client asked is kept."""
    both = {"include_usage": True, "continuous_usage_stats": True}
    p, out = plan({"messages": MESSAGES, "stream": True})
    assert out["stream_options"] == both and not p.client_wants_usage
    assert not p.client_wants_running_usage
    p, out = plan({"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}})
    assert p.client_wants_usage and not p.client_wants_running_usage
    assert out["stream_options"] == both
    p, out = plan({"messages": MESSAGES, "stream": True, "stream_options": both})
    assert p.client_wants_usage and p.client_wants_running_usage
    # vLLM sends running usage only with include_usage: alone, the flag asks for nothing.
    only = {"continuous_usage_stats": True}
    p, out = plan({"messages": MESSAGES, "stream": True, "stream_options": only})
    assert not p.client_wants_usage and not p.client_wants_running_usage


def test_c12_non_stream_never_carries_stream_options() -> None:
    """C12: a non-streaming request never carries stream_options upstream."""
    _, out = plan({"messages": MESSAGES, "stream_options": {"include_usage": True}})
    assert "stream_options" not in out


def test_isolation_fields_replaced() -> None:
    """Client cache_salt, priority and request_id are replaced by gateway values."""
    _, out = plan({"messages": MESSAGES, "cache_salt": "x", "priority": -5, "request_id": "mine"})
    assert out["cache_salt"] == cache_salt(b"secret", "acme") != "x"
    assert "priority" not in out and out["request_id"] == "rid-1"
    assert cache_salt(b"secret", "acme") != cache_salt(b"secret", "beta")


def test_reservation_uses_max_tokens_times_n() -> None:
    """Reservation = prompt ceiling + max output x n; the tenant cap applies when unset."""
    p, out = plan({"messages": MESSAGES, "max_tokens": 50, "n": 3})
    assert p.reserve_tokens == p.prompt_ceiling + 150 and p.output_tokens == 150
    p, out = plan({"messages": MESSAGES})
    assert p.max_output == 1000 and out["max_completion_tokens"] == 1000


def test_reasoning_content_history_accepted() -> None:
    """C08: assistant history sent back with reasoning_content reaches the engine as reasoning."""
    msgs = [*MESSAGES, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    _, out = plan({"messages": msgs})
    assert out["messages"][1] == {"role": "assistant", "content": "a", "reasoning": "r"}


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"messages": []},
        {"messages": "hi"},
        {"messages": [1]},
        {"messages": MESSAGES, "stream": "yes"},
        {"messages": MESSAGES, "n": 0},
        {"messages": MESSAGES, "max_tokens": -1},
        {"messages": MESSAGES, "chat_template_kwargs": []},
        {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": "no"}},
    ],
)
def test_bad_bodies_are_400(body: Any) -> None:
    """Malformed bodies are 400 with an OpenAI error, before anything reaches the engine."""
    with pytest.raises(BadRequest):
        plan(body)


def test_completions_need_prompt_and_keep_sampling() -> None:
    """/v1/completions: prompt required; no chat template fields are added."""
    with pytest.raises(BadRequest):
        plan({}, kind="completions")
    p, out = plan({"prompt": "abc"}, kind="completions")
    assert p.thinking is None and "chat_template_kwargs" not in out and out["max_tokens"] == 16


def test_lone_surrogate_is_refused_naming_where() -> None:
    """A lone surrogate escape (valid JSON, but no UTF-8 text the engine can tokenize) is a 400 naming where it is."""
    body = json.loads('{"messages": [{"role": "user", "content": "\\ud800"}]}')
    with pytest.raises(BadRequest) as caught:
        plan(body)
    assert caught.value.param == "messages"
    assert "messages[0].content" in caught.value.message
