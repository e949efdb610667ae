"""Several engines behind one gateway: the ``fleet`` section of the benchmark.

Four simulators at 30 tokens/s, one sequence each (``--max-num-seqs 1``), behind one gateway
with four ``[[engines]]`` of one slot. Eight tenants of weight 1 each run `SESSIONS` agent
sessions: a session sends its next turn as soon as the previous answer ended, its prompt growing
by the previous answer and a new user message every turn, with its ``prompt_cache_key``. That is
16 sessions for 4 slots: a standing backlog of 12. Measured from the simulators' ``--record``
times (``received_at``/``ended_at``) over the window:

- aggregate busy: the time each engine had a request, over the window, averaged over engines;
- in flight: the most requests any engine ever had at once (its own records), against its slot;
- Jain's index over the tokens (prompt + completion) each tenant was served, pro rata at the
  window's edges;
- affinity: the turns served by the engine that served the session's previous turn, over all
  turns after a session's first; load: the most requests one engine served over the mean;
- failover: after the window, with the load stopped, the engine holding a session is killed
  (SIGKILL) and the session's next turn sent at once: seconds from the kill to its first byte,
  served by another engine; and, with no request at all, seconds from killing another engine
  to ``/ready`` showing it down (the health poller alone, ``health_interval_s = 0.5``);
- hang: between the two kills, the engine holding another session is stopped (SIGSTOP: it
  accepts connections and answers nothing) and that session's next turn sent at once: seconds
  from the stop to its first byte (the turn is placed on the hung engine, moved when the engine
  leaves rotation, served by another one), and to ``/ready`` showing the engine out of
  rotation (``rotation_timeout_s = 0.3``); then SIGCONT and seconds until it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from engine.sim.tokens import chat_prompt_tokens
from tests.conftest import ALIAS, Gateway, Sim, start_gateway, start_sim
from tests.perf.busy import jain
from tests.perf.stacks import _terminate

RATE = 30.0
"""Simulator tokens per second: one V100's decode speed for Qwen3.8-27B."""
ENGINES = 4
TENANTS = tuple(f"f{i}" for i in range(1, 9))
SESSIONS = 2
"""Sessions per tenant: 16 sessions on 4 one-slot engines."""
ANSWER_TOKENS = 90
"""Tokens of every answer: 3 s at 30 tokens/s (agent turns: tool calls and short edits)."""
SYSTEM_WORDS, USER_WORDS = 400, 40
BUSY_TARGET, JAIN_TARGET, AFFINITY_TARGET, LOAD_TARGET, FAILOVER_TARGET_S = (
    0.97,
    0.95,
    0.90,
    1.5,
    1.2,
)
CHAT_PATH = "/v1/chat/completions"
_KEYS = {t: f"sk-q38-fleet{t.upper()}" + "F" * 30 for t in TENANTS}


@dataclass
class FleetResult:
    """The ``fleet`` figures (seconds, fractions, tokens)."""

    window_s: float
    turns: int
    busy: float
    busy_by_engine: dict[str, float]
    max_in_flight: dict[str, int]
    jain: float
    tokens: dict[str, float]
    affinity: float
    follow_ups: int
    moved: int
    served_by_engine: dict[str, int]
    load_ratio: float
    failover_s: float
    failover_from: str
    failover_engine: str
    detect_s: float
    hang_s: float = float("inf")
    hang_from: str = "?"
    hang_engine: str = "?"
    hang_out_s: float = float("inf")
    hang_back_s: float = float("inf")
    errors: int = 0
    notes: list[str] = field(default_factory=list)

    def verdicts(self) -> list[str]:
        """One line per target: the figure, the target, and pass or FAIL."""

        def line(name: str, value: str, target: str, ok: bool) -> str:
            return f"- {name}: {value} (target {target}) {'pass' if ok else 'FAIL'}"

        slots_ok = all(n <= 1 for n in self.max_in_flight.values())
        return [
            line("aggregate busy", f"{self.busy:.1%}", f">= {BUSY_TARGET:.0%}", self.busy >= 0.97),
            line(
                "most in flight on one engine",
                str(max(self.max_in_flight.values())),
                "<= its 1 slot",
                slots_ok,
            ),
            line("Jain over tokens", f"{self.jain:.3f}", f">= {JAIN_TARGET}", self.jain >= 0.95),
            line(
                "turns on their session's engine",
                f"{self.affinity:.1%} of {self.follow_ups}",
                f">= {AFFINITY_TARGET:.0%}",
                self.affinity >= AFFINITY_TARGET,
            ),
            line(
                "busiest engine over the mean",
                f"{self.load_ratio:.2f}x",
                f"<= {LOAD_TARGET}x",
                self.load_ratio <= LOAD_TARGET,
            ),
            line(
                "kill -> next turn served elsewhere",
                f"{self.failover_s:.3f} s ({self.failover_from} killed, served by "
                f"{self.failover_engine})",
                f"< {FAILOVER_TARGET_S} s",
                self.failover_s < FAILOVER_TARGET_S,
            ),
            line(
                "hang -> next turn served elsewhere",
                f"{self.hang_s:.3f} s ({self.hang_from} stopped, served by {self.hang_engine})",
                f"< {FAILOVER_TARGET_S} s",
                self.hang_s < FAILOVER_TARGET_S,
            ),
            line(
                "hang -> out of rotation",
                f"{self.hang_out_s:.3f} s (back {self.hang_back_s:.3f} s after SIGCONT)",
                f"< {FAILOVER_TARGET_S} s",
                self.hang_out_s < FAILOVER_TARGET_S,
            ),
            line(
                "kill (no traffic) -> out of rotation",
                f"{self.detect_s:.3f} s",
                f"< {FAILOVER_TARGET_S} s",
                self.detect_s < FAILOVER_TARGET_S,
            ),
        ]


