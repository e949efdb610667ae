"""engine.toml: defaults, validation errors naming key and value, refused flags and variables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    ConfigError,
    EngineConfig,
    Settings,
    SuperviseConfig,
    config_path,
    load_settings,
    parse_settings,
)

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent


def test_missing_file_means_all_defaults(tmp_path: Path) -> None:
    """A config file that does not exist gives the DESIGN section 8 defaults."""
    settings = load_settings(tmp_path / "absent.toml")
    assert settings == Settings(source=None)
    engine = settings.engine
    assert engine.program == ("python3", "-m", "vllm.entrypoints.openai.api_server")
    assert engine.model_path == "/models/Qwen3.8-27B-QUASAR-NVFP4"
    assert engine.served_model == "qwen3.8-27b"
    assert engine.socket == "/run/qwen38/engine.sock"
    assert (engine.gpu, engine.max_model_len, engine.kv_cache_dtype) == ("0", 254976, "fp8_e5m2")
    assert (engine.gpu_memory_utilization, engine.max_num_seqs) == (0.90, 1)
    assert (engine.reasoning_parser, engine.tool_call_parser) == ("qwen3", "qwen3_coder")
    assert engine.attention_backend == "FLASH_ATTN_V100"
    assert (engine.extra_args, dict(engine.env)) == ((), {})
    supervise = settings.supervise
    assert (supervise.start_timeout_s, supervise.health_interval_s) == (1800, 5)
    assert (supervise.unhealthy_after_s, supervise.stop_grace_s) == (60, 30)


def test_config_path_precedence() -> None:
    """--config wins over $QWEN38_ENGINE_CONFIG, which wins over /etc/qwen38/engine.toml."""
    assert str(config_path("/a.toml", {CONFIG_ENV: "/b.toml"})) == "/a.toml"
    assert str(config_path(None, {CONFIG_ENV: "/b.toml"})) == "/b.toml"
    assert str(config_path(None, {})) == DEFAULT_CONFIG_PATH


def test_shipped_example_loads() -> None:
    """deploy/etc/engine.toml is valid and keeps the reference values."""
    example = REPO / "deploy" / "etc" / "engine.toml"
    if not example.exists():
        pytest.skip("deploy/etc/engine.toml not present")
    settings = load_settings(example)
    assert settings.source == str(example)
    assert settings.engine == EngineConfig()


def test_full_file_with_short_timings(tmp_path: Path) -> None:
    """Every section parses; float timings below a second are accepted for tests."""
    path = tmp_path / "engine.toml"
    path.write_text(
        """
