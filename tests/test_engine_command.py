"""The engine's command line: golden reference argv and environment, rendering, inheritance."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest

from engine.command import build_launch
from engine.config import EngineConfig

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent

REFERENCE_ARGV = [
    "python3", "-m", "vllm.entrypoints.openai.api_server",
    "--model", "/models/Qwen3.8-27B-QUASAR-NVFP4",
    "--served-model-name", "qwen3.8-27b",
    "--uds", "/run/qwen38/engine.sock",
    "--max-model-len", "254976",
    "--kv-cache-dtype", "fp8_e5m2",
    "--reasoning-parser", "qwen3",
    "--enable-auto-tool-choice",
    "--tool-call-parser", "qwen3_coder",
    "--attention-backend", "FLASH_ATTN_V100",
    "--disable-fastapi-docs",
    "--gpu-memory-utilization", "0.9",
    "--max-num-seqs", "1",
]  # fmt: skip

REFERENCE_TEXT = """\
env CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0 \\
  python3 -m vllm.entrypoints.openai.api_server \\
  --model /models/Qwen3.8-27B-QUASAR-NVFP4 \\
  --served-model-name qwen3.8-27b \\
  --uds /run/qwen38/engine.sock \\
  --max-model-len 254976 \\
  --kv-cache-dtype fp8_e5m2 \\
  --reasoning-parser qwen3 \\
  --enable-auto-tool-choice \\
  --tool-call-parser qwen3_coder \\
  --attention-backend FLASH_ATTN_V100 \\
  --disable-fastapi-docs \\
  --gpu-memory-utilization 0.9 \\
  --max-num-seqs 1
"""


def test_reference_command_line_is_exact() -> None:
    """The reference deployment's argv and environment, flag for flag (DESIGN section 8)."""
    launch = build_launch(EngineConfig())
    assert list(launch.argv) == REFERENCE_ARGV
    assert dict(launch.env) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"}
    assert not any(arg.startswith("--api-key") for arg in launch.argv)


def test_reference_rendering_is_exact() -> None:
    """`render` prints the env line, the program, then one flag with its value per line."""
    assert build_launch(EngineConfig()).render() == REFERENCE_TEXT


def test_rendering_pastes_back_to_the_same_words() -> None:
    """The rendered text, split by a shell, gives env assignments then the exact argv."""
    engine = EngineConfig(
        model_path="/models/Qwen 3.8 (27B)",
        extra_args=("--limit-mm-per-prompt", '{"image":0,"video":0}', "--language-model-only"),
        env=MappingProxyType({"VLLM_LOGGING_LEVEL": "DEBUG", "HF_HOME": "/var/cache/hf home"}),
    )
    launch = build_launch(engine)
    words = shlex.split(launch.render().replace("\\\n", " "))
    env_words = [f"{k}={v}" for k, v in launch.env.items()]
    assert words == ["env", *env_words, *launch.argv]
    assert launch.argv[-3:] == (
        "--limit-mm-per-prompt",
        '{"image":0,"video":0}',
        "--language-model-only",
    )
    assert launch.env["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_pci_bus_id_needs_a_resolved_device() -> None:
    """CUDA_VISIBLE_DEVICES cannot take a PCI bus id: it must be resolved to the GPU's UUID."""
    engine = EngineConfig(gpu="00000000:00:1E.0")
    with pytest.raises(ValueError, match="PCI bus id"):
        build_launch(engine)
    uuid = "GPU-5a0c3e4f-8f1b-2d7e-91a3-0c6b2f9d4e11"
    assert build_launch(engine, visible_devices=[uuid]).env["CUDA_VISIBLE_DEVICES"] == uuid


def test_child_environment_drops_keys_and_systemd_variables() -> None:
    """Inherited VLLM_API_KEY, dev mode and NOTIFY_SOCKET are dropped (names reported); CUDA_* overridden."""
    launch = build_launch(EngineConfig(env=MappingProxyType({"VLLM_LOGGING_LEVEL": "INFO"})))
    inherited = {
        "PATH": "/usr/bin",
        "VLLM_API_KEY": "sk-live-SECRET",
        "VLLM_SERVER_DEV_MODE": "1",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "30000000",
        "CUDA_VISIBLE_DEVICES": "3",
    }
    env, dropped = launch.environment(inherited)
    assert env == {
        "PATH": "/usr/bin",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "0",
        "VLLM_LOGGING_LEVEL": "INFO",
    }
    assert dropped == ("NOTIFY_SOCKET", "VLLM_API_KEY", "VLLM_SERVER_DEV_MODE", "WATCHDOG_USEC")


def test_command_subcommand_prints_the_reference(tmp_path: Path) -> None:
    """`qwen38-engine command` with the defaults prints exactly the reference text."""
    env = {k: v for k, v in os.environ.items() if k != "QWEN38_ENGINE_CONFIG"}
    done = subprocess.run(
        [sys.executable, "-m", "engine", "command", "--config", str(tmp_path / "absent.toml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == REFERENCE_TEXT


def test_command_subcommand_reports_config_errors(tmp_path: Path) -> None:
    """An invalid engine.toml makes `command` exit 2 naming key and value on stderr."""
    path = tmp_path / "engine.toml"
    path.write_text('[engine]\ngpu_memory_utilization = "high"\n')
    done = subprocess.run(
        [sys.executable, "-m", "engine", "command", "--config", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert 'engine.gpu_memory_utilization = "high": expected a number' in done.stderr
    assert done.stdout == ""
