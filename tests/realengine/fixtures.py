"""Pytest fixtures and hooks for the two engines: real vLLM and the simulator, each started once.

A test that takes the ``engine`` fixture runs once per engine (ids ``sim`` and ``real``), unless
it is marked ``sim_only`` (it needs the simulator's fault injection). Real-engine items also get
the ``real_engine`` marker, so ``pytest -m real_engine`` runs just them.

The real engine needs vLLM's CPU build in its own virtual environment (.ci/run makes one in
``.engine-venv``; ``QWEN38_REAL_ENGINE_PYTHON`` names another interpreter). Without it every
real-engine test errors, naming the fix; ``QWEN38_SKIP_REAL_ENGINE=1`` skips them instead, and the
run's summary says so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Gateway, _stop, start_gateway
from tests.layers import is_real_engine_item
from tests.realengine.launcher import (
    MAX_MODEL_LEN,
    PYTHON_ENV,
    SKIP_ENV,
    EngineStartFailed,
    EngineUnavailable,
    LaunchedEngine,
    check_engine_python,
    engine_python,
    launch,
)

ENGINE_KINDS = ("sim", "real")
# pytest-timeout's bound of a real-engine test: the engine's start_timeout_s (300 s) and two
# minutes for the test itself.
REAL_ENGINE_TEST_TIMEOUT_S = 420


def real_engine_skipped() -> bool:
    """The user opted out of the real engine with ``QWEN38_SKIP_REAL_ENGINE=1``."""
    return os.environ.get(SKIP_ENV, "") not in ("", "0")


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers."""
    config.addinivalue_line(
        "markers", "sim_only: needs the simulator's fault injection; not run on the real engine"
    )
    config.addinivalue_line("markers", "real_engine: runs against real vLLM (CPU build)")
    config.addinivalue_line(
        "markers",
        "sim_pending(reason): the simulator does not match real vLLM here yet; its run is a "
        "strict xfail, so the marker must go once the simulator is fixed",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise every test taking ``engine`` over both engines (``sim_only``: the simulator)."""
    if "engine" not in metafunc.fixturenames:
        return
    kinds = ["sim"] if metafunc.definition.get_closest_marker("sim_only") else list(ENGINE_KINDS)
    metafunc.parametrize("engine", kinds, indirect=True, scope="session")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the real-engine items ``real_engine``; make ``sim_pending`` simulator runs xfail."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        kind = callspec.params.get("engine") if callspec is not None else None
        if is_real_engine_item(item):
            item.add_marker(pytest.mark.real_engine)
            if item.get_closest_marker("timeout") is None:
                # The first real-engine test of a worker pays for the engine's start (under
                # supervise.start_timeout_s, 300 s), which setup.cfg's 120 s would cut short.
                item.add_marker(pytest.mark.timeout(REAL_ENGINE_TEST_TIMEOUT_S))
        pending = item.get_closest_marker("sim_pending")
        if kind == "sim" and pending is not None:
            reason = pending.args[0] if pending.args else "simulator differs from real vLLM"
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"simulator: {reason}"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say plainly when the real-engine tests were skipped on request."""
    if real_engine_skipped():
        terminalreporter.write_sep(
            "!",
            f"REAL-ENGINE TESTS NOT RUN ({SKIP_ENV}={os.environ[SKIP_ENV]}): only the simulator "
            "was tested",
            red=True,
            bold=True,
        )


def _workdir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o700)
    return path


@pytest.fixture(scope="session")
def real_engine() -> Iterator[LaunchedEngine]:
    """Real vLLM (CPU) serving the tiny model, under the launcher, for the whole session."""
    if real_engine_skipped():
        pytest.skip(f"real engine not run: {SKIP_ENV} is set")
    python = engine_python()
    try:
        check_engine_python(python)
    except EngineUnavailable as exc:
        pytest.fail(f"real engine unavailable ({PYTHON_ENV}): {exc}", pytrace=False)
    workdir = _workdir("q38re-")
    try:
        engine = launch("real", workdir, python)
    except EngineStartFailed as exc:
        # The engine's own line first (e.g. vLLM's NotImplementedError), not only the
        # launcher's "engine exited with code 1"; the log stays for a look.
        pytest.fail(str(exc), pytrace=False)
    try:
        yield engine
    finally:
        engine.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def sim_engine() -> Iterator[LaunchedEngine]:
    """The simulator under the launcher, with the same engine.toml, for the whole session."""
    workdir = _workdir("q38se-")
    engine = launch("sim", workdir)
    try:
        yield engine
    finally:
        engine.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def engine(request: pytest.FixtureRequest) -> LaunchedEngine:
    """The engine of this parametrisation: ``sim`` or ``real`` (see `pytest_generate_tests`)."""
    name = "real_engine" if request.param == "real" else "sim_engine"
    launched: LaunchedEngine = request.getfixturevalue(name)
    return launched


@pytest.fixture(scope="session")
def engine_gateway(engine: LaunchedEngine) -> Iterator[Gateway]:
    """The gateway in front of ``engine`` (tenants acme, beta, carol), per engine."""
    workdir = _workdir("q38eg-")
    config = {
        "engine": {
            "socket": engine.socket,
            "ready_file": engine.ready_file,
            "max_model_len": MAX_MODEL_LEN,
            # The production default (probe timeout 2 s): real vLLM's /health takes up to about
            # 0.8 s while it streams flat out on 2 busy cores, and a probe timeout marks the
            # engine down (503s, quarantine deaths) although it is working.
            "health_interval_s": 2.0,
        }
    }
    gw = start_gateway(workdir, None, config)
    try:
        yield gw
    finally:
        _stop(gw.proc)
        shutil.rmtree(workdir, ignore_errors=True)
