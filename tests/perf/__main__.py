"""``python -m tests.perf``: the relay benchmark of issue 8, printed as one table with verdicts.

Sections (``--only`` picks some; default all but ``profile``):

- ``fast``: simulator at 0 ms per token, 256 tokens an answer; c = 1, 32, 256;
- ``paced``: 25 ms per token (40 tokens/s), 64 tokens; c = 1, 32, 64, 256;
- ``limits``: adds the gateway with its rate limiter off to the ``fast`` rows;
- ``slow``: 2,000 streams at 1 token/s, opened over 5 s, 25 s each (RSS and added stall);
- ``busy``: one engine slot at 1,000 tokens/s, four tenants' backlog: engine busy fraction,
  hand-over gap, Jain's fairness index, a short request's wait behind long ones
  (`tests.perf.busy`);
- ``profile``: py-spy samples of the gateway under ``fast`` c=32 load, summarised;
- ``slot``: adds the gateway with production's ``engine.max_concurrency = 1`` to the ``fast``
  rows at c=1 (the engine-counter baseline of every request);
- ``floor``: adds a minimal aiohttp relay (`tests.perf.floor`: no auth, parsing, limits or
  rewrites) to the ``fast`` rows: what aiohttp and the event loop cost by themselves;
- ``fleet``: four engines at 30 tokens/s behind one gateway, eight tenants of agent sessions:
  busy, slots, fairness, session affinity, failover (`tests.perf.fleet`; not in the default run).

Each of direct, nginx and gateway is measured in turn at each concurrency, the sequence repeated
``--rounds`` times (default 3), and the medians are reported. Everything runs on loopback and Unix
sockets in a private temp directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from tests.perf.bench import Row, measure, medians, run_profile, save, table
from tests.perf.busy import BusyResults, run_busy
from tests.perf.busy_report import busy_report
from tests.perf.fleet import FleetResult, fleet_report, run_fleet
from tests.perf.loadgen import raise_open_files_limit
from tests.perf.nginx import find_nginx
from tests.perf.profile import find_py_spy, recording, summarise
from tests.perf.slow import SlowResult, run_slow, slow_table
from tests.perf.stacks import BENCH_MAX_CONCURRENCY, Profile, run_stack
from tests.perf.targets import verdicts

FAST = Profile("fast", "0 ms per token, 256 tokens an answer", 0.0, 256, (1, 32, 256))
PACED = Profile("paced", "25 ms per token (40 tokens/s), 64 tokens", 40.0, 64, (1, 32, 64, 256))
SECTIONS = ("fast", "paced", "limits", "slow", "busy")
EXTRA_SECTIONS = ("profile", "ledger", "fleet", "slot", "floor")
# fleet: measured window (s).
FLEET_WINDOW_S, QUICK_FLEET_WINDOW_S = 60.0, 20.0
SLOW_STREAMS, SLOW_TOKENS = 2000, 25
QUICK_SLOW_STREAMS, QUICK_SLOW_TOKENS = 500, 8
# busy: measured window of each backlog run (s) and short probes behind the long backlog.
BUSY_WINDOW_S, BUSY_PROBES = 30.0, 12
QUICK_BUSY_WINDOW_S, QUICK_BUSY_PROBES = 8.0, 4
# Rows sampled by the profile section (about 1 s each at c=32: enough samples to rank functions).
PROFILE_ROWS = 6


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _nginx_version(binary: str | None) -> str:
    if not binary:
        return "not installed (nginx rows skipped)"
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
    return (out.stderr or out.stdout).strip().removeprefix("nginx version: ")


def _uvloop_version() -> str:
    try:
        import uvloop
    except ImportError:
        return "not installed"
    return uvloop.__version__


def header(nginx_binary: str | None, rounds: int, quick: bool) -> str:
    """What the numbers were measured on: machine, versions, settings."""
    load = os.getloadavg()
    return "\n".join(
        [
            "# qwen38-gateway relay benchmark",
            "",
            f"- machine: {os.cpu_count()} CPUs, load average at start "
            f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {platform.platform()}",
            f"- Python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
            f"uvloop {_uvloop_version()}, nginx {_nginx_version(nginx_binary)}",
            f"- {rounds} round(s), rows interleaved, medians reported"
            + (" (quick: fewer requests per row)" if quick else ""),
            f"- gateway: auth, memory rate limits, rewrites, metrics and access log on; "
            f"engine.max_concurrency = {BENCH_MAX_CONCURRENCY} so the admission queue does not "
            "serialise the load (production uses max_concurrency = 1, one V100)",
            "- CPU = proxy process time on CPU (/proc/<pid>/task/*/schedstat) per 1,000 chunks "
            "received by the client; peak RSS = VmHWM reset before each row; "
            "+TTFT = difference to direct",
        ]
    )


def run_profile_section(workdir: Path, quick: bool) -> str:
    """py-spy the gateway during `PROFILE_ROWS` ``fast`` c=32 rows; the summary text."""
    binary = find_py_spy()
    if binary is None:
        return "py-spy not installed (pip install py-spy): profile skipped"
    with run_stack(workdir / "profile", FAST, nginx_binary=None) as stack:
        sim, targets = stack
        gateway = next(t for t in targets if t.name == "gateway")
        out = workdir / "gateway-profile.txt"
        assert gateway.rss_pid is not None
        with recording(binary, gateway.rss_pid, out):
            rows = [measure(FAST, gateway, 32, sim.proc.pid, quick) for _ in range(PROFILE_ROWS)]
        row = medians(rows)[0]
    text = summarise(out.read_text())
    return (
        f"gateway under fast c=32 load ({row.rps:.1f} req/s, {row.cpu_per_1k:.1f} ms CPU "
        f"per 1k chunks while sampled):\n\n{text}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the selected sections and print the report on stdout (progress on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.perf", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests per row; 1 round")
    parser.add_argument("--rounds", type=int, help="repetitions of every row (default 3; quick 1)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS + EXTRA_SECTIONS,
        help=f"sections to run (default: {' '.join(SECTIONS)})",
    )
    parser.add_argument("--json", type=Path, help="also write every measured row here (JSON lines)")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        help="relay rows only at these concurrencies (default: each profile's own)",
    )
    args = parser.parse_args(argv)
    only = set(args.only or SECTIONS)
    rounds = args.rounds or (1 if args.quick else 3)
    raise_open_files_limit()
    nginx_binary = find_nginx()
    workdir = Path(tempfile.mkdtemp(prefix="q38perf-", dir="/tmp"))
    os.chmod(workdir, 0o700)
    report = [header(nginx_binary, rounds, args.quick), ""]
    if only <= {"busy", "fleet"}:  # the relay settings in the header do not apply to this section
        report = [*report[0].splitlines()[:4], ""]
    rows: list[Row] = []
    slow: list[SlowResult] = []
    busy: BusyResults | None = None
    fleet: FleetResult | None = None
    try:
        for profile in (FAST, PACED):
            extras = [
                variant
                for section, variant in (
                    ("limits", "gateway-limits-off"),
                    ("ledger", "gateway-ledger-off"),
                    ("slot", "gateway-one-slot"),
                    ("floor", "aiohttp-floor"),
                )
                if profile.name == "fast" and section in only
            ]
            wanted = profile.name in only or bool(extras)
            if not wanted:
                continue
            full = profile.name in only
            variants = tuple(extras)
            if args.concurrency:
                profile = dataclasses.replace(
                    profile,
                    concurrencies=tuple(c for c in profile.concurrencies if c in args.concurrency),
                )
            _progress(f"starting {profile.name}: {profile.description}")
            with run_stack(
                workdir / profile.name,
                profile,
                nginx_binary=nginx_binary if full else None,
                variants=variants,
            ) as (sim, targets):
                if not full:
                    targets = [t for t in targets if t.name.startswith(("gateway", "aiohttp"))]
                rows += run_profile(
                    profile,
                    targets,
                    sim.proc.pid,
                    rounds=rounds,
                    quick=args.quick,
                    progress=_progress,
                )
        if "slow" in only:
            streams = QUICK_SLOW_STREAMS if args.quick else SLOW_STREAMS
            tokens = QUICK_SLOW_TOKENS if args.quick else SLOW_TOKENS
            _progress(f"starting slow streams: {streams} at 1 token/s, {tokens} tokens")
            slow = run_slow(
                workdir / "slow",
                streams=streams,
                tokens=tokens,
                rounds=rounds,
                progress=_progress,
            )
        if "busy" in only:
            busy = run_busy(
                workdir / "busy",
                window_s=QUICK_BUSY_WINDOW_S if args.quick else BUSY_WINDOW_S,
                probes=QUICK_BUSY_PROBES if args.quick else BUSY_PROBES,
                progress=_progress,
            )
        if "fleet" in only:
            window = QUICK_FLEET_WINDOW_S if args.quick else FLEET_WINDOW_S
            fleet = run_fleet(workdir / "fleet", window, progress=_progress)
        profile_text = run_profile_section(workdir, args.quick) if "profile" in only else ""
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        save(rows, args.json)
    if rows:
        report += [
            "## Streaming relay (medians)",
            "",
            f"- fast: {FAST.description}; paced: {PACED.description}",
            "",
            table(sorted(medians(rows), key=_order)),
            "",
        ]
    if slow:
        report += ["## Slow streams (1 token/s)", "", slow_table(slow), ""]
    if rows or slow:
        report += ["## Targets (issue 8)", ""]
        report += [v.line() for v in verdicts(medians(rows), slow)]
        report += [""]
    if busy is not None:
        report += ["## One engine slot: busy and fair", ""]
        report += busy_report(busy)
    if fleet is not None:
        report += ["## Several engines behind one gateway", ""]
        report += fleet_report(fleet)
    if profile_text:
        report += ["", "## Profile", "", profile_text]
    print("\n".join(report))
    return 0


_TARGET_ORDER = {
    "direct": 0,
    "nginx": 1,
    "gateway": 2,
    "gateway-limits-off": 3,
    "gateway-ledger-off": 4,
    "gateway-one-slot": 5,
}


def _order(row: Row) -> tuple[int, int, int]:
    return (row.profile != "fast", row.concurrency, _TARGET_ORDER.get(row.target, 9))


if __name__ == "__main__":
    sys.exit(main())