@contextlib.contextmanager
def fleet_stack(workdir: Path) -> Iterator[tuple[list[Sim], Gateway]]:
    """Four simulators (30 tokens/s, one sequence) behind one gateway, one slot each."""
    workdir.mkdir(parents=True, exist_ok=True)
    sims: list[Sim] = []
    gw: Gateway | None = None
    try:
        for i in range(ENGINES):
            sims.append(
                start_sim(
                    workdir, "--tokens-per-second", str(RATE), "--max-num-seqs", "1", name=f"e{i}"
                )
            )
        limits = {"rpm": 10**9, "tpm": 10**12, "concurrency": 10_000, "weight": 1.0}
        config = {
            "engines": [
                {"name": f"e{i}", "socket": sim.socket, "max_concurrency": 1}
                for i, sim in enumerate(sims)
            ],
            "engine": {
                "queue_size": 10_000,
                "queue_timeout_s": 600.0,
                "health_interval_s": 0.5,
                "rotation_timeout_s": 0.3,
            },
            "logging": {"level": "info"},
            "tenants": {"default": dict(limits), **{t: dict(limits) for t in TENANTS}},
        }
        keys = {f"KEY_{t.upper()}": (t, key) for t, key in _KEYS.items()}
        gw = start_gateway(workdir, None, config, keys, name="gw-fleet")
        yield sims, gw
    finally:
        if gw is not None:
            _terminate(gw.proc)
        for sim in sims:
            sim.stop()


def _words(n: int, seed: str) -> str:
    return " ".join(f"{seed}{i % 97}" for i in range(n))


@dataclass
class _Session:
    tenant: str
    sid: str
    messages: list[dict[str, str]]
    turn: int = 0

    @property
    def key(self) -> str:
        return f"{self.tenant}-{self.sid}"

    def body(self) -> dict[str, Any]:
        return {
            "model": ALIAS,
            "messages": self.messages,
            "stream": True,
            "max_tokens": ANSWER_TOKENS,
            "prompt_cache_key": self.key,
            "sim": {"completion_tokens": ANSWER_TOKENS},
        }

    def grow(self) -> None:
        self.messages += [
            {"role": "assistant", "content": _words(ANSWER_TOKENS, "a")},
            {"role": "user", "content": _words(USER_WORDS, f"u{self.turn}")},
        ]
        self.turn += 1


async def _turn(http: aiohttp.ClientSession, gw: Gateway, session: _Session) -> bytes:
    """One streamed turn read to its end; the body (or b"" on a transport error)."""
    headers = {
        "Authorization": f"Bearer {_KEYS[session.tenant]}",
        "X-Request-Id": f"{session.key}.{session.turn}",
    }
    try:
        async with http.post(gw.url(CHAT_PATH), json=session.body(), headers=headers) as resp:
            return await resp.read()
    except aiohttp.ClientError:
        return b""


