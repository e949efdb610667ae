"""The CPU engine's KV cache dtype: FP8 only on a CPU with AVX-512 or AMX, decided in engine.cpukv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.command import build_launch
from engine.config import load_settings
from engine.cpukv import (
    FP8_IF_SUPPORTED,
    cpu_flags,
    fp8_kv_cache_supported,
    read_cpu_flags,
    resolve_kv_cache_dtype,
)

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
CPUINFO = REPO / "tests" / "fixtures" / "cpuinfo"
ETC = REPO / "deploy" / "etc"

# Recorded /proc/cpuinfo (tests/fixtures/cpuinfo/README) and the dtype vLLM's CPU build accepts.
HOSTS = {
    "epyc-avx512": "fp8_e5m2",
    "epyc-no-avx512": "auto",
    "xeon-sapphire-rapids-amx": "fp8_e5m2",
    "xeon-phi-knl": "auto",
}


def flags_of(host: str) -> frozenset[str]:
    return cpu_flags((CPUINFO / f"{host}.txt").read_text())


def kv_flag(argv: tuple[str, ...]) -> str:
    return argv[argv.index("--kv-cache-dtype") + 1]


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_cpu_config_gets_the_dtype_its_cpu_supports(host: str) -> None:
    """engine.cpu.toml's command line carries fp8_e5m2 with AVX-512 or AMX, else auto."""
    settings = load_settings(ETC / "engine.cpu.toml")
    assert settings.engine.kv_cache_dtype == FP8_IF_SUPPORTED
    launch = build_launch(settings.engine, cpu_flags=flags_of(host))
    assert kv_flag(launch.argv) == HOSTS[host]


def test_each_branch_says_why() -> None:
    """The launcher's log line names what the CPU has or misses."""
    fp8 = resolve_kv_cache_dtype(FP8_IF_SUPPORTED, flags_of("epyc-avx512"))
    assert fp8.dtype == "fp8_e5m2"
    assert "AVX-512" in fp8.reason
    amx = resolve_kv_cache_dtype(FP8_IF_SUPPORTED, frozenset({"avx2", "amx_tile"}))
    assert (amx.dtype, amx.reason) == ("fp8_e5m2", "the CPU has amx_tile: FP8 KV cache")
    auto = resolve_kv_cache_dtype(FP8_IF_SUPPORTED, flags_of("xeon-phi-knl"))
    assert auto.dtype == "auto"
    assert "missing avx512bw avx512dq avx512vl" in auto.reason


def test_avx512_means_all_four_extensions_as_pytorch_counts_them() -> None:
    """avx512f alone is not AVX-512 to PyTorch (and so to vLLM); the four together are."""
    assert not fp8_kv_cache_supported(frozenset({"avx512f"}))
    assert not fp8_kv_cache_supported(frozenset({"avx512f", "avx512vl", "avx512bw"}))
    assert fp8_kv_cache_supported(frozenset({"avx512f", "avx512vl", "avx512bw", "avx512dq"}))
    assert fp8_kv_cache_supported(frozenset({"amx_tile"}))
    assert not fp8_kv_cache_supported(frozenset())


@pytest.mark.parametrize("config", ["engine.toml", "engine.tp2.toml"])
def test_gpu_configs_keep_their_fp8_whatever_the_cpu(config: str) -> None:
    """The V100 configs say fp8_e5m2 and get it on any CPU: only the sentinel is resolved."""
    settings = load_settings(ETC / config)
    assert settings.engine.kv_cache_dtype == "fp8_e5m2"
    devices = tuple(str(i) for i in range(settings.engine.tensor_parallel_size))
    launch = build_launch(
        settings.engine, visible_devices=devices, cpu_flags=flags_of("epyc-no-avx512")
    )
    assert kv_flag(launch.argv) == "fp8_e5m2"


def test_no_flags_line_or_no_cpuinfo_means_the_default(tmp_path: Path) -> None:
    """A cpuinfo without flags (or none at all) chooses vLLM's default, never FP8."""
    assert cpu_flags("processor\t: 0\nvendor_id\t: ARM\n") == frozenset()
    assert read_cpu_flags(tmp_path / "absent") == frozenset()
    assert resolve_kv_cache_dtype(FP8_IF_SUPPORTED, frozenset()).dtype == "auto"


def test_command_subcommand_shows_this_hosts_choice() -> None:
    """`qwen38-engine command` with engine.cpu.toml prints the dtype this host's CPU gets."""
    done = subprocess.run(
        [sys.executable, "-m", "engine", "command", "--config", str(ETC / "engine.cpu.toml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    expected = "fp8_e5m2" if fp8_kv_cache_supported(read_cpu_flags()) else "auto"
    assert f"--kv-cache-dtype {expected} " in done.stdout
