"""Preflight: each pitfall of the deployment notes as a host check with its one-sentence fix.

System access (running ``nvidia-smi`` and the engine's Python, reading glibc's version, ``which``,
``statvfs``) goes through one `Probes` value so tests feed recorded outputs of real hosts; the
functions here only decide. Files (checkpoint, ``Python.h``, socket directory) are read directly.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint import checkpoint_check, draft_check
from engine.command import build_launch
from engine.config import Settings
from engine.gpucheck import gpu_checks
from engine.gpus import CUDA_TOOLKIT, gpu_kind
from engine.probes import CheckResult, Probes, dotted, last_line, parse_version

REQUIRED_PYTHON = (3, 12)  # the wheel is cp312 (vllm-protocol.md section 1.1)
REQUIRED_GLIBC = (2, 38)  # flash_attn_v100_cuda.so needs GLIBC_2.38 (DEPLOYMENT-NOTES)
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
    line = last_line(output.stdout)
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
        reason = last_line(output.stderr) or line or f"exit {output.returncode}"
        return CheckResult("FAIL", "python", f"{python} failed to run a probe: {reason}", fix)


def _python_check(found: Interpreter) -> CheckResult:
    text = f"CPython {dotted(found.version)} ({found.executable})"
    if found.version[:2] == REQUIRED_PYTHON:
        return CheckResult("PASS", "python", text)
    return CheckResult(
        "FAIL",
        "python",
        f"{text}; the 1Cat-vLLM wheel is built for CPython {dotted(REQUIRED_PYTHON)} (cp312)",
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
    version = parse_version(version_text)
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
            f"{text}; releases before {dotted(ONECAT_PROTOCOL_BASE)} sit on an older vLLM base "
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
    need = dotted(REQUIRED_GLIBC)
    if match is None:
        return CheckResult("FAIL", "glibc", f"not a glibc system ({text or 'unknown libc'})", fix)
    found = (int(match.group(1)), int(match.group(2)))
    if found < REQUIRED_GLIBC:
        return CheckResult(
            "FAIL",
            "glibc",
            f"glibc {dotted(found)} < {need}: the wheel's flash_attn_v100_cuda.so needs "
            f"GLIBC_{need}",
            fix,
        )
    return CheckResult("PASS", "glibc", f"glibc {dotted(found)} (>= {need})")


# -- files -----------------------------------------------------------------------------------


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
    text = f"CUDA_HOME={home}, nvcc {dotted(release)}"
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
            f"{text}; the wheel is built with CUDA {dotted(CUDA_TOOLKIT)}",
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
    probe with names the GPUs."""
    engine = settings.engine
    gpu_results, gpus = gpu_checks(engine, probes)
    if gpus is not None:
        visible = tuple(gpu.uuid for gpu in gpus)
    else:
        visible = tuple("" if gpu_kind(gpu) == "pci" else gpu for gpu in engine.devices)
    env, _dropped = build_launch(engine, visible_devices=visible).environment(probes.environ)
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
    results.append(checkpoint_check(engine.model_path))
    if engine.speculative is not None:
        results.append(draft_check(engine.speculative.model))
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
