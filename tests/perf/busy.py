"""Engine occupancy and fairness with one engine slot: the ``busy`` section of the benchmark.

One simulator at 1,000 tokens/s answering one sequence at a time (``--max-num-seqs 1``), one
gateway with ``engine.max_concurrency = 1`` and four tenants of weight 1, each holding a backlog
in the admission queue. Two scenarios:

- ``backlog``: every tenant keeps `OUTSTANDING` requests open (a new one as soon as one ends)
  for the measured window, each tenant with its own answer lengths (`SIZES`). Measured at the
  engine, from the simulator's ``--record`` times (``received_at``: request headers read;
  ``ended_at``: answer written): the busy fraction (time with a request running at the engine
  / window), the gap from one request's end to the next one's arrival (p50, p99, max), and
  Jain's fairness index over the tokens (prompt + completion) each tenant was served in the
  window, requests cut by the window's edges counted pro rata.
- ``short-behind-long``: one tenant keeps `LONG_OUTSTANDING` long answers queued; another sends
  one short request at a time at random moments. Its wait (sent by the client to received by
  the engine) should be at most one long answer's engine time (the one running when it arrived)
  plus its own turn (the gap target), not the whole long backlog.

Jain's index: ``(sum x)^2 / (n * sum x^2)`` over the tenants' shares ``x``; 1 is an equal split,
``1/n`` one tenant served alone (R. Jain, D. Chiu, W. Hawe, "A Quantitative Measure of Fairness
and Discrimination for Resource Allocation in Shared Computer Systems", DEC-TR-301, 1984).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from engine.sim.tokens import chat_prompt_tokens
from tests.conftest import ALIAS, Gateway, Sim, start_gateway, start_sim
from tests.perf.procstat import run_delay_seconds
from tests.perf.stacks import _terminate

RATE = 1000.0
"""Simulator tokens per second: fast enough that the cost of each hand-over shows."""
TENANTS = ("t1", "t2", "t3", "t4")
SIZES: dict[str, tuple[int, ...]] = {"t1": (32,), "t2": (128,), "t3": (512,), "t4": (64, 256)}
"""Answer lengths (``max_tokens``) per tenant, cycled: short and long tenants side by side."""
OUTSTANDING = 3
"""Open requests per tenant in ``backlog`` (all but one of them queued at the gateway)."""
LONG_TOKENS, SHORT_TOKENS, LONG_OUTSTANDING = 2000, 16, 4
BUSY_TARGET, GAP_P99_TARGET_MS, JAIN_TARGET = 0.98, 5.0, 0.95
CHAT_PATH = "/v1/chat/completions"
_KEYS = {t: f"sk-q38-bench{t.upper()}" + "B" * 30 for t in TENANTS}


@dataclass
class BacklogResult:
    """The ``backlog`` figures; times in ms, shares in tokens."""

    window_s: float
    requests: int
    busy: float
    gap_p50: float
    gap_p99: float
    gap_max: float
    gaps: int
    jain: float
    jain_completion: float
    tokens: dict[str, float] = field(default_factory=dict)
    errors: int = 0
    run_delay_ms_per_s: dict[str, float] = field(default_factory=dict)
    load: tuple[float, float] = (0.0, 0.0)


@dataclass
class ShortResult:
    """The ``short-behind-long`` figures; times in ms."""

    long_service: float
    short_service: float
    waits: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def bound(self) -> float:
        """Longest acceptable wait: one long answer plus the short one's own turn (gap target)."""
        return self.long_service + GAP_P99_TARGET_MS


def jain(shares: Sequence[float]) -> float:
    """Jain's fairness index of ``shares`` (1.0 for an empty or all-zero list)."""
    total, squares = sum(shares), sum(x * x for x in shares)
    return 1.0 if squares == 0 else total * total / (len(shares) * squares)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


