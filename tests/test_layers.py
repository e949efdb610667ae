"""The suite's layers (tests/layers.py): the fast marker's guard and selection, the xdist groups."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.layers import REAL_ENGINE_GROUP
from tests.realengine.fixtures import REAL_ENGINE_TEST_TIMEOUT_S
from tests.timetable import file_of, table

pytestmark = pytest.mark.fast

CONFTEST = """
import pytest

pytest_plugins = ("tests.layers",)


@pytest.fixture
def stack():
    yield "a server process in the real conftest"


@pytest.fixture(params=["sim", "real"])
def engine(request):
    return request.param
"""


@pytest.fixture(autouse=True)
def _no_plugin_autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inner runs load only tests.layers (and xdist where asked): seconds less per run."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def _write(pytester: pytest.Pytester, files: dict[str, str]) -> None:
    pytester.makeconftest(CONFTEST)
    for name, text in files.items():
        (pytester.path / name).write_text(textwrap.dedent(text))


def test_a_fast_test_using_a_server_fixture_is_a_collection_error(
    pytester: pytest.Pytester,
) -> None:
    """A test marked fast that takes a server fixture from conftest fails collection, naming it."""
    _write(
        pytester,
        {
            "test_one.py": """
                import pytest
                pytestmark = pytest.mark.fast
                def test_uses_stack(stack):
                    '''Uses the server fixture.'''
            """
        },
    )
    result = pytester.runpytest_inprocess("-m", "fast", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_uses_stack is marked fast but uses stack*"])


def test_a_module_redefining_a_server_fixture_in_process_may_be_fast(
    pytester: pytest.Pytester,
) -> None:
    """A fast module with its own in-process fixture of a server fixture's name is accepted."""
    _write(
        pytester,
        {
            "test_own.py": """
                import pytest
                pytestmark = pytest.mark.fast
                @pytest.fixture
                def stack():
                    return "in-process"
                def test_uses_own_stack(stack):
                    '''Uses the module's own fixture.'''
                    assert stack == "in-process"
            """
        },
    )
    result = pytester.runpytest_inprocess("-m", "fast", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_dash_m_fast_does_not_import_files_without_the_marker(pytester: pytest.Pytester) -> None:
    """``-m fast`` skips files whose text never says mark.fast; a full run imports them."""
    _write(
        pytester,
        {
            "test_fast.py": """
                import pytest
                @pytest.mark.fast
                def test_quick():
                    '''Quick.'''
            """,
            "test_slow.py": """
                raise RuntimeError("imported")
            """,
        },
    )
    fast = pytester.runpytest_inprocess("-m", "fast", "-p", "no:cacheprovider")
    fast.assert_outcomes(passed=1)
    full = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert full.ret == pytest.ExitCode.INTERRUPTED
    full.stdout.fnmatch_lines(["*RuntimeError: imported*"])


def _collect(pytester: pytest.Pytester, *args: str) -> list[pytest.Item]:
    """The session's items in their final order (after every collection hook)."""
    recorder = pytester.inline_run("--collect-only", "-p", "no:cacheprovider", *args)
    session: pytest.Session = recorder.getcalls("pytest_collection_finish")[0].session
    return list(session.items)


def _groups(items: list[pytest.Item]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        assert mark is not None, item.nodeid
        out.append((item.nodeid, str(mark.args[0])))
    return out


def test_loadgroup_groups_by_file_real_engine_together_slow_first(
    pytester: pytest.Pytester,
) -> None:
    """Under --dist loadgroup: one group per file, all real-engine items in one, slow ones first."""
    _write(
        pytester,
        {
            "test_a.py": """
                def test_plain():
                    '''Plain.'''
                def test_engine(engine):
                    '''Both engines.'''
            """,
            "test_b.py": """
                import pytest
                pytestmark = pytest.mark.slow(300)
                def test_waits():
                    '''Waits.'''
                @pytest.mark.xdist_group("own")
                def test_own_group():
                    '''Its own group.'''
            """,
            "test_c.py": """
                def test_engine_too(engine):
                    '''Both engines.'''
            """,
        },
    )
    items = _collect(pytester, "-p", "xdist", "--dist", "loadgroup")
    groups = _groups(items)
    assert groups[:2] == [
        ("test_a.py::test_engine[real]", REAL_ENGINE_GROUP),
        ("test_c.py::test_engine_too[real]", REAL_ENGINE_GROUP),
    ]
    assert groups[2:4] == [
        ("test_b.py::test_waits", "test_b.py"),
        ("test_b.py::test_own_group", "own"),
    ]
    assert sorted(groups[4:]) == [
        ("test_a.py::test_engine[sim]", "test_a.py"),
        ("test_a.py::test_plain", "test_a.py"),
        ("test_c.py::test_engine_too[sim]", "test_c.py"),
    ]


def test_without_loadgroup_items_keep_their_order_and_get_no_group(
    pytester: pytest.Pytester,
) -> None:
    """A serial run is left as pytest orders it: no groups added, slow files not moved."""
    _write(
        pytester,
        {
            "test_a.py": "def test_first():\n    '''First.'''\n",
            "test_b.py": "import pytest\npytestmark = pytest.mark.slow(300)\n"
            "def test_second():\n    '''Second.'''\n",
        },
    )
    items = _collect(pytester)
    assert [item.nodeid for item in items] == ["test_a.py::test_first", "test_b.py::test_second"]
    assert all(item.get_closest_marker("xdist_group") is None for item in items)


def test_timetable_sums_each_file_from_junit(tmp_path: Path) -> None:
    """The per-file table adds setup, call and teardown time of each file's tests, slowest first."""
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_x" name="a" time="1.5"/>'
        '<testcase classname="tests.test_x.TestK" name="b" time="2.0"/>'
        '<testcase classname="tests.realengine.test_y" name="c" time="9.0"/>'
        "</testsuite></testsuites>"
    )
    assert file_of("tests.test_x.TestK") == "tests/test_x.py"
    assert table(report) == [("tests/realengine/test_y.py", 9.0, 1), ("tests/test_x.py", 3.5, 2)]


def test_ci_run_and_its_setup_scripts_pass_shellcheck() -> None:
    """.ci/run and every .ci/setup.d and .ci/steps script pass shellcheck (skipped without it)."""
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck; .ci/run installs it)")
    scripts = [
        str(REPO / ".ci" / "run"),
        *map(str, sorted((REPO / ".ci" / "setup.d").glob("*.sh"))),
        *map(str, sorted((REPO / ".ci" / "steps").glob("*.sh"))),
    ]
    done = subprocess.run(
        [shellcheck, "-x", *scripts], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_real_engine_tests_may_wait_for_the_engines_start(pytester: pytest.Pytester) -> None:
    """A real-engine test's timeout covers the engine's start (its own timeout mark wins)."""
    pytester.makeconftest('pytest_plugins = ("tests.layers", "tests.realengine.fixtures")\n')
    pytester.makepyfile(
        test_r="""
        import pytest
        def test_plain(engine):
            '''Both engines.'''
        @pytest.mark.timeout(7)
        def test_own(engine):
            '''Its own bound.'''
        """
    )
    items = _collect(pytester, "-p", "pytest_timeout")
    bounds = {item.nodeid: item.get_closest_marker("timeout") for item in items}
    assert bounds["test_r.py::test_plain[real]"].args == (REAL_ENGINE_TEST_TIMEOUT_S,)
    assert bounds["test_r.py::test_own[real]"].args == (7,)
    assert bounds["test_r.py::test_plain[sim]"] is None
