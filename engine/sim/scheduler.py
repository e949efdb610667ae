"""Admission into the simulated engine: `--max-num-seqs` slots, and the metrics of each request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from engine.sim.metrics import SimMetrics


class Slot:
    """One admitted request: counts its tokens and ends exactly once with a finish reason."""

    def __init__(self, scheduler: Scheduler, prompt_tokens: int, arrival: float) -> None:
        self._scheduler = scheduler
        self._arrival = arrival
        self.kv_tokens = prompt_tokens
        self.generated = 0
        self.finish_reason: str | None = None

    def token(self) -> None:
        """Account one generated token (the first one also observes time to first token)."""
        metrics = self._scheduler.metrics
        if self.generated == 0:
            metrics.ttft.observe(time.monotonic() - self._arrival)
        self.generated += 1
        self.kv_tokens += 1
        metrics.generation_tokens.inc()
        self._scheduler.kv_add(1)

    def finish(self, reason: str) -> None:
        """End the request with a vLLM finish reason (stop, length, abort, error); once only."""
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        metrics = self._scheduler.metrics
        metrics.finished(reason)
        metrics.e2e.observe(time.monotonic() - self._arrival)


class Scheduler:
    """At most `max_num_seqs` sequences generate at once; the others wait, as in vLLM's engine
    (each choice of an `n` > 1 request is a sequence of its own).

    Keeps `vllm:num_requests_running`, `vllm:num_requests_waiting` and
    `vllm:kv_cache_usage_perc` (tokens held by running requests / `kv_cache_tokens`).
    """

    def __init__(self, metrics: SimMetrics, max_num_seqs: int, kv_cache_tokens: int) -> None:
        self.metrics = metrics
        self._slots = asyncio.Semaphore(max_num_seqs)
        self._kv_capacity = kv_cache_tokens
        self._kv_used = 0
        self.running = 0  # sequences generating now

    def kv_add(self, tokens: int) -> None:
        """Change the KV cache tokens in use by `tokens` and publish the fill ratio."""
        self._kv_used += tokens
        self.metrics.kv_usage.set(min(1.0, self._kv_used / self._kv_capacity))

    @asynccontextmanager
    async def admit(self, prompt_tokens: int, arrival: float) -> AsyncIterator[Slot]:
        """Wait for a free slot, then hold it; `arrival` is the request's `time.monotonic()`.

        A request that leaves without `Slot.finish` (cancelled or a failed write: the client went
        away, or the server stops) is counted as `abort` (the fork's behaviour; vLLM 0.32 no
        longer counts aborts in `vllm:request_success_total`); one that raised anything else as
        `error`.
        """
        metrics = self.metrics
        metrics.waiting.inc()
        try:
            await self._slots.acquire()
        finally:
            metrics.waiting.dec()
        slot = Slot(self, prompt_tokens, arrival)
        metrics.running.inc()
        self.running += 1
        metrics.prompt_tokens.inc(prompt_tokens)
        self.kv_add(prompt_tokens)
        try:
            yield slot
        except ConnectionError:
            slot.finish("abort")
            raise
        except Exception:
            slot.finish("error")
            raise
        finally:
            slot.finish("abort")
            self.kv_add(-slot.kv_tokens)
            metrics.running.dec()
            self.running -= 1
            self._slots.release()
