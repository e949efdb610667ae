"""The relay benchmark of issue 8: direct, nginx and gateway rows, interleaved, medians of rounds.

Each row is one run of `tests.perf.loadgen` (a process of its own) against one target at one
concurrency. Rows are interleaved (direct, nginx, gateway, direct, nginx, gateway, ...) so slow
drift of a shared machine hits every target alike, the whole sequence is repeated ``rounds``
times and every number reported is the median of its rounds.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tests.conftest import REPO
from tests.perf.loadgen import LoadResult, LoadSpec
from tests.perf.procstat import memory_kib, reset_peak
from tests.perf.stacks import Profile, Target, request_body

CHAT_PATH = "/v1/chat/completions"
# Time allowed beyond a row's own limit for the load process to start, finish and report.
_LOADGEN_SLACK_S = 90.0


@dataclass
class Row:
    """One measured row (or the median of several); times in ms, memory in MiB.

    ``cpu_per_1k`` is the target's CPU milliseconds per 1,000 chunks delivered to the client
    (nan for ``direct``, which has no proxy); ``engine_cpu_per_1k`` the simulator's.
    """

    profile: str
    target: str
    concurrency: int
    ttft_p50: float
    ttft_p99: float
    total_p50: float
    total_p99: float
    rps: float
    chunks_per_s: float
    cpu_per_1k: float
    engine_cpu_per_1k: float
    peak_rss_mib: float
    ok: int
    errors: int
    error_sample: list[str] = field(default_factory=list, compare=False)


def row_plan(profile: Profile, concurrency: int, quick: bool) -> tuple[int, float]:
    """(requests, time limit in s) for one row: enough chunks for a 10 ms CPU clock to resolve.

    At 0 ms per token a row carries about 300 x 256 = 77k chunks at c=1 and 8 requests per
    connection above; at 25 ms per token (1.6 s an answer) 3 answers per connection.
    """
    if profile.tokens_per_second == 0:
        requests = 300 if concurrency == 1 else 8 * concurrency
        limit = 20.0
    else:
        requests = 8 if concurrency == 1 else 3 * concurrency
        limit = 20.0
    if quick:
        requests = max(concurrency, requests // 4)
        limit = 6.0
    return requests, limit


def run_loadgen(spec: LoadSpec) -> LoadResult:
    """Run `tests.perf.loadgen` with ``spec`` on stdin; its parsed result.

    Raises:
        RuntimeError: the load process failed or printed no result.
        subprocess.TimeoutExpired: it ran past its limits plus a minute and a half (killed).
    """
    proc = subprocess.run(
        [sys.executable, "-m", "tests.perf.loadgen"],
        input=json.dumps(asdict(spec)).encode(),
        capture_output=True,
        cwd=REPO,
        timeout=spec.time_limit_s + spec.request_timeout_s + _LOADGEN_SLACK_S,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed: {proc.stderr.decode()[-2000:]}")
    return LoadResult(**json.loads(proc.stdout))


def measure(
    profile: Profile, target: Target, concurrency: int, engine_pid: int, quick: bool
) -> Row:
    """One row: reset the target's peak RSS, run the load, charge CPU and memory to the target."""
    requests, limit = row_plan(profile, concurrency, quick)
    if target.rss_pid:
        reset_peak(target.rss_pid)
    spec = LoadSpec(
        url=target.url,
        path=CHAT_PATH,
        headers=target.headers,
        body=request_body(profile.completion_tokens * 2),
        concurrency=concurrency,
        requests=requests,
        time_limit_s=limit,
        watch_pids=[*target.cpu_pids, engine_pid],
    )
    result = run_loadgen(spec)
    chunks = max(1, result.chunks)
    proxy_cpu = sum(result.cpu_s.get(str(pid), 0.0) for pid in target.cpu_pids)
    engine_cpu = result.cpu_s.get(str(engine_pid), 0.0)
    rss = memory_kib(target.rss_pid).get("VmHWM", 0) / 1024 if target.rss_pid else float("nan")
    wall = max(result.wall_s, 1e-9)
    return Row(
        profile=profile.name,
        target=target.name,
        concurrency=concurrency,
        ttft_p50=result.ttft_p50 * 1000,
        ttft_p99=result.ttft_p99 * 1000,
        total_p50=result.total_p50 * 1000,
        total_p99=result.total_p99 * 1000,
        rps=result.ok / wall,
        chunks_per_s=result.chunks / wall,
        cpu_per_1k=proxy_cpu * 1000 / chunks * 1000 if target.cpu_pids else float("nan"),
        engine_cpu_per_1k=engine_cpu * 1000 / chunks * 1000,
        peak_rss_mib=rss,
        ok=result.ok,
        errors=result.errors,
        error_sample=result.error_sample,
    )


