"""The benchmark's A/B runner (`tests.perf.ab`) cleans up after itself: its sides' processes
and temp directories end with it."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO
from tests.perf.ab import Side


def _processes_naming(text: str) -> list[int]:
    """Pids of the processes whose command line contains ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(proc.name))
    return found


def test_a_stopped_side_leaves_no_process_and_no_files() -> None:
    """A side (simulator and gateway of one tree), once stopped, leaves no process and no temp
    directory (logs, the simulator's record, the ledger, the keys file) behind."""
    side = Side("this tree", REPO, 8)
    try:
        cmdline = Path(f"/proc/{side.pid}/cmdline").read_bytes().split(b"\0")
        work = Path(cmdline[cmdline.index(b"--config") + 1].decode()).parent
        assert work.is_dir() and len(_processes_naming(str(work))) == 2  # gateway, simulator
    finally:
        side.stop()
    assert _processes_naming(str(work)) == []
    assert not work.exists(), sorted(p.name for p in work.iterdir())
