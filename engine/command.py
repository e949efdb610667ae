"""The engine's argv and environment, computed from engine.toml (vllm-protocol.md sections 1.3, 1.4)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from engine.config import EngineConfig
from engine.configvalues import FORBIDDEN_ENV
from engine.cpukv import FP8_IF_SUPPORTED, read_cpu_flags, resolve_kv_cache_dtype
from engine.gpus import gpu_kind

# systemd's notification variables belong to the launcher, not to its child (sd_notify(3)).
_LAUNCHER_ONLY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclass(frozen=True)
class Launch:
    """How to start the engine.

    Attributes:
        argv: the full command line: ``engine.program`` then the computed flags then
            ``engine.extra_args``.
        env: variables set on top of the inherited environment, in the order shown to operators.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]

    def environment(self, inherited: Mapping[str, str]) -> tuple[dict[str, str], tuple[str, ...]]:
        """The child's whole environment and the inherited names that were dropped from it.

        Dropped: the variables engine.toml refuses (``VLLM_API_KEY``, ``VLLM_SERVER_DEV_MODE`` ...,
        see `engine.configvalues.FORBIDDEN_ENV`) and systemd's ``NOTIFY_SOCKET``/``WATCHDOG_*``, except
        those ``env`` sets itself (``CUDA_*``), which it overrides. The names are returned so they
        can be logged; their values never are.
        """
        dropped = tuple(
            sorted(
                name
                for name in inherited
                if (name in FORBIDDEN_ENV or name in _LAUNCHER_ONLY_ENV) and name not in self.env
            )
        )
        child = {name: value for name, value in inherited.items() if name not in dropped}
        child.update(self.env)
        return child, dropped

    def render(self) -> str:
        """Shell text an operator can paste: ``env NAME=VALUE ... \\`` then one flag per line.

        Every word is quoted with `shlex.quote`, so paths with spaces survive.
        """
        first = ["env", *(f"{name}={value}" for name, value in self.env.items())]
        lines = [shlex.join(first)]
        words = list(self.argv)
        program_end = next(
            (i for i, word in enumerate(words) if i > 0 and _is_option(word)), len(words)
        )
        lines.append(shlex.join(words[:program_end]))
        current: list[str] = []
        for word in words[program_end:]:
            if _is_option(word) and current:
                lines.append(shlex.join(current))
                current = []
            current.append(word)
        if current:
            lines.append(shlex.join(current))
        return " \\\n  ".join(lines) + "\n"


def _is_option(word: str) -> bool:
    """True for ``--flag`` words (flags start a new line in `Launch.render`)."""
    return word.startswith("--") and len(word) > 2


def build_launch(
    engine: EngineConfig,
    *,
    visible_devices: Sequence[str] | None = None,
    cpu_flags: frozenset[str] | None = None,
) -> Launch:
    """The argv and environment for ``engine``.

    The flag list is the reference deployment's (DESIGN section 8; every flag checked against
    vLLM's engine arguments). ``--api-key`` is never emitted: the engine listens only on its
    Unix socket and the gateway checks keys. With several GPUs, ``--tensor-parallel-size`` is
    their count (vLLM runs one tensor-parallel rank per visible GPU, in ``CUDA_VISIBLE_DEVICES``
    order); with ``[engine.speculative]``, ``--speculative-config`` carries it as JSON.

    Args:
        engine: validated ``[engine]`` settings.
        visible_devices: ``CUDA_VISIBLE_DEVICES`` entries, one per GPU of ``engine.devices``;
            defaults to those selectors, which must then be indices or UUIDs (CUDA does not
            accept PCI bus ids; resolve those to the GPU's UUID first, see
            `engine.gpus.resolve_devices`).
        cpu_flags: the host CPU's ``/proc/cpuinfo`` flags, read only when ``kv_cache_dtype`` is
            ``fp8_e5m2_if_cpu_supports``, which `engine.cpukv.resolve_kv_cache_dtype` turns into
            ``fp8_e5m2`` or ``auto``; defaults to this host's.

    Raises:
        ValueError: ``visible_devices`` is missing and a GPU is named by its PCI bus id, or it
            does not have one entry per GPU.
    """
    if visible_devices is None:
        pci = [gpu for gpu in engine.devices if gpu_kind(gpu) == "pci"]
        if pci:
            raise ValueError(
                f"GPU {pci[0]!r} is a PCI bus id; CUDA_VISIBLE_DEVICES needs the GPU's index or "
                "UUID, which nvidia-smi provides"
            )
        visible_devices = engine.devices
    if len(visible_devices) != len(engine.devices):
        raise ValueError(f"{len(visible_devices)} devices for {len(engine.devices)} GPUs")
    parallel: tuple[str, ...] = ()
    if engine.tensor_parallel_size > 1:
        parallel = ("--tensor-parallel-size", str(engine.tensor_parallel_size))
    kv_cache_dtype = engine.kv_cache_dtype
    if kv_cache_dtype == FP8_IF_SUPPORTED:
        flags = read_cpu_flags() if cpu_flags is None else cpu_flags
        kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, flags).dtype
    speculative: tuple[str, ...] = ()
    if engine.speculative is not None:
        speculative = ("--speculative-config", engine.speculative.as_json())
    argv = (
        *engine.program,
        "--model",
        engine.model_path,
        "--served-model-name",
        engine.served_model,
        "--uds",
        engine.socket,
        "--max-model-len",
        str(engine.max_model_len),
        "--kv-cache-dtype",
        kv_cache_dtype,
        "--reasoning-parser",
        engine.reasoning_parser,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        engine.tool_call_parser,
        "--attention-backend",
        engine.attention_backend,
        "--disable-fastapi-docs",
        "--gpu-memory-utilization",
        repr(engine.gpu_memory_utilization),
        "--max-num-seqs",
        str(engine.max_num_seqs),
        *parallel,
        *speculative,
        *engine.extra_args,
    )
    # CUDA numbers GPUs fastest-first unless told otherwise; PCI_BUS_ID makes indices match
    # nvidia-smi and slot order (CUDA C Programming Guide, CUDA Environment Variables).
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(visible_devices)}
    env.update(engine.env)
    return Launch(argv=argv, env=MappingProxyType(env))
