"""The KV cache element type on vLLM's CPU build: FP8 where the CPU can, vLLM's default elsewhere.

vLLM's CPU attention backend refuses an FP8 KV cache unless PyTorch finds AVX-512 or AMX
(``vllm/v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``: ``NotImplementedError: FP8 KV
cache on CPU requires x86 with AVX-512 or AMX``). PyTorch's tests are, in
``aten/src/ATen/cpu/Utils.cpp``: AVX-512 is ``avx512f`` and ``avx512vl`` and ``avx512bw`` and
``avx512dq`` together (``is_cpu_support_avx512``), AMX is ``amx_tile``
(``is_amx_tile_supported``). Those are the flag names Linux prints in ``/proc/cpuinfo``.

``engine.kv_cache_dtype = "fp8_e5m2_if_cpu_supports"`` (`FP8_IF_SUPPORTED`, what
deploy/etc/engine.cpu.toml sets) is resolved here and only here, when the launcher builds the
engine's command line: ``fp8_e5m2`` with those flags, else ``auto`` (vLLM's default: the model's
own dtype). Every other value is passed to vLLM unchanged, so the GPU configs are not affected.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FP8_IF_SUPPORTED = "fp8_e5m2_if_cpu_supports"
FP8_DTYPE = "fp8_e5m2"
# vLLM's default --kv-cache-dtype: the model's dtype.
DEFAULT_DTYPE = "auto"
AVX512_FLAGS = frozenset({"avx512f", "avx512vl", "avx512bw", "avx512dq"})
AMX_FLAG = "amx_tile"
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class KvChoice:
    """The resolved ``--kv-cache-dtype``.

    Attributes:
        dtype: what the engine gets (``fp8_e5m2``, ``auto``, or the configured value).
        reason: one sentence for the launcher's log; "" when the value was not ours to choose.
    """

    dtype: str
    reason: str = ""


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` text (empty if none).

    The first processor stands for all: Linux lists the same flags for every core of a host.
    """
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def read_cpu_flags(path: Path = CPUINFO) -> frozenset[str]:
    """`cpu_flags` of this host; empty when ``path`` cannot be read (not Linux, no /proc)."""
    try:
        return cpu_flags(path.read_text(errors="replace"))
    except OSError:
        return frozenset()


def fp8_kv_cache_supported(flags: frozenset[str]) -> bool:
    """vLLM's CPU build accepts an FP8 KV cache on a CPU with these flags (AVX-512 or AMX)."""
    return AVX512_FLAGS.issubset(flags) or AMX_FLAG in flags


def resolve_kv_cache_dtype(configured: str, flags: frozenset[str]) -> KvChoice:
    """The ``--kv-cache-dtype`` for ``configured`` on a CPU with ``flags``.

    Only `FP8_IF_SUPPORTED` is resolved; any other value comes back as it is.
    """
    if configured != FP8_IF_SUPPORTED:
        return KvChoice(configured)
    if fp8_kv_cache_supported(flags):
        found = (
            "amx_tile" if AMX_FLAG in flags else "AVX-512 (" + " ".join(sorted(AVX512_FLAGS)) + ")"
        )
        return KvChoice(FP8_DTYPE, f"the CPU has {found}: FP8 KV cache")
    missing = " ".join(sorted(AVX512_FLAGS - flags))
    return KvChoice(
        DEFAULT_DTYPE,
        f"the CPU has neither amx_tile nor all of AVX-512 (missing {missing}): vLLM's CPU build "
        "refuses an FP8 KV cache there, so the model's dtype is used",
    )
