"""Claude Code against `qwen38-gateway demo` exactly as README's Clients section shows it: the
tool round trip it promises, and a wrong key reported at once (skipped without the binary)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_cli_clients import find
from tests.test_demo import Demo, demo  # noqa: F401 - the demo fixture

# Claude Code retried a 401 for 171 s before x-should-retry: false; a bounded wait says it stops.
WRONG_KEY_BOUND_S = 30.0


def readme_claude_command() -> list[str]:
    """The `claude -p ...` line of README's Claude Code recipe, as argv."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("**Claude Code**") : text.index("**Codex CLI**")]
    (line,) = [ln for ln in section.splitlines() if ln.startswith("claude -p ")]
    return shlex.split(line)


def claude_env(demo: Demo, home: Path, key: str) -> dict[str, str]:  # noqa: F811
    """README's environment for Claude Code, pointed at the demo, in a private HOME."""
    home.mkdir(exist_ok=True)
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": demo.base_url.removesuffix("/v1"),
        "ANTHROPIC_AUTH_TOKEN": key,
        "ANTHROPIC_MODEL": "qwen3.8-27b",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }


def claude(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    binary = find("claude")
    if binary is None:
        pytest.skip("Claude Code not installed (npm install @anthropic-ai/claude-code)")
    return subprocess.run(
        [binary, *argv[1:]],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(300)
def test_readme_recipe_runs_the_tool_through_the_demo(demo: Demo, tmp_path: Path) -> None:  # noqa: F811
    """README's `claude -p` line: Bash runs (nothing denied), its result goes back, one turn of
    two requests ends in success; the same recipe with `touch` leaves the file behind."""
    argv = readme_claude_command()
    assert "--allowedTools" in argv and "Bash" in argv
    env = claude_env(demo, tmp_path / "home", demo.key)
    before = len(demo.access_logs())
    run = claude(argv, env, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:] + run.stdout[-2000:]
    result = json.loads(run.stdout)
    assert result["subtype"] == "success" and result["num_turns"] == 2, result
    assert result.get("permission_denials", []) == []
    messages = [e for e in demo.access_logs()[before:] if e.get("route") == "/v1/messages"]
    assert [e["status"] for e in messages] == [200, 200]
    touch = [re.sub(r"`ls`", "`touch ran-by-claude`", word) for word in argv]
    again = claude(touch, env, tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "ran-by-claude").exists()


@pytest.mark.timeout(120)
def test_a_wrong_key_is_reported_at_once(demo: Demo, tmp_path: Path) -> None:  # noqa: F811
    """A wrong key: Claude Code stops after the 401 (x-should-retry: false) within seconds,
    instead of retrying for minutes."""
    env = claude_env(demo, tmp_path / "home", "sk-q38-" + "x" * 40)
    before = len(demo.access_logs())
    started = time.monotonic()
    run = claude(readme_claude_command(), env, tmp_path)
    elapsed = time.monotonic() - started
    assert run.returncode != 0
    assert elapsed < WRONG_KEY_BOUND_S, f"{elapsed:.0f} s"
    refused = [e for e in demo.access_logs()[before:] if e.get("status") == 401]
    assert 1 <= len(refused) <= 2, refused
