"""Preflight's GPU checks: every GPU engine.toml lists, and whether the configuration fits."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.gpus import (
    CUDA_TOOLKIT,
    MIN_DRIVER,
    REQUIRED_COMPUTE_CAP,
    SMI_HEADER,
    GpuInfo,
    find_gpu,
    query_gpus,
)
from engine.memory import DRAFT_GIB, DRAFT_LM_HEAD_GIB, estimate
from engine.probes import CheckResult, PreflightError, Probes, dotted, parse_version


def _key(engine: EngineConfig) -> str:
    return "engine.gpus" if engine.gpus else "engine.gpu"


def gpu_checks(
    engine: EngineConfig, probes: Probes
) -> tuple[list[CheckResult], list[GpuInfo] | None]:
    """``nvidia_smi``, then for every GPU of ``engine.devices`` ``gpu``, ``compute_capability``
    and ``gpu_memory``, then ``driver`` and ``gpu_fit`` (the memory arithmetic of
    `engine.memory`); one line per GPU for the per-GPU checks, in rank order.

    Returns the results and the GPUs found (None when one is missing or nvidia-smi failed).
    """
    names = ("compute_capability", "gpu_memory", "driver", "gpu_fit")
    key = _key(engine)
    try:
        gpus = query_gpus(probes)
    except PreflightError as exc:
        wanted = ", ".join(engine.devices)
        results = [
            CheckResult("FAIL", "nvidia_smi", str(exc), exc.fix),
            CheckResult(
                "FAIL",
                "gpu",
                f"GPU {wanted} ({key}) not visible: nvidia-smi gave no GPU list",
                exc.fix,
            ),
        ]
        results += [
            CheckResult("FAIL", name, "not checked: no GPU information", "fix nvidia_smi first")
            for name in names
        ]
        return results, None
    driver = gpus[0].driver_version
    results = [CheckResult("PASS", "nvidia_smi", f"{len(gpus)} GPU(s), driver {driver}")]
    found: list[GpuInfo] = []
    for selector in engine.devices:
        gpu = find_gpu(gpus, selector)
        if gpu is None:
            visible = "; ".join(g.describe() for g in gpus)
            results.append(
                CheckResult(
                    "FAIL",
                    "gpu",
                    f"no GPU matches {key} = {selector!r}; visible: {visible}",
                    f"set {key} to the V100's index, UUID or PCI bus id as nvidia-smi -L shows it",
                )
            )
        elif gpu in found:
            results.append(
                CheckResult(
                    "FAIL",
                    "gpu",
                    f"{key} names GPU {gpu.describe()} twice ({selector!r})",
                    "list each GPU once",
                )
            )
        else:
            found.append(gpu)
            results.append(CheckResult("PASS", "gpu", f"{key} = {selector!r} is {gpu.describe()}"))
    if len(found) != len(engine.devices):
        results += [
            CheckResult("FAIL", name, "not checked: configured GPU not found", "fix gpu first")
            for name in names
        ]
        return results, None
    results += [_compute_check(gpu) for gpu in found]
    results += [_memory_check(gpu, engine.gpu_memory_utilization) for gpu in found]
    results.append(_driver_check(found[0], probes))
    results.append(fit_check(engine, found))
    return results, found


def fit_check(engine: EngineConfig, gpus: Sequence[GpuInfo]) -> CheckResult:
    """``gpu_fit``: the per-card memory estimate of `engine.memory` for this configuration.

    WARN when the need exceeds the smallest card, with the arithmetic and, when speculative
    decoding is what does not fit on one card, the two-GPU way out; also WARN when the listed
    GPUs differ (tensor parallelism runs at the pace of the slowest and the memory of the
    smallest).
    """
    smallest = min(gpus, key=lambda gpu: gpu.memory_total_mib)
    fit = estimate(
        tp=len(gpus),
        max_model_len=engine.max_model_len,
        kv_cache_dtype=engine.kv_cache_dtype,
        draft=engine.speculative is not None,
        card_total_mib=smallest.memory_total_mib,
    )
    what = f"{len(gpus)} GPU(s), max_model_len {engine.max_model_len}"
    if engine.speculative is not None:
        what += f", draft {engine.speculative.model}"
    text = f"{what}: {fit.arithmetic()}"
    models = {(gpu.name, gpu.memory_total_mib) for gpu in gpus}
    if not fit.fits:
        if engine.speculative is not None and len(gpus) == 1:
            fix = (
                f"the draft model (about {DRAFT_GIB:.2f} GiB, its BF16 lm_head alone "
                f"{DRAFT_LM_HEAD_GIB:.2f} GiB) does not fit next to the target on one card: add a "
                "second V100 (engine.gpus, tensor parallel 2; see the operator's manual) or "
                "remove [engine.speculative]"
            )
        else:
            fix = "lower engine.max_model_len, or spread the engine over more GPUs (engine.gpus)"
        return CheckResult("WARN", "gpu_fit", text + " (estimate; vLLM may refuse to start)", fix)
    if len(models) > 1:
        kinds = "; ".join(f"{gpu.index} {gpu.name} {gpu.memory_total_mib} MiB" for gpu in gpus)
        return CheckResult(
            "WARN",
            "gpu_fit",
            f"{text}; the GPUs differ ({kinds}): every rank runs at the pace of the slowest",
            "list identical GPUs in engine.gpus",
        )
    return CheckResult("PASS", "gpu_fit", text + " (estimate)")


def _compute_check(gpu: GpuInfo) -> CheckResult:
    if gpu.compute_cap == REQUIRED_COMPUTE_CAP:
        return CheckResult(
            "PASS",
            "compute_capability",
            f"GPU {gpu.index}: {gpu.compute_cap} ({gpu.name}, SM70 kernels)",
        )
    return CheckResult(
        "FAIL",
        "compute_capability",
        f"GPU {gpu.index} {gpu.name} has compute capability {gpu.compute_cap}; the 1Cat-vLLM "
        f"wheel and its FLASH_ATTN_V100 backend are built for {REQUIRED_COMPUTE_CAP} (V100) only",
        "point engine.gpu (or engine.gpus) at V100s (compute capability 7.0), or serve newer "
        "GPUs with "
        "upstream vLLM instead of this fork",
    )


def _memory_check(gpu: GpuInfo, utilization: float) -> CheckResult:
    # vLLM's worker refuses to start when free memory is below utilization x total
    # (vllm/v1/worker/gpu_worker.py, "Free memory on device ... is less than desired GPU memory
    # utilization").
    need = math.ceil(utilization * gpu.memory_total_mib)
    text = (
        f"GPU {gpu.index}: {gpu.memory_free_mib} MiB free of {gpu.memory_total_mib} MiB; "
        f"gpu_memory_utilization {utilization:g} needs {need} MiB"
    )
    if gpu.memory_free_mib >= need:
        return CheckResult("PASS", "gpu_memory", text)
    return CheckResult(
        "FAIL",
        "gpu_memory",
        text + " free (vLLM refuses to start with less)",
        "stop the other processes on this GPU (nvidia-smi lists them); lowering "
        "gpu_memory_utilization also shrinks the KV cache below one full context",
    )


def _driver_check(gpu: GpuInfo, probes: Probes) -> CheckResult:
    version = parse_version(gpu.driver_version)
    header = probes.run(SMI_HEADER, timeout_s=30.0)
    cuda = None
    if header is not None and header.returncode == 0:
        match = re.search(r"CUDA Version:\s*(\d+\.\d+)", header.stdout)
        cuda = parse_version(match.group(1)) if match else None
    shown = f"driver {gpu.driver_version}" + (f" (CUDA {dotted(cuda)})" if cuda else "")
    need = dotted(MIN_DRIVER)
    if version is None or version < MIN_DRIVER:
        return CheckResult(
            "FAIL",
            "driver",
            f"{shown} is older than {need}, the minimum for CUDA 12.x minor-version "
            "compatibility (NVIDIA CUDA Compatibility guide); the engine's CUDA 12.8 runtime "
            "will not initialise",
            f"upgrade the host's NVIDIA driver to {need} or newer (the 525 branch or later)",
        )
    if cuda is not None and cuda >= CUDA_TOOLKIT:
        return CheckResult("PASS", "driver", f"{shown} runs CUDA 12.8 natively")
    return CheckResult(
        "PASS",
        "driver",
        f"{shown}: CUDA 12.8 runs through minor-version compatibility (>= {need}); SM70 code is "
        "prebuilt, so no PTX JIT is needed",
    )
