"""The engine's own token counters around one request: the exact charge of a request cut short.

A stream cut short (the client gone, the engine dropped, a drain, a time limit) has no final
usage. The running usage on each chunk (`gateway.sse.RunningUsage`) says what was *streamed*;
the engine generated more: it goes on generating, and counting, tokens its API server has not
streamed yet until the abort lands. While the gateway holds the engine's only slot
(``engine.max_concurrency = 1``, the default) the engine's cumulative counters are the
request's own, so reading them before the request is sent and again once the abort has landed
gives exactly what it generated:

- ``vllm:generation_tokens_total`` and ``vllm:prompt_tokens_total`` (vLLM docs, "Production
  Metrics"), read from the engine's ``/metrics`` over its socket (`Upstream.metrics_text`);
- "landed": ``vllm:num_requests_running`` plus ``vllm:num_requests_waiting`` is 0 and the
  counters are unchanged over two reads at least `SETTLE_MIN_S` after the cut (vLLM stops
  counting a request's tokens when its API server aborts it, before the engine core reports it
  no longer running), or `SETTLE_BOUND_S` passed (then the latest reading, still at least what
  was streamed).

The counters are not the request's own when the engine restarted in between (they start
again from 0: a counter lower than before, another ``vllm:generation_tokens_created``) or did
not answer; the caller then falls back to the streamed usage. With ``max_concurrency > 1`` no
baseline is taken: several requests share the counters.

The "before" reading is off the request path (`IdleCounters`): with one slot nothing but the
gateway's own requests moves the engine's counters, so a reading taken while no request is at
the engine (after the previous one gave its slot back) is the next request's baseline. A reading
still under way when the next request is granted is not waited for: the request is sent at once
and the reading finishes beside it (`IdleCounters.baseline_at_once`). It is still the state
before the request: its ``GET /metrics`` was sent while no request was at the engine, before the
request's POST, and vLLM counts a request's tokens only after an engine step has run it, while
it counts as running; a reading that shows anything running or waiting is not used. The request
path reads the counters itself only when there is no idle reading since the previous grant (the
first request, or the queue granted it the slot straight from the previous one).

Most requests end complete, with the engine's final usage: the counters after such a request
are the ones before it plus that usage (vLLM adds each request's prompt and output token counts
to the two counters), so the next request's baseline is that sum, not another ``GET /metrics``
(`IdleCounters.advance`). The sums are checked against a reading at first and then once in
`SUM_CHECK_EVERY`; one that differs (an engine counting otherwise, or another client of the
engine) stops them for good. Between two checks a foreign client's tokens would go unseen by
the sums; with the engine's only slot held by the gateway there is none.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gateway.upstream import Upstream

log = structlog.get_logger("gateway.counters")

SETTLE_BOUND_S = 2.0
"""Longest wait after a cut for the engine's abort to land (the slot stays held meanwhile)."""
SETTLE_MIN_S = 0.1
"""Shortest wait after a cut: the engine's API server has noticed the closed connection."""
SETTLE_POLL_S = 0.02
"""Pause between two reads of the engine's /metrics while waiting for the abort."""
BASELINE_TIMEOUT_S = 0.5
"""Longest wait for the engine's /metrics before a request is sent (then no baseline)."""
SUM_CHECK_EVERY = 16
"""Of the readings replaced by sums (`IdleCounters.advance`), one in this many is still read
and compared with its sum."""

_NAMES = {
    b"vllm:prompt_tokens_total": "prompt",
    b"vllm:generation_tokens_total": "generation",
    b"vllm:num_requests_running": "busy",
    b"vllm:num_requests_waiting": "busy",
    b"vllm:generation_tokens_created": "created",
}


@dataclass(frozen=True)
class EngineCounters:
    """One reading of the engine's counters.

    Attributes:
        prompt_tokens: ``vllm:prompt_tokens_total`` summed over engines (tokens).
        generation_tokens: ``vllm:generation_tokens_total`` summed over engines (tokens).
        busy: ``vllm:num_requests_running`` plus ``vllm:num_requests_waiting`` (requests).
        created: ``vllm:generation_tokens_created``, when the counter was created (Unix
            seconds; a restarted engine has a later one), or None when not exported.
    """

    prompt_tokens: float
    generation_tokens: float
    busy: float
    created: float | None = None

    def same_engine(self, before: EngineCounters) -> bool:
        """False when the engine restarted since ``before`` (counters start again from 0)."""
        if self.created != before.created:
            return False
        return (
            self.prompt_tokens >= before.prompt_tokens
            and self.generation_tokens >= before.generation_tokens
        )