@contextlib.contextmanager
def busy_stack(workdir: Path) -> Iterator[tuple[Sim, Gateway]]:
    """The simulator (1,000 tokens/s, one sequence) and a gateway with one
    engine slot and four tenants of weight 1 whose limits no request reaches."""
    workdir.mkdir(parents=True, exist_ok=True)
    sim = start_sim(
        workdir,
        "--tokens-per-second", str(RATE),
        "--max-num-seqs", "1",
        name="busy",
    )  # fmt: skip
    gw: Gateway | None = None
    try:
        limits = {"rpm": 10**9, "tpm": 10**12, "concurrency": 10_000, "weight": 1.0}
        config = {
            "engine": {
                "max_concurrency": 1,
                "queue_size": 10_000,
                "queue_timeout_s": 600.0,
                "health_interval_s": 2.0,
            },
            "logging": {"level": "info"},
            "tenants": {"default": dict(limits), **{t: dict(limits) for t in TENANTS}},
        }
        keys = {f"KEY_{t.upper()}": (t, key) for t, key in _KEYS.items()}
        gw = start_gateway(workdir, sim, config, keys, name="gw-busy")
        yield sim, gw
    finally:
        if gw is not None:
            _terminate(gw.proc)
        sim.stop()


def _body(tokens: int, budget: bool = True) -> dict[str, Any]:
    """A streamed chat request whose answer is ``tokens`` long (the simulator's ``sim`` key
    passes through the gateway), with ``max_tokens`` set to that length when ``budget``; without
    it the gateway reserves the tenant's default output budget."""
    body: dict[str, Any] = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Write about the coast."}],
        "stream": True,
        "sim": {"completion_tokens": tokens},
    }
    if budget:
        body["max_tokens"] = tokens
    return body


async def _request(
    session: aiohttp.ClientSession,
    gw: Gateway,
    tenant: str,
    request_id: str,
    tokens: int,
    budget: bool = True,
) -> bool:
    """One streamed request read to its end; True if it ended with ``[DONE]``."""
    headers = {"Authorization": f"Bearer {_KEYS[tenant]}", "X-Request-Id": request_id}
    async with session.post(gw.url(CHAT_PATH), json=_body(tokens, budget), headers=headers) as resp:
        data = await resp.read()
    return resp.status == 200 and data.rstrip().endswith(b"data: [DONE]")


@dataclass
class _Sent:
    tenant: str
    at: float
    ok: bool | None = None
    done_at: float | None = None


async def _closed_loop(
    session: aiohttp.ClientSession,
    gw: Gateway,
    tenant: str,
    sizes: Sequence[int],
    outstanding: int,
    sent: dict[str, _Sent],
    budget: bool = True,
) -> None:
    """Keep ``outstanding`` requests of ``tenant`` open until cancelled."""

    async def worker(w: int) -> None:
        for i in range(1 << 30):
            request_id = f"{tenant}-{w}-{i}"
            entry = sent[request_id] = _Sent(tenant, time.time())
            try:
                size = sizes[(w + i * outstanding) % len(sizes)]
                entry.ok = await _request(session, gw, tenant, request_id, size, budget)
            except aiohttp.ClientError:
                entry.ok = False
            entry.done_at = time.time()

    await asyncio.gather(*(worker(w) for w in range(outstanding)))


def _model_records(sim: Sim) -> list[dict[str, Any]]:
    return [r for r in sim.records() if r.get("path") == CHAT_PATH and "received_at" in r]


_ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{12}$")


def _record_id(record: dict[str, Any]) -> str:
    """The client's request id of a recorded engine request: the gateway sends it to the engine
    with a suffix of its own (``-`` and 12 hex digits), the direct client as is."""
    headers = {k.lower(): v for k, v in record["headers"].items()}
    return _ENGINE_SUFFIX.sub("", str(headers.get("x-request-id", "")))


async def _settle(sim: Sim, ids: set[str], timeout: float = 5.0) -> list[dict[str, Any]]:
    """The records, once every id in ``ids`` has one (the simulator writes at the end)."""
    deadline = time.monotonic() + timeout
    while True:
        records = _model_records(sim)
        if ids <= {_record_id(r) for r in records} or time.monotonic() > deadline:
            return records
        await asyncio.sleep(0.1)


