"""Per-engine series in process: every engine's forwarded ``vllm:*`` families merged with an
``engine`` label (vLLM's own kept as ``vllm_engine``), each engine's launcher status file as its
own ``qwen38_engine_*`` series."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.status import StatusFile
from gateway.exposition import engine_families, label_engine, merge_engines
from gateway.launcher_status import LauncherStatusCollector

pytestmark = pytest.mark.fast

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-metrics"


def test_a_sample_gets_the_configured_engine_and_keeps_vllms_own_as_vllm_engine() -> None:
    """``engine`` becomes the configured name, first; vLLM's ``engine`` index is kept as
    ``vllm_engine``; values with commas, braces and quotes survive; bare samples get a label."""
    line = 'vllm:x{engine="0",model_name="a,b}\\"c"} 2.0'
    assert label_engine(line, "gpu1") == (
        'vllm:x{engine="gpu1",vllm_engine="0",model_name="a,b}\\"c"} 2.0'
    )
    assert label_engine("vllm:y 3", "gpu0") == 'vllm:y{engine="gpu0"} 3'
    assert label_engine("vllm:z{} 1", "e") == 'vllm:z{engine="e"} 1'


def test_two_engines_merge_into_one_valid_exposition_with_each_family_once() -> None:
    """The recorded vLLM exposition of two engines: one HELP/TYPE per family, twice the
    samples, each with engine e0 or e1 (vLLM's engine index as vllm_engine), parsed by
    prometheus_client."""
    raw = (FIXTURES / "running.txt").read_text()
    one = engine_families(raw)
    merged = merge_engines([("e0", one), ("e1", one)])
    types = [line for line in merged.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)) == one.count("# TYPE ")
    single = [s for f in text_string_to_metric_families(one) for s in f.samples]
    samples = [s for f in text_string_to_metric_families(merged) for s in f.samples]
    assert len(samples) == 2 * len(single)
    assert {s.labels["engine"] for s in samples} == {"e0", "e1"}
    indexed = {s.labels.get("vllm_engine") for s in samples if s.name.startswith("vllm:num_")}
    assert indexed == {"0"}
    running = {
        s.labels["engine"]: s.value for s in samples if s.name == "vllm:num_requests_running"
    }
    assert set(running) == {"e0", "e1"}
    assert merge_engines([]) == ""


def test_each_engines_status_file_is_its_own_series(tmp_path: Path) -> None:
    """Two engines' launcher status files: restarts, hangs, state each labelled with their
    engine; an engine whose file is missing has no series, the other keeps its own."""
    files = {name: tmp_path / f"{name}.status.json" for name in ("gpu0", "gpu1")}
    first = StatusFile(str(files["gpu0"]), 1800)
    first.update(state="ready")
    first.record_restart("hang", "hung")
    second = StatusFile(str(files["gpu1"]), 1800)
    second.update(state="loading", stalled_s=4.0)
    paths = [("gpu0", str(files["gpu0"])), ("gpu1", str(files["gpu1"])), ("gpu2", "")]
    registry = CollectorRegistry()
    registry.register(LauncherStatusCollector(lambda: paths))
    text = generate_latest(registry).decode()
    assert 'qwen38_engine_restarts_total{engine="gpu0",reason="hang"} 1.0' in text
    assert 'qwen38_engine_restarts_total{engine="gpu1",reason="hang"} 0.0' in text
    assert 'qwen38_engine_launcher_state{engine="gpu0",state="ready"} 1.0' in text
    assert 'qwen38_engine_launcher_state{engine="gpu1",state="loading"} 1.0' in text
    assert 'qwen38_engine_stalled_seconds{engine="gpu1"} 4.0' in text
    assert 'engine="gpu2"' not in text
    files["gpu0"].unlink()
    text = generate_latest(registry).decode()
    assert 'engine="gpu0"' not in text and 'engine="gpu1"' in text
