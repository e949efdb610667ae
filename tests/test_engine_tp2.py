"""Two V100s: a list of GPUs, tensor parallel 2, the DFlash2 draft, and whether it all fits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.cli import _launch
from engine.command import build_launch
from engine.config import ConfigError, EngineConfig, Settings, load_settings, parse_settings
from engine.memory import DRAFT_LM_HEAD_GIB, estimate
from engine.probes import CheckResult, PreflightError
from tests.test_preflight import RecordedHost, make_checkpoint, settings_for, write_safetensors

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
TP2_EXAMPLE = REPO / "deploy" / "etc" / "engine.tp2.toml"
UUID0 = "GPU-5a0c3e4f-8f1b-2d7e-91a3-0c6b2f9d4e11"
UUID1 = "GPU-c81d2b6a-3e4f-4a70-8b19-7d2e5f0a9c36"
DRAFT = "/models/Qwen3.8-27B-DFlash2"

COMMON = """\
env CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1 \\
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
  --max-num-seqs 1 \\
  --tensor-parallel-size 2"""
TP2_TEXT = COMMON + "\n"
TP2_DRAFT_TEXT = (
    COMMON + " \\\n  --speculative-config "
    '\'{"method":"dflash","model":"/models/Qwen3.8-27B-DFlash2"}\'\n'
)


def command(config: Path) -> subprocess.CompletedProcess[str]:
    """``qwen38-engine command --config CONFIG`` as a process."""
    env = {k: v for k, v in os.environ.items() if k != "QWEN38_ENGINE_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "engine", "command", "--config", str(config)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- configuration and command line ------------------------------------------------------------


def test_gpu_list_renders_tensor_parallel_and_pins_the_devices() -> None:
    """gpus = [a, b]: --tensor-parallel-size 2 and CUDA_VISIBLE_DEVICES in rank order."""
    settings = parse_settings({"engine": {"gpus": [UUID1, UUID0]}})
    assert settings.engine.devices == (UUID1, UUID0)
    assert settings.engine.tensor_parallel_size == 2
    launch = build_launch(settings.engine)
    assert launch.env["CUDA_VISIBLE_DEVICES"] == f"{UUID1},{UUID0}"
    assert launch.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    argv = list(launch.argv)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--speculative-config" not in argv
    single = build_launch(EngineConfig())
    assert "--tensor-parallel-size" not in single.argv
    assert single.env["CUDA_VISIBLE_DEVICES"] == "0"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"gpu": "0", "gpus": ["0", "1"]}, "engine.gpu and engine.gpus are both set"),
        ({"gpus": []}, "engine.gpus = []: expected a non-empty list of GPUs"),
        ({"gpus": ["0", "0"]}, "a GPU is listed twice"),
        ({"gpus": ["0", "GPU-12"]}, 'engine.gpus[1] = "GPU-12": expected one GPU'),
        ({"speculative": {"method": "dflash"}}, "engine.speculative.model: the draft model"),
        ({"speculative": {"model": DRAFT, "k": 5}}, "unknown key engine.speculative.k"),
        (
            {
                "gpus": ["0", "1", "2"],
                "speculative": {"model": DRAFT, "draft_tensor_parallel_size": 2},
            },
            "must be 1 or the number of GPUs (3)",
        ),
        ({"extra_args": ["--tensor-parallel-size", "2"]}, "use engine.gpus"),
        ({"extra_args": ["--speculative-config={}"]}, "use [engine.speculative]"),
    ],
)
def test_bad_gpu_lists_and_speculative_tables_are_refused(
    table: dict[str, Any], message: str
) -> None:
    """Both keys, empty or duplicate lists, a draft without a model, flags set by hand: refused."""
    with pytest.raises(ConfigError) as caught:
        parse_settings({"engine": table})
    assert message in str(caught.value)


def test_speculative_config_is_vllm_json() -> None:
    """[engine.speculative] becomes --speculative-config with vLLM's key names, fixed order."""
    settings = parse_settings(
        {
            "engine": {
                "gpus": ["0", "1"],
                "speculative": {
                    "model": DRAFT,
                    "num_speculative_tokens": 15,
                    "draft_tensor_parallel_size": 2,
                    "method": "dflash",
                },
            }
        }
    )
    argv = list(build_launch(settings.engine).argv)
    assert argv[argv.index("--speculative-config") + 1] == (
        '{"method":"dflash","model":"/models/Qwen3.8-27B-DFlash2",'
        '"num_speculative_tokens":15,"draft_tensor_parallel_size":2}'
    )


