"""``qwen38-gateway usage report``: several ledgers merged, grouping, formats, errors."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway.ledger import Ledger, UsageRecord, utc_day
from gateway.metrics import Metrics
from tests.conftest import REPO


def day_ts(day: str, hour: int = 12) -> float:
    return dt.datetime.fromisoformat(f"{day}T{hour:02d}:00:00+00:00").timestamp()


def write_ledger(path: Path, rows: list[tuple[str, str, str, str | None, int, int, int]]) -> None:
    """Rows of (day, tenant, key id, subject, status, prompt, completion)."""
    ledger = Ledger(path, Metrics(CollectorRegistry()))
    for i, (day, tenant, key, subject, status, prompt, completion) in enumerate(rows):
        ts = day_ts(day)
        ledger.record(UsageRecord(ts, utc_day(ts), tenant, key, subject, "/v1/chat/completions",
                                  status, prompt, completion, None, None, None, 0.1,
                                  f"{path.stem}-{i}"))  # fmt: skip
    ledger.close()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "usage", "report", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_report_merges_replicas_and_groups(workdir: Path) -> None:
    """Two replicas' ledgers merge (the same file twice counts once), by tenant, key and day."""
    one, two = workdir / "one.sqlite3", workdir / "two.sqlite3"
    write_ledger(one, [
        ("2026-11-30", "acme", "KEY_A", None, 200, 10, 20),
        ("2026-12-01", "acme", "KEY_A", None, 200, 1, 2),
        ("2026-12-01", "customer-42", "jwt:hs1", "customer-42", 200, 5, 5),
    ])  # fmt: skip
    write_ledger(two, [
        ("2026-12-01", "acme", "KEY_A2", None, 429, 0, 0),
        ("2026-12-01", "customer-43", "jwt:hs1", "customer-43", 200, 7, 3),
        ("2026-12-02", "acme", "KEY_A", None, 200, 100, 100),
    ])  # fmt: skip
    span = ("--since", "2026-11-30", "--until", "2026-12-01")
    done = run(*span, "--ledger", str(one), "--ledger", str(two), "--ledger", str(one),
               "--format", "json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["object"] == "usage.report" and doc["by"] == "tenant"
    rows = {r["tenant"]: r for r in doc["data"]}
    assert rows["acme"]["total_tokens"] == 33 and rows["acme"]["requests"] == 3
    assert rows["acme"]["errors"] == 1
    assert rows["customer-42"]["total_tokens"] == 10 and rows["customer-43"]["total_tokens"] == 10
    assert doc["total"]["total_tokens"] == 53

    done = run(*span, "--ledger", str(one), "--ledger", str(two), "--by", "key", "--format", "csv")
    table = list(csv.DictReader(io.StringIO(done.stdout)))
    subjects = {(r["key_id"], r["subject"]): int(r["total_tokens"]) for r in table}
    assert subjects[("jwt:hs1", "customer-42")] == 10
    assert subjects[("jwt:hs1", "customer-43")] == 10

    done = run("--since", "2026-11-30", "--until", "2026-12-02", "--ledger", str(one),
               "--ledger", str(two), "--by", "day")  # fmt: skip
    lines = done.stdout.splitlines()
    assert lines[0] == "usage 2026-11-30 .. 2026-12-02 (UTC), by day"
    assert [line.split()[0] for line in lines[2:]] == ["2026-11-30", "2026-12-01", "2026-12-02",
                                                       "TOTAL"]  # fmt: skip
    assert lines[-1].split()[-1] == "253"


def test_report_errors_are_clear(workdir: Path) -> None:
    """A bad date or a missing ledger exits 1 with a message naming it."""
    done = run("--since", "12/01/2026", "--ledger", str(workdir / "x.sqlite3"))
    assert done.returncode == 1 and "since must be a date as YYYY-MM-DD" in done.stderr
    done = run("--ledger", str(workdir / "missing.sqlite3"))
    assert done.returncode == 1 and "missing.sqlite3: cannot open ledger" in done.stderr
    (workdir / "junk.sqlite3").write_text("not a database")
    done = run("--ledger", str(workdir / "junk.sqlite3"))
    assert done.returncode == 1 and "not a readable usage ledger" in done.stderr


def test_report_names_the_ledger_it_reads_and_refuses_to_guess(workdir: Path) -> None:
    """Without --ledger: the config's ledger is named on stderr; with no config file at all the
    report refuses, naming both ways to say which ledger, instead of reading the default."""
    ledger = workdir / "mine.sqlite3"
    write_ledger(ledger, [("2026-12-01", "acme", "KEY_A", None, 200, 1, 2)])
    config = workdir / "gateway.toml"
    config.write_text(f'[ledger]\npath = "{ledger}"\n')
    span = ("--since", "2026-12-01", "--until", "2026-12-01")
    done = run(*span, "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert done.stderr == f"usage report: ledger {ledger}, from {config}\n"
    assert "acme" in done.stdout
    absent = workdir / "absent.toml"
    refused = run(*span, "--config", str(absent))
    assert refused.returncode == 1 and refused.stdout == ""
    assert f"no --ledger and no config file ({absent} does not exist)" in refused.stderr
    assert "--ledger PATH" in refused.stderr and "--config PATH" in refused.stderr
    named = run(*span, "--ledger", str(ledger))
    assert named.returncode == 0 and named.stderr == f"usage report: ledger {ledger}\n"
