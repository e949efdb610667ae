"""How much Python one request runs through in the gateway: calls and distinct functions.

``python -m tests.perf.calls [--requests 300] [--tokens 1] [--slots 4096] [--top 30] [--list]``

Time per stage moves with the machine's load by more than most changes to the request path are
worth (`tests/perf/README.md`: the rounds of one row spread by ±0.2-0.4 ms), but what the path
executes does not. This counts it with `cProfile` inside a real gateway process: the gateway
serves a warm-up, then ``--requests`` streamed chat requests at c=1 (`tests.perf.loadgen`,
the benchmark's body, ``--tokens`` tokens an answer from the simulator) with the profiler on.

Printed per request: Python function calls, C functions called from Python, and the distinct
Python functions run (those called at least 0.9 times per request), by package and by gateway
module. In place, between two requests whose client and engine share the machine's caches, a
request's cost follows the code it touches more than any one function's speed
(`tests/perf/README.md`, thirteenth round): the distinct functions are the figure to bring down.

``--slots 1`` measures production's one engine slot (the counter baseline of exact cut charges).
The gateway runs under ``python -m tests.perf.calls child`` (the profiler is switched on by
SIGUSR1 and written out by SIGUSR2); everything runs in a temp directory removed at the end.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import runpy
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.conftest import KEY_A, start_gateway, start_sim
from tests.perf.bench import CHAT_PATH, run_loadgen
from tests.perf.loadgen import LoadSpec
from tests.perf.stacks import BENCH_CONFIG, VARIANT_CONFIG, VARIANTS, _variant_gateway, request_body

PROFILE_ENV = "QWEN38_CALLS_PROFILE"
"""Where the child writes its profile (set by the parent)."""
MIN_PER_REQUEST = 0.9
"""A function counts as run by every request when called at least this often per request."""


def child(argv: list[str]) -> None:
    """Run ``qwen38-gateway serve ARGV`` with a profiler that SIGUSR1 starts and SIGUSR2 stops
    and writes to ``$QWEN38_CALLS_PROFILE`` (pstats format)."""
    profiler = cProfile.Profile()

    def start(*_: Any) -> None:
        profiler.enable()

    def stop(*_: Any) -> None:
        profiler.disable()
        profiler.dump_stats(os.environ[PROFILE_ENV])

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = ["gateway", "serve", *argv]
    runpy.run_module("gateway", run_name="__main__")


def _place(path: str) -> str:
    """A short name for a code file: ``gateway/x.py``, a package name, ``stdlib`` or ``C``."""
    if path == "~":
        return "C"
    if "/gateway/" in path and "site-packages" not in path:
        return "gateway/" + path.rsplit("/gateway/", 1)[1]
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    return "stdlib"


def summarise(stats: pstats.Stats, requests: int, top: int, listing: bool = False) -> str:
    """The report: calls and distinct functions per request, by place (module doc); with
    ``listing``, also every distinct gateway function and its calls per request."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    calls = c_calls = 0.0
    distinct: collections.Counter[str] = collections.Counter()
    functions: list[tuple[str, str, float]] = []
    for (path, _line, name), (_, count, _, _, _) in raw.items():
        per = count / requests
        if path == "~":
            c_calls += per
            continue
        calls += per
        if per >= MIN_PER_REQUEST:
            distinct[_place(path)] += 1
            functions.append((_place(path), name, per))
    gateway = sum(n for place, n in distinct.items() if place.startswith("gateway/"))
    lines = [
        f"per request ({requests} requests):",
        f"  Python function calls      {calls:8.0f}",
        f"  C functions called         {c_calls:8.0f}",
        f"  distinct Python functions  {sum(distinct.values()):8d} (gateway: {gateway})",
        "distinct functions by place:",
    ]
    for place, count in distinct.most_common(top):
        lines.append(f"  {count:4d}  {place}")
    if listing:
        lines.append("distinct gateway functions (calls per request):")
        for place, name, per in sorted(functions):
            if place.startswith("gateway/"):
                lines.append(f"  {per:6.1f}  {place}:{name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["child"]:
        child(args[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m tests.perf.calls", description=__doc__)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=1, help="tokens an answer (default 1)")
    parser.add_argument("--slots", type=int, default=4096, help="engine.max_concurrency")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--list", action="store_true", help="list every gateway function run")
    parsed = parser.parse_args(args)
    with tempfile.TemporaryDirectory(prefix="q38calls-") as temp:
        work = Path(temp)
        out = work / "profile.pstats"
        os.environ[PROFILE_ENV] = str(out)
        VARIANTS["gateway-calls"] = ["-m", "tests.perf.calls", "child"]
        VARIANT_CONFIG["gateway-calls"] = {"engine": {"max_concurrency": parsed.slots}}
        sim = start_sim(
            work, "--tokens-per-second", "0", "--completion-tokens", str(parsed.tokens),
            "--max-num-seqs", "4096", name="fast",
        )  # fmt: skip
        gateway = start_gateway(work, sim, BENCH_CONFIG, name="gw")
        proc, url = _variant_gateway(work, gateway.config_path, "gateway-calls")
        headers = {"Authorization": f"Bearer {KEY_A}"}
        body = request_body(parsed.tokens)
        try:
            run_loadgen(LoadSpec(url, CHAT_PATH, headers, body, 1, 50, 60))  # warm-up
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
            run_loadgen(LoadSpec(url, CHAT_PATH, headers, body, 1, parsed.requests, 300))
            time.sleep(0.3)  # the last request's finish (access line, ledger record)
            proc.send_signal(signal.SIGUSR2)
            for _ in range(100):
                if out.exists():
                    break
                time.sleep(0.1)
            time.sleep(0.5)
        finally:
            for running in (proc, gateway.proc):
                running.send_signal(signal.SIGTERM)
                running.wait(30)
            sim.stop()
        print(summarise(pstats.Stats(str(out)), parsed.requests, parsed.top, parsed.list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
