"""The usage ledger: SQLite WAL writer thread, crash loss bound, full disk, retention, reports."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.ledger import (
    Ledger,
    UsageRecord,
    connect,
    open_readonly,
    tokens_by_tenant,
    utc_day,
)
from gateway.metrics import Metrics
from tests.conftest import KEY_A, REPO, write_keys

# The stated bound: a record is committed at most one flush interval (0.5 s) plus one commit
# after it was queued; a kill loses at most the records of the last second.
LOSS_BOUND_S = 1.0


def rec(i: int, ts: float, tenant: str = "acme", tokens: tuple[int, int] = (3, 5)) -> UsageRecord:
    return UsageRecord(
        ts, utc_day(ts), tenant, "k1", None, "/v1/chat/completions", 200,
        tokens[0], tokens[1], None, 0.0, 0.01, 0.02, f"req-{i}",
    )  # fmt: skip


def sample(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(CollectorRegistry())


def test_records_committed_in_wal_mode_and_readable_while_live(
    workdir: Path, metrics: Metrics
) -> None:
    """Queued records reach the file within the flush interval; a read-only reader sees them."""
    path = workdir / "sub" / "usage.sqlite3"
    ledger = Ledger(path, metrics, flush_interval_s=0.05)
    ledger.start()
    try:
        now = time.time()
        for i in range(50):
            ledger.record(rec(i, now, tenant="acme" if i % 2 else "beta"))
        deadline = time.monotonic() + 5
        while ledger.written < 50 and time.monotonic() < deadline:
            time.sleep(0.02)
        conn = open_readonly(path)
        try:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert tokens_by_tenant(conn, now - 1) == {"acme": 200, "beta": 200}
            with pytest.raises(sqlite3.OperationalError):
                conn.execute("DELETE FROM usage")
        finally:
            conn.close()
        assert sample(metrics, "gateway_ledger_records_total") == 50
    finally:
        ledger.close()
    assert oct(path.parent.stat().st_mode & 0o777) == "0o750"


def test_close_commits_everything_queued(workdir: Path, metrics: Metrics) -> None:
    """A clean stop commits the records still in memory."""
    path = workdir / "usage.sqlite3"
    ledger = Ledger(path, metrics, flush_interval_s=1.0)
    ledger.start()
    now = time.time()
    for i in range(1000):
        ledger.record(rec(i, now))
    ledger.close()
    conn = open_readonly(path)
    assert conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0] == 1000
    conn.close()


def test_retention_prunes_old_records(workdir: Path, metrics: Metrics) -> None:
    """Records older than retention_days are deleted by the writer; recent ones stay."""
    path = workdir / "usage.sqlite3"
    now = time.time()
    ledger = Ledger(path, metrics, flush_interval_s=0.05, retention_days=30)
    for i in range(30):
        ledger.record(rec(i, now - 40 * 86_400))
    ledger.record(rec(99, now - 29 * 86_400))
    ledger.record(rec(100, now))
    ledger.flush()
    ledger.start()  # the writer prunes after its first successful commit
    ledger.record(rec(101, now))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        conn = open_readonly(path)
        left = [r[0] for r in conn.execute("SELECT request_id FROM usage ORDER BY ts")]
        conn.close()
        if len(left) == 3:
            break
        time.sleep(0.05)
    ledger.close()
    assert left == ["req-99", "req-100", "req-101"]


def test_unwritable_path_is_counted_and_retried_never_raised(
    workdir: Path, metrics: Metrics
) -> None:
    """A ledger whose directory cannot be created counts errors and keeps records in memory."""
    blocker = workdir / "file"
    blocker.write_text("not a directory")
    ledger = Ledger(blocker / "usage.sqlite3", metrics, flush_interval_s=0.02, max_pending=1000)
    ledger.start()
    try:
        now = time.time()
        for i in range(1500):
            ledger.record(rec(i, now))
        deadline = time.monotonic() + 5
        while sample(metrics, "gateway_ledger_dropped_records_total") < 500:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert sample(metrics, "gateway_ledger_write_errors_total") >= 1
        assert sample(metrics, "gateway_ledger_pending_records") == 1000
        # The file becomes writable: what was kept (the newest 1000) is committed.
        blocker.unlink()
        deadline = time.monotonic() + 15
        while ledger.written < 1000:
            assert time.monotonic() < deadline, ledger.written
            time.sleep(0.05)
    finally:
        ledger.close()
    conn = open_readonly(blocker / "usage.sqlite3")
    ids = {r[0] for r in conn.execute("SELECT request_id FROM usage")}
    conn.close()
    assert ids == {f"req-{i}" for i in range(500, 1500)}


@pytest.fixture
def tiny_fs(workdir: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (a disk that fills up); skipped where mounting is not allowed."""
    mnt = workdir / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_is_counted_then_recovers_without_loss(tiny_fs: Path, metrics: Metrics) -> None:
    """On a full file system writes fail and are retried; once space frees nothing is lost."""
    path = tiny_fs / "usage.sqlite3"
    ledger = Ledger(path, metrics, flush_interval_s=0.05)
    ledger.start()
    try:
        filler = tiny_fs / "filler"
        with open(filler, "wb") as handle, pytest.raises(OSError):
            handle.write(b"\0" * (2 << 20))
        now = time.time()
        for i in range(3000):
            ledger.record(rec(i, now))
        deadline = time.monotonic() + 5
        while sample(metrics, "gateway_ledger_write_errors_total") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert ledger.written < 3000
        filler.unlink()
        deadline = time.monotonic() + 15
        while ledger.written < 3000:
            assert time.monotonic() < deadline, ledger.written
            time.sleep(0.05)
    finally:
        ledger.close()
    assert sample(metrics, "gateway_ledger_dropped_records_total") == 0
    conn = open_readonly(path)
    assert conn.execute("SELECT COUNT(DISTINCT request_id) FROM usage").fetchone()[0] == 3000
    conn.close()


