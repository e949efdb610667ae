"""engine.toml: the launcher's configuration (DESIGN section 8), parsed once into frozen dataclasses.

Every key has a default and a missing file means all defaults. Unknown keys and values of the wrong
type or range fail at load with a `ConfigError` naming the key and the value; values that could be
secrets (anything after ``--api-key``, ``VLLM_API_KEY``) are never echoed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.configvalues import (
    Check,
    check_bool,
    check_env,
    check_extra_args,
    check_float,
    check_gpu,
    check_gpus,
    check_int,
    check_name,
    check_path,
    check_program,
    check_socket,
    check_string,
    show,
)
from engine.configvalues import ConfigError as ConfigError  # part of this module's API
from engine.gpus import GpuKind, gpu_kind
from engine.tomlfile import load_toml

DEFAULT_CONFIG_PATH = "/etc/qwen38/engine.toml"
CONFIG_ENV = "QWEN38_ENGINE_CONFIG"


@dataclass(frozen=True)
class SpeculativeConfig:
    """``[engine.speculative]``: speculative decoding, rendered as vLLM's ``--speculative-config``.

    The keys are those of vLLM's ``SpeculativeConfig`` (vLLM documentation, Speculative
    Decoding: ``--speculative-config '{"method": ..., "model": ..., "num_speculative_tokens":
    ...}'``). Absent table: no speculative decoding.

    Attributes:
        method: vLLM's method name, e.g. ``"dflash"`` for a DFlash draft such as DFlash2.
        model: the draft model's directory.
        num_speculative_tokens: tokens proposed per step; 0 leaves it to the draft's config
            (vLLM takes the number from the draft model's config when it is absent).
        draft_tensor_parallel_size: the draft's tensor parallelism, 1 or the target's; 0 leaves
            vLLM's default (the target's).
    """

    method: str = "dflash"
    model: str = ""
    num_speculative_tokens: int = 0
    draft_tensor_parallel_size: int = 0

    def as_json(self) -> str:
        """The ``--speculative-config`` value: compact JSON, keys in a fixed order."""
        config: dict[str, object] = {"method": self.method, "model": self.model}
        if self.num_speculative_tokens:
            config["num_speculative_tokens"] = self.num_speculative_tokens
        if self.draft_tensor_parallel_size:
            config["draft_tensor_parallel_size"] = self.draft_tensor_parallel_size
        return json.dumps(config, separators=(",", ":"))


@dataclass(frozen=True)
class EngineConfig:
    """``[engine]``: what to run and with which vLLM flags (DESIGN section 8).

    Attributes:
        program: argv prefix; the launcher appends the flags (vllm-protocol.md section 1.2: the
            ``python -m vllm.entrypoints.openai.api_server`` form takes ``--model``).
        model_path: checkpoint directory (``--model``).
        served_model: ``--served-model-name``; the gateway's ``engine.model`` must match.
        socket: ``--uds`` path; the engine never listens on TCP.
        gpu: one GPU as an index (``"0"``), a UUID (``"GPU-..."``) or a PCI bus id
            (``"00000000:00:1E.0"``); becomes ``CUDA_VISIBLE_DEVICES`` with
            ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (a bus id is translated to the GPU's UUID, because
            CUDA does not accept bus ids there).
        gpus: several GPUs, each named as ``gpu`` is, instead of ``gpu`` (one of the two keys);
            the engine runs one tensor-parallel rank per GPU (``--tensor-parallel-size``), and
            ``CUDA_VISIBLE_DEVICES`` lists them in this order. Empty: ``gpu`` alone.
        max_model_len: context length in tokens; 254,976 fits the 256,484-token FP8 KV pool measured
            on the reference V100 (DEPLOYMENT-NOTES).
        kv_cache_dtype: ``--kv-cache-dtype``; ``fp8_e5m2`` is what Flash-V100 uses on SM70
            (vllm-protocol.md section 1.3). ``fp8_e5m2_if_cpu_supports`` (vLLM's CPU build
            only): ``fp8_e5m2`` on a CPU with AVX-512 or AMX, else ``auto``, decided by
            `engine.cpukv` when the command line is built.
        gpu_memory_utilization: fraction (0, 1] of the card vLLM may use (``--gpu-memory-utilization``).
            0.90 is vLLM's default, and 0.90 x 32 GiB = 28.8 GiB is the reference deployment's
            measured footprint of 28.77 GiB on the V100 (DEPLOYMENT-NOTES), the setting that
            produced the 256,484-token KV pool ``max_model_len`` relies on: lower values shrink the pool below one full
            context and vLLM refuses to start; higher values leave too little for the CUDA context
            and allocator fragmentation around the ~23 GB of weights. vLLM also refuses to start
            when less than this fraction of the card is free, which preflight checks.
        max_num_seqs: ``--max-num-seqs`` (vLLM requires >= 1). 1: the gateway sends one request
            at a time (DESIGN section 3, ``engine.max_concurrency = 1``), the KV pool holds about one
            full-length context, and vLLM reserves recurrent (Gated DeltaNet) state and CUDA graphs
            per sequence slot, memory the KV pool needs more.
        reasoning_parser: ``--reasoning-parser``; without it thinking text lands in ``content``.
        tool_call_parser: ``--tool-call-parser`` (with ``--enable-auto-tool-choice``).
        attention_backend: ``--attention-backend``; the flag, not ``VLLM_ATTENTION_BACKEND``
            (ignored by this build, vllm-protocol.md section 1.4).
        extra_args: appended after the computed flags; never ``--api-key``, never a managed flag.
        env: added to the engine's environment (``[engine.env]``).
        speculative: ``[engine.speculative]``, None without speculative decoding.
    """

    program: tuple[str, ...] = ("python3", "-m", "vllm.entrypoints.openai.api_server")
    model_path: str = "/models/Qwen3.8-27B-QUASAR-NVFP4"
    served_model: str = "qwen3.8-27b"
    socket: str = "/run/qwen38/engine.sock"
    gpu: str = "0"
    max_model_len: int = 254_976
    kv_cache_dtype: str = "fp8_e5m2"
    gpu_memory_utilization: float = 0.90
    max_num_seqs: int = 1
    reasoning_parser: str = "qwen3"
    tool_call_parser: str = "qwen3_coder"
    attention_backend: str = "FLASH_ATTN_V100"
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    gpus: tuple[str, ...] = ()
    speculative: SpeculativeConfig | None = None

    @property
    def gpu_kind(self) -> GpuKind:
        """How ``gpu`` names the card: ``index``, ``uuid`` or ``pci`` (validated at load)."""
        return gpu_kind(self.gpu)

    @property
    def devices(self) -> tuple[str, ...]:
        """The GPUs the engine uses, in rank order: ``gpus``, else ``(gpu,)``."""
        return self.gpus or (self.gpu,)

    @property
    def tensor_parallel_size(self) -> int:
        """One tensor-parallel rank per GPU (``--tensor-parallel-size``)."""
        return len(self.devices)


@dataclass(frozen=True)
class SuperviseConfig:
    """``[supervise]``: timings of the launcher's watch over the engine, in seconds.

    Attributes:
        start_timeout_s: from spawn to the end of the warm-up; loading 23 GB and compiling kernels
            on a V100 takes minutes (DESIGN section 8).
        health_interval_s: time between two ``GET /health`` probes.
        probe_timeout_s: longest wait for one probe's answer.
        unhealthy_after_s: no healthy answer for this long after ready: kill, exit non-zero.
        stop_grace_s: time between SIGTERM and SIGKILL.
        warmup: send one short chat completion before reporting ready.
        warmup_max_tokens: its ``max_tokens``.
        ready_file: a file created when the engine is ready (after the warm-up) and removed
            while it is unhealthy and when the launcher exits; the gateway's
            ``engine.ready_file`` points at it to tell ``warming`` from ``ready``. Empty: none.
        stall_after_s: the progress watchdog: a request running (``vllm:num_requests_running``
            above 0) with no movement of the token and finished-request counters for this long
            means hung: the engine is killed as an unhealthy one. 1800 s clears a
            250,000-token prefill on a V100, during which vLLM's counters stand still; the
            arithmetic is in `engine.progress`. 0 turns the verdict off (the reading is still
            reported). Must be 0 or at least ``health_interval_s``.
        status_file: the launcher's status JSON (state, watchdog reading, restarts by reason;
            format in `engine.status`), rewritten on every change and probe; the gateway's
            ``engine.launcher_status_file`` reads it for its metrics. Empty: none.
    """

    start_timeout_s: float = 1800.0
    health_interval_s: float = 5.0
    probe_timeout_s: float = 5.0
    unhealthy_after_s: float = 60.0
    stop_grace_s: float = 30.0
    warmup: bool = True
    warmup_max_tokens: int = 16
    ready_file: str = ""
    stall_after_s: float = 1800.0
    status_file: str = ""


@dataclass(frozen=True)
class PreflightConfig:
    """``[preflight]``: thresholds of the host checks.

    Attributes:
        min_shm_mib: smaller ``/dev/shm`` is a WARN; Docker's default of 64 MiB is the usual
            culprit (DEPLOYMENT-NOTES field report: give the engine enough shared memory).
        min_free_disk_mib: less free space than this where the caches live is a FAIL (Triton,
            torch.compile and tilelang write compiled kernels there on first use).
        cache_dir: where those caches live; empty means ``$XDG_CACHE_HOME`` or ``$HOME/.cache``
            of the engine's environment.
    """

    min_shm_mib: int = 1024
    min_free_disk_mib: int = 5120
    cache_dir: str = ""


@dataclass(frozen=True)
class Settings:
    """The whole launcher configuration. Build with `load_settings` or `parse_settings`.

    ``source`` is the file read, or None when defaults were used because it does not exist.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    supervise: SuperviseConfig = field(default_factory=SuperviseConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    source: str | None = None


def _speculative(key: str, value: Any) -> SpeculativeConfig:
    if not isinstance(value, dict):
        raise ConfigError(f"[{key}]: expected a table")
    checks: dict[str, _Check] = {
        "method": check_name,
        "model": check_path,
        "num_speculative_tokens": check_int(0, 64),
        "draft_tensor_parallel_size": check_int(0, 64),
    }
    values = {}
    for name, item in value.items():
        check = checks.get(name)
        if check is None:
            raise ConfigError(f"unknown key {key}.{name} (known: {', '.join(sorted(checks))})")
        values[name] = check(f"{key}.{name}", item)
    if "model" not in values:
        raise ConfigError(f"{key}.model: the draft model's directory is required")
    return SpeculativeConfig(**values)


_Check = Check

_ENGINE_KEYS: dict[str, _Check] = {
    "program": check_program,
    "model_path": check_path,
    "served_model": check_name,
    "socket": check_socket,
    "gpu": check_gpu,
    "gpus": check_gpus,
    "max_model_len": check_int(1, 1 << 24),
    "kv_cache_dtype": check_name,
    "gpu_memory_utilization": check_float(0.0, 1.0, low_open=True),
    "max_num_seqs": check_int(1, 4096),
    "reasoning_parser": check_name,
    "tool_call_parser": check_name,
    "attention_backend": check_name,
    "extra_args": check_extra_args,
    "env": check_env,
    "speculative": _speculative,
}

_SUPERVISE_KEYS: dict[str, _Check] = {
    "start_timeout_s": check_float(0.0, 86_400.0, low_open=True),
    "health_interval_s": check_float(0.01, 3600.0),
    "probe_timeout_s": check_float(0.01, 3600.0),
    "unhealthy_after_s": check_float(0.01, 86_400.0),
    "stop_grace_s": check_float(0.0, 3600.0),
    "warmup": check_bool,
    "warmup_max_tokens": check_int(1, 4096),
    "ready_file": check_string,
    "stall_after_s": check_float(0.0, 86_400.0),
    "status_file": check_string,
}

_PREFLIGHT_KEYS: dict[str, _Check] = {
    "min_shm_mib": check_int(0, 1 << 30),
    "min_free_disk_mib": check_int(0, 1 << 40),
    "cache_dir": check_string,
}

_SECTIONS: dict[str, tuple[type, dict[str, _Check]]] = {
    "engine": (EngineConfig, _ENGINE_KEYS),
    "supervise": (SuperviseConfig, _SUPERVISE_KEYS),
    "preflight": (PreflightConfig, _PREFLIGHT_KEYS),
}


def _section(name: str, table: Any) -> Any:
    cls, checks = _SECTIONS[name]
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}]: expected a table")
    values = {}
    for key, value in table.items():
        check = checks.get(key)
        if check is None:
            raise ConfigError(f"unknown key {name}.{key} (known: {', '.join(sorted(checks))})")
        values[key] = check(f"{name}.{key}", value)
    return cls(**values)


