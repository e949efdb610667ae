"""Two versions of the gateway side by side: the relay row of each, alternating in one period.

``python -m tests.perf.ab REV [--rounds N] [--concurrency C] [--requests R] [--tokens T]``

On a shared virtual machine the CPU a row costs moves by 10-20% from one minute to the next
(other tenants, steal time), more than most changes to the relay are worth, so two runs of
`tests.perf` at different times do not compare. Here the gateway of this tree and the gateway
of ``REV`` (any git revision, checked out in a temporary worktree) run at once, each in front of
its own simulator (0 ms per token, ``T`` tokens an answer, the ``fast`` profile of
`tests.perf`), and the load generator (`tests.perf.loadgen`, the same rows as `tests.perf`:
``R`` streamed chat requests at concurrency ``C`` after one warm-up each) alternates between
them ``N`` times, in the order A B, B A, A B, ...: both versions see the same machine.

Printed per version: the median and every round of the gateway's CPU milliseconds per 1,000
chunks (its process, all threads, `tests.perf.procstat`) and of the TTFT p50 (ms). Nothing is
compared to nginx here: `tests.perf` does that. The worktree and temp files are removed at the
end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import KEY_A, REPO
from tests.perf.bench import CHAT_PATH, run_loadgen
from tests.perf.loadgen import LoadSpec
from tests.perf.stacks import request_body

_SERVE = r"""
import json, shutil, signal, sys, tempfile
from pathlib import Path
sys.path.insert(0, ".")
from tests.conftest import start_gateway, start_sim
from tests.perf.stacks import BENCH_CONFIG
work = Path(tempfile.mkdtemp(prefix="q38ab-", dir="/tmp"))
sim = gw = None
try:
    sim = start_sim(work, "--tokens-per-second", "0", "--completion-tokens", sys.argv[1],
                    "--max-num-seqs", "4096", name="fast")
    gw = start_gateway(work, sim, BENCH_CONFIG, name="gw")
    info = {"url": gw.base_url, "pid": gw.proc.pid, "sim_pid": sim.proc.pid, "work": str(work)}
    print(json.dumps(info), flush=True)
    sys.stdin.read()
finally:
    if gw is not None:
        gw.proc.send_signal(signal.SIGTERM)
        gw.proc.wait(30)
    if sim is not None:
        sim.stop()
    shutil.rmtree(work, ignore_errors=True)
"""
"""Run in a tree's root: one simulator and one gateway of that tree, until stdin closes; then
both are stopped and their directory (``/tmp/q38ab-*``: logs, the simulator's record, the
ledger) removed, also when either failed to start."""


class Side:
    """One version's simulator and gateway, started from the tree at ``root``; `stop` ends
    both and removes their directory ``work``.

    Raises:
        RuntimeError: the gateway did not start.
    """

    def __init__(self, name: str, root: Path, tokens: int) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, str(tokens)],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the gateway of {name} did not start")
        info = json.loads(line)
        self.url: str = info["url"]
        self.pid: int = info["pid"]
        self.sim_pid: int = info["sim_pid"]
        self.work = Path(info["work"])
        self.cpu_per_1k: list[float] = []
        self.ttft_ms: list[float] = []

    def measure(self, concurrency: int, requests: int, tokens: int) -> None:
        """One row of load against this side; its CPU per 1k chunks and TTFT p50 kept."""
        spec = LoadSpec(
            url=self.url,
            path=CHAT_PATH,
            headers={"Authorization": f"Bearer {KEY_A}"},
            body=request_body(tokens * 2),
            concurrency=concurrency,
            requests=requests,
            time_limit_s=20.0,
            watch_pids=[self.pid],
        )
        result = run_loadgen(spec)
        self.cpu_per_1k.append(result.cpu_s[str(self.pid)] * 1e6 / max(1, result.chunks))
        self.ttft_ms.append(result.ttft_p50 * 1000)

    def report(self) -> str:
        """One line: medians, then every round."""
        cpu = " ".join(f"{v:.1f}" for v in self.cpu_per_1k)
        ttft = " ".join(f"{v:.2f}" for v in self.ttft_ms)
        return (
            f"| {self.name} | {statistics.median(self.cpu_per_1k):.2f} | "
            f"{statistics.median(self.ttft_ms):.2f} | {cpu} | {ttft} |"
        )

    def stop(self) -> None:
        """Close the side's stdin (it stops its gateway and simulator, removes ``work``)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(60)
        self.proc.stdout.close()


def main() -> int:
    """Parse the arguments, run both sides alternately, print a Markdown table."""
    parser = argparse.ArgumentParser(prog="python -m tests.perf.ab", description=__doc__)
    parser.add_argument("rev", help="the git revision to compare this tree with")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="q38ab-tree-") as tmp:
        other = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(other), args.rev],
            check=True,
        )
        sides: list[Side] = []
        try:
            sides.append(Side("this tree", REPO, args.tokens))
            sides.append(Side(args.rev, other, args.tokens))
            for index in range(args.rounds):
                for side in sides if index % 2 == 0 else sides[::-1]:
                    side.measure(args.concurrency, args.requests, args.tokens)
        finally:
            for side in sides:
                side.stop()
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)], check=False
            )
    load = os.getloadavg()
    print(
        f"# c={args.concurrency}, {args.requests} requests x {args.rounds} rounds, "
        f"{args.tokens} tokens, load {load[0]:.1f}"
    )
    print(
        "| gateway | CPU ms / 1k chunks, median | TTFT p50 ms, median | CPU, rounds | TTFT, rounds |"
    )
    print("| --- | --- | --- | --- | --- |")
    for side in sides:
        print(side.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
