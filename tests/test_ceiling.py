"""The prompt ceiling (`gateway.ceiling`) bounds the rendered chat template, whatever the body.

The template is the one real vLLM serves in the real-engine tests (`tests.realengine.model`,
read from its source: importing that module needs torch), rendered with the sandbox and the
``tojson`` transformers gives chat templates, and with Jinja's own HTML-safe ``tojson`` (which
escapes ``<``, ``>``, ``&`` and ``'`` to six bytes each). A byte-level BPE writes at most one
token per byte of the NFC-normalised text, so the NFC UTF-8 size of the rendering is the most
any tokenizer of this family can count; the simulator's rule must stay under it too.
"""

from __future__ import annotations

import ast
import contextlib
import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.sim.tokens import chat_prompt_tokens
from gateway.ceiling import completion_ceiling, json_ceiling, string_ceiling
from gateway.config import TenantSettings, parse_settings
from gateway.rewrite import estimate_prompt_tokens, plan_request

pytestmark = pytest.mark.fast

MODEL_SOURCE = Path(__file__).parent / "realengine" / "model.py"
SETTINGS = parse_settings({"engine": {"max_model_len": 10_000_000}})
TENANT = TenantSettings(name="acme", max_tokens=16)


def _template_source() -> str:
    tree = ast.parse(MODEL_SOURCE.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CHAT_TEMPLATE":
            value = ast.literal_eval(node.value)
            assert isinstance(value, str)
            return value
    raise AssertionError("CHAT_TEMPLATE not found in tests/realengine/model.py")


def _environment(html_safe: bool) -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    if not html_safe:
        # transformers' chat-template tojson: json.dumps, ensure_ascii False, no HTML escaping.
        env.filters["tojson"] = lambda x, ensure_ascii=False: json.dumps(
            x, ensure_ascii=ensure_ascii
        )
    return env


TEMPLATES = {safe: _environment(safe).from_string(_template_source()) for safe in (False, True)}


def rendered_bytes(engine_body: dict[str, Any], *, html_safe: bool) -> int:
    """NFC UTF-8 bytes of the prompt the template renders from an engine chat body, prepared
    as vLLM prepares it for a template that prints ``content`` as a string: text parts joined
    with newlines, tool call arguments parsed into objects."""
    messages = json.loads(json.dumps(engine_body["messages"]))
    for message in messages:
        if isinstance(message.get("content"), list):
            message["content"] = "\n".join(p["text"] for p in message["content"])
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                with contextlib.suppress(ValueError):
                    function["arguments"] = json.loads(function["arguments"])
    text = TEMPLATES[html_safe].render(
        messages=messages,
        tools=engine_body.get("tools"),
        add_generation_prompt=True,
        **engine_body.get("chat_template_kwargs", {}),
    )
    return len(unicodedata.normalize("NFC", text).encode("utf-8", "surrogatepass"))


def engine_body(body: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The body the gateway sends the engine and the ceiling it reserves."""
    plan = plan_request(
        body, "chat", settings=SETTINGS, tenant=TENANT, request_id="r1", salt_secret=b"s"
    )
    return json.loads(plan.body), plan.prompt_ceiling


def tool(name: str, parameters: Any, description: str = "d") -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


ADVERSARIAL: dict[str, dict[str, Any]] = {
    "empty_arrays": {"tools": [tool("f", {"x": [[] for _ in range(20_000)]})]},
    "empty_objects": {"tools": [tool("f", {"x": [{} for _ in range(5_000)]})]},
    "deep_nesting": {"tools": [tool("f", json.loads("[" * 400 + "]" * 400))]},
    "html_punctuation": {"tools": [tool("f", {"type": "object"}, "<>&'\"\\" * 2_000)]},
    "control_characters": {"tools": [tool("f", {"type": "object"}, "\x01\x1f\n" * 2_000)]},
    "unicode": {"tools": [tool("f", {"d": "😀é\u0301\u0344한\U0001d15e" * 1_000})]},
    "long_names": {"tools": [tool("n" * 200 + str(i), {}) for i in range(200)]},
    "many_tools": {"tools": [tool(f"t{i}", {"type": "object"}) for i in range(1_000)]},
    "system_blocks": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "<&>"} for _ in range(2_000)]},
            {"role": "user", "content": "hi"},
        ]
    },
    "tool_call_arguments": {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {
                            "name": "f",
                            "arguments": json.dumps({f"k{i}": [] for i in range(3_000)}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
    },
}


@pytest.mark.parametrize("shape", sorted(ADVERSARIAL))
def test_ceiling_bounds_adversarial_shapes(shape: str) -> None:
    """C26: each adversarial shape's ceiling is at least the template's rendered bytes (both
    tojson flavours) and the simulator's count, where the old estimate was far below them."""
    body = {"messages": [{"role": "user", "content": "hi"}], **ADVERSARIAL[shape]}
    sent, ceiling = engine_body(body)
    rendered = max(rendered_bytes(sent, html_safe=False), rendered_bytes(sent, html_safe=True))
    assert rendered <= ceiling
    assert chat_prompt_tokens(sent["messages"], sent.get("tools")) <= ceiling
    if shape in ("empty_arrays", "empty_objects", "deep_nesting", "tool_call_arguments"):
        # The shapes that defeated the old estimate: 28 tokens for 20,031 counted (C26).
        assert estimate_prompt_tokens(body, "chat") * 10 < rendered


JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=30),
    st.sampled_from(["<", ">", "&", "'", '"', "\\", "\x00", "é", "\u0344", "😀", "\U0001d15e"]),
)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=40,
)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=60)
TOOL = st.builds(tool, st.text(min_size=1, max_size=20), JSON_VALUE, TEXT)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]), "content": TEXT}),
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": TEXT,
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "id": st.just("c"),
                        "type": st.just("function"),
                        "function": st.fixed_dictionaries(
                            {
                                "name": st.text(min_size=1, max_size=10),
                                "arguments": st.one_of(
                                    st.dictionaries(st.text(max_size=8), JSON_VALUE).map(
                                        json.dumps
                                    ),
                                    st.dictionaries(st.text(max_size=8), JSON_VALUE),
                                ),
                            }
                        ),
                    }
                ),
                max_size=3,
            ),
        }
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=st.lists(MESSAGE, min_size=1, max_size=6),
    tools=st.lists(TOOL, max_size=4),
    thinking=st.booleans(),
)
def test_ceiling_bounds_generated_bodies(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], thinking: bool
) -> None:
    """Any generated chat body: the rendered template (both tojson flavours) and the
    simulator's count stay within the reserved ceiling."""
    body: dict[str, Any] = {"messages": messages, "enable_thinking": thinking}
    if tools:
        body["tools"] = tools
    sent, ceiling = engine_body(body)
    assert rendered_bytes(sent, html_safe=False) <= ceiling
    assert rendered_bytes(sent, html_safe=True) <= ceiling
    assert chat_prompt_tokens(sent["messages"], sent.get("tools")) <= ceiling


@settings(max_examples=300, deadline=None)
@given(value=JSON_VALUE)
def test_json_ceiling_bounds_every_tojson(value: Any) -> None:
    """`json_ceiling` is at least every ``tojson`` output: ASCII-escaped or not, HTML-safe or
    not, NFD bytes of the text included."""
    env = ImmutableSandboxedEnvironment()
    outputs = [
        json.dumps(value, ensure_ascii=True),
        json.dumps(value, ensure_ascii=False),
        str(env.from_string("{{ v | tojson }}").render(v=value)),
    ]
    for text in outputs:
        assert len(unicodedata.normalize("NFD", text).encode("utf-8")) <= json_ceiling(value)


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(exclude_categories=("Cs",))))
def test_text_ceilings_bound_nfc_bytes(text: str) -> None:
    """A string's ceiling is at least its NFC UTF-8 bytes (what a byte-level BPE reads), as
    text and as a JSON string."""
    nfc = len(unicodedata.normalize("NFC", text).encode("utf-8"))
    assert nfc + 2 <= string_ceiling(text)
    assert nfc <= completion_ceiling(text)
