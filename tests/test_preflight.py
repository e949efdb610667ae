"""Preflight decisions on recorded outputs of real hosts, and `check` on this machine."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from engine.config import EngineConfig, PreflightConfig, Settings
from engine.gpus import GPU_QUERY, find_gpu, parse_gpu_query
from engine.preflight import report, run_checks
from engine.probes import CheckResult, Output, Probes

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "preflight"
CUDA_HOME = "/usr/local/cuda-12.8"


class RecordedHost:
    """`Probes` answering from a fixture directory (see tests/fixtures/preflight/README).

    ``include`` replaces the include directory the engine's Python reports (so a test can
    provide ``Python.h``); ``replace`` maps fixture file names to other contents.
    """

    def __init__(
        self, name: str, *, include: Path | None = None, replace: Mapping[str, str] | None = None
    ) -> None:
        self.chain: list[Path] = []
        self.absent: set[str] = set()
        self.exit_codes: dict[str, int] = {}
        self.include = include
        self.replace = dict(replace or {})
        current: str | None = name
        while current:
            directory = FIXTURES / current
            meta = json.loads((directory / "host.json").read_text())
            self.chain.append(directory)
            # The nearest host decides: a file it marks absent stays absent.
            self.absent |= {f for f in meta.get("absent", []) if not self._own(f)}
            for key, code in meta.get("exit_codes", {}).items():
                self.exit_codes.setdefault(key, code)
            current = meta.get("inherit")

    def _own(self, name: str) -> bool:
        return any((d / name).is_file() for d in self.chain)

    def text(self, name: str) -> str | None:
        """The recorded file ``name`` from the nearest host that has it, None if absent."""
        if name in self.replace:
            return self.replace[name]
        if name in self.absent:
            return None
        for directory in self.chain:
            if (directory / name).is_file():
                return (directory / name).read_text()
        return None

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> Output | None:
        args = tuple(argv)
        if args == GPU_QUERY:
            name = "nvidia-smi-query.csv"
        elif args == ("nvidia-smi",):
            name = "nvidia-smi.txt"
        elif args[1:2] == ("-c",):
            name = "engine-python.json"
        elif args == (f"{CUDA_HOME}/bin/nvcc", "--version"):
            name = "nvcc-version.txt"
        else:
            raise AssertionError(f"unexpected command {args}")
        content = self.text(name)
        if content is None:
            return None
        if name == "engine-python.json" and self.include is not None:
            data = json.loads(content)
            data["include"] = str(self.include)
            content = json.dumps(data)
        return Output(self.exit_codes.get(name, 0), content, "")

    def disk_usage(self, path: str) -> tuple[int, int]:
        for line in (self.text("df.txt") or "").splitlines()[1:]:
            target, size, avail = line.split()
            if target == path:
                return int(size), int(avail)
        raise FileNotFoundError(path)

    def probes(self, **environ: str) -> Probes:
        """Probes of this host; ``environ`` entries override (an empty value unsets)."""
        env = {
            "PATH": "/opt/qwen38/venv/bin:/usr/local/cuda-12.8/bin:/usr/bin:/bin",
            "HOME": "/var/cache/qwen38/home",
            "XDG_CACHE_HOME": "/var/cache/qwen38",
            "CUDA_HOME": CUDA_HOME,
            **environ,
        }
        return Probes(
            run=self.run,
            which=lambda name, path: {"gcc": "/usr/bin/gcc"}.get(name),
            glibc=lambda: (self.text("glibc.txt") or "").strip(),
            disk_usage=self.disk_usage,
            environ={k: v for k, v in env.items() if v},
        )


def write_safetensors(path: Path, sizes: Mapping[str, int]) -> None:
    """A valid safetensors file with one U8 tensor of each size (bytes)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, size in sizes.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def make_checkpoint(root: Path, shards: int = 3) -> Path:
    """A complete small checkpoint directory in Hugging Face layout."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"architectures": ["Qwen3_5ForConditionalGeneration"]}')
    (root / "tokenizer.json").write_text("{}")
    (root / "tokenizer_config.json").write_text("{}")
    weight_map = {}
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        write_safetensors(root / name, {f"layer{i}.weight": 4096, f"layer{i}.bias": 64})
        weight_map[f"layer{i}.weight"] = name
        weight_map[f"layer{i}.bias"] = name
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return root


@pytest.fixture
def host_tree(workdir: Path) -> Path:
    """A checkpoint, a private socket directory and Python headers under ``workdir``."""
    make_checkpoint(workdir / "model")
    (workdir / "run").mkdir(mode=0o750)
    include = workdir / "include" / "python3.12"
    include.mkdir(parents=True)
    (include / "Python.h").write_text("/* Python.h */\n")
    return workdir


def settings_for(tree: Path, **engine: object) -> Settings:
    """Settings whose paths point into ``tree`` (see `host_tree`)."""
    fields: dict[str, object] = {
        "model_path": str(tree / "model"),
        "socket": str(tree / "run" / "engine.sock"),
        **engine,
    }
    return Settings(engine=EngineConfig(**fields), preflight=PreflightConfig())  # type: ignore[arg-type]


def checks(
    host_name: str, tree: Path, settings: Settings | None = None, **env: str
) -> dict[str, CheckResult]:
    """Run every check on recorded host ``host_name`` with the paths of ``tree``, by name."""
    host = RecordedHost(host_name, include=tree / "include" / "python3.12")
    results = run_checks(settings or settings_for(tree), host.probes(**env))
    return {r.name: r for r in results}


def test_v100_reference_host_passes_every_check(host_tree: Path) -> None:
    """The reference V100 container passes all checks, in the documented order."""
    results = checks("v100", host_tree)
    assert {name: r.status for name, r in results.items()} == dict.fromkeys(results, "PASS")
    assert list(results) == [
        "python", "glibc", "vllm", "nvidia_smi", "gpu", "compute_capability", "gpu_memory",
        "driver", "gpu_fit", "checkpoint", "c_compiler", "python_headers", "cuda_home",
        "socket_dir", "shm", "cache_disk",
    ]  # fmt: skip
    assert "20.94 target + 7.78 KV = 28.72 GiB per card of 31.74 GiB" in results["gpu_fit"].detail
    assert "Tesla V100-SXM2-32GB" in results["gpu"].detail
    assert "525.105.17 (CUDA 12.0)" in results["driver"].detail
    assert "minor-version compatibility" in results["driver"].detail
    assert "1Cat-vLLM 1.3.0" in results["vllm"].detail
    assert "3 safetensors shard(s)" in results["checkpoint"].detail


def test_a100_host_fails_compute_capability_with_fix(host_tree: Path) -> None:
    """An A100 (compute capability 8.0) is refused: the wheel's kernels are SM70 only."""
    results = checks("a100", host_tree)
    cap = results["compute_capability"]
    assert cap.status == "FAIL"
    assert "8.0" in cap.detail and "NVIDIA A100-SXM4-80GB" in cap.detail
    assert "V100" in cap.fix
    assert results["gpu"].status == "PASS"
    assert results["driver"].status == "PASS"
    assert "CUDA 12.2" in results["driver"].detail


