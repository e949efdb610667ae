"""How well the gateway predicts a queued request's wait: ``python -m tests.perf.forecast``.

One engine slot (the simulator, paced at ``--tps`` tokens/s with a prefill proportional to the
prompt), a warm-up of streamed requests the gateway learns the speeds from, then bursts of
requests from three tenants, streamed and not, answers of random length (uniform in
``--min-out``..``--max-out`` tokens), submitted at once. Prints the speeds the gateway learned
against the simulator's, and each queued request's predicted wait against its actual wait (the
gateway's ``wait_forecast`` debug lines, the same figures as
``gateway_queue_start_forecast_error_seconds``). Results: ``gateway/README.md``, "Deadlines".
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

from tests.conftest import ALIAS, KEY_A, KEY_B, KEY_C, Gateway, _stop, start_gateway, start_sim

KEYS = (KEY_A, KEY_B, KEY_C)
PREFILL_TPS = 2000.0
"""The simulator's prefill speed here: ``prefill_ms`` is set from each prompt's length."""


def request(gw: Gateway, key: str, words: int, out: int, stream: bool, tps: float) -> None:
    """One chat request of ``words`` words asking for exactly ``out`` tokens, read to its end."""
    prompt = " ".join(["word"] * words)
    body: dict[str, Any] = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4096,
        "stream": stream,
        # The simulator counts a word as a token: prefill at PREFILL_TPS, decode at tps.
        "sim": {
            "completion_tokens": out,
            "prefill_ms": 1000 * words / PREFILL_TPS,
            "tokens_per_second": tps,
        },
    }
    status = gw.read_through(key, body, 600)
    assert status == 200, status


def run(args: argparse.Namespace) -> None:
    """Warm up, run the bursts, print the figures."""
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="q38f-", dir="/tmp"))
    sim = start_sim(work)
    config = {"engine": {"max_concurrency": 1}, "tenants": {"carol": {}}}
    gw = start_gateway(work, sim, config)
    try:
        for _ in range(args.warmup):
            out = rng.randint(args.min_out, args.max_out)
            request(gw, KEY_A, rng.randint(200, 2000), out, True, args.tps)
        for _ in range(args.bursts):
            threads = []
            for index in range(args.burst):
                out = rng.randint(args.min_out, args.max_out)
                words = rng.randint(200, 2000)
                spec = (gw, KEYS[index % 3], words, out, rng.random() < 0.5, args.tps)
                threads.append(threading.Thread(target=request, args=spec))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(600)
        lines = [e for e in gw.logs() if e.get("event") == "wait_forecast"]
        speeds = {
            phase: gw.metric("gateway_forecast_tokens_per_second", phase=phase)
            for phase in ("prefill", "decode")
        }
        output = gw.metric("gateway_forecast_output_tokens", thinking="true")  # the default
    finally:
        _stop(gw.proc)
        sim.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"simulator: prefill {PREFILL_TPS:g} tokens/s (a word a token), decode {args.tps:g}")
    print(
        f"learned:   prefill {speeds['prefill']:.0f} tokens/s, decode {speeds['decode']:.1f}, "
        f"expected output {output:.0f} tokens (answers uniform in "
        f"{args.min_out}..{args.max_out})"
    )
    waits = [e["waited_s"] for e in lines]
    errors = [e["waited_s"] - e["predicted_start_s"] for e in lines]
    absolute = sorted(abs(e) for e in errors)
    if not lines:
        print("no queued request")
        return
    print(f"queued requests: {len(lines)}; actual wait median {statistics.median(waits):.1f} s")
    print(
        f"|actual - predicted|: median {statistics.median(absolute):.2f} s, "
        f"p90 {absolute[int(0.9 * (len(absolute) - 1))]:.2f} s, max {absolute[-1]:.2f} s; "
        f"mean signed {statistics.fmean(errors):+.2f} s (+: later than predicted)"
    )
    relative = [abs(e) / w for e, w in zip(errors, waits, strict=True) if w >= 5]
    if relative:
        print(f"relative error of waits >= 5 s: median {statistics.median(relative):.0%}")


def main() -> None:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tps", type=float, default=100.0, help="decode tokens/s (100)")
    parser.add_argument("--min-out", type=int, default=50)
    parser.add_argument("--max-out", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=5, help="streamed requests first (5)")
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--burst", type=int, default=9, help="requests per burst (9)")
    parser.add_argument("--seed", type=int, default=1)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