def test_command_prints_the_tp2_and_tp2_draft_lines(tmp_path: Path) -> None:
    """`qwen38-engine command` on engine.tp2.toml: TP2 plus the draft; without the table, TP2."""
    with_draft = command(TP2_EXAMPLE)
    assert with_draft.returncode == 0, with_draft.stderr
    assert with_draft.stdout == TP2_DRAFT_TEXT
    text = TP2_EXAMPLE.read_text()
    without = tmp_path / "engine.toml"
    without.write_text(text[: text.index("[engine.speculative]")])
    plain = command(without)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == TP2_TEXT


def test_bus_ids_resolve_to_uuids_on_a_recorded_two_v100_host() -> None:
    """PCI bus ids in gpus become the UUIDs nvidia-smi reports on the two-V100 host, in order."""
    probes = RecordedHost("v100x2").probes()
    settings = parse_settings({"engine": {"gpus": ["0000:00:1f.0", "00000000:00:1E.0"]}})
    launch = _launch(settings, probes)
    assert launch.env["CUDA_VISIBLE_DEVICES"] == f"{UUID1},{UUID0}"
    missing = parse_settings({"engine": {"gpus": ["00000000:00:1E.0", "00000000:00:2A.0"]}})
    with pytest.raises(PreflightError, match=r"no GPU has PCI bus id 00000000:00:2A\.0"):
        _launch(missing, probes)


def test_tp2_example_differs_from_the_reference_only_in_gpus_and_draft() -> None:
    """engine.tp2.toml keeps every other reference value and comments each key."""
    reference = load_settings(REPO / "deploy" / "etc" / "engine.toml")
    tp2 = load_settings(TP2_EXAMPLE)
    assert tp2.engine.gpus == ("0", "1") and tp2.engine.speculative is not None
    assert tp2.engine.speculative.model == DRAFT and tp2.engine.speculative.method == "dflash"
    same = Settings(
        engine=EngineConfig(
            **{
                **{f: getattr(tp2.engine, f) for f in EngineConfig.__dataclass_fields__},
                "gpus": (),
                "speculative": None,
            }
        ),
        supervise=tp2.supervise,
        preflight=tp2.preflight,
        source=reference.source,
    )
    assert same == reference
    previous = ""
    for line in TP2_EXAMPLE.read_text().splitlines():
        if re.match(r"^[a-z_]+\s*=", line):
            assert previous.startswith("#"), line
        if line.strip():
            previous = line


# -- preflight on recorded hosts -----------------------------------------------------------------


@pytest.fixture
def tree(workdir: Path) -> Path:
    """A checkpoint, a draft, a private socket directory and Python headers under ``workdir``."""
    make_checkpoint(workdir / "model")
    draft = workdir / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    write_safetensors(draft / "model.safetensors", {"lm_head.weight": 8192})
    (workdir / "run").mkdir(mode=0o750)
    include = workdir / "include" / "python3.12"
    include.mkdir(parents=True)
    (include / "Python.h").write_text("/* Python.h */\n")
    return workdir


def run(host: str, tree: Path, **engine: Any) -> list[CheckResult]:
    """Every preflight check on recorded ``host`` with the paths of ``tree``."""
    from engine.preflight import run_checks

    recorded = RecordedHost(host, include=tree / "include" / "python3.12")
    return run_checks(settings_for(tree, **engine), recorded.probes())


def by_name(results: list[CheckResult], name: str) -> list[CheckResult]:
    return [r for r in results if r.name == name]


