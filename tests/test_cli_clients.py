"""Codex CLI (`codex exec`) and Claude Code (`claude -p`), configured as the README says, finish
a turn with a tool call through the real gateway and the simulator.

The clients are large native binaries from the npm registry (`@openai/codex`,
`@anthropic-ai/claude-code`); the tests run when they are found on ``PATH`` or in
``$QWEN38_CLIENTS_BIN`` (a ``node_modules/.bin`` directory) and are skipped otherwise. The
simulator's ``--tool-call`` answers the first request with one call of a real tool of each client
(Claude Code's ``Bash``, Codex's ``exec_command``) and the request carrying its result with text.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import KEY_A, Gateway

MARK = "hi-from-tool"


def find(name: str) -> str | None:
    """The client binary ``name`` from ``$QWEN38_CLIENTS_BIN`` or ``PATH``."""
    directory = os.environ.get("QWEN38_CLIENTS_BIN")
    if directory and (Path(directory) / name).exists():
        return str(Path(directory) / name)
    return shutil.which(name)


def stack(
    sim_factory: Callable[..., Any], gateway_factory: Callable[..., Gateway], tool_call: str
) -> Gateway:
    sim = sim_factory(
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "qwen3_coder",
        "--completion-tokens",
        "12",
        "--tool-call",
        tool_call,
    )
    return gateway_factory(sim, {"model": {"accepted": ["*"]}})


def engine_messages(gw: Gateway) -> list[list[dict[str, Any]]]:
    assert gw.sim is not None
    return [
        r["body"]["messages"] for r in gw.sim.model_records() if r["path"] == "/v1/chat/completions"
    ]


def codex_config(base_url: str) -> str:
    """The README's Codex ``config.toml`` for this gateway."""
    return f"""model = "qwen3.8-27b"
model_provider = "local"
check_for_update_on_startup = false
model_context_window = 254976
web_search = "disabled"
[model_providers.local]
name = "qwen38-gateway"
base_url = "{base_url}/v1"
env_key = "QWEN38_API_KEY"
wire_api = "responses"
[analytics]
enabled = false
[features]
plugins = false
apps = false
[otel]
exporter = "none"
metrics_exporter = "none"
trace_exporter = "none"
"""


@pytest.mark.timeout(300)
def test_claude_code_finishes_a_turn_with_a_tool_call(
    sim_factory: Any, gateway_factory: Any, workdir: Path
) -> None:
    """`claude -p` runs Bash through the gateway, sends its result back and ends the turn."""
    binary = find("claude")
    if binary is None:
        pytest.skip("Claude Code not installed (npm install @anthropic-ai/claude-code)")
    gw = stack(
        sim_factory,
        gateway_factory,
        f'Bash {{"command": "echo {MARK}", "description": "Print a greeting"}}',
    )
    home = workdir / "home"
    home.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": gw.base_url,
        "ANTHROPIC_AUTH_TOKEN": KEY_A,
        "ANTHROPIC_MODEL": "qwen3.8-27b",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    run = subprocess.run(
        [binary, "-p", f"Run echo {MARK}", "--output-format", "json", "--allowedTools", "Bash"],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert '"subtype":"success"' in run.stdout and '"num_turns":2' in run.stdout
    turns = engine_messages(gw)
    assert len(turns) == 2
    assert turns[1][-1]["role"] == "tool" and MARK in turns[1][-1]["content"]
    assert all(e["status"] == 200 for e in gw.access_logs() if e.get("route") == "/v1/messages")


@pytest.mark.timeout(300)
def test_codex_finishes_a_turn_with_a_tool_call(
    sim_factory: Any, gateway_factory: Any, workdir: Path
) -> None:
    """`codex exec` runs exec_command through the gateway, sends its output back and ends."""
    binary = find("codex")
    if binary is None:
        pytest.skip("Codex CLI not installed (npm install @openai/codex)")
    gw = stack(sim_factory, gateway_factory, f'exec_command {{"cmd": "echo {MARK}"}}')
    codex_home = workdir / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(codex_config(gw.base_url))
    project = workdir / "project"
    project.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(workdir),
        "CODEX_HOME": str(codex_home),
        "QWEN38_API_KEY": KEY_A,
    }
    run = subprocess.run(
        [binary, "exec", "--skip-git-repo-check", f"Run echo {MARK}"],
        env=env,
        cwd=project,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().startswith("Simulated")
    turns = engine_messages(gw)
    assert len(turns) == 2
    assert turns[1][-1]["role"] == "tool" and MARK in turns[1][-1]["content"]
    assert all(e["status"] == 200 for e in gw.access_logs() if e.get("route") == "/v1/responses")