def test_gpu_selected_by_index_uuid_or_bus_id(host_tree: Path) -> None:
    """engine.gpu finds the second A100 by index, UUID or either bus id spelling."""
    host = RecordedHost("a100")
    gpus = parse_gpu_query(host.text("nvidia-smi-query.csv") or "")
    for selector in (
        "1",
        "GPU-1e77b2d5-0c6a-4f3b-a9d2-6b0f4c8e2d17",
        "00000000:0F:00.0",
        "0000:0f:00.0",
    ):
        found = find_gpu(gpus, selector)
        assert found is not None and found.index == 1, selector
    assert find_gpu(gpus, "2") is None
    results = checks("a100", host_tree, settings_for(host_tree, gpu="5"))
    assert results["gpu"].status == "FAIL"
    assert "engine.gpu = '5'" in results["gpu"].detail
    assert "00000000:0F:00.0" in results["gpu"].detail


def test_host_without_gpu_fails_naming_the_gpu(host_tree: Path) -> None:
    """Without nvidia-smi the GPU checks fail, naming the configured GPU and the fix."""
    results = checks("no-gpu", host_tree)
    assert results["nvidia_smi"].status == "FAIL"
    assert "nvidia-smi not found" in results["nvidia_smi"].detail
    assert "--gpus" in results["nvidia_smi"].fix
    assert results["gpu"].status == "FAIL"
    assert results["gpu"].detail.startswith("GPU 0 ")
    assert "--gpus" in results["gpu"].fix
    for name in ("compute_capability", "gpu_memory", "driver"):
        assert results[name].status == "FAIL"
        assert results[name].detail.startswith("not checked")
    assert results["python"].status == "PASS"


