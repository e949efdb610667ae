"""engine/procgroup.py: a process group is signalled only while its id still names the group
that was started, real processes on this machine."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.procgroup import ProcessGroup, start_ticks
from tests.conftest import wait_until
from tests.launcher import Launchers, engine_groups


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts, each in a session of its own; killed and reaped after."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def spawn(procs: list[subprocess.Popen[bytes]], *argv: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    procs.append(proc)
    return proc


def test_leader_alive_is_signalled(procs: list[subprocess.Popen[bytes]]) -> None:
    """A group whose leader is the process started is signalled (SIGKILL ends it)."""
    leader = spawn(procs, "sleep", "60")
    group = ProcessGroup.of(leader.pid)
    assert group.started is not None
    assert group.signal(signal.SIGKILL)
    assert leader.wait(10) == -signal.SIGKILL


def test_pid_taken_by_another_group_is_left_alone(procs: list[subprocess.Popen[bytes]]) -> None:
    """A record whose leader was reaped, its pid now leading another session (as after a pid
    wrap): not signalled, the other session lives on."""
    gone = spawn(procs, "sleep", "60")
    record = ProcessGroup.of(gone.pid)
    gone.kill()
    gone.wait(10)
    time.sleep(0.05)  # a later clock tick (100 per second)
    other = spawn(procs, "sleep", "60")
    # The other session's leader in the record's place: same id, another start time.
    reused = ProcessGroup(other.pid, record.started)
    if start_ticks(other.pid) == record.started:
        pytest.skip("both processes started within one clock tick")
    assert not reused.ours()
    assert not reused.signal(signal.SIGKILL)
    assert other.poll() is None


def test_members_outliving_the_leader_are_signalled(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """Leader exited and reaped, a worker of its group alive: the group (held by the worker)
    is still signalled, and the worker dies."""
    leader = spawn(procs, "sh", "-c", "sleep 60 & echo $!")
    group = ProcessGroup.of(leader.pid)
    assert leader.stdout is not None
    worker = int(leader.stdout.readline())
    leader.wait(10)
    assert start_ticks(leader.pid) is None
    assert os.getpgid(worker) == group.pgid
    assert group.signal(signal.SIGKILL)
    assert wait_until(lambda: start_ticks(worker) is None or _zombie(worker), 10)


def test_group_gone_is_not_an_error(procs: list[subprocess.Popen[bytes]]) -> None:
    """Leader and group gone: nothing sent, no error."""
    leader = spawn(procs, "true")
    group = ProcessGroup.of(leader.pid)
    leader.wait(10)
    assert not group.signal(signal.SIGKILL)


def test_start_time_of_a_name_with_parentheses(
    procs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """The start time is read past a command name containing ') ' (proc(5) field 22)."""
    sleep = shutil.which("sleep")
    assert sleep
    odd = tmp_path / "a) 1 2 (b"
    shutil.copy(sleep, odd)
    before = spawn(procs, "sleep", "60")
    proc = spawn(procs, str(odd), "60")
    after = spawn(procs, "sleep", "60")
    assert "(a) 1 2 (b)" in Path(f"/proc/{proc.pid}/stat").read_text()
    ticks = [start_ticks(p.pid) for p in (before, proc, after)]
    assert None not in ticks
    assert ticks == sorted(ticks), ticks  # type: ignore[type-var]


def _zombie(pid: int) -> bool:
    """True when ``pid`` is a zombie (killed, not yet reaped by init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_launcher_logs_the_engine_start_time(workdir: Path) -> None:
    """The launcher's ``spawn`` event carries the engine's start time, which names its group
    for a later kill (tests/launcher.py's close)."""
    launchers = Launchers(workdir)
    try:
        launcher = launchers.start()
        launcher.notify.wait_for("READY=1", timeout=30)
        spawn = launcher.event("spawn")
        assert spawn["start_ticks"] == start_ticks(spawn["pid"])
        assert engine_groups(launcher.logs())[0].ours()
    finally:
        launchers.close()
    assert start_ticks(spawn["pid"]) is None