async def _run_sessions(gw: Gateway, sessions: list[_Session], stop: asyncio.Event) -> int:
    """Every session sends turns back to back until ``stop``; returns the failed turns."""
    errors = 0

    async def loop(session: _Session) -> None:
        nonlocal errors
        while not stop.is_set():
            data = await _turn(http, gw, session)
            if not data.rstrip().endswith(b"data: [DONE]"):
                errors += 1
            session.grow()

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        tasks = [asyncio.create_task(loop(s)) for s in sessions]
        await stop.wait()
        await asyncio.gather(*tasks)
    return errors


def _records(sims: list[Sim]) -> list[tuple[str, dict[str, Any]]]:
    """(engine name, record) of every chat request the simulators recorded."""
    out = []
    for i, sim in enumerate(sims):
        for r in sim.records():
            if r.get("path") == CHAT_PATH and "received_at" in r:
                out.append((f"e{i}", r))
    return out


def _client_id(record: dict[str, Any]) -> str:
    headers = {k.lower(): v for k, v in record["headers"].items()}
    return str(headers.get("x-request-id", ""))[:-13]  # the gateway's "-<12 hex>" suffix


def analyse(records: list[tuple[str, dict[str, Any]]], start: float, end: float) -> dict[str, Any]:
    """Busy, in-flight peaks, fairness, affinity and load over ``[start, end]`` (Unix s)."""
    names = [f"e{i}" for i in range(ENGINES)]
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    peaks: dict[str, int] = dict.fromkeys(names, 0)
    for name in names:
        mine = sorted((r["received_at"], r["ended_at"]) for n, r in records if n == name)
        spans[name] = mine
        events = sorted([(b, 1) for b, _ in mine] + [(e, -1) for _, e in mine])
        level = 0
        for _, step in events:
            level += step
            peaks[name] = max(peaks[name], level)
    busy_by = {}
    for name in names:
        busy, last = 0.0, start
        for b, e in spans[name]:
            lo, hi = max(b, last, start), min(e, end)
            if hi > lo:
                busy += hi - lo
            last = max(last, e)
        busy_by[name] = busy / (end - start)
    tokens = dict.fromkeys(TENANTS, 0.0)
    served: Counter[str] = Counter()
    turns: dict[str, dict[int, str]] = defaultdict(dict)
    for name, r in records:
        client = _client_id(r)
        key, _, turn = client.rpartition(".")
        tenant = key.split("-")[0]
        if tenant not in tokens or not turn.isdigit():
            continue
        turns[key][int(turn)] = name
        b, e = r["received_at"], r["ended_at"]
        if e <= start or b >= end:
            continue
        inside = (min(e, end) - max(b, start)) / max(e - b, 1e-9)
        prompt = chat_prompt_tokens((r.get("body") or {}).get("messages") or [])
        tokens[tenant] += inside * (prompt + r["tokens_sent"])
        served[name] += 1
    follow, same = 0, 0
    for by_turn in turns.values():
        for turn, name in by_turn.items():
            if turn - 1 in by_turn:
                follow += 1
                same += by_turn[turn - 1] == name
    counts = [served.get(n, 0) for n in names]
    mean = sum(counts) / len(counts)
    return {
        "busy": sum(busy_by.values()) / len(names),
        "busy_by_engine": busy_by,
        "max_in_flight": peaks,
        "jain": jain(list(tokens.values())),
        "tokens": tokens,
        "affinity": same / follow if follow else 0.0,
        "follow_ups": follow,
        "moved": follow - same,
        "served_by_engine": dict(zip(names, counts, strict=True)),
        "load_ratio": max(counts) / mean if mean else 0.0,
        "turns": sum(counts),
    }


def _home_of(records: list[tuple[str, dict[str, Any]]]) -> dict[str, tuple[int, str]]:
    """Each session's last recorded turn and its engine."""
    last: dict[str, tuple[int, str]] = {}
    for name, r in records:
        key, _, turn = _client_id(r).rpartition(".")
        if turn.isdigit() and int(turn) >= last.get(key, (-1, ""))[0]:
            last[key] = (int(turn), name)
    return last


