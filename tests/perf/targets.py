"""The targets of issue 8, checked against measured rows: one verdict line each."""

from __future__ import annotations

from dataclasses import dataclass

from tests.perf.bench import Row
from tests.perf.slow import SlowResult

# Issue 8, "Targets".
TTFT_P50_SLACK_MS = 1.0
TTFT_P99_FACTOR = 2.0
CPU_FACTOR = 3.0
SLOW_RSS_MIB = 300.0
SLOW_STALL_MS = 50.0
LEDGER_OVERHEAD = 1.05
"""The usage ledger's CPU cost on the relay: under 5% of the gateway's CPU."""
LIMITS_OVERHEAD = 1.20


@dataclass
class Verdict:
    """One target: met or not, and the numbers that decided it."""

    name: str
    met: bool | None  # None: not measured in this run
    detail: str

    def line(self) -> str:
        """``PASS``/``FAIL``/``n/a``, the target, and the measurement."""
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[self.met]
        return f"{mark}  {self.name}: {self.detail}"


def _get(rows: list[Row], profile: str, target: str, concurrency: int) -> Row | None:
    return next(
        (r for r in rows if (r.profile, r.target, r.concurrency) == (profile, target, concurrency)),
        None,
    )


def _added(rows: list[Row], target: str, concurrency: int, column: str) -> float | None:
    row = _get(rows, "fast", target, concurrency)
    direct = _get(rows, "fast", "direct", concurrency)
    if row is None or direct is None:
        return None
    return float(getattr(row, column) - getattr(direct, column))


def verdicts(rows: list[Row], slow: list[SlowResult]) -> list[Verdict]:
    """Every issue 8 target against the median rows of the ``fast`` profile and the slow runs.

    The CPU target is checked on every (profile, concurrency) where both proxies ran; its
    verdict quotes the worst ratio.
    """
    out: list[Verdict] = []
    gw, ng = _added(rows, "gateway", 1, "ttft_p50"), _added(rows, "nginx", 1, "ttft_p50")
    if gw is None or ng is None:
        out.append(Verdict("added TTFT p50 at c=1 <= nginx's + 1 ms", None, "not measured"))
    else:
        out.append(
            Verdict(
                "added TTFT p50 at c=1 <= nginx's + 1 ms",
                gw <= ng + TTFT_P50_SLACK_MS,
                f"gateway {gw:+.2f} ms, nginx {ng:+.2f} ms",
            )
        )
    gw, ng = _added(rows, "gateway", 256, "ttft_p99"), _added(rows, "nginx", 256, "ttft_p99")
    if gw is None or ng is None:
        out.append(Verdict("added TTFT p99 at c=256 <= 2x nginx's", None, "not measured"))
    else:
        out.append(
            Verdict(
                "added TTFT p99 at c=256 <= 2x nginx's",
                gw <= TTFT_P99_FACTOR * max(ng, 0.0),
                f"gateway {gw:+.2f} ms, nginx {ng:+.2f} ms",
            )
        )
    ratios = []
    for row in rows:
        if row.target != "gateway":
            continue
        ref = _get(rows, row.profile, "nginx", row.concurrency)
        if ref is not None and ref.cpu_per_1k > 0:
            ratios.append((row.cpu_per_1k / ref.cpu_per_1k, row, ref))
    if not ratios:
        out.append(Verdict("CPU per 1k chunks <= 3x nginx's", None, "not measured"))
    else:
        worst, row, ref = max(ratios, key=lambda item: item[0])
        best = min(r[0] for r in ratios)
        out.append(
            Verdict(
                "CPU per 1k chunks <= 3x nginx's",
                worst <= CPU_FACTOR,
                f"worst {worst:.2f}x ({row.profile} c={row.concurrency}: gateway "
                f"{row.cpu_per_1k:.1f} ms, nginx {ref.cpu_per_1k:.1f} ms), best {best:.2f}x",
            )
        )
    slow_gw = [r for r in slow if r.target == "gateway"]
    if not slow_gw:
        out.append(Verdict("slow streams: RSS < 300 MiB, added stall <= 50 ms", None, "not run"))
    else:
        peak = max(r.peak_rss for r in slow_gw)
        stall = max(r.added_stall_max for r in slow_gw)
        direct = [r.added_stall_max for r in slow if r.target == "direct"]
        tuned = [r.added_stall_max for r in slow if r.target == "gateway-gc-tuned"]
        streams = min(r.peak_open for r in slow_gw)
        out.append(
            Verdict(
                f"{slow_gw[0].streams} slow streams: RSS < 300 MiB",
                peak < SLOW_RSS_MIB and streams == slow_gw[0].streams,
                f"peak RSS {peak:.1f} MiB, streams open at once {streams}",
            )
        )
        out.append(
            Verdict(
                f"{slow_gw[0].streams} slow streams: added stall <= 50 ms",
                stall <= SLOW_STALL_MS,
                f"worst gap beyond 1 s through the gateway {stall:.1f} ms"
                + (f"; direct to the engine {max(direct):.1f} ms" if direct else "")
                + (f"; gateway with gc thresholds tuned {max(tuned):.1f} ms" if tuned else ""),
            )
        )
    pairs = []
    for row in rows:
        if row.target != "gateway":
            continue
        base = _get(rows, row.profile, "gateway-limits-off", row.concurrency)
        if base is not None and base.cpu_per_1k > 0:
            pairs.append((row.cpu_per_1k / base.cpu_per_1k, row, base))
    if not pairs:
        out.append(Verdict("all on <= 1.2x limits off (CPU)", None, "not measured"))
    else:
        worst, row, base = max(pairs, key=lambda item: item[0])
        out.append(
            Verdict(
                "all on <= 1.2x limits off (CPU)",
                worst <= LIMITS_OVERHEAD,
                f"worst {worst:.2f}x ({row.profile} c={row.concurrency}: {row.cpu_per_1k:.1f} "
                f"vs {base.cpu_per_1k:.1f} ms per 1k chunks)",
            )
        )
    ledger = [
        (row.cpu_per_1k / base.cpu_per_1k, row, base)
        for row in rows
        if row.target == "gateway"
        for base in [_get(rows, row.profile, "gateway-ledger-off", row.concurrency)]
        if base is not None and base.cpu_per_1k > 0
    ]
    if ledger:
        worst, row, base = max(ledger, key=lambda item: item[0])
        out.append(
            Verdict(
                "ledger on < 1.05x ledger off (CPU)",
                worst < LEDGER_OVERHEAD,
                f"worst {worst:.3f}x ({row.profile} c={row.concurrency}: {row.cpu_per_1k:.1f} "
                f"vs {base.cpu_per_1k:.1f} ms per 1k chunks)",
            )
        )
    return out
