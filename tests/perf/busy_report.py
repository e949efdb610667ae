"""The ``busy`` section's report: the figures of `tests.perf.busy` and a verdict per target."""

from __future__ import annotations

from collections.abc import Sequence

from tests.perf.busy import (
    BUSY_TARGET,
    GAP_P99_TARGET_MS,
    JAIN_TARGET,
    LONG_OUTSTANDING,
    LONG_TOKENS,
    OUTSTANDING,
    RATE,
    SHORT_TOKENS,
    SIZES,
    TENANTS,
    BusyResults,
    percentile,
)


def _max(values: Sequence[float]) -> float:
    return max(values, default=float("nan"))


def busy_report(results: BusyResults) -> list[str]:
    """The section's Markdown lines: figures, then one verdict per target."""
    backlog, no_budget, short = results.backlog, results.no_budget, results.short
    direct = results.direct
    assert backlog is not None and no_budget is not None and short is not None
    assert direct is not None
    shares = ", ".join(f"{t} {backlog.tokens[t]:.0f}" for t in TENANTS)
    nb_shares = ", ".join(f"{t} {no_budget.tokens[t]:.0f}" for t in TENANTS)
    waits = short.waits
    lines = [
        f"- simulator {RATE:g} tokens/s, one sequence; gateway engine.max_concurrency = 1; "
        f"four tenants of weight 1, answer lengths {SIZES}, {OUTSTANDING} open requests each",
        f"- backlog window {backlog.window_s:.1f} s, {backlog.requests} requests at the engine, "
        f"{backlog.errors} errors; machine noise: load average {backlog.load[0]:.1f} at the "
        f"start, {backlog.load[1]:.1f} at the end; waiting for a CPU while runnable: "
        + ", ".join(f"{k} {v:.1f} ms/s" for k, v in backlog.run_delay_ms_per_s.items()),
        f"- (a) engine busy {backlog.busy * 100:.2f} %; gap end -> next arrival over "
        f"{backlog.gaps} hand-overs: p50 {backlog.gap_p50:.2f} ms, p99 {backlog.gap_p99:.2f} ms, "
        f"max {backlog.gap_max:.2f} ms",
        f"- floor, one client straight to the simulator (no gateway, same lengths): busy "
        f"{direct.busy * 100:.2f} %, gap p50 {direct.gap_p50:.2f} ms, p99 "
        f"{direct.gap_p99:.2f} ms, max {direct.gap_max:.2f} ms over {direct.gaps} hand-overs",
        f"- (b) Jain's index over tokens served (prompt + completion) {backlog.jain:.4f} "
        f"(completion only {backlog.jain_completion:.4f}); tokens: {shares}",
        f"- (b') the same with t4 sending no max_tokens (the gateway reserves the default "
        f"budget): Jain {no_budget.jain:.4f}; tokens: {nb_shares}; busy "
        f"{no_budget.busy * 100:.2f} %, gap p99 {no_budget.gap_p99:.2f} ms",
        f"- (c) short ({SHORT_TOKENS} tokens) behind {LONG_OUTSTANDING} queued long answers "
        f"({LONG_TOKENS} tokens, {short.long_service:.0f} ms at the engine): wait to the engine "
        f"p50 {percentile(waits, 50):.0f} ms, max {_max(waits):.0f} ms over {len(waits)} probes "
        f"({short.errors} errors); end to end p50 {percentile(short.latencies, 50):.0f} ms, "
        f"max {_max(short.latencies):.0f} ms",
        "",
    ]
    checks = [
        (f"engine busy >= {BUSY_TARGET * 100:g} %", backlog.busy >= BUSY_TARGET,
         f"{backlog.busy * 100:.2f} %"),
        (f"hand-over gap p99 < {GAP_P99_TARGET_MS:g} ms", backlog.gap_p99 < GAP_P99_TARGET_MS,
         f"{backlog.gap_p99:.2f} ms"),
        (f"Jain's index >= {JAIN_TARGET:g}", backlog.jain >= JAIN_TARGET, f"{backlog.jain:.4f}"),
        (f"Jain's index >= {JAIN_TARGET:g}, one tenant without max_tokens",
         no_budget.jain >= JAIN_TARGET, f"{no_budget.jain:.4f}"),
        ("short request waits <= one long answer + its turn",
         bool(waits) and not short.errors and max(waits) <= short.bound,
         f"max {_max(waits):.0f} ms <= {short.bound:.0f} ms"),
    ]  # fmt: skip
    for name, met, detail in checks:
        lines.append(f"{'PASS' if met else 'FAIL'}  {name}: {detail}")
    return lines