WRITER = """
import sys, time
from prometheus_client import CollectorRegistry
from gateway.ledger import Ledger, UsageRecord, utc_day
from gateway.metrics import Metrics
ledger = Ledger(sys.argv[1], Metrics(CollectorRegistry()), flush_interval_s=0.5)
ledger.start()
i = 0
while True:
    ts = time.time()
    ledger.record(UsageRecord(ts, utc_day(ts), "acme", "k1", None, "/v1/chat/completions", 200,
                              1, 1, None, None, None, 0.0, f"req-{i}"))
    print(i, ts, flush=True)
    i += 1
    time.sleep(0.002)
"""


def test_kill_9_loses_at_most_the_last_second(workdir: Path) -> None:
    """SIGKILL of a process writing records: every record queued over 1 s before it is kept."""
    path = workdir / "usage.sqlite3"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    queued: dict[str, float] = {}
    started = time.monotonic()
    while time.monotonic() - started < 3.3:
        line = proc.stdout.readline()
        i, ts = line.split()
        queued[f"req-{i}"] = float(ts)
    os.kill(proc.pid, signal.SIGKILL)
    killed_at = time.time()
    proc.wait(5)
    for line in proc.stdout:  # what it printed before the kill landed
        i, ts = line.split()
        queued[f"req-{i}"] = float(ts)
    proc.stdout.close()
    conn = open_readonly(path)
    kept = {r[0] for r in conn.execute("SELECT request_id FROM usage")}
    conn.close()
    lost = {rid: ts for rid, ts in queued.items() if rid not in kept}
    assert len(kept) > 500
    if lost:
        print(f"lost {len(lost)} of {len(queued)}; oldest {killed_at - min(lost.values()):.3f} s")
    assert all(ts > killed_at - LOSS_BOUND_S for ts in lost.values()), json.dumps(
        {"lost": len(lost), "oldest_lost_age_s": killed_at - min(lost.values())}
    )


def test_a_hanging_write_keeps_at_most_max_pending_and_counts_what_it_drops(
    workdir: Path, metrics: Metrics
) -> None:
    """While the writer hangs in a write (another process holds the file's write lock, so
    SQLite waits its 5 s busy timeout), records beyond max_pending drop the oldest at once,
    counted with their tokens per tenant before any write error; the newest are committed."""
    path = workdir / "usage.sqlite3"
    ledger = Ledger(path, metrics, flush_interval_s=0.02, max_pending=1000)
    ledger.start()
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        now = time.time()
        ledger.record(rec(-1, now))
        deadline = time.monotonic() + 5
        while ledger._unwritten != 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        for i in range(3000):
            ledger.record(rec(i, now, tenant="beta" if i % 2 else "acme"))
        held = len(ledger._queue) + ledger._unwritten
        assert held <= 1000
        assert sample(metrics, "gateway_ledger_dropped_records_total") == 2001
        assert sample(metrics, "gateway_ledger_write_errors_total") == 0  # still hanging
        assert sample(metrics, "gateway_ledger_pending_records") == 1000
        blocker.execute("ROLLBACK")
        deadline = time.monotonic() + 20
        while ledger.written < 1000:
            assert time.monotonic() < deadline, ledger.written
            time.sleep(0.05)
    finally:
        blocker.close()
        ledger.close()
    conn = open_readonly(path)
    ids = {r[0] for r in conn.execute("SELECT request_id FROM usage")}
    conn.close()
    # The record in the hanging write stays; the queue kept the newest 999.
    assert ids == {"req--1"} | {f"req-{i}" for i in range(2001, 3000)}


def test_check_warns_of_a_ledger_path_serve_could_not_write(tmp_path: Path) -> None:
    """`check` warns (exit status unchanged) of a ledger path whose directory cannot be created
    or is not a directory, which `serve` would accept and then keep records in memory only; a
    path whose directory serve would create is OK, and `check` creates nothing there."""
    keys = tmp_path / "keys.env"
    write_keys(keys, {"KEY_A": ("acme", KEY_A)})
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    garbage = tmp_path / "garbage.db"
    garbage.write_text("garbage\n")
    config = tmp_path / "s1.toml"

    def check(ledger_path: str) -> subprocess.CompletedProcess[str]:
        config.write_text(
            f'[server]\nhost = "127.0.0.1"\n[auth]\nkeys_file = "{keys}"\n'
            f'[ledger]\npath = "{ledger_path}"\n'
        )
        return subprocess.run(
            [sys.executable, "-m", "gateway", "check", "--config", str(config)],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    for path, words in (
        ("/proc/nope/usage.sqlite3", "directory /proc/nope does not exist and cannot be created"),
        (f"{blocker}/usage.sqlite3", f"{blocker} is not a directory"),
        (str(tmp_path), "a directory, not a file"),
        (str(garbage), "not an SQLite database"),
    ):
        done = check(path)
        assert done.returncode == 0, (path, done.stdout, done.stderr)
        assert f"WARN ledger: {path}: {words}" in done.stdout, done.stdout
        assert "in memory only" in done.stdout and "OK   keys" in done.stdout
    fresh = tmp_path / "not-yet" / "deeper" / "usage.sqlite3"
    done = check(str(fresh))
    assert done.returncode == 0 and f"OK   ledger: {fresh}" in done.stdout, done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a-file",
        "garbage.db",
        "keys.env",
        "s1.toml",
    ]
    live = tmp_path / "live.sqlite3"
    connect(live).close()  # a ledger the gateway wrote
    done = check(str(live))
    assert done.returncode == 0 and f"OK   ledger: {live}" in done.stdout, done.stdout