def analyse_backlog(
    records: list[dict[str, Any]], tenant_of: dict[str, str], start: float, end: float
) -> BacklogResult:
    """Busy fraction, gaps and fairness of the engine in ``[start, end]`` (Unix seconds)."""
    spans = sorted(
        (r["received_at"], r["ended_at"], r)
        for r in records
        if r["ended_at"] > start and r["received_at"] < end and _record_id(r) in tenant_of
    )
    busy = 0.0
    last_end = start
    for begin, finish, _ in spans:  # the union of the spans inside the window
        lo, hi = max(begin, last_end, start), min(finish, end)
        if hi > lo:
            busy += hi - lo
        last_end = max(last_end, finish)
    gaps = [
        max(0.0, b[0] - a[1]) * 1000
        for a, b in itertools.pairwise(spans)
        if a[1] >= start and b[0] <= end
    ]
    tokens = {t: 0.0 for t in TENANTS}
    completion = {t: 0.0 for t in TENANTS}
    for begin, finish, record in spans:
        inside = (min(finish, end) - max(begin, start)) / max(finish - begin, 1e-9)
        body = record.get("body") or {}
        prompt = chat_prompt_tokens(body.get("messages") or [])
        tenant = tenant_of[_record_id(record)]
        tokens[tenant] += inside * (prompt + record["tokens_sent"])
        completion[tenant] += inside * record["tokens_sent"]
    return BacklogResult(
        window_s=end - start,
        requests=len(spans),
        busy=busy / (end - start),
        gap_p50=percentile(gaps, 50),
        gap_p99=percentile(gaps, 99),
        gap_max=max(gaps, default=float("nan")),
        gaps=len(gaps),
        jain=jain(list(tokens.values())),
        jain_completion=jain(list(completion.values())),
        tokens=tokens,
    )


async def run_backlog(
    gw: Gateway,
    sim: Sim,
    window_s: float,
    settle_s: float = 1.0,
    no_budget: frozenset[str] = frozenset(),
) -> BacklogResult:
    """Four tenants' closed loops for ``settle_s + window_s``; the window's figures.

    Tenants in ``no_budget`` send no ``max_tokens`` (the gateway reserves their default budget,
    far above what they use)."""
    sent: dict[str, _Sent] = {}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [
            asyncio.create_task(
                _closed_loop(session, gw, t, SIZES[t], OUTSTANDING, sent, t not in no_budget)
            )
            for t in TENANTS
        ]
        try:
            start = time.time() + settle_s
            await asyncio.sleep(settle_s)
            pids = {"gateway": gw.proc.pid, "simulator": sim.proc.pid}
            delays = {name: run_delay_seconds(pid) for name, pid in pids.items()}
            load = os.getloadavg()[0]
            await asyncio.sleep(window_s)
            end = time.time()
            waited = {
                name: (run_delay_seconds(pid) - delays[name]) * 1000 / window_s
                for name, pid in pids.items()
            }
            load_end = os.getloadavg()[0]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    records = await _settle(sim, {rid for rid, s in sent.items() if s.at < end})
    result = analyse_backlog(records, {rid: s.tenant for rid, s in sent.items()}, start, end)
    result.errors = sum(1 for s in sent.values() if s.ok is False and s.done_at and s.done_at < end)
    result.run_delay_ms_per_s, result.load = waited, (load, load_end)
    return result