def parse_settings(data: Mapping[str, Any], source: str | None = None) -> Settings:
    """Build `Settings` from a parsed TOML document.

    Raises:
        ConfigError: unknown section or key, wrong type, out-of-range value, a refused flag or
            environment variable, both ``gpu`` and ``gpus``, a draft tensor parallelism other
            than 1 or the GPU count, or ``supervise.unhealthy_after_s`` or a non-zero
            ``stall_after_s`` below ``health_interval_s``.
    """
    sections: dict[str, Any] = {}
    for name, table in data.items():
        if name not in _SECTIONS:
            raise ConfigError(f"unknown section [{name}] (known: {', '.join(_SECTIONS)})")
        sections[name] = _section(name, table)
    engine_table = data.get("engine")
    if isinstance(engine_table, dict) and "gpu" in engine_table and "gpus" in engine_table:
        raise ConfigError(
            "engine.gpu and engine.gpus are both set: use gpu for one GPU or gpus for several"
        )
    settings = Settings(**sections, source=source)
    speculative = settings.engine.speculative
    tp = settings.engine.tensor_parallel_size
    if speculative is not None and speculative.draft_tensor_parallel_size not in (0, 1, tp):
        raise ConfigError(
            f"engine.speculative.draft_tensor_parallel_size = "
            f"{speculative.draft_tensor_parallel_size}: must be 1 or the number of GPUs ({tp}) "
            "(vLLM's SpeculativeConfig)"
        )
    supervise = settings.supervise
    if supervise.unhealthy_after_s < supervise.health_interval_s:
        raise ConfigError(
            f"supervise.unhealthy_after_s = {show(supervise.unhealthy_after_s)}: must be at least "
            f"supervise.health_interval_s ({show(supervise.health_interval_s)})"
        )
    if 0 < supervise.stall_after_s < supervise.health_interval_s:
        raise ConfigError(
            f"supervise.stall_after_s = {show(supervise.stall_after_s)}: must be 0 (off) or at "
            f"least supervise.health_interval_s ({show(supervise.health_interval_s)})"
        )
    return settings


def config_path(path: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> Path:
    """The file to read: ``path``, else ``$QWEN38_ENGINE_CONFIG``, else the default (DESIGN §2)."""
    return Path(path or environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)


def load_settings(path: str | os.PathLike[str]) -> Settings:
    """Read and validate one engine.toml; a file that does not exist means all defaults.

    Raises:
        ConfigError: unreadable file, invalid TOML, or anything `parse_settings` rejects; the
            message starts with the file name.
    """
    return load_toml(Path(path), parse_settings, Settings, ConfigError)
