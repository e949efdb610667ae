"""The load generator: concurrent streaming requests from a process of its own, timed per request.

Run as ``python -m tests.perf.loadgen``: reads one JSON `LoadSpec` on stdin (so credentials never
appear in argv), prints one JSON `LoadResult` on stdout. The orchestrator (`tests.perf.bench`)
starts it once per row so the client's CPU never mixes with the measured proxy's.

Per request it measures the time to first token (the first ``data:`` event of the answer), the
total time to the end of the stream, the data events received (``[DONE]`` excluded) and, with
``gaps``, the longest silence between two events after the first.
"""

from __future__ import annotations

import asyncio
import gc
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from tests.perf.procstat import cpu_seconds


@dataclass
class LoadSpec:
    """One row of load.

    Attributes:
        url: ``http://127.0.0.1:PORT`` (TCP) or ``unix:/path.sock`` (HTTP over a Unix socket).
        path: request path, e.g. ``/v1/chat/completions``.
        headers: request headers (the Bearer credential among them).
        body: the JSON request body (``stream`` true).
        concurrency: requests in flight at once (one worker each).
        requests: measured requests in all; the row stops at this count or at ``time_limit_s``.
        time_limit_s: no new request starts after this many seconds of measuring.
        request_timeout_s: a request taking longer is counted as an error.
        warmup: each worker first sends one unmeasured request (opens and warms its connection).
        ramp_s: worker ``i`` starts measuring ``ramp_s * i / concurrency`` s late (spreads connects).
        gaps: record the longest gap between two events of each request.
        watch_pids: processes whose CPU seconds are read when measuring starts and ends.
    """

    url: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    concurrency: int
    requests: int
    time_limit_s: float
    request_timeout_s: float = 120.0
    warmup: bool = True
    ramp_s: float = 0.0
    gaps: bool = False
    watch_pids: list[int] = field(default_factory=list)


@dataclass
class LoadResult:
    """What one row measured; times in seconds, percentiles by nearest rank.

    Attributes:
        ok: requests that ended with ``[DONE]``; errors: the others (status, error event, reset).
        wall_s: from the start of measuring to the end of the last request.
        chunks: data events received by the successful requests.
        ttft_p50, ttft_p99, total_p50, total_p99: over the successful requests.
        max_gap_s: longest gap between two events of one request (``gaps`` only), 0 otherwise.
        gap_p99_s: 99th percentile over requests of their longest gap (``gaps`` only).
        peak_open: most streams open at once (headers received, end not yet).
        cpu_s: CPU seconds each watched pid used while measuring (key: the pid as a string).
        error_sample: up to five error descriptions.
    """

    ok: int = 0
    errors: int = 0
    wall_s: float = 0.0
    chunks: int = 0
    ttft_p50: float = 0.0
    ttft_p99: float = 0.0
    total_p50: float = 0.0
    total_p99: float = 0.0
    max_gap_s: float = 0.0
    gap_p99_s: float = 0.0
    peak_open: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)
    error_sample: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``values``; 0.0 for an empty list."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


@dataclass
class _Sample:
    ttft: float
    total: float
    events: int
    max_gap: float