async def _failover(
    gw: Gateway, sims: list[Sim], sessions: list[_Session]
) -> tuple[float, str, str]:
    """Kill the engine of a session and time its next turn's first byte; the killed and the
    serving engine."""
    homes = _home_of(_records(sims))
    session = next(s for s in sessions if s.key in homes)
    victim = int(homes[session.key][1][1:])
    headers = {
        "Authorization": f"Bearer {_KEYS[session.tenant]}",
        "X-Request-Id": f"{session.key}.{session.turn}",
    }
    async with aiohttp.ClientSession() as http:
        sims[victim].proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        async with http.post(gw.url(CHAT_PATH), json=session.body(), headers=headers) as resp:
            await resp.content.readany()
            first_byte = time.monotonic() - killed
            await resp.read()
    sims[victim].proc.wait()
    for _ in range(50):
        homes = _home_of(_records(sims))
        if homes.get(session.key, (-1, ""))[0] == session.turn:
            break
        await asyncio.sleep(0.1)
    return first_byte, f"e{victim}", homes.get(session.key, (0, "?"))[1]


def _detect(gw: Gateway, sim: Sim, name: str) -> float:
    """Kill an idle engine; seconds until ``/ready`` shows it down."""
    sim.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    sim.proc.wait()
    while time.monotonic() - killed < 10:
        detail = httpx.get(gw.url("/ready"), timeout=2).json()["engines"]
        if detail[name]["status"] == "down":
            return time.monotonic() - killed
        time.sleep(0.01)
    return float("inf")


def run_fleet(
    workdir: Path, window_s: float, progress: Callable[[str], None] = print
) -> FleetResult:
    """The whole section: warm-up, the measured window, then the two kills."""
    sessions = [
        _Session(
            t,
            f"s{n}",
            [
                {"role": "system", "content": _words(SYSTEM_WORDS, f"{t}s{n}")},
                {"role": "user", "content": _words(USER_WORDS, "u")},
            ],
        )
        for t, n in itertools.product(TENANTS, range(SESSIONS))
    ]
    with fleet_stack(workdir) as (sims, gw):
        progress(f"fleet: {len(sessions)} sessions on {ENGINES} engines, window {window_s:g} s")

        async def load() -> tuple[int, float, float]:
            stop = asyncio.Event()
            runner = asyncio.create_task(_run_sessions(gw, sessions, stop))
            await asyncio.sleep(5.0)  # every session placed, the backlog built
            start = time.time()
            await asyncio.sleep(window_s)
            end = time.time()
            stop.set()
            return await runner, start, end

        errors, start, end = asyncio.run(load())
        time.sleep(1.0)
        figures = analyse(_records(sims), start, end)
        progress("fleet: killing an engine under a session")
        failover_s, victim, by = asyncio.run(_failover(gw, sims, sessions))
        progress("fleet: stopping (SIGSTOP) an engine under a session")
        skip = next(s.key for s in sessions if _home_of(_records(sims)).get(s.key))
        from tests.perf.fleet_hang import hang  # it reads this module's sessions

        hang_s, hung, hang_by, hang_out_s, hang_back_s = asyncio.run(hang(gw, sims, sessions, skip))
        other = next(i for i, s in enumerate(sims) if s.proc.poll() is None)
        detect_s = _detect(gw, sims[other], f"e{other}")
    return FleetResult(
        window_s=end - start,
        failover_s=failover_s,
        failover_from=victim,
        failover_engine=by,
        detect_s=detect_s,
        hang_s=hang_s,
        hang_from=hung,
        hang_engine=hang_by,
        hang_out_s=hang_out_s,
        hang_back_s=hang_back_s,
        errors=errors,
        **figures,
    )


def fleet_report(result: FleetResult) -> list[str]:
    """The section's lines for the benchmark report."""
    return [
        f"{ENGINES} simulator engines at {RATE:g} tokens/s, one slot each; {len(TENANTS)} tenants x "
        f"{SESSIONS} agent sessions (turns back to back, prompts growing by ~"
        f"{ANSWER_TOKENS + USER_WORDS} tokens a turn, {ANSWER_TOKENS}-token answers); "
        f"window {result.window_s:.0f} s, {result.turns} turns, {result.errors} failed.",
        "",
        "| engine | busy | most in flight | turns served |",
        "| --- | --- | --- | --- |",
        *(
            f"| {name} | {result.busy_by_engine[name]:.1%} | {result.max_in_flight[name]} | "
            f"{result.served_by_engine[name]} |"
            for name in sorted(result.busy_by_engine)
        ),
        "",
        "Tokens by tenant: " + ", ".join(f"{t} {v:,.0f}" for t, v in sorted(result.tokens.items())),
        f"Sessions moved: {result.moved} of {result.follow_ups} follow-up turns.",
        "",
        *result.verdicts(),
    ]
