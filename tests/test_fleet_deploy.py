"""The per-card engine template unit, the fleet example, the fleet alerts and the fleet docs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.config import ENGINE_NAME_RE, parse_settings
from tests.conftest import REPO, to_toml

DEPLOY = REPO / "deploy"
TEMPLATE = DEPLOY / "systemd" / "qwen38-engine@.service"
SINGLE = DEPLOY / "systemd" / "qwen38-engine.service"


def _service_lines(path: Path) -> list[str]:
    """The unit's lines with continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", path.read_text())
    return [line for line in joined.splitlines() if line and not line.startswith("#")]


def test_template_unit_passes_systemd_analyze_verify_as_an_instance(tmp_path: Path) -> None:
    """qwen38-engine@gpu0.service verifies (only the docker binary is absent here)."""
    verify = shutil.which("systemd-analyze")
    if verify is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd)")
    instance = tmp_path / "qwen38-engine@gpu0.service"
    shutil.copy(TEMPLATE, instance)
    result = subprocess.run(
        [verify, "verify", str(instance)], capture_output=True, text=True, timeout=60
    )
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and not re.search(r"Command \S*docker is not executable", line)
    ]
    assert problems == []


def test_template_runs_one_container_per_instance_with_its_own_config_and_card() -> None:
    """Each instance: its container name, its engines/<name>.toml as engine.toml, its GPU env
    file; everything else exactly as the single-engine unit."""
    template, single = _service_lines(TEMPLATE), _service_lines(SINGLE)
    assert "EnvironmentFile=/etc/qwen38/engines/%i.env" in template
    start = next(line for line in template if line.startswith("ExecStart="))
    assert "--name qwen38-engine-%i " in start
    assert "source=/etc/qwen38/engines/%i.toml,target=/etc/qwen38/engine.toml,readonly" in start
    assert '--gpus "\\"device=${QWEN38_GPU}\\""' in start
    generic = [
        line.replace("qwen38-engine-%i", "qwen38-engine")
        .replace("/etc/qwen38/engines/%i.toml", "/etc/qwen38/engine.toml")
        .replace(" %i", "")
        for line in template
        if line != "EnvironmentFile=/etc/qwen38/engines/%i.env"
    ]
    assert generic == single


def test_install_sh_installs_the_template_beside_the_units() -> None:
    """install.sh copies qwen38-engine@.service with the other units (it enables no instance)."""
    text = (DEPLOY / "install.sh").read_text()
    assert "qwen38-engine@.service" in text
    assert "enable --now --no-block qwen38-engine@" not in text


def test_the_readme_example_fleet_config_loads(tmp_path: Path) -> None:
    """The 4-card gateway.toml of deploy/README.md "Adding V100s" loads as four engines."""
    text = (DEPLOY / "README.md").read_text()
    section = text[text.index("## Adding V100s") :]
    block = re.search(r"```toml\n(.*?)```", section, re.S)
    assert block is not None
    import tomllib

    settings = parse_settings(tomllib.loads(block.group(1)))
    names = [spec.name for spec in settings.engine_specs]
    assert names == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert all(ENGINE_NAME_RE.match(n) for n in names)
    assert to_toml({"engines": [{"name": "x", "socket": "/s"}]}).count("[[engines]]") == 1