@dataclass(frozen=True)
class Baseline:
    """The counters before a request that holds the engine's only slot.

    Attributes:
        counters: the reading.
        grants: `gateway.admission.AdmissionQueue.grants` then; another grant before the
            request ends means the engine was shared and the delta is not its own.
    """

    counters: EngineCounters
    grants: int


@dataclass(frozen=True)
class Generated:
    """Tokens the engine counted between two readings (prompt, generated)."""

    prompt_tokens: int
    completion_tokens: int


def parse_counters(text: str) -> EngineCounters | None:
    """The counters in a Prometheus text exposition, or None when a token counter is missing.

    Only the few sample lines needed are read (``name{labels} value``), by their prefix: a
    real vLLM scrape has some 70 families and is read on every request.
    """
    values = {"prompt": 0.0, "generation": 0.0, "busy": 0.0}
    found: set[str] = set()
    created: float | None = None
    for line in text.encode().splitlines():
        if not line or line[0] not in b"vp":
            continue
        end = line.find(b"{")
        if end < 0:
            end = line.find(b" ")
        key = _NAMES.get(line[:end])
        if key is None:
            continue
        try:
            value = float(line.rsplit(b" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if key == "created":
            created = value if created is None else max(created, value)
            continue
        values[key] += value
        found.add(key)
    if "prompt" not in found or "generation" not in found:
        return None
    return EngineCounters(values["prompt"], values["generation"], values["busy"], created)


async def read_counters(upstream: Upstream, timeout: float) -> EngineCounters | None:
    """The engine's counters now, None when it did not answer in ``timeout`` seconds."""
    text = await upstream.metrics_text(timeout=timeout)
    return parse_counters(text) if text is not None else None


async def settled_counters(
    upstream: Upstream,
    before: EngineCounters,
    *,
    bound_s: float = SETTLE_BOUND_S,
    clock: Callable[[], float] = time.monotonic,
) -> EngineCounters | None:
    """The engine's counters once the abort of a cut request has landed (see the module doc).

    Returns None when the engine did not answer or restarted since ``before``; after
    ``bound_s`` seconds the latest reading, even if the engine still reports work.
    """
    began = clock()
    deadline = began + bound_s
    previous: EngineCounters | None = None
    while True:
        left = deadline - clock()
        now = await read_counters(upstream, timeout=max(0.05, min(1.0, left)))
        if now is None or not now.same_engine(before):
            return None
        stable = (
            previous is not None
            and previous.busy == 0
            and now.busy == 0
            and previous.prompt_tokens == now.prompt_tokens
            and previous.generation_tokens == now.generation_tokens
        )
        if (stable and clock() - began >= SETTLE_MIN_S) or clock() >= deadline:
            return now
        previous = now
        await asyncio.sleep(SETTLE_POLL_S)


def generated(before: EngineCounters, after: EngineCounters) -> Generated:
    """Tokens counted from ``before`` to ``after`` (same engine, `EngineCounters.same_engine`)."""
    return Generated(
        prompt_tokens=max(0, round(after.prompt_tokens - before.prompt_tokens)),
        completion_tokens=max(0, round(after.generation_tokens - before.generation_tokens)),
    )


class IdleCounters:
    """The engine's counters read while it had no request from the gateway (one slot only).

    `refresh` starts one background reading when the last request gave the slot back; `baseline`
    gives the request just granted the slot (grant number ``grants``) a reading taken after the
    previous grant's request ended, waiting for one under way, or reads the counters itself.
    Readings whose ``busy`` is not 0 are not kept (the engine still works on something).

    Args:
        upstream: the engine boundary (its ``/metrics``).
        timeout: longest wait for one reading (seconds).
    """

    def __init__(self, upstream: Upstream, timeout: float = BASELINE_TIMEOUT_S) -> None:
        self._upstream = upstream
        self._timeout = timeout
        self._latest: Baseline | None = None
        self._reading: asyncio.Task[Baseline | None] | None = None
        self._summable: bool | None = None  # sums matched readings (None: not compared yet)
        self._sums = 0
        self._expected: Baseline | None = None

    def refresh(self, grants: int) -> None:
        """Read the counters in the background; ``grants`` is the admission queue's grant count
        now, with no request at the engine."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read(grants))

    def advance(self, baseline: Baseline, prompt_tokens: int, completion_tokens: int) -> None:
        """The request granted as number ``baseline.grants`` ended complete, the engine's final
        usage ``prompt_tokens`` and ``completion_tokens`` (one sequence), nothing at the engine
        since: the counters after it are ``baseline`` plus that usage, without a reading.

        vLLM adds a request's prompt and output token counts to ``vllm:prompt_tokens_total`` and
        ``vllm:generation_tokens_total``; whether an engine does is checked, not assumed: the
        first sum, and one in `SUM_CHECK_EVERY` after it, is read as well (`refresh`) and
        compared; sums are kept only while they match, and one difference (an engine that
        counts otherwise) stops them for good (logged ``engine_counters_not_summable``).
        """
        counters = baseline.counters
        after = EngineCounters(
            counters.prompt_tokens + prompt_tokens,
            counters.generation_tokens + completion_tokens,
            0.0,
            counters.created,
        )
        self._sums += 1
        if self._summable and self._sums % SUM_CHECK_EVERY:
            self._latest = Baseline(after, baseline.grants)
            return
        if self._summable is not False:
            self._expected = Baseline(after, baseline.grants)
        self.refresh(baseline.grants)

    def keep(self, counters: EngineCounters, grants: int) -> None:
        """Keep ``counters`` read at the end of the request granted as number ``grants`` (its
        abort landed, the slot still held) when the engine was idle."""
        if counters.busy == 0:
            self._latest = Baseline(counters, grants)

    async def close(self) -> None:
        """Stop a reading under way (the gateway shuts down)."""
        if self._reading is not None and not self._reading.done():
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading

    def forget(self) -> None:
        """Drop the kept reading (the engine changed state: restarted, down)."""
        self._latest = None

    async def baseline(self, grants: int) -> Baseline | None:
        """The counters before the request granted as number ``grants``, or None.

        A kept reading taken after grant ``grants - 1`` ended, or one under way (awaited, not
        cancelled with the caller), else a fresh reading (`read_counters`); None when the
        engine did not answer or was busy.
        """
        reading = self._reading
        if reading is not None and not reading.done():
            await asyncio.shield(reading)
        latest = self._latest
        if latest is not None and latest.grants == grants - 1:
            return Baseline(latest.counters, grants)
        counters = await read_counters(self._upstream, timeout=self._timeout)
        if counters is None or counters.busy != 0:
            return None
        return Baseline(counters, grants)

    async def baseline_at_once(
        self, grants: int
    ) -> Baseline | asyncio.Future[Baseline | None] | None:
        """As `baseline`, but a reading under way is returned unfinished (a future of its
        `Baseline` or None) instead of waited for, so the request is sent beside it."""
        reading = self._reading
        if reading is not None and not reading.done():
            return asyncio.ensure_future(self._after(reading, grants))
        return await self.baseline(grants)

    async def _after(
        self, reading: asyncio.Future[Baseline | None], grants: int
    ) -> Baseline | None:
        result = await asyncio.shield(reading)
        if result is None or result.grants != grants - 1:
            return None
        return Baseline(result.counters, grants)

    async def _read(self, grants: int) -> Baseline | None:
        expected, self._expected = self._expected, None
        counters = await read_counters(self._upstream, timeout=self._timeout)
        if counters is None or counters.busy != 0:
            return None
        if expected is not None and expected.grants == grants and self._summable is not False:
            sums = expected.counters
            if (sums.prompt_tokens, sums.generation_tokens, sums.created) == (
                counters.prompt_tokens,
                counters.generation_tokens,
                counters.created,
            ):
                self._summable = True
            else:
                self._summable = False
                log.warning(
                    "engine_counters_not_summable",
                    summed=[sums.prompt_tokens, sums.generation_tokens],
                    read=[counters.prompt_tokens, counters.generation_tokens],
                )
        self._latest = Baseline(counters, grants)
        return self._latest