[engine]
program = ["qwen38-engine", "sim"]
gpu = "GPU-5a0c3e4f-8f1b-2d7e-91a3-0c6b2f9d4e11"
gpu_memory_utilization = 0.94
max_num_seqs = 2
extra_args = ["--enable-prefix-caching", "--max-num-batched-tokens", "8192"]
[engine.env]
VLLM_LOGGING_LEVEL = "DEBUG"
[supervise]
start_timeout_s = 20
health_interval_s = 0.2
probe_timeout_s = 0.5
unhealthy_after_s = 2
stop_grace_s = 1.5
warmup = false
warmup_max_tokens = 4
[preflight]
min_shm_mib = 64
cache_dir = "/var/cache/qwen38"
"""
    )
    settings = load_settings(path)
    assert settings.engine.program == ("qwen38-engine", "sim")
    assert settings.engine.gpu_kind == "uuid"
    assert settings.engine.extra_args[0] == "--enable-prefix-caching"
    assert dict(settings.engine.env) == {"VLLM_LOGGING_LEVEL": "DEBUG"}
    assert settings.supervise == SuperviseConfig(
        start_timeout_s=20.0,
        health_interval_s=0.2,
        probe_timeout_s=0.5,
        unhealthy_after_s=2.0,
        stop_grace_s=1.5,
        warmup=False,
        warmup_max_tokens=4,
    )
    assert settings.preflight.min_shm_mib == 64


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"engine": {"modle_path": "/m"}}, "unknown key engine.modle_path"),
        ({"engnie": {}}, "unknown section [engnie]"),
        ({"supervise": {"watchdog": True}}, "unknown key supervise.watchdog"),
        ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs = 0: must be between 1"),
        ({"engine": {"max_num_seqs": "1"}}, 'engine.max_num_seqs = "1": expected an integer'),
        ({"engine": {"max_model_len": True}}, "engine.max_model_len = true: expected an integer"),
        (
            {"engine": {"gpu_memory_utilization": 1.5}},
            "engine.gpu_memory_utilization = 1.5: must be more than 0.0 and at most 1.0",
        ),
        (
            {"engine": {"gpu_memory_utilization": 0}},
            "engine.gpu_memory_utilization = 0: must be more than 0.0",
        ),
        ({"engine": {"gpu": 0}}, "engine.gpu = 0: expected a string"),
        ({"engine": {"gpu": "first"}}, 'engine.gpu = "first": expected one GPU'),
        ({"engine": {"gpu": "0,1"}}, 'engine.gpu = "0,1": expected one GPU'),
        ({"engine": {"program": []}}, "engine.program = []: expected a non-empty list"),
        (
            {"engine": {"socket": "engine.sock"}},
            'engine.socket = "engine.sock": expected an absolute',
        ),
        ({"engine": {"socket": "/" + "s" * 120}}, "longer than 107 bytes"),
        ({"engine": {"served_model": "qwen 3"}}, 'engine.served_model = "qwen 3": expected a name'),
        ({"engine": {"env": {"A": 1}}}, "engine.env.A = 1: expected a string"),
        ({"engine": {"env": {"1A": "x"}}}, "engine.env.1A: not a valid environment variable name"),
        ({"supervise": {"warmup": "yes"}}, 'supervise.warmup = "yes": expected true or false'),
        ({"supervise": {"stop_grace_s": -1}}, "supervise.stop_grace_s = -1: must be at least 0.0"),
        (
            {"supervise": {"health_interval_s": 5, "unhealthy_after_s": 2}},
            "supervise.unhealthy_after_s = 2.0: must be at least supervise.health_interval_s",
        ),
        ({"preflight": {"min_shm_mib": 1.5}}, "preflight.min_shm_mib = 1.5: expected an integer"),
    ],
)
def test_invalid_values_name_key_and_value(data: dict[str, Any], expected: str) -> None:
    """Each invalid entry is refused with a message naming the key and the offending value."""
    with pytest.raises(ConfigError) as info:
        parse_settings(data)
    assert expected in str(info.value)


def test_error_names_the_file(tmp_path: Path) -> None:
    """Errors from a file start with its path; invalid TOML is reported as such."""
    path = tmp_path / "engine.toml"
    path.write_text("[engine]\nmax_num_seqs = 0\n")
    with pytest.raises(ConfigError, match=rf"^{path}: engine.max_num_seqs = 0"):
        load_settings(path)
    path.write_text("[engine\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not valid TOML"):
        load_settings(path)


@pytest.mark.parametrize(
    "extra",
    [
        ["--api-key", "sk-live-SECRET"],
        ["--api-key=sk-live-SECRET"],
        ["--api_key", "sk-live-SECRET"],
        ["--api-k", "sk-live-SECRET"],
    ],
)
def test_api_key_in_extra_args_is_refused_without_echoing_it(extra: list[str]) -> None:
    """--api-key in any spelling vLLM's parser accepts is refused, and the key is not shown."""
    with pytest.raises(ConfigError) as info:
        parse_settings({"engine": {"extra_args": extra}})
    message = str(info.value)
    assert "--api-key is refused" in message
    assert "SECRET" not in message


def test_api_server_count_is_not_mistaken_for_api_key() -> None:
    """Other --api-* flags pass (only prefixes of --api-key are refused)."""
    settings = parse_settings({"engine": {"extra_args": ["--api-server-count", "1"]}})
    assert settings.engine.extra_args == ("--api-server-count", "1")


@pytest.mark.parametrize(
    ("flag", "key"),
    [
        ("--uds=/tmp/x.sock", "engine.socket"),
        ("--max-num-seqs", "engine.max_num_seqs"),
        ("--kv_cache_dtype", "engine.kv_cache_dtype"),
        ("--attention-backend", "engine.attention_backend"),
    ],
)
def test_managed_flags_in_extra_args_point_to_their_key(flag: str, key: str) -> None:
    """A flag the launcher computes is refused in extra_args, naming the key to use."""
    with pytest.raises(ConfigError, match=f"use {key} instead"):
        parse_settings({"engine": {"extra_args": [flag, "1"]}})


def test_attention_backend_env_is_refused_pointing_to_the_key() -> None:
    """VLLM_ATTENTION_BACKEND is refused: this build ignores it; attention_backend is the way."""
    with pytest.raises(ConfigError) as info:
        parse_settings({"engine": {"env": {"VLLM_ATTENTION_BACKEND": "FLASH_ATTN_V100"}}})
    message = str(info.value)
    assert "engine.env.VLLM_ATTENTION_BACKEND is refused" in message
    assert "ignores it" in message and "engine.attention_backend" in message


@pytest.mark.parametrize(
    "name",
    [
        "VLLM_API_KEY",
        "VLLM_SERVER_DEV_MODE",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "CUDA_VISIBLE_DEVICES",
    ],
)
def test_dangerous_or_managed_env_is_refused_without_echoing_value(name: str) -> None:
    """Keys, dev-mode routes and launcher-managed CUDA variables cannot be set in [engine.env]."""
    with pytest.raises(ConfigError) as info:
        parse_settings({"engine": {"env": {name: "sk-live-SECRET"}}})
    assert f"engine.env.{name} is refused" in str(info.value)
    assert "SECRET" not in str(info.value)
