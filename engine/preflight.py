"""Preflight: each pitfall of the deployment notes as a host check with its one-sentence fix.

System access (running ``nvidia-smi`` and the engine's Python, reading glibc's version, ``which``,
``statvfs``) goes through one `Probes` value so tests feed recorded outputs of real hosts; the
functions here only decide. Files (checkpoint, ``Python.h``, socket directory) are read directly.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from engine.command import build_launch
from engine.config import EngineConfig, Settings, gpu_kind, normalize_bus_id

Status = Literal["PASS", "WARN", "FAIL"]

GPU_QUERY: tuple[str, ...] = (
    "nvidia-smi",
    "--query-gpu=index,uuid,pci.bus_id,name,compute_cap,memory.total,memory.free,driver_version",
    "--format=csv,noheader,nounits",
)
SMI_HEADER: tuple[str, ...] = ("nvidia-smi",)

REQUIRED_PYTHON = (3, 12)  # the wheel is cp312 (vllm-protocol.md section 1.1)
REQUIRED_GLIBC = (2, 38)  # flash_attn_v100_cuda.so needs GLIBC_2.38 (DEPLOYMENT-NOTES)
REQUIRED_COMPUTE_CAP = "7.0"  # the wheel's kernels are SM70 (V100) only
# NVIDIA CUDA Compatibility guide, "Minor Version Compatibility": CUDA 12.x user space runs on
# Linux drivers >= 525.60.13.
MIN_DRIVER = (525, 60, 13)
CUDA_TOOLKIT = (12, 8)  # the wheel is built with CUDA 12.8 (vllm-protocol.md section 1.1)
ONECAT_DIST = "1cat-vllm"  # pyproject name of the 1Cat wheel (vllm-protocol.md section 1.1)
ONECAT_PROTOCOL_BASE = (1, 2)  # releases the wire-protocol notes were checked against

# Printed as the engine's Python's last stdout line (importing vllm may log to stdout first).
PROBE_SCRIPT = """\
import importlib.metadata as md, json, os, sys, sysconfig
out = {"executable": sys.executable, "version": list(sys.version_info[:3]),
       "include": sysconfig.get_paths()["include"], "distributions": {}}
for name in ("1cat-vllm", "vllm"):
    try:
        out["distributions"][name] = md.version(name)
    except md.PackageNotFoundError:
        pass
try:
    import vllm
    out["vllm_version"] = getattr(vllm, "__version__", None)
    out["import_error"] = None