class _Run:
    """The shared state of one row: counters, samples and the measuring window."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.body = json.dumps(spec.body).encode()
        self.url = ("http://engine" if spec.url.startswith("unix:") else spec.url) + spec.path
        self.headers = {"Content-Type": "application/json", **spec.headers}
        self.samples: list[_Sample] = []
        self.errors: list[str] = []
        self.issued = 0
        self.open = 0
        self.peak_open = 0
        self.warmed = 0
        self.go = asyncio.Event()
        self.start = self.deadline = 0.0
        self.cpu_start: dict[str, float] = {}

    async def one(self, session: aiohttp.ClientSession) -> _Sample | str:
        """One streamed request; a sample, or a short error description."""
        t0 = time.perf_counter()
        ttft = last = 0.0
        events = 0
        max_gap = 0.0
        done = False
        pending = b""
        try:
            async with session.post(self.url, data=self.body, headers=self.headers) as resp:
                if resp.status != 200:
                    return f"status {resp.status}: {(await resp.read())[:200]!r}"
                self.open += 1
                self.peak_open = max(self.peak_open, self.open)
                try:
                    async for data in resp.content.iter_any():
                        if pending:
                            data = pending + data
                        end = data.rfind(b"\n\n")
                        if end < 0:
                            pending = data
                            continue
                        pending = data[end + 2 :]
                        block = data[:end]
                        count = block.count(b"\n\ndata:") + block.startswith(b"data:")
                        if b"data: [DONE]" in block:
                            done = True
                            count -= 1
                        if b'data: {"error"' in block:
                            return f"error event: {block[-300:]!r}"
                        if count > 0:
                            now = time.perf_counter()
                            if not events:
                                ttft = now - t0
                            elif now - last > max_gap:
                                max_gap = now - last
                            last = now
                            events += count
                finally:
                    self.open -= 1
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"[:300]
        if not done:
            return "stream ended without [DONE]"
        return _Sample(ttft=ttft, total=time.perf_counter() - t0, events=events, max_gap=max_gap)

    def begin(self) -> None:
        """Start measuring: read the watched CPU clocks, set the deadline, release the workers."""
        self.cpu_start = _cpu(self.spec.watch_pids)
        self.start = time.perf_counter()
        self.deadline = self.start + self.spec.time_limit_s
        self.go.set()

    async def worker(self, session: aiohttp.ClientSession, index: int) -> None:
        spec = self.spec
        if spec.warmup:
            await self.one(session)
        self.warmed += 1
        if self.warmed == spec.concurrency:
            self.begin()
        await self.go.wait()
        if spec.ramp_s:
            await asyncio.sleep(spec.ramp_s * index / spec.concurrency)
        while self.issued < spec.requests and time.perf_counter() < self.deadline:
            self.issued += 1
            result = await self.one(session)
            if isinstance(result, str):
                self.errors.append(result)
            else:
                self.samples.append(result)


def _cpu(pids: list[int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid in pids:
        try:
            out[str(pid)] = cpu_seconds(pid)
        except OSError:
            out[str(pid)] = 0.0
    return out


async def run_load(spec: LoadSpec) -> LoadResult:
    """Run one row of load and summarise it."""
    run = _Run(spec)
    if spec.url.startswith("unix:"):
        connector: aiohttp.BaseConnector = aiohttp.UnixConnector(path=spec.url[5:], limit=0)
    else:
        connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=spec.request_timeout_s)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False
    ) as session:
        workers = [asyncio.create_task(run.worker(session, i)) for i in range(spec.concurrency)]
        await asyncio.gather(*workers)
        wall = time.perf_counter() - run.start
        cpu_end = _cpu(spec.watch_pids)
    samples = run.samples
    return LoadResult(
        ok=len(samples),
        errors=len(run.errors),
        wall_s=wall,
        chunks=sum(s.events for s in samples),
        ttft_p50=percentile([s.ttft for s in samples], 50),
        ttft_p99=percentile([s.ttft for s in samples], 99),
        total_p50=percentile([s.total for s in samples], 50),
        total_p99=percentile([s.total for s in samples], 99),
        max_gap_s=max((s.max_gap for s in samples), default=0.0),
        gap_p99_s=percentile([s.max_gap for s in samples], 99),
        peak_open=run.peak_open,
        cpu_s={pid: cpu_end[pid] - run.cpu_start[pid] for pid in run.cpu_start},
        error_sample=run.errors[:5],
    )


def raise_open_files_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def main() -> int:
    """Read a `LoadSpec` as JSON on stdin, run it, print the `LoadResult` as JSON."""
    spec = LoadSpec(**json.loads(sys.stdin.read()))
    raise_open_files_limit()
    # A collection pause here would be measured as latency of the target; a row is short-lived.
    gc.disable()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        result = asyncio.run(run_load(spec))
    else:
        result = uvloop.run(run_load(spec))
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
