"""Slow streams: thousands of answers at 1 token per second held open at once (issue 8).

What matters at the engine's real pace is not throughput but that a stream's chunks are not held
back: for each stream the client measures its longest gap between two events; the engine spaces
them 1 s apart, so the gap beyond 1 s is stall added on the way (simulator and client included,
which the ``direct`` row measures). The gateway's resident memory is read before and at peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.perf.bench import CHAT_PATH, run_loadgen
from tests.perf.loadgen import LoadSpec
from tests.perf.procstat import memory_kib, reset_peak
from tests.perf.stacks import Profile, Target, request_body, run_stack

# Streams are opened over this many seconds (400 a second for 2,000) rather than in one burst:
# a burst would overflow aiohttp's listen backlog of 128 (1 s SYN retransmits) and measure the
# cost of accepting 2,000 requests at once rather than the holding of open streams.
RAMP_S = 5.0


@dataclass
class SlowResult:
    """One slow-streams run against one target; times in ms, memory in MiB.

    Attributes:
        added_stall_max: the longest gap between two events of any stream, minus the engine's
            1,000 ms spacing.
        added_stall_p99: the same for the 99th percentile stream.
        rss_before, peak_rss: the target's resident memory before the first run (freed memory
            stays with the process, so later runs start higher) and at this run's peak.
        per_stream_kib: (peak - before) / streams.
        cpu_per_1k: the target's CPU ms per 1,000 chunks (one chunk per engine write here).
    """

    target: str
    streams: int
    ok: int
    errors: int
    peak_open: int
    added_stall_max: float
    added_stall_p99: float
    rss_before: float
    peak_rss: float
    per_stream_kib: float
    cpu_per_1k: float


def measure_slow(target: Target, streams: int, tokens: int, before: float) -> SlowResult:
    """Open ``streams`` streams of ``tokens`` tokens at 1 token/s through ``target``; measure.

    ``before`` is the target's RSS in MiB before any stream was opened (0 for ``direct``).
    """
    peak = 0.0
    if target.rss_pid:
        reset_peak(target.rss_pid)
    spec = LoadSpec(
        url=target.url,
        path=CHAT_PATH,
        headers=target.headers,
        body=request_body(tokens * 2),
        concurrency=streams,
        requests=streams,
        time_limit_s=RAMP_S + 10,
        request_timeout_s=tokens + 60,
        warmup=False,
        ramp_s=RAMP_S,
        gaps=True,
        watch_pids=target.cpu_pids,
    )
    result = run_loadgen(spec)
    if target.rss_pid:
        peak = memory_kib(target.rss_pid)["VmHWM"] / 1024
    cpu = sum(result.cpu_s.values())
    return SlowResult(
        target=target.name,
        streams=streams,
        ok=result.ok,
        errors=result.errors,
        peak_open=result.peak_open,
        added_stall_max=result.max_gap_s * 1000 - 1000,
        added_stall_p99=result.gap_p99_s * 1000 - 1000,
        rss_before=before,
        peak_rss=peak,
        per_stream_kib=(peak - before) * 1024 / streams if target.rss_pid else 0.0,
        cpu_per_1k=cpu * 1e6 / max(1, result.chunks) if target.cpu_pids else float("nan"),
    )


def run_slow(
    workdir: Path,
    *,
    streams: int,
    tokens: int,
    rounds: int,
    progress: Callable[[str], None],
) -> list[SlowResult]:
    """``rounds`` x (direct, gateway, gateway-gc-tuned) runs against one simulator at 1 token/s.

    The simulator runs with its garbage collector off: its full collections with 2,000 open
    streams pause every stream for about 120 ms, which would hide the gateway's own stalls.
    """
    profile = Profile("slow", f"1 token/s, {tokens} tokens", 1.0, tokens, (streams,))
    results: list[SlowResult] = []
    with run_stack(
        workdir,
        profile,
        nginx_binary=None,
        variants=("gateway-gc-tuned",),
        engine_gc_off=True,
    ) as (_, targets):
        before = {
            t.name: memory_kib(t.rss_pid)["VmRSS"] / 1024 if t.rss_pid else 0.0 for t in targets
        }
        for round_no in range(1, rounds + 1):
            for target in targets:
                result = measure_slow(target, streams, tokens, before[target.name])
                results.append(result)
                progress(
                    f"round {round_no}/{rounds} slow {target.name}: {result.ok}/{streams} ok, "
                    f"peak open {result.peak_open}, added stall max "
                    f"{result.added_stall_max:.1f} ms, peak RSS {result.peak_rss:.1f} MiB"
                )
    return results


def slow_table(results: list[SlowResult]) -> str:
    """Slow-stream results as a Markdown table (one line per run)."""
    head = (
        "| target | streams | ok | errors | peak open | added stall max ms | added stall p99 ms "
        "| RSS before MiB | peak RSS MiB | KiB per stream | CPU ms / 1k chunks |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in results:
        cells = [
            r.target,
            str(r.streams),
            str(r.ok),
            str(r.errors),
            str(r.peak_open),
            f"{r.added_stall_max:.1f}",
            f"{r.added_stall_p99:.1f}",
            f"{r.rss_before:.1f}" if r.rss_before else "-",
            f"{r.peak_rss:.1f}" if r.peak_rss else "-",
            f"{r.per_stream_kib:.1f}" if r.peak_rss else "-",
            f"{r.cpu_per_1k:.1f}" if r.cpu_per_1k == r.cpu_per_1k else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