async def run_short_behind_long(gw: Gateway, sim: Sim, probes: int, seed: int = 7) -> ShortResult:
    """``t1`` keeps `LONG_OUTSTANDING` long answers open; ``t2`` sends ``probes`` short ones."""
    rng = random.Random(seed)
    sent: dict[str, _Sent] = {}
    probe_ids: list[str] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        longs = asyncio.create_task(
            _closed_loop(session, gw, "t1", (LONG_TOKENS,), LONG_OUTSTANDING, sent)
        )
        try:
            await asyncio.sleep(1.0)
            for k in range(probes):
                await asyncio.sleep(rng.uniform(0.2, 1.8))
                request_id = f"t2-probe-{k}"
                entry = sent[request_id] = _Sent("t2", time.time())
                try:
                    entry.ok = await _request(session, gw, "t2", request_id, SHORT_TOKENS)
                except aiohttp.ClientError:
                    entry.ok = False
                entry.done_at = time.time()
                probe_ids.append(request_id)
        finally:
            longs.cancel()
            await asyncio.gather(longs, return_exceptions=True)
    records = {_record_id(r): r for r in await _settle(sim, set(probe_ids))}
    long_times = [
        (r["ended_at"] - r["received_at"]) * 1000
        for rid, r in records.items()
        if rid.startswith("t1-") and r["outcome"] == "finished"
    ]
    result = ShortResult(
        long_service=statistics.median(long_times) if long_times else float("nan"),
        short_service=float("nan"),
    )
    short_times = []
    for rid in probe_ids:
        entry, record = sent[rid], records.get(rid)
        if not entry.ok or record is None or entry.done_at is None:
            result.errors += 1
            continue
        result.waits.append((record["received_at"] - entry.at) * 1000)
        result.latencies.append((entry.done_at - entry.at) * 1000)
        short_times.append((record["ended_at"] - record["received_at"]) * 1000)
    if short_times:
        result.short_service = statistics.median(short_times)
    return result


async def run_direct(sim: Sim, window_s: float) -> BacklogResult:
    """The floor: one client sending the same answer lengths one after another straight to the
    simulator's socket, so each hand-over costs one client turn and no gateway. Fairness is
    meaningless here (one client); busy and gaps are comparable."""
    sizes = [size for t in TENANTS for size in SIZES[t]]
    sent: dict[str, _Sent] = {}
    connector = aiohttp.UnixConnector(path=sim.socket)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.time() + 0.2
        end = start + window_s
        for i in range(1 << 30):
            now = time.time()
            if now > end:
                break
            request_id = f"t{1 + i % len(TENANTS)}-direct-{i}"
            sent[request_id] = _Sent(TENANTS[i % len(TENANTS)], now)
            async with session.post(
                "http://engine" + CHAT_PATH,
                json=_body(sizes[i % len(sizes)]),
                headers={"X-Request-Id": request_id},
            ) as resp:
                await resp.read()
    records = await _settle(sim, set(sent))
    return analyse_backlog(records, {rid: s.tenant for rid, s in sent.items()}, start, end)


def run_busy(
    workdir: Path, *, window_s: float, probes: int, progress: Callable[[str], None]
) -> BusyResults:
    """The scenarios, each against a fresh stack (so none inherits another's queue)."""
    results = BusyResults()
    with busy_stack(workdir / "direct") as (sim, _):
        progress(f"busy direct: one client straight to the simulator, {window_s:g} s")
        results.direct = asyncio.run(run_direct(sim, window_s))
    for name, no_budget in (("backlog", frozenset()), ("no-budget", frozenset({"t4"}))):
        with busy_stack(workdir / name) as (sim, gw):
            progress(f"busy {name}: 4 tenants, {window_s:g} s window")
            result = asyncio.run(run_backlog(gw, sim, window_s, no_budget=no_budget))
            if no_budget:
                results.no_budget = result
            else:
                results.backlog = result
    with busy_stack(workdir / "short") as (sim, gw):
        progress(f"busy short-behind-long: {probes} probes")
        results.short = asyncio.run(run_short_behind_long(gw, sim, probes))
    return results


@dataclass
class BusyResults:
    """Everything the section measured; None where a scenario did not run."""

    direct: BacklogResult | None = None
    backlog: BacklogResult | None = None
    no_budget: BacklogResult | None = None
    short: ShortResult | None = None