def test_driver_not_loaded_reports_nvidia_smi_message(host_tree: Path) -> None:
    """nvidia-smi failing (exit 9, module not loaded) shows its own message."""
    results = checks("driver-not-loaded", host_tree)
    smi = results["nvidia_smi"]
    assert smi.status == "FAIL"
    assert "exit 9" in smi.detail
    assert "couldn't communicate with the NVIDIA driver" in smi.detail


def test_driver_too_old_for_cuda_12_fails(host_tree: Path) -> None:
    """Driver 515 (CUDA 11.7) is below 525.60.13, the CUDA 12.x minor-version minimum."""
    results = checks("driver-515", host_tree)
    driver = results["driver"]
    assert driver.status == "FAIL"
    assert "515.105.01 (CUDA 11.7)" in driver.detail and "525.60.13" in driver.detail
    assert "525.60.13" in driver.fix
    assert results["compute_capability"].status == "PASS"


def test_old_glibc_host_fails_with_container_fix(host_tree: Path) -> None:
    """On the Ubuntu 20.04 host (glibc 2.31) glibc and the vllm import fail; fix: the 24.04 image."""
    results = checks("ubuntu2004-host", host_tree, CUDA_HOME="")
    glibc = results["glibc"]
    assert glibc.status == "FAIL"
    assert "glibc 2.31 < 2.38" in glibc.detail
    assert "Ubuntu 24.04 image" in glibc.fix
    vllm = results["vllm"]
    assert vllm.status == "FAIL"
    assert "GLIBC_2.38" in vllm.detail
    assert "Ubuntu 24.04 image" in vllm.fix
    cuda = results["cuda_home"]
    assert cuda.status == "FAIL" and "CUDA_HOME is not set" in cuda.detail
    assert "cuda-nvcc-12-8" in cuda.fix


def test_upstream_vllm_is_not_the_1cat_build(host_tree: Path) -> None:
    """Upstream vLLM 0.21.0 imports but is refused: no SM70 kernels."""
    vllm = checks("upstream-vllm", host_tree)["vllm"]
    assert vllm.status == "FAIL"
    assert "0.21.0" in vllm.detail and "not the 1Cat build" in vllm.detail
    assert "1cat_vllm-1.3.0" in vllm.fix


def test_cuda_13_nvcc_cannot_build_for_sm70(host_tree: Path) -> None:
    """CUDA_HOME pointing at CUDA 13.0 fails: it dropped sm_70 offline compilation."""
    cuda = checks("cuda13", host_tree)["cuda_home"]
    assert cuda.status == "FAIL"
    assert "nvcc 13.0" in cuda.detail and "sm_70" in cuda.detail
    assert "12.8" in cuda.fix


def test_docker_default_shm_warns(host_tree: Path) -> None:
    """Docker's default 64 MiB /dev/shm is a warning with the --shm-size fix."""
    results = checks("docker-default-shm", host_tree)
    assert results["shm"].status == "WARN"
    assert "64 MiB" in results["shm"].detail
    assert "--shm-size" in results["shm"].fix
    assert [r.status for r in results.values()].count("FAIL") == 0


def test_incomplete_checkpoint_names_missing_and_truncated_files(host_tree: Path) -> None:
    """A missing shard, a truncated shard and a missing tokenizer are each named."""
    model = host_tree / "model"
    (model / "model-00002-of-00003.safetensors").unlink()
    shard = model / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    (model / "tokenizer.json").unlink()
    checkpoint = checks("v100", host_tree)["checkpoint"]
    assert checkpoint.status == "FAIL"
    assert "model-00002-of-00003.safetensors missing" in checkpoint.detail
    assert "model-00003-of-00003.safetensors truncated" in checkpoint.detail
    assert "tokenizer.json" in checkpoint.detail
    assert "download" in checkpoint.fix


