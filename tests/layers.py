"""The suite's layers and how its files share the CI machine (tests/README.md, "Layers").

Markers:

- ``fast``: in-process and unit tests, no subprocess servers (``pytest -m fast``, under 90 s on
  2 cores). A module opts in with ``pytestmark = pytest.mark.fast``, one test with
  ``@pytest.mark.fast`` (``-m fast`` imports only the files whose text says ``mark.fast``). A fast item that asks for a fixture starting a server process
  (`SERVER_FIXTURES`) is a collection error, so the layer stays fast.
- ``slow(seconds)``: a file that takes minutes, most of it waiting (``seconds`` is its cost on
  the CI machine, for ordering). Under ``pytest -n N --dist loadgroup`` (what .ci/run runs) the
  slow work units start first, longest first, so they run beside the rest instead of after it.

Work units under ``--dist loadgroup``: a test goes to the worker of its ``xdist_group``; a test
without one gets its file as group, so a module's fixtures start once, as in a serial run. Every
real-engine test is in the group `REAL_ENGINE_GROUP`, so the session's real vLLM (about 3 GiB)
starts on one worker only. A slow file whose tests are independent can give each test its own
``@pytest.mark.xdist_group("name")`` to run them side by side too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Fixtures that start a server process (the simulator, the gateway, the launcher, real vLLM).
SERVER_FIXTURES = frozenset(
    {
        "stack",
        "sim_factory",
        "gateway_factory",
        "engine",
        "engine_gateway",
        "real_engine",
        "sim_engine",
    }
)
REAL_ENGINE_GROUP = "real-engine"
# Ordering weight of the real-engine group: its tests' seconds in the run of 2026-12-01 19:55
# (`.ci/run` from a clean clone, tests/README.md "Where the time goes").
REAL_ENGINE_SECONDS = 1500.0
DEFAULT_SLOW_SECONDS = 60.0
# Files that took a minute or more in that run (their tests outside the real-engine group, from
# its JUnit report) and carry no ``slow`` mark of their own: ordering weights only, so the
# longest start first.
MEASURED_SLOW_FILES = {
    "tests/test_limits_e2e.py": 121.0,
    "tests/test_observability_e2e.py": 113.0,
    "tests/test_memory_bounds.py": 78.0,
    "tests/test_cases_server.py": 78.0,
    "tests/test_long_waits.py": 70.0,
    "tests/test_cases.py": 63.0,
    "tests/test_fleet_engines.py": 62.0,
    "tests/test_usage_e2e.py": 61.0,
    "tests/test_deadline_e2e.py": 60.0,
}


def pytest_configure(config: pytest.Config) -> None:
    """Register the layer markers (and ``xdist_group``, so files load without pytest-xdist)."""
    config.addinivalue_line(
        "markers", "fast: in-process or unit test, no subprocess servers (pytest -m fast)"
    )
    config.addinivalue_line(
        "markers",
        "slow(seconds): a file that takes minutes, mostly waiting; scheduled first under xdist",
    )
    config.addinivalue_line(
        "markers", "xdist_group(name): tests that must share one pytest-xdist worker"
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With exactly ``-m fast``, skip importing test files that never mention the marker.

    Importing every module costs most of a ``-m fast`` run on 2 busy cores; a file with no
    ``mark.fast`` in its text has no fast test, so nothing it holds would be selected.
    """
    if config.getoption("markexpr", "") != "fast" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "mark.fast" not in collection_path.read_text(errors="replace")


def is_real_engine_item(item: pytest.Item) -> bool:
    """The item runs against real vLLM (its ``engine`` parameter, fixture or marker)."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("engine") == "real":
        return True
    if "real_engine" in getattr(item, "fixturenames", ()):
        return True
    return item.get_closest_marker("real_engine") is not None


def _slow_seconds(item: pytest.Item) -> float:
    if is_real_engine_item(item):
        return REAL_ENGINE_SECONDS
    mark = item.get_closest_marker("slow")
    if mark is None:
        return MEASURED_SLOW_FILES.get(item.nodeid.split("::", 1)[0], 0.0)
    value = mark.args[0] if mark.args else mark.kwargs.get("seconds", DEFAULT_SLOW_SECONDS)
    return float(value)


def _server_fixtures(item: pytest.Item) -> list[str]:
    """The `SERVER_FIXTURES` the item uses, unless its own module redefines them in-process."""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(getattr(item, "module", None), "__name__", "")
    found = []
    for name in SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        defs = info.name2fixturedefs.get(name, ()) if info is not None else ()
        if defs and getattr(defs[-1].func, "__module__", "") == module:
            continue
        found.append(name)
    return sorted(found)


def _check_fast(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("fast") is None:
            continue
        servers = _server_fixtures(item)
        if servers:
            raise pytest.UsageError(
                f"{item.nodeid} is marked fast but uses {', '.join(servers)}, which start server "
                "processes: remove the fast mark (tests/README.md, Layers)"
            )


def _group(item: pytest.Item) -> str:
    if is_real_engine_item(item):
        return REAL_ENGINE_GROUP
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Check the fast layer; under ``--dist loadgroup`` give every item one group, slow first."""
    _check_fast(items)
    # Workers of ``-n N --dist loadgroup`` see option.loadgroup; ``--dist loadgroup`` alone
    # (no workers) groups too, harmlessly, which is how tests/test_layers.py looks at it.
    loadgroup = getattr(config.option, "loadgroup", False)
    if not loadgroup and getattr(config.option, "dist", "no") != "loadgroup":
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    # Stable: pytest's own order (shared fixtures together) is kept inside each weight.
    items.sort(key=lambda item: -_slow_seconds(item))