ONE_REQUEST_TARGETS = ("gateway-one-slot",)
"""Targets measured at c=1 only."""


def run_profile(
    profile: Profile,
    targets: list[Target],
    engine_pid: int,
    *,
    rounds: int,
    quick: bool,
    progress: Callable[[str], None],
) -> list[Row]:
    """Every (round, concurrency, target) row of one profile, targets interleaved."""
    rows: list[Row] = []
    for round_no in range(1, rounds + 1):
        for concurrency in profile.concurrencies:
            for target in targets:
                if target.name in ONE_REQUEST_TARGETS and concurrency != 1:
                    continue  # one engine slot: more clients only measure the queue
                row = measure(profile, target, concurrency, engine_pid, quick)
                rows.append(row)
                progress(
                    f"round {round_no}/{rounds} {profile.name} c={concurrency} {target.name}: "
                    f"{row.rps:.1f} req/s, TTFT p50 {row.ttft_p50:.2f} ms, "
                    f"CPU {row.cpu_per_1k:.1f} ms/1k chunks, errors {row.errors}"
                    + (f" ({row.error_sample[0]})" if row.error_sample else "")
                )
    return rows


def medians(rows: Iterable[Row]) -> list[Row]:
    """One row per (profile, target, concurrency), each number the median of its rounds.

    Medians are taken per column, so one median row may mix rounds; errors are summed.
    """
    groups: dict[tuple[str, str, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.profile, row.target, row.concurrency), []).append(row)
    out = []
    for (profile, target, concurrency), group in groups.items():
        values = {}
        for f in fields(Row):
            if f.name in ("profile", "target", "concurrency", "error_sample"):
                continue
            column = [getattr(r, f.name) for r in group]
            values[f.name] = sum(column) if f.name == "errors" else statistics.median(column)
        values["ok"] = int(values["ok"])
        out.append(Row(profile=profile, target=target, concurrency=concurrency, **values))
    return out


def _find(rows: list[Row], profile: str, target: str, concurrency: int) -> Row | None:
    for row in rows:
        if (row.profile, row.target, row.concurrency) == (profile, target, concurrency):
            return row
    return None


def _num(value: float, digits: int = 1) -> str:
    if value != value:  # nan
        return "-"
    return f"{value:,.{digits}f}"


def table(rows: list[Row]) -> str:
    """The results as a Markdown table, with the differences to direct and ratios to nginx."""
    head = (
        "| engine | target | c | TTFT p50 ms | TTFT p99 ms | total p50 ms | total p99 ms "
        "| req/s | chunks/s | CPU ms / 1k chunks | peak RSS MiB | +TTFT p50 ms | +TTFT p99 ms "
        "| req/s vs direct | CPU vs nginx |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for row in rows:
        direct = _find(rows, row.profile, "direct", row.concurrency)
        nginx = _find(rows, row.profile, "nginx", row.concurrency)
        added50 = added99 = ratio_direct = ratio_nginx = float("nan")
        if direct is not None and row.target != "direct":
            added50 = row.ttft_p50 - direct.ttft_p50
            added99 = row.ttft_p99 - direct.ttft_p99
            ratio_direct = row.rps / direct.rps if direct.rps else float("nan")
        if nginx is not None and row.target not in ("direct", "nginx") and nginx.cpu_per_1k:
            ratio_nginx = row.cpu_per_1k / nginx.cpu_per_1k
        cells = [
            row.profile,
            row.target,
            str(row.concurrency),
            _num(row.ttft_p50, 2),
            _num(row.ttft_p99, 2),
            _num(row.total_p50, 1),
            _num(row.total_p99, 1),
            _num(row.rps, 1),
            _num(row.chunks_per_s, 0),
            _num(row.cpu_per_1k, 1),
            _num(row.peak_rss_mib, 1),
            _num(added50, 2),
            _num(added99, 2),
            _num(ratio_direct, 2) + ("x" if ratio_direct == ratio_direct else ""),
            _num(ratio_nginx, 1) + ("x" if ratio_nginx == ratio_nginx else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save(rows: list[Row], path: Path) -> None:
    """Write rows as JSON lines (one object per row) for later comparison."""
    path.write_text("".join(json.dumps(asdict(row)) + "\n" for row in rows))