def test_checkpoint_path_missing_fails(host_tree: Path) -> None:
    """A model_path that is not a directory fails the checkpoint check."""
    settings = settings_for(host_tree, model_path=str(host_tree / "nowhere"))
    checkpoint = checks("v100", host_tree, settings)["checkpoint"]
    assert checkpoint.status == "FAIL" and "is not a directory" in checkpoint.detail


def test_busy_gpu_fails_memory_check(host_tree: Path) -> None:
    """Less free memory than gpu_memory_utilization x total fails, as vLLM would refuse."""
    row = (FIXTURES / "v100" / "nvidia-smi-query.csv").read_text().replace("32494", "20480")
    host = RecordedHost("v100", replace={"nvidia-smi-query.csv": row})
    results = run_checks(settings_for(host_tree), host.probes())
    memory = {r.name: r for r in results}["gpu_memory"]
    assert memory.status == "FAIL"
    assert "20480 MiB free of 32768 MiB" in memory.detail
    assert "gpu_memory_utilization 0.9 needs 29492 MiB" in memory.detail
    assert "other processes" in memory.fix


def test_missing_compiler_headers_and_socket_dir(host_tree: Path) -> None:
    """No gcc, no Python.h and a world-writable socket directory each fail with their fix."""
    (host_tree / "include" / "python3.12" / "Python.h").unlink()
    os.chmod(host_tree / "run", 0o777)
    host = RecordedHost("v100", include=host_tree / "include" / "python3.12")
    probes = dataclasses.replace(host.probes(), which=lambda name, path: None)
    results = {r.name: r for r in run_checks(settings_for(host_tree), probes)}
    assert results["python_headers"].status == "FAIL"
    assert "Python.h" in results["python_headers"].detail
    assert "python3.12-dev" in results["python_headers"].fix
    assert results["socket_dir"].status == "FAIL"
    assert "world-writable (mode 0777)" in results["socket_dir"].detail
    assert results["c_compiler"].status == "FAIL"
    assert "Failed to find C compiler" in results["c_compiler"].detail
    assert "build-essential" in results["c_compiler"].fix


def test_socket_dir_missing_fails(host_tree: Path) -> None:
    """A socket directory that does not exist fails with the command that creates it."""
    settings = settings_for(host_tree, socket=str(host_tree / "absent" / "engine.sock"))
    socket_dir = checks("v100", host_tree, settings)["socket_dir"]
    assert socket_dir.status == "FAIL" and "does not exist" in socket_dir.detail
    assert "install -d -m 0750" in socket_dir.fix


def test_report_lines_have_status_name_detail_and_fix() -> None:
    """Each line is 'STATUS name: detail'; WARN and FAIL lines are followed by their fix."""
    text = report(
        [
            CheckResult("PASS", "glibc", "glibc 2.39 (>= 2.38)"),
            CheckResult("FAIL", "gpu", "GPU 0 not visible", "start the container with --gpus"),
        ]
    )
    assert text.splitlines() == [
        "PASS glibc: glibc 2.39 (>= 2.38)",
        "FAIL gpu: GPU 0 not visible",
        "    fix: start the container with --gpus",
        "1 FAIL, 0 WARN, 1 PASS",
    ]


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None or importlib.util.find_spec("vllm") is not None,
    reason="this machine has a GPU driver or vllm",
)
def test_check_on_this_machine_fails_naming_gpu_and_vllm(workdir: Path) -> None:
    """`qwen38-engine check` here (no GPU, no vllm) exits 1 with FAIL lines and fixes for both."""
    env = {k: v for k, v in os.environ.items() if k != "QWEN38_ENGINE_CONFIG"}
    done = subprocess.run(
        [sys.executable, "-m", "engine", "check", "--config", str(workdir / "absent.toml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    gpu = next(i for i, line in enumerate(lines) if line.startswith("FAIL gpu: GPU 0 "))
    assert lines[gpu + 1].startswith("    fix: ")
    vllm = next(i for i, line in enumerate(lines) if line.startswith("FAIL vllm: "))
    assert "not installed" in lines[vllm]
    assert lines[vllm + 1].startswith("    fix: install the 1Cat-vLLM wheel")
    assert lines[0].startswith("WARN config: ") and "absent.toml not found" in lines[0]
    assert lines[-1].endswith("PASS") and "FAIL" in lines[-1]