except BaseException as exc:
    out["vllm_version"] = None
    out["import_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@dataclass(frozen=True)
class CheckResult:
    """One preflight line.

    Attributes:
        status: ``PASS``, ``WARN`` (works, but not as intended) or ``FAIL`` (the engine will not
            start or not work; ``serve`` refuses to start and ``check`` exits 1).
        name: short check name, stable for scripts (``gpu``, ``glibc`` ...).
        detail: what was found.
        fix: one sentence, for WARN and FAIL.
    """

    status: Status
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        """``STATUS name: detail`` and, for WARN/FAIL, an indented ``fix:`` line."""
        text = f"{self.status} {self.name}: {self.detail}"
        if self.status != "PASS" and self.fix:
            text += f"\n    fix: {self.fix}"
        return text


@dataclass(frozen=True)
class Output:
    """What a probed command printed; ``returncode`` 124 means it timed out."""

    returncode: int
    stdout: str
    stderr: str


class Runner(Protocol):
    """Runs a command and returns its `Output`, or None when the program does not exist."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> Output | None: ...


@dataclass(frozen=True)
class Probes:
    """Everything preflight asks the system, as replaceable callables.

    Attributes:
        run: runs a command (`Runner`).
        which: ``(name, PATH) -> path or None``, like `shutil.which`.
        glibc: ``os.confstr("CS_GNU_LIBC_VERSION")``, e.g. ``"glibc 2.39"``; ``""`` if not glibc.
        disk_usage: ``path -> (total, free)`` in bytes (free as seen by unprivileged users);
            raises OSError when the path does not exist.
        environ: the launcher's environment (the engine inherits it).
    """

    run: Runner
    which: Callable[[str, str | None], str | None]
    glibc: Callable[[], str]
    disk_usage: Callable[[str], tuple[int, int]]
    environ: Mapping[str, str] = field(default_factory=dict)


def _run(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 30.0
) -> Output | None:
    try:
        done = subprocess.run(
            list(argv),
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        return Output(126, "", str(exc))
    except subprocess.TimeoutExpired:
        return Output(124, "", f"timed out after {timeout_s:g} s")
    return Output(done.returncode, done.stdout, done.stderr)


def _glibc() -> str:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return ""


def _disk_usage(path: str) -> tuple[int, int]:
    usage = shutil.disk_usage(path)
    return usage.total, usage.free


def system_probes(environ: Mapping[str, str] | None = None) -> Probes:
    """`Probes` of this machine (``environ`` defaults to `os.environ`)."""
    return Probes(
        run=_run,
        which=lambda name, path: shutil.which(name, path=path),
        glibc=_glibc,
        disk_usage=_disk_usage,
        environ=dict(os.environ if environ is None else environ),
    )


@dataclass(frozen=True)
class GpuInfo:
    """One row of `GPU_QUERY`; memory in MiB, ``bus_id`` as nvidia-smi prints it."""

    index: int
    uuid: str
    bus_id: str
    name: str
    compute_cap: str
    memory_total_mib: int
    memory_free_mib: int
    driver_version: str

    def describe(self) -> str:
        """``0 Tesla V100-SXM2-32GB (GPU-..., 00000000:00:1E.0)``."""
        return f"{self.index} {self.name} ({self.uuid}, {self.bus_id})"


class PreflightError(RuntimeError):
    """A probe needed outside `run_checks` (GPU lookup for a PCI bus id) failed; ``fix`` says how."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def parse_gpu_query(text: str) -> list[GpuInfo]:
    """Parse the output of `GPU_QUERY` (CSV, no header, no units).

    Raises:
        ValueError: a row does not have the eight fields or a number does not parse (``[N/A]``).
    """
    gpus = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if not row:
            continue
        if len(row) != 8:
            raise ValueError(f"unexpected nvidia-smi row: {', '.join(row)}")
        index, uuid, bus_id, name, cap, total, free, driver = (item.strip() for item in row)
        gpus.append(
            GpuInfo(
                index=int(index),
                uuid=uuid,
                bus_id=bus_id,
                name=name,
                compute_cap=cap,
                memory_total_mib=int(total),
                memory_free_mib=int(free),
                driver_version=driver,
            )
        )
    return gpus


def find_gpu(gpus: Sequence[GpuInfo], selector: str) -> GpuInfo | None:
    """The GPU ``selector`` (index, UUID or PCI bus id, as in ``engine.gpu``) names, if visible.

    Indices are nvidia-smi's, which follow PCI bus order like CUDA's with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
    """
    kind = gpu_kind(selector)
    for gpu in gpus:
        if kind == "index" and gpu.index == int(selector):
            return gpu
        if kind == "uuid" and gpu.uuid.lower() == selector.lower():
            return gpu
        if kind == "pci" and normalize_bus_id(gpu.bus_id) == normalize_bus_id(selector):
            return gpu
    return None


_NO_SMI_FIX = (
    "install the NVIDIA driver on the host and start the container with the NVIDIA Container "
    "Toolkit (docker run --gpus ...)"
)


def query_gpus(probes: Probes) -> list[GpuInfo]:
    """The GPUs nvidia-smi lists.

    Raises:
        PreflightError: nvidia-smi is missing, fails, or prints something unparsable.
    """
    output = probes.run(GPU_QUERY, timeout_s=30.0)
    if output is None:
        raise PreflightError("nvidia-smi not found: no NVIDIA driver is visible here", _NO_SMI_FIX)
    if output.returncode != 0:
        message = _first_line(output.stdout) or _first_line(output.stderr) or "no output"
        raise PreflightError(
            f"nvidia-smi failed (exit {output.returncode}): {message}",
            "make nvidia-smi work on the host (driver loaded, GPU listed), then restart the "
            "container",
        )
    try:
        gpus = parse_gpu_query(output.stdout)
    except ValueError as exc:
        raise PreflightError(
            f"cannot read nvidia-smi's GPU list: {exc}",
            f"upgrade the NVIDIA driver to {_dotted(MIN_DRIVER)} or newer",
        ) from exc
    if not gpus:
        raise PreflightError("nvidia-smi lists no GPU", _NO_SMI_FIX)
    return gpus


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _last_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return ""


def _version(text: str | None) -> tuple[int, ...] | None:
    """Leading numeric components of a version (``"1.3.0rc1+g12"`` -> ``(1, 3, 0)``)."""
    if not text:
        return None
    match = re.match(r"^\s*(\d+(?:\.\d+)*)", text)
    if match is None:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def _dotted(version: Sequence[int]) -> str:
    return ".".join(str(part) for part in version)


def config_check(path: str, settings: Settings) -> CheckResult:
    """Whether engine.toml was read or the built-in defaults are in use."""
    if settings.source is not None:
        return CheckResult("PASS", "config", f"{path} loaded")
    return CheckResult(
        "WARN",
        "config",
        f"{path} not found; built-in defaults in use",
        f"write {path} (example: deploy/etc/engine.toml) or pass --config PATH",
    )


# -- the engine's Python ---------------------------------------------------------------------


@dataclass(frozen=True)
class Interpreter:
    """What `PROBE_SCRIPT` reported about the engine's Python."""

    executable: str
    version: tuple[int, ...]
    include: str
    distributions: Mapping[str, str]
    vllm_version: str | None
    import_error: str | None


def engine_python(program: Sequence[str]) -> str:
    """The interpreter that runs the engine.

    ``program[0]`` for the ``PYTHON -m MODULE`` shape of DESIGN section 8; otherwise (a console
    script such as ``qwen38-engine sim``) the launcher's own interpreter.
    """
    if len(program) >= 3 and program[1] == "-m":
        return program[0]
    return sys.executable


def probe_interpreter(
    python: str, env: Mapping[str, str], probes: Probes
) -> Interpreter | CheckResult:
    """Run `PROBE_SCRIPT` with ``python``; a FAIL ``python`` result when that is impossible.

    The timeout is generous: importing vllm imports torch, seconds to a minute on a cold disk.
    """
    output = probes.run((python, "-c", PROBE_SCRIPT), env=env, timeout_s=300.0)
    fix = "install Python 3.12 or point engine.program at it"
    if output is None:
        return CheckResult("FAIL", "python", f"cannot run {python}: not found", fix)
    line = _last_line(output.stdout)
    try:
        data = json.loads(line)
        return Interpreter(
            executable=str(data["executable"]),
            version=tuple(int(part) for part in data["version"]),
            include=str(data["include"]),
            distributions=dict(data["distributions"]),
            vllm_version=data["vllm_version"],
            import_error=data["import_error"],
        )
    except (ValueError, KeyError, TypeError):
        reason = _last_line(output.stderr) or line or f"exit {output.returncode}"
        return CheckResult("FAIL", "python", f"{python} failed to run a probe: {reason}", fix)


def _python_check(found: Interpreter) -> CheckResult:
    text = f"CPython {_dotted(found.version)} ({found.executable})"
    if found.version[:2] == REQUIRED_PYTHON:
        return CheckResult("PASS", "python", text)
    return CheckResult(
        "FAIL",
        "python",
        f"{text}; the 1Cat-vLLM wheel is built for CPython {_dotted(REQUIRED_PYTHON)} (cp312)",
        "run the engine in the Ubuntu 24.04 image (Python 3.12) or point engine.program at a "
        "Python 3.12 interpreter",
    )


def _vllm_check(found: Interpreter) -> CheckResult:
    install = (
        "install the 1Cat-vLLM wheel (1cat_vllm-1.3.0-cp312-cp312-linux_x86_64.whl, verified by "
        "sha256) into the engine's Python"
    )
    dists = found.distributions
    if found.import_error is not None:
        if not dists:
            return CheckResult(
                "FAIL", "vllm", f"vllm is not installed for {found.executable}", install
            )
        installed = ", ".join(f"{name} {version}" for name, version in dists.items())
        if "GLIBC_" in found.import_error:
            fix = "run the engine in the Ubuntu 24.04 image (glibc 2.39)"
        else:
            fix = (
                "reinstall the wheel into the engine's Python and run python3 -c 'import vllm' "
                "there for the full error"
            )
        return CheckResult(
            "FAIL", "vllm", f"{installed} installed but import fails: {found.import_error}", fix
        )
    version_text = dists.get(ONECAT_DIST) or found.vllm_version or dists.get("vllm") or "unknown"
    version = _version(version_text)
    is_onecat = ONECAT_DIST in dists or (version is not None and version[0] >= 1)
    if not is_onecat:
        return CheckResult(
            "FAIL",
            "vllm",
            f"vllm {version_text} is upstream vLLM, not the 1Cat build; upstream wheels have no "
            "SM70 (V100) kernels",
            f"uninstall vllm and {install}",
        )
    text = f"1Cat-vLLM {version_text} imports ({found.executable})"
    if version is not None and version[:2] < ONECAT_PROTOCOL_BASE:
        return CheckResult(
            "WARN",
            "vllm",
            f"{text}; releases before {_dotted(ONECAT_PROTOCOL_BASE)} sit on an older vLLM base "
            "than the wire protocol this gateway was checked against",
            "upgrade to the 1Cat-vLLM 1.3.0 wheel",
        )
    return CheckResult("PASS", "vllm", text)


def _headers_check(found: Interpreter) -> CheckResult:
    header = Path(found.include) / "Python.h"
    if header.is_file():
        return CheckResult("PASS", "python_headers", f"{header} present (Triton)")
    return CheckResult(
        "FAIL",
        "python_headers",
        f"{header} missing: Triton compiles a helper module against it on first use "
        '("fatal error: Python.h: No such file")',
        "install python3.12-dev in the image",
    )


def _glibc_check(probes: Probes) -> CheckResult:
    text = probes.glibc()
    match = re.match(r"^glibc (\d+)\.(\d+)", text)
    fix = (
        "run the engine in the Ubuntu 24.04 image (glibc 2.39); the host's glibc cannot be "
        "upgraded in place"
    )
    need = _dotted(REQUIRED_GLIBC)
    if match is None:
        return CheckResult("FAIL", "glibc", f"not a glibc system ({text or 'unknown libc'})", fix)
    found = (int(match.group(1)), int(match.group(2)))
    if found < REQUIRED_GLIBC:
        return CheckResult(
            "FAIL",
            "glibc",
            f"glibc {_dotted(found)} < {need}: the wheel's flash_attn_v100_cuda.so needs "
            f"GLIBC_{need}",
            fix,
        )
    return CheckResult("PASS", "glibc", f"glibc {_dotted(found)} (>= {need})")


# -- GPU ------------------------------------------------------------------------------------


def _gpu_checks(engine: EngineConfig, probes: Probes) -> tuple[list[CheckResult], GpuInfo | None]:
    """``nvidia_smi``, ``gpu``, ``compute_capability``, ``gpu_memory`` and ``driver``."""
    names = ("compute_capability", "gpu_memory", "driver")
    try:
        gpus = query_gpus(probes)
    except PreflightError as exc:
        results = [
            CheckResult("FAIL", "nvidia_smi", str(exc), exc.fix),
            CheckResult(
                "FAIL",
                "gpu",
                f"GPU {engine.gpu} (engine.gpu) not visible: nvidia-smi gave no GPU list",
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
    gpu = find_gpu(gpus, engine.gpu)
    if gpu is None:
        visible = "; ".join(g.describe() for g in gpus)
        results.append(
            CheckResult(
                "FAIL",
                "gpu",
                f"no GPU matches engine.gpu = {engine.gpu!r}; visible: {visible}",
                "set engine.gpu to the V100's index, UUID or PCI bus id as nvidia-smi -L shows it",
            )
        )
        results += [
            CheckResult("FAIL", name, "not checked: configured GPU not found", "fix gpu first")
            for name in names
        ]
        return results, None
    results.append(CheckResult("PASS", "gpu", f"engine.gpu = {engine.gpu!r} is {gpu.describe()}"))
    results.append(_compute_check(gpu))
    results.append(_memory_check(gpu, engine.gpu_memory_utilization))
    results.append(_driver_check(gpu, probes))
    return results, gpu


def _compute_check(gpu: GpuInfo) -> CheckResult:
    if gpu.compute_cap == REQUIRED_COMPUTE_CAP:
        return CheckResult(
            "PASS", "compute_capability", f"{gpu.compute_cap} ({gpu.name}, SM70 kernels)"
        )
    return CheckResult(
        "FAIL",
        "compute_capability",
        f"GPU {gpu.index} {gpu.name} has compute capability {gpu.compute_cap}; the 1Cat-vLLM "
        f"wheel and its FLASH_ATTN_V100 backend are built for {REQUIRED_COMPUTE_CAP} (V100) only",
        "point engine.gpu at a V100 (compute capability 7.0), or serve newer GPUs with "
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
    version = _version(gpu.driver_version)
    header = probes.run(SMI_HEADER, timeout_s=30.0)
    cuda = None
    if header is not None and header.returncode == 0:
        match = re.search(r"CUDA Version:\s*(\d+\.\d+)", header.stdout)
        cuda = _version(match.group(1)) if match else None
    shown = f"driver {gpu.driver_version}" + (f" (CUDA {_dotted(cuda)})" if cuda else "")
    need = _dotted(MIN_DRIVER)
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


# -- files -----------------------------------------------------------------------------------


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file, or None.

    Format (huggingface/safetensors): 8-byte little-endian header length, JSON header whose
    tensors carry ``data_offsets`` relative to the end of the header.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return "truncated (no header)"
            (length,) = struct.unpack("<Q", prefix)
            if length > size - 8 or length > 100_000_000:
                return "truncated header"
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"
    if not isinstance(header, dict):
        return "not a safetensors file"
    ends = [
        item["data_offsets"][1]
        for key, item in header.items()
        if key != "__metadata__" and isinstance(item, dict) and "data_offsets" in item
    ]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        return f"truncated ({size} of {needed} bytes)"
    return None


def _checkpoint_check(model_path: str) -> CheckResult:
    root = Path(model_path)
    fix = (
        "download the complete checkpoint (QUASAR-QAT/Qwen3.8-27B-QUASAR-NVFP4) into "
        "engine.model_path again"
    )
    if not root.is_dir():
        return CheckResult("FAIL", "checkpoint", f"{root} is not a directory", fix)
    problems: list[str] = []
    if not (root / "config.json").is_file():
        problems.append("config.json missing")
    has_fast = (root / "tokenizer.json").is_file()
    has_bpe = (root / "vocab.json").is_file() and (root / "merges.txt").is_file()
    if not (root / "tokenizer_config.json").is_file():
        problems.append("tokenizer_config.json missing")
    if not (has_fast or has_bpe):
        problems.append("tokenizer.json (or vocab.json + merges.txt) missing")
    index_path = root / "model.safetensors.index.json"
    shards: list[str]
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"model.safetensors.index.json unreadable ({exc})")
            shards = []
    elif (root / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        problems.append("no model.safetensors.index.json and no model.safetensors")
        shards = []
    total = 0
    for shard in shards:
        problem = _safetensors_problem(root / shard)
        if problem is not None:
            problems.append(f"{shard} {problem}")
        else:
            total += (root / shard).stat().st_size
    if problems:
        shown = "; ".join(problems[:5]) + (
            f"; {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        return CheckResult("FAIL", "checkpoint", f"{root} incomplete: {shown}", fix)
    return CheckResult(
        "PASS",
        "checkpoint",
        f"{root}: config, tokenizer, {len(shards)} safetensors shard(s), {total / 2**30:.1f} GiB",
    )


def _compiler_check(env: Mapping[str, str], probes: Probes) -> CheckResult:
    # Triton's get_cc (triton/runtime/build.py): $CC, else gcc, else clang.
    path = env.get("PATH")
    chosen = env.get("CC")
    candidates = [chosen] if chosen else ["gcc", "clang"]
    for name in candidates:
        found = probes.which(name, path)
        if found:
            return CheckResult("PASS", "c_compiler", f"{found} (Triton)")
    wanted = f"CC={chosen}" if chosen else "gcc or clang"
    return CheckResult(
        "FAIL",
        "c_compiler",
        f'no C compiler ({wanted}) on PATH: Triton fails with "Failed to find C compiler"',
        "install build-essential in the image (or set CC in [engine.env])",
    )


def _cuda_home_check(env: Mapping[str, str], probes: Probes) -> CheckResult:
    # tilelang's _find_cuda_home reads CUDA_HOME, then CUDA_PATH.
    fix = (
        "install cuda-nvcc-12-8 and cuda-cudart-dev-12-8 and set CUDA_HOME=/usr/local/cuda-12.8 "
        "for the engine"
    )
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if not home:
        return CheckResult(
            "FAIL",
            "cuda_home",
            "CUDA_HOME is not set: tilelang cannot find nvcc and fails its CUDA check",
            fix,
        )
    nvcc = str(Path(home) / "bin" / "nvcc")
    output = probes.run((nvcc, "--version"), env=env, timeout_s=30.0)
    if output is None or output.returncode != 0:
        return CheckResult(
            "FAIL", "cuda_home", f"CUDA_HOME={home} but {nvcc} is missing or broken", fix
        )
    match = re.search(r"release (\d+)\.(\d+)", output.stdout)
    if match is None:
        return CheckResult("FAIL", "cuda_home", f"{nvcc} --version printed no release number", fix)
    release = (int(match.group(1)), int(match.group(2)))
    text = f"CUDA_HOME={home}, nvcc {_dotted(release)}"
    if release[0] >= 13:
        return CheckResult(
            "FAIL",
            "cuda_home",
            f"{text}: CUDA 13 removed offline compilation for sm_70 (Volta), so tilelang "
            "kernels cannot be built for the V100",
            "point CUDA_HOME at a CUDA 12.8 toolkit (cuda-nvcc-12-8, cuda-cudart-dev-12-8)",
        )
    if release[0] < 12:
        return CheckResult("FAIL", "cuda_home", f"{text}: older than CUDA 12", fix)
    if release != CUDA_TOOLKIT:
        return CheckResult(
            "WARN",
            "cuda_home",
            f"{text}; the wheel is built with CUDA {_dotted(CUDA_TOOLKIT)}",
            fix,
        )
    return CheckResult("PASS", "cuda_home", f"{text} (tilelang)")


def _socket_dir_check(socket_path: str) -> CheckResult:
    directory = Path(socket_path).parent
    create = (
        f"create it for the engine's user and the gateway's group, not world-writable: "
        f"install -d -m 0750 {directory} (or RuntimeDirectory= in the unit)"
    )
    try:
        info = directory.stat()
    except FileNotFoundError:
        return CheckResult("FAIL", "socket_dir", f"{directory} does not exist", create)
    except OSError as exc:
        return CheckResult("FAIL", "socket_dir", f"{directory}: {exc.strerror}", create)
    if not stat.S_ISDIR(info.st_mode):
        return CheckResult("FAIL", "socket_dir", f"{directory} is not a directory", create)
    mode = stat.S_IMODE(info.st_mode)
    if mode & stat.S_IWOTH:
        return CheckResult(
            "FAIL",
            "socket_dir",
            f"{directory} is world-writable (mode {mode:04o}): any local user could put their "
            "own socket where the gateway expects the engine",
            f"chmod o-w {directory}, or move engine.socket to a private directory",
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        return CheckResult(
            "FAIL",
            "socket_dir",
            f"{directory} is not writable by uid {os.getuid()}",
            f"chown {directory} to the user that runs the engine",
        )
    return CheckResult("PASS", "socket_dir", f"{directory} writable, mode {mode:04o}")


def _shm_check(minimum_mib: int, probes: Probes) -> CheckResult:
    try:
        total, _free = probes.disk_usage("/dev/shm")
    except OSError:
        return CheckResult(
            "FAIL",
            "shm",
            "/dev/shm is missing",
            "mount a tmpfs on /dev/shm (docker run --ipc=host or --shm-size=8g)",
        )
    size_mib = total // 2**20
    if size_mib < minimum_mib:
        return CheckResult(
            "WARN",
            "shm",
            f"/dev/shm is {size_mib} MiB (< {minimum_mib} MiB): vLLM's processes exchange data "
            "through it",
            "give the container more shared memory (docker run --shm-size=8g, or --ipc=host)",
        )
    return CheckResult("PASS", "shm", f"/dev/shm is {size_mib} MiB")


def _cache_dir(configured: str, env: Mapping[str, str]) -> str:
    if configured:
        return configured
    if env.get("XDG_CACHE_HOME"):
        return env["XDG_CACHE_HOME"]
    return str(Path(env.get("HOME") or "/root") / ".cache")


def _disk_check(
    configured: str, minimum_mib: int, env: Mapping[str, str], probes: Probes
) -> CheckResult:
    cache = _cache_dir(configured, env)
    # A cache directory created on first use lives on its nearest existing ancestor's file system.
    path = Path(cache)
    for candidate in (path, *path.parents):
        try:
            _total, free = probes.disk_usage(str(candidate))
            break
        except FileNotFoundError:
            continue
        except OSError as exc:
            return CheckResult(
                "FAIL", "cache_disk", f"cannot stat {candidate}: {exc}", "set preflight.cache_dir"
            )
    else:
        return CheckResult(
            "FAIL", "cache_disk", f"no file system holds {cache}", "set preflight.cache_dir"
        )
    free_mib = free // 2**20
    text = f"{free_mib} MiB free for caches at {cache}"
    if free_mib < minimum_mib:
        return CheckResult(
            "FAIL",
            "cache_disk",
            f"{text} (< {minimum_mib} MiB): Triton, torch.compile and tilelang write compiled "
            "kernels there",
            f"free disk space on the file system holding {cache}",
        )
    return CheckResult("PASS", "cache_disk", text)


# -- all together ----------------------------------------------------------------------------


def run_checks(settings: Settings, probes: Probes) -> list[CheckResult]:
    """Every check, in a fixed order; the GPU ones run first because the environment the others
    probe with names the GPU."""
    engine = settings.engine
    gpu_results, gpu = _gpu_checks(engine, probes)
    visible = gpu.uuid if gpu is not None else ("" if engine.gpu_kind == "pci" else engine.gpu)
    env, _dropped = build_launch(engine, visible_device=visible).environment(probes.environ)
    python = engine_python(engine.program)
    found = probe_interpreter(python, env, probes)
    results: list[CheckResult] = []
    if isinstance(found, Interpreter):
        results += [_python_check(found), _glibc_check(probes), _vllm_check(found)]
    else:
        results += [
            found,
            _glibc_check(probes),
            CheckResult("FAIL", "vllm", f"not checked: {python} did not run", "fix python first"),
        ]
    results += gpu_results
    results.append(_checkpoint_check(engine.model_path))
    results.append(_compiler_check(env, probes))
    if isinstance(found, Interpreter):
        results.append(_headers_check(found))
    else:
        results.append(
            CheckResult(
                "FAIL", "python_headers", f"not checked: {python} did not run", "fix python first"
            )
        )
    results.append(_cuda_home_check(env, probes))
    results.append(_socket_dir_check(engine.socket))
    results.append(_shm_check(settings.preflight.min_shm_mib, probes))
    results.append(
        _disk_check(settings.preflight.cache_dir, settings.preflight.min_free_disk_mib, env, probes)
    )
    return results


def report(results: Sequence[CheckResult]) -> str:
    """The ``check`` output: one `CheckResult.line` per check and a summary line."""
    counts = {
        status: sum(r.status == status for r in results) for status in ("PASS", "WARN", "FAIL")
    }
    summary = f"{counts['FAIL']} FAIL, {counts['WARN']} WARN, {counts['PASS']} PASS"
    return "\n".join([*(r.line() for r in results), summary]) + "\n"


def failed(results: Sequence[CheckResult]) -> bool:
    """True when any check FAILed (``serve`` refuses to start, ``check`` exits 1)."""
    return any(r.status == "FAIL" for r in results)
