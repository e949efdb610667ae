"""README's client snippets run as written against the real `qwen38-gateway demo`."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_demo import Demo, demo  # noqa: F401 - the demo fixture

REPO = Path(__file__).resolve().parent.parent
_SNIPPET_RE = re.compile(r"<!-- client-snippet: ([a-z0-9-]+) -->\n```([a-z]+)\n(.*?)```", re.S)
# Snippet -> the Python modules (or programs) it needs; missing ones skip it with the reason.
NEEDS = {
    "curl": ("curl",),
    "openai-sdk": ("openai",),
    "langchain": ("langchain_openai", "langchain_deepseek"),
    "litellm": ("litellm",),
    "llm-cli": ("llm",),
}


def snippets() -> dict[str, tuple[str, str]]:
    """The README's marked snippets: name -> (language, code)."""
    text = (REPO / "README.md").read_text()
    return {name: (lang, code) for name, lang, code in _SNIPPET_RE.findall(text)}


def _missing(name: str) -> list[str]:
    bindir = Path(sys.executable).parent
    out = []
    for need in NEEDS[name]:
        if need in ("curl", "llm"):
            if not (bindir / need).exists() and not any(
                (Path(d) / need).exists() for d in os.environ.get("PATH", "").split(os.pathsep)
            ):
                out.append(need)
        elif importlib.util.find_spec(need) is None:
            out.append(need)
    return out


def _run(demo: Demo, name: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:  # noqa: F811
    lang, code = snippets()[name]
    env = {
        **os.environ,
        "OPENAI_BASE_URL": demo.base_url,
        "OPENAI_API_KEY": demo.key,
        "LLM_USER_PATH": str(tmp_path / "llm"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    if lang == "python":
        argv = [sys.executable, "-c", code]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", code]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90, cwd=tmp_path)


def test_litellm_snippet_sets_the_variable_its_text_names() -> None:
    """The LiteLLM snippet itself sets LITELLM_LOCAL_MODEL_COST_MAP (the test's environment does
    not: a user's does not either), before LiteLLM is imported."""
    _, code = snippets()["litellm"]
    text = (REPO / "README.md").read_text()
    named = re.findall(r"`(LITELLM_[A-Z_]+)=True`", text)
    assert named == ["LITELLM_LOCAL_MODEL_COST_MAP"]
    setting = f'os.environ["{named[0]}"] = "True"'
    assert setting in code and code.index(setting) < code.index("import litellm")


def test_readme_has_every_client_snippet() -> None:
    """The Clients section marks a snippet for each client the tests run."""
    assert set(NEEDS) <= set(snippets())


@pytest.mark.parametrize("name", list(NEEDS))
def test_client_snippet_runs(demo: Demo, name: str, tmp_path: Path) -> None:  # noqa: F811
    """A README client snippet exits 0 against the demo and prints the model's answer."""
    missing = _missing(name)
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (pip install -e '.[clients]')")
    done = _run(demo, name, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip(), done.stderr[-2000:]
    if name in ("openai-sdk", "langchain"):
        reasoning = [line for line in done.stdout.splitlines() if line.startswith("reasoning:")]
        assert reasoning and reasoning[0].strip() != "reasoning: None"
    if name == "langchain":
        assert "get_weather" in done.stdout
    if name == "curl":
        assert '"reasoning_content"' in done.stdout and '"content"' in done.stdout
