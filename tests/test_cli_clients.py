"""Codex CLI (`codex exec`) and Claude Code (`claude -p`), configured as the README says, finish
a turn with a tool call through the real gateway and the simulator.

The clients are large native binaries from the npm registry (`@openai/codex`,
`@anthropic-ai/claude-code`); the tests run when they are found on ``PATH`` or in
``$QWEN38_CLIENTS_BIN`` (a ``node_modules/.bin`` directory) and are skipped otherwise. The
simulator's ``--tool-call`` answers the first request with one call of a real tool of each client
(Claude Code's ``Bash``, Codex's ``exec_command``) and the request carrying its result with text.

Against real vLLM (the tiny model of `tests.realengine.model`, here with a 65,536-token context:
Claude Code's first request is about 30,000 tokens) the model calls ``get_weather``, a tool
neither client has: the client answers with an error result, and the model then ends the turn.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import KEY_A, Gateway, _stop, start_gateway
from tests.realengine.fixtures import real_engine_skipped
from tests.realengine.launcher import (
    EngineUnavailable,
    LaunchedEngine,
    check_engine_python,
    engine_python,
    launch,
)

MARK = "hi-from-tool"
LONG_CONTEXT = 65536
WEATHER = "What is the weather like in Paris today?"


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


def run_claude(
    binary: str, gw: Gateway, workdir: Path, prompt: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``claude -p`` with the README's environment (offline switches included)."""
    home = workdir / "claude-home"
    home.mkdir(exist_ok=True)
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
    return subprocess.run(
        [binary, "-p", prompt, "--output-format", "json", "--allowedTools", "Bash"],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def run_codex(
    binary: str, gw: Gateway, workdir: Path, prompt: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``codex exec`` with the README's ``config.toml``."""
    codex_home = workdir / "codex-home"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(gw.base_url))
    project = workdir / "project"
    project.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(workdir),
        "CODEX_HOME": str(codex_home),
        "QWEN38_API_KEY": KEY_A,
    }
    return subprocess.run(
        [binary, "exec", "--skip-git-repo-check", prompt],
        env=env,
        cwd=project,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


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
    run = run_claude(binary, gw, workdir, f"Run echo {MARK}")
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
    run = run_codex(binary, gw, workdir, f"Run echo {MARK}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().startswith("Simulated")
    turns = engine_messages(gw)
    assert len(turns) == 2
    assert turns[1][-1]["role"] == "tool" and MARK in turns[1][-1]["content"]
    assert all(e["status"] == 200 for e in gw.access_logs() if e.get("route") == "/v1/responses")


@pytest.fixture(scope="module")
def long_real_gateway() -> Iterator[Gateway]:
    """Real vLLM (CPU) with a 65,536-token context, and a gateway in front of it."""
    if real_engine_skipped():
        pytest.skip("real engine not run: QWEN38_SKIP_REAL_ENGINE is set")
    if find("claude") is None and find("codex") is None:
        pytest.skip("neither Codex CLI nor Claude Code is installed")
    python = engine_python()
    try:
        check_engine_python(python)
    except EngineUnavailable as exc:
        pytest.fail(f"real engine unavailable: {exc}", pytrace=False)
    workdir = Path(tempfile.mkdtemp(prefix="q38cl-", dir="/tmp"))
    engine: LaunchedEngine = launch("real", workdir, python, max_model_len=LONG_CONTEXT)
    try:
        gw = start_gateway(
            workdir,
            None,
            {
                "engine": {
                    "socket": engine.socket,
                    "ready_file": engine.ready_file,
                    "max_model_len": LONG_CONTEXT,
                },
                "model": {"accepted": ["*"]},
            },
        )
        try:
            yield gw
        finally:
            _stop(gw.proc)
    finally:
        engine.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def assert_tool_round_trip(gw: Gateway, route: str) -> None:
    """Two requests on ``route``, both 200: the tool call, then the turn with its result."""
    logs = [e for e in gw.access_logs() if e.get("route") == route]
    assert [e["status"] for e in logs[-2:]] == [200, 200]
    assert logs[-1]["prompt_tokens"] > logs[-2]["prompt_tokens"]


@pytest.mark.real_engine
@pytest.mark.timeout(600)
def test_claude_code_tool_turn_on_the_real_engine(
    long_real_gateway: Gateway, workdir: Path
) -> None:
    """`claude -p` on real vLLM: the model's get_weather call, Claude Code's error result, the
    model's final answer; the turn completes."""
    binary = find("claude")
    if binary is None:
        pytest.skip("Claude Code not installed (npm install @anthropic-ai/claude-code)")
    run = run_claude(binary, long_real_gateway, workdir, WEATHER)
    assert run.returncode == 0, run.stderr[-2000:]
    assert '"subtype":"success"' in run.stdout and '"num_turns":2' in run.stdout
    assert "Hello from the tiny model!" in run.stdout
    assert_tool_round_trip(long_real_gateway, "/v1/messages")


@pytest.mark.real_engine
@pytest.mark.timeout(600)
def test_codex_tool_turn_on_the_real_engine(long_real_gateway: Gateway, workdir: Path) -> None:
    """`codex exec` on real vLLM: the model's get_weather call, Codex's error output, the
    model's final answer."""
    binary = find("codex")
    if binary is None:
        pytest.skip("Codex CLI not installed (npm install @openai/codex)")
    run = run_codex(binary, long_real_gateway, workdir, WEATHER)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "Hello from the tiny model!"
    assert "get_weather" in run.stderr
    assert_tool_round_trip(long_real_gateway, "/v1/responses")
