"""The benchmark's stage timer (`tests.perf.phases`) still times the code in this tree: its
wrappers replace gateway functions by name and signature, so a change to one of them must not
leave the tool hanging or silently timing nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.perf.phases import PHASES


def test_the_stage_timer_runs_and_times_every_stage() -> None:
    """A short run (30 streamed requests of 4 tokens) prints a median for every stage, a
    client TTFT, and leaves no temp directory behind."""
    before = set(Path("/tmp").glob("q38ph-*"))
    done = subprocess.run(
        [sys.executable, "-m", "tests.perf.phases", "30", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = dict(re.findall(r"^\| ([A-Za-z ]+) \| (\d+) \|", done.stdout, re.MULTILINE))
    for name in PHASES:
        if name == "baseline":
            continue  # 0 when the engine's counters need no baseline
        assert name in rows, (name, done.stdout)
    assert int(rows["connect"]) > 0 and int(rows["first byte"]) > 0
    assert int(rows["client TTFT"]) > int(rows["connect"])
    assert set(Path("/tmp").glob("q38ph-*")) == before