def test_two_v100_host_passes_every_check_for_tp2_with_the_draft(tree: Path) -> None:
    """Both V100s pass model, SM70, memory and driver; the draft fits at 18.35 GiB per card."""
    spec = parse_settings({"engine": {"speculative": {"model": str(tree / "draft")}}})
    results = run("v100x2", tree, gpus=("0", "1"), speculative=spec.engine.speculative)
    assert [r for r in results if r.status != "PASS"] == []
    gpus = by_name(results, "gpu")
    assert [UUID0 in gpus[0].detail, UUID1 in gpus[1].detail] == [True, True]
    assert [r.detail.split(":")[0] for r in by_name(results, "compute_capability")] == [
        "GPU 0",
        "GPU 1",
    ]
    assert len(by_name(results, "gpu_memory")) == 2 and len(by_name(results, "driver")) == 1
    (fit,) = by_name(results, "gpu_fit")
    assert "(20.94 target + 7.78 KV + 6.97 draft) / 2 + 0.50 TP overhead = 18.35 GiB" in fit.detail
    assert "of 31.74 GiB (13.39 GiB spare)" in fit.detail
    assert by_name(results, "draft")[0].detail.endswith("1 safetensors shard(s), 0.0 GiB")


def test_draft_on_one_card_warns_with_the_arithmetic(tree: Path) -> None:
    """One V100 with the draft: WARN, 35.69 GiB needed of 31.74, and the second-GPU way out."""
    spec = parse_settings({"engine": {"speculative": {"model": str(tree / "draft")}}})
    results = run("v100", tree, speculative=spec.engine.speculative)
    (fit,) = by_name(results, "gpu_fit")
    assert fit.status == "WARN"
    assert "20.94 target + 7.78 KV + 6.97 draft = 35.69 GiB per card of 31.74 GiB" in fit.detail
    assert "(3.95 GiB over)" in fit.detail
    assert f"BF16 lm_head alone {DRAFT_LM_HEAD_GIB:.2f} GiB" in fit.fix
    assert "second V100" in fit.fix


def test_missing_or_mixed_second_gpu_is_reported(tree: Path) -> None:
    """A listed GPU the host lacks FAILs naming it; a smaller second card WARNs in gpu_fit."""
    results = run("v100", tree, gpus=("0", "1"))
    failed = [r for r in by_name(results, "gpu") if r.status == "FAIL"]
    assert len(failed) == 1 and "engine.gpus = '1'" in failed[0].detail
    assert by_name(results, "gpu_fit")[0].status == "FAIL"
    mixed = run("v100-mixed", tree, gpus=("0", "1"))
    (fit,) = by_name(mixed, "gpu_fit")
    assert fit.status == "WARN" and "Tesla V100-PCIE-16GB 16384 MiB" in fit.detail
    assert "of 15.87 GiB" in fit.detail


def test_incomplete_draft_fails(tree: Path) -> None:
    """A draft directory without weights fails the draft check with the download fix."""
    (tree / "draft" / "model.safetensors").unlink()
    spec = parse_settings({"engine": {"speculative": {"model": str(tree / "draft")}}})
    (draft,) = by_name(
        run("v100x2", tree, gpus=("0", "1"), speculative=spec.engine.speculative), "draft"
    )
    assert draft.status == "FAIL" and "no .safetensors file" in draft.detail


def test_estimate_matches_the_measured_reference_points() -> None:
    """The model reproduces the two measurements: 28.77 GiB alone, about 4 GiB over with the draft."""
    alone = estimate(
        tp=1, max_model_len=256_484, kv_cache_dtype="fp8_e5m2", draft=False, card_total_mib=32768
    )
    assert round(alone.need, 2) == 28.77 and alone.fits
    both = estimate(
        tp=1, max_model_len=256_484, kv_cache_dtype="fp8_e5m2", draft=True, card_total_mib=32768
    )
    assert round(both.need - both.limit, 2) == 4.0 and not both.fits
