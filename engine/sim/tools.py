"""Tool calling in the simulator: which tool the "model" calls, and with which arguments.

vLLM checks `tools` and `tool_choice` before generating (vLLM's `ChatCompletionRequest`
validators, vllm-protocol.md sections 4.1 and 7.3); the simulator answers the same 400s. When
the request allows a call, the simulated model makes one, as the tiny deterministic test model
of the real engine does whenever tools are in its prompt:

- `tool_choice` "required" or absent/"auto" (with `--enable-auto-tool-choice`): one tool, chosen
  by `choose_tool` from the prompt (`prompt_text`: the user's own words): the tool the prompt
  names (its exact name as a word; the earliest named wins), else a shell tool (`SHELL_TOOLS`:
  Claude Code's `Bash`, Codex's `exec_command`), else the first tool; a conversation whose last
  message is a tool result is answered in text instead ("auto" only: "required" forces a call
  on every turn, as vLLM's guided decoding does);
- a named function (`{"type": "function", "function": {"name": ...}}`): that tool, produced as
  plain JSON by guided decoding, so the choice ends with finish_reason `stop` (section 5.1);
- "none": a text answer.

Arguments are valid JSON for the tool's `parameters` schema (JSON Schema, draft 2020-12
keywords `type`, `enum`, `const`, `properties`, `required`, `items`, `minItems`, `minimum`,
`maximum`, `anyOf`, `oneOf`): every required property gets a deterministic value of its type
(strings the first `backquoted` text of the prompt, else "Paris", the real test model's city;
integers and numbers 1 within their bounds; booleans true; arrays of `minItems` (at least one)
sample items). So "Run `ls` with the Bash tool" makes Claude Code run ``ls``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A JSON Schema nested deeper than this is sampled as an empty object / "Paris": bodies may be
# hostile (600-deep lists), and no real tool schema comes close.
MAX_SCHEMA_DEPTH = 16
SAMPLE_STRING = "Paris"
# Tools that run a shell command, called when the prompt names no tool: Claude Code's, Codex
# CLI's (shared/agent-clients.md), and the common generic names.
SHELL_TOOLS = ("Bash", "exec_command", "shell", "local_shell")
_QUOTED = re.compile(r"`([^`\n]+)`")


class ToolError(ValueError):
    """A `tools` / `tool_choice` the engine rejects: `param` is vLLM's parameter name, and
    `validation` is True for the framework's field validation ("Bad Request")."""

    def __init__(self, message: str, param: str | None, *, validation: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.validation = validation


@dataclass(frozen=True)
class ToolPlan:
    """The tool calls a chat answer makes.

    `calls` holds (function name, arguments object) pairs; `named` is True for a named
    `tool_choice` (guided JSON: no tool-call markup, finish_reason `stop`); `forced` is True
    for "required" and named choices (the non-streaming `content` is then "" rather than null,
    as vLLM builds those messages).
    """

    calls: tuple[tuple[str, dict[str, Any]], ...]
    named: bool = False
    forced: bool = False


def sample_value(schema: object, depth: int = 0, text: str = SAMPLE_STRING) -> Any:
    """A deterministic value valid for the JSON Schema `schema` (rules in the module docstring);
    ``text`` is the value of its strings."""
    if not isinstance(schema, Mapping) or depth > MAX_SCHEMA_DEPTH:
        return text
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return sample_value(options[0], depth + 1, text)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None and isinstance(schema.get("properties"), Mapping):
        kind = "object"
    if kind == "object":
        return sample_arguments(schema, depth + 1, text)
    if kind == "array":
        count = schema.get("minItems")
        count = count if isinstance(count, int) and not isinstance(count, bool) else 1
        items = schema.get("items")
        return [sample_value(items, depth + 1, text) for _ in range(max(1, min(count, 8)))]
    if kind in ("integer", "number"):
        return _number(schema, integer=kind == "integer")
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return text


def _number(schema: Mapping[str, Any], *, integer: bool) -> int | float:
    value: float = 1
    low, high = schema.get("minimum"), schema.get("maximum")
    if isinstance(low, (int, float)) and not isinstance(low, bool) and value < low:
        value = low
    if isinstance(high, (int, float)) and not isinstance(high, bool) and value > high:
        value = high
    return int(value) if integer else value


def sample_arguments(schema: object, depth: int = 0, text: str = SAMPLE_STRING) -> dict[str, Any]:
    """Arguments for a function whose `parameters` is `schema`: its required properties only,
    in the order `required` lists them, strings ``text``; {} for a schema without any."""
    if not isinstance(schema, Mapping):
        return {}
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = schema.get("required")
    names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
    return {name: sample_value(properties.get(name), depth + 1, text) for name in names}


def _functions(tools: object) -> list[Mapping[str, Any]]:
    """The `function` objects of `tools`, checked as vLLM's request model does."""
    if not isinstance(tools, list):
        raise ToolError("Input should be a valid list", "body.tools", validation=True)
    if not tools:
        raise ToolError(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            "tools",
        )
    functions = []
    for position, tool in enumerate(tools):
        where = f"body.tools.{position}"
        if not isinstance(tool, Mapping):
            raise ToolError(
                "Input should be a valid dictionary or object to extract fields from",
                where,
                validation=True,
            )
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ToolError("Field required", where + ".function", validation=True)
        if not isinstance(function.get("name"), str):
            raise ToolError("Field required", where + ".function.name", validation=True)
        functions.append(function)
    return functions


def prompt_text(messages: Sequence[object]) -> str:
    """The prompt the tool choice reads: the first text of the user's last turn (the user
    messages after the last assistant message) that is not a ``<system-reminder>`` block; ""
    if none.

    The first, not the last: clients add their own context around the user's words (Claude
    Code's ``<system-reminder>`` parts before them, its list of agents and skills, which names
    tools, after them as another message).
    """
    turn: list[object] = []
    for message in reversed(messages):
        if not isinstance(message, Mapping) or message.get("role") != "user":
            break
        turn.insert(0, message)
    for message in turn:
        assert isinstance(message, Mapping)
        content = message.get("content")
        parts = [content] if isinstance(content, str) else content
        if not isinstance(parts, list):
            continue
        for part in parts:
            text = part.get("text") if isinstance(part, Mapping) else part
            if isinstance(text, str) and text.strip() and not _is_reminder(text):
                return text
    return ""


def _is_reminder(text: str) -> bool:
    stripped = text.strip()
    return stripped.startswith("<system-reminder>") and stripped.endswith("</system-reminder>")


def choose_tool(functions: Sequence[Mapping[str, Any]], prompt: str) -> Mapping[str, Any]:
    """The tool the simulated model calls: the one ``prompt`` names (the earliest mention of an
    exact tool name as a word), else the first of `SHELL_TOOLS` offered, else the first tool."""
    named: list[tuple[int, int]] = []
    for position, function in enumerate(functions):
        name = function["name"]
        found = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", prompt) if name else None
        if found is not None:
            named.append((found.start(), position))
    if named:
        return functions[min(named)[1]]
    shell = next((f for f in functions if f["name"] in SHELL_TOOLS), None)
    return shell if shell is not None else functions[0]


def _call(
    functions: Sequence[Mapping[str, Any]], messages: Sequence[object]
) -> tuple[str, dict[str, Any]]:
    """The chosen tool's name and arguments (strings: the prompt's first `quoted` text)."""
    prompt = prompt_text(messages)
    function = choose_tool(functions, prompt)
    quoted = _QUOTED.search(prompt)
    text = quoted.group(1) if quoted is not None else SAMPLE_STRING
    return function["name"], sample_arguments(function.get("parameters"), text=text)


def _last_is_tool_result(messages: Sequence[object]) -> bool:
    return (
        bool(messages) and isinstance(messages[-1], Mapping) and messages[-1].get("role") == "tool"
    )


def plan_tools(
    body: Mapping[str, Any], messages: Sequence[object], *, auto_allowed: bool
) -> ToolPlan | None:
    """The tool calls of a chat request, or None for a text answer.

    `auto_allowed` says whether the server runs with `--enable-auto-tool-choice` and a
    `--tool-call-parser`. Raises ToolError for what vLLM refuses (messages of vLLM 0.32, the
    parameter named): tools that are not a list of function objects, an empty list, a
    `tool_choice` without `tools`, an unknown named tool, an unknown choice, and "auto"
    without the server flags (ValueError with vLLM's message, param None).
    """
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice is not None and choice != "none":
            raise ToolError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    functions = _functions(tools)
    if choice is None:
        choice = "auto"
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        match = next((f for f in functions if f.get("name") == name), None)
        if match is None:
            raise ToolError(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
        return ToolPlan(
            ((match["name"], sample_arguments(match.get("parameters"))),), named=True, forced=True
        )
    if choice == "none":
        return None
    if choice == "auto":
        if not auto_allowed:
            raise ToolError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                None,
            )
        if _last_is_tool_result(messages):
            return None
        return ToolPlan((_call(functions, messages),))
    if choice == "required":
        return ToolPlan((_call(functions, messages),), forced=True)
    raise ToolError(
        f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
        '"required" are supported.',
        "tool_choice",
    )
