"""Which tool the simulator's model calls: the one the prompt names, else a shell tool, else the
first (engine/sim/README.md, "Tool calls"); strings from the prompt's backquoted text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.sim.tools import choose_tool, plan_tools, prompt_text
from gateway.translate.anthropic_request import translate_messages

pytestmark = pytest.mark.fast

# Claude Code 2.1.197's first request (shared/agent-clients, recorded): 24 tools, Agent first.
RECORDED = Path(__file__).parent / "fixtures" / "clients"


def tool(name: str, required: tuple[str, ...] = ("command",)) -> dict[str, Any]:
    properties = {field: {"type": "string"} for field in required}
    parameters = {"type": "object", "properties": properties, "required": list(required)}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


CLAUDE_TOOLS = [tool("Agent", ("prompt",)), tool("Bash"), tool("Read", ("file_path",))]


def user(*texts: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": text} for text in texts]}]


def planned(tools: list[dict[str, Any]], messages: list[dict[str, Any]]) -> tuple[str, Any]:
    plan = plan_tools({"tools": tools}, messages, auto_allowed=True)
    assert plan is not None
    ((name, arguments),) = plan.calls
    return name, arguments


def test_a_shell_tool_is_called_when_the_prompt_names_none() -> None:
    """Claude Code offers Agent first; "List the files" calls Bash, not Agent."""
    assert planned(CLAUDE_TOOLS, user("List the files here"))[0] == "Bash"
    codex = [tool("update_plan", ("plan",)), tool("exec_command", ("cmd",))]
    assert planned(codex, user("List the files here"))[0] == "exec_command"


def test_the_tool_the_prompt_names_wins_and_backquotes_give_the_string() -> None:
    """A tool named in the prompt is called, with the first `backquoted` text as its strings."""
    assert planned(CLAUDE_TOOLS, user("Run `ls -la` with the Bash tool")) == (
        "Bash",
        {"command": "ls -la"},
    )
    assert planned(CLAUDE_TOOLS, user("Use Read on `README.md`, not Bash")) == (
        "Read",
        {"file_path": "README.md"},
    )


def test_only_the_users_own_words_count() -> None:
    """Claude Code's system-reminder before the words and its agent list after them (both name
    Agent) do not choose: the first other text of the last user turn does."""
    messages = [
        {"role": "assistant", "content": "Earlier answer naming Read."},
        *user("<system-reminder>Use the Agent tool for searches</system-reminder>", "Hi"),
        {"role": "user", "content": "Available agent types for the Agent tool: ..."},
    ]
    assert prompt_text(messages) == "Hi"
    assert planned(CLAUDE_TOOLS, messages)[0] == "Bash"


def test_without_a_named_or_shell_tool_the_first_is_called_as_before() -> None:
    """get_weather and get_time, a prompt naming neither: the first, strings "Paris"."""
    tools = [tool("get_weather", ("city",)), tool("get_time", ("zone",))]
    assert planned(tools, user("What is the weather like in Paris today?")) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert planned(tools, user("And get_time?"))[0] == "get_time"


def test_names_match_as_whole_words_only() -> None:
    """ "Reading" is not Read, "Bashful" not Bash: whole names only."""
    functions = [{"name": "Agent"}, {"name": "Read"}]
    assert choose_tool(functions, "Reading is Bashful")["name"] == "Agent"


def test_the_recorded_claude_code_request_gets_bash() -> None:
    """Claude Code's real first request ("List the files in the current directory", 24 tools,
    Agent first), translated by the gateway as the engine gets it: a Bash call."""
    recorded = json.loads((RECORDED / "claude-code-first-request-tool_use-sse.json").read_text())
    body = recorded["request"]["body"]
    body = json.loads(body) if isinstance(body, str) else body
    chat = translate_messages(body).chat
    assert chat["tools"][0]["function"]["name"] == "Agent"
    assert planned(chat["tools"], chat["messages"])[0] == "Bash"
