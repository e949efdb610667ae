"""The admission queue: a bounded number of requests at the engine, the others wait fairly."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from enum import Enum

from gateway.errors import EngineUnavailable, GatewayError, RateLimited, retry_after_header
from gateway.metrics import Metrics

SERVICE_EWMA_ALPHA = 0.2
"""Weight of the newest request's engine time in the moving average behind the drain rate."""

DEFAULT_SERVICE_S = 30.0
"""Assumed engine time per request until one has been measured: about 900 tokens at the ~30
tokens/s one V100 generates."""

# Cancelled waiters stay in the heap until popped; past this many dead entries (and more dead than
# live) the heap is rebuilt, so a storm of cancellations cannot grow it without bound.
_HEAP_SLACK = 64


class _State(Enum):
    WAITING = "waiting"
    GRANTED = "granted"
    DONE = "done"


class Ticket:
    """One request's place at the engine: granted at once, or waiting in the queue.

    Always call `release` in a ``finally``; it is idempotent and correct in every state.
    """

    __slots__ = (
        "_future",
        "_queue",
        "_state",
        "behind_own",
        "cost",
        "enqueued_at",
        "granted_at",
        "label",
        "tag",
        "tenant",
        "weight",
    )

    def __init__(
        self,
        queue: AdmissionQueue,
        tenant: str,
        label: str,
        weight: float,
        cost: int,
        enqueued_at: float,
    ) -> None:
        self._queue = queue
        self._state = _State.WAITING
        self._future: asyncio.Future[None] | None = None
        self.tenant = tenant
        self.label = label
        self.weight = weight
        self.cost = cost
        self.tag = 0.0
        self.behind_own = False
        self.enqueued_at = enqueued_at
        self.granted_at: float | None = None

    @property
    def granted(self) -> bool:
        """True while the ticket holds an engine slot."""
        return self._state is _State.GRANTED

    @property
    def waited_s(self) -> float:
        """Seconds spent in the queue: until granted, or until now while still waiting."""
        end = self.granted_at if self.granted_at is not None else self._queue.clock()
        return max(0.0, end - self.enqueued_at)

    async def wait(self, max_wait: float | None = None) -> bool:
        """Wait for the slot.

        Args:
            max_wait: seconds to wait at most in this call; None waits until granted or timed out.

        Returns:
            True once granted; False if ``max_wait`` passed and the ticket is still queued (call
            again to keep waiting; the app sends ``: queued`` SSE comments in between).

        Raises:
            RateLimited: ``queue``, when ``engine.queue_timeout_s`` since `AdmissionQueue.enqueue`
                passed and this request queued behind its own tenant's earlier waiters, at least
                two and at least the tenant's weighted share of the queue then.
            EngineUnavailable: the same timeout otherwise (the engine is saturated overall).
            GatewayError: the queue was closed (`AdmissionQueue.close`) while waiting: the
                closing error, e.g. 503 during a shutdown.
            RuntimeError: the ticket was released (before or during the wait).
            asyncio.CancelledError: passed on, after giving the place (or slot) back.
        """
        if self._state is _State.GRANTED:
            return True
        if self._state is _State.DONE:
            raise RuntimeError("ticket already released")
        queue = self._queue
        future = self._future
        assert future is not None
        start = queue.clock()
        try:
            while True:
                now = queue.clock()
                remaining = self.enqueued_at + queue.queue_timeout_s - now
                if remaining <= 0:
                    raise queue._expire(self)
                timeout = remaining
                if max_wait is not None:
                    left = start + max_wait - now
                    if left <= 0:
                        return False
                    timeout = min(timeout, left)
                await asyncio.wait(
                    (future, queue._reloaded()),
                    timeout=timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if future.done():
                    if future.cancelled():
                        raise RuntimeError("ticket released while waiting")
                    future.result()  # raises the error of a queue closed by `close`
                    return True
        except asyncio.CancelledError:
            self.release()
            raise

    def release(self) -> None:
        """Give the place or slot back and grant the next ticket; idempotent, never raises."""
        state = self._state
        self._state = _State.DONE
        if state is _State.WAITING:
            self._queue._forget(self)
        elif state is _State.GRANTED:
            self._queue._finish(self)


class AdmissionQueue:
    """Weighted fair admission to an engine that runs ``max_concurrency`` requests at once.

    A request is granted at once while a slot is free and nobody waits. Otherwise it waits, and
    slots go to waiters by self-clocked weighted fair queueing (Golestani, 1994) on tokens: a
    ticket's tag is ``max(virtual time, the tenant's previous tag) + cost / weight``, the smallest
    tag is granted next, and virtual time becomes its tag. A tenant's tags only grow, so its own
    requests stay in order; a tenant of 8k-token requests gets the same tokens per unit of weight
    as one of 100-token requests, so it cannot crowd the other out.

    Args:
        max_concurrency: requests at the engine at once (``engine.max_concurrency``).
        queue_size: requests waiting, all tenants together (``engine.queue_size``).
        queue_timeout_s: longest wait from `enqueue` (``engine.queue_timeout_s``).
        metrics: ``gateway_queue_depth``, ``gateway_queue_wait_seconds``,
            ``gateway_rate_limited_total{limit="queue"}``.
        clock: monotonic seconds (measurements and deadlines).
    """

    def __init__(
        self,
        max_concurrency: int,
        queue_size: int,
        queue_timeout_s: float,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_concurrency = max_concurrency
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.clock = clock
        self._metrics = metrics
        self._in_flight = 0
        self._depth = 0
        self._heap: list[tuple[float, int, Ticket]] = []
        self._seq = itertools.count()
        self._vtime = 0.0
        self._last_tag: dict[str, float] = {}
        # tenant -> [tickets waiting, weight]; only tenants with waiters; and their total weight.
        self._waiting: dict[str, list[float]] = {}
        self._total_weight = 0.0
        self._service_s: float | None = None
        self._reload_future: asyncio.Future[None] | None = None
        self._closed: Callable[[], GatewayError] | None = None
        metrics.queue_depth.set(0)

    @property
    def in_flight(self) -> int:
        """Tickets holding an engine slot."""
        return self._in_flight

    @property
    def depth(self) -> int:
        """Tickets waiting for a slot."""
        return self._depth

    @property
    def drain_rate(self) -> float:
        """Requests the engine completes per second when saturated, from measured engine times.

        ``max_concurrency / average engine time``, the average an EWMA (alpha 0.2) of
        grant-to-release durations; `DEFAULT_SERVICE_S` until a request has finished.
        """
        service = self._service_s if self._service_s is not None else DEFAULT_SERVICE_S
        return self.max_concurrency / max(service, 1e-3)

    def enqueue(self, tenant: str, weight: float, cost: int, *, label: str | None = None) -> Ticket:
        """Ask for an engine slot for one request.

        Args:
            tenant: tenant name (fairness is per name).
            weight: the tenant's ``weight`` (> 0).
            cost: the request's token reservation (prompt estimate plus output budget).
            label: the tenant's metrics label (`Settings.tenant_label`); the name when None.

        Returns:
            A ticket, already granted if a slot was free and nobody waited; else wait on it.

        Raises:
            RateLimited: ``queue``: the queue is full and this tenant holds at least its weighted
                share of it; Retry-After is the expected time until one of its waiters is served.
            EngineUnavailable: the queue is full with other tenants' requests; Retry-After is the
                expected time until the engine finishes one request (`drain_rate`).
            GatewayError: the queue is closed (`close`): the closing error.
        """
        if self._closed is not None:
            raise self._closed()
        now = self.clock()
        ticket = Ticket(self, tenant, label or tenant, weight, cost, now)
        if self._in_flight < self.max_concurrency and self._depth == 0:
            self._grant(ticket, now)
            return ticket
        if self._depth >= self.queue_size:
            ticket._state = _State.DONE
            entry = self._waiting.get(tenant)
            held = int(entry[0]) if entry is not None else 0
            others = self._total_weight - (entry[1] if entry is not None else 0.0)
            at_share = held > 0 and held >= self.queue_size * weight / (others + weight)
            raise self._refusal(
                ticket, f"The queue is full ({self.queue_size} requests waiting)", at_share
            )
        ticket.tag = max(self._vtime, self._last_tag.get(tenant, 0.0)) + cost / weight
        self._last_tag[tenant] = ticket.tag
        ticket._future = asyncio.get_running_loop().create_future()
        entry = self._waiting.get(tenant)
        if entry is None:
            entry = self._waiting[tenant] = [0, weight]
            self._total_weight += weight
        elif entry[1] != weight:
            self._total_weight += weight - entry[1]
            entry[1] = weight
        entry[0] += 1
        self._depth += 1
        # Waiting behind its own tenant's backlog of at least its weighted share of the queue:
        # if this request times out, that backlog is the cause (429), not the engine (503).
        ticket.behind_own = entry[0] >= 2 and entry[0] >= self._depth * weight / self._total_weight
        heapq.heappush(self._heap, (ticket.tag, next(self._seq), ticket))
        self._metrics.queue_depth.set(self._depth)
        return ticket

    def close(self, error: Callable[[], GatewayError]) -> int:
        """Stop admitting (a shutdown): every waiter fails at once with ``error()``, and so does
        every later `enqueue`; tickets holding a slot keep it until released.

        Returns:
            The number of waiters failed (they were never started).
        """
        self._closed = error
        failed = 0
        for _, _, ticket in self._heap:
            if ticket._state is not _State.WAITING:
                continue
            ticket._state = _State.DONE
            self._leave(ticket)
            if ticket._future is not None and not ticket._future.done():
                ticket._future.set_exception(error())
            failed += 1
        self._metrics.queue_depth.set(self._depth)
        self._idle()
        return failed

    def reconfigure(self, max_concurrency: int, queue_size: int, queue_timeout_s: float) -> None:
        """Apply reloaded ``[engine]`` values; waiters keep their places and see the new timeout.

        A smaller queue refuses newcomers until it has drained below the new size; a larger
        ``max_concurrency`` grants waiters at once.
        """
        self.max_concurrency = max_concurrency
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        if self._reload_future is not None and not self._reload_future.done():
            self._reload_future.set_result(None)
        self._reload_future = None
        self._dispatch()

    def _reloaded(self) -> asyncio.Future[None]:
        """A future resolved at the next `reconfigure` (waiters recompute their deadlines)."""
        if self._reload_future is None:
            self._reload_future = asyncio.get_running_loop().create_future()
        return self._reload_future

    def _expire(self, ticket: Ticket) -> RateLimited | EngineUnavailable:
        """Remove a waiter whose ``queue_timeout_s`` passed; the error to raise for it."""
        error = self._refusal(
            ticket,
            f"Waited {self.queue_timeout_s:g} s in the queue for the engine",
            ticket.behind_own,
        )
        ticket.release()
        return error

    def _forget(self, ticket: Ticket) -> None:
        """Drop a waiter that left (released, cancelled or timed out) from the queue."""
        if ticket._future is not None and not ticket._future.done():
            ticket._future.cancel()
        self._leave(ticket)
        self._metrics.queue_depth.set(self._depth)
        if self._depth == 0:
            self._idle()
        elif len(self._heap) > 2 * self._depth + _HEAP_SLACK:
            self._heap = [e for e in self._heap if e[2]._state is _State.WAITING]
            heapq.heapify(self._heap)

    def _finish(self, ticket: Ticket) -> None:
        """Free a granted ticket's slot, learn its engine time, and grant the next waiter."""
        self._in_flight -= 1
        if ticket.granted_at is not None:
            sample = max(0.0, self.clock() - ticket.granted_at)
            old = self._service_s
            self._service_s = sample if old is None else old + SERVICE_EWMA_ALPHA * (sample - old)
        self._dispatch()

    def _grant(self, ticket: Ticket, now: float) -> None:
        ticket._state = _State.GRANTED
        ticket.granted_at = now
        self._in_flight += 1
        self._metrics.queue_wait.labels(ticket.label).observe(now - ticket.enqueued_at)

    def _dispatch(self) -> None:
        """Grant waiters, smallest tag first, while slots are free."""
        while self._in_flight < self.max_concurrency and self._heap:
            tag, _, ticket = heapq.heappop(self._heap)
            if ticket._state is not _State.WAITING:
                continue
            self._vtime = tag
            self._leave(ticket)
            self._grant(ticket, self.clock())
            assert ticket._future is not None
            ticket._future.set_result(None)
        self._metrics.queue_depth.set(self._depth)
        if self._depth == 0:
            self._idle()

    def _leave(self, ticket: Ticket) -> None:
        """Take a waiting ticket out of the per-tenant counts."""
        entry = self._waiting[ticket.tenant]
        entry[0] -= 1
        if entry[0] <= 0:
            del self._waiting[ticket.tenant]
            self._total_weight -= entry[1]
        self._depth -= 1

    def _idle(self) -> None:
        """Nobody waits: the next busy period starts at virtual time 0 (tags only order waiters)."""
        self._total_weight = 0.0
        self._heap.clear()
        self._vtime = 0.0
        self._last_tag.clear()

    def _refusal(
        self, ticket: Ticket, what: str, at_share: bool
    ) -> RateLimited | EngineUnavailable:
        """429 ``queue`` if the tenant is ``at_share`` of the queue, else 503 (engine saturated).

        Retry-After: the expected time until the engine finishes one request (1 / `drain_rate`);
        for a 429, until it finishes one of this tenant's, which get ``weight / total weight`` of
        the engine while others wait.
        """
        per_request = 1.0 / self.drain_rate
        if at_share:
            self._metrics.rate_limited.labels(ticket.label, "queue").inc()
            entry = self._waiting.get(ticket.tenant)
            others = self._total_weight - (entry[1] if entry is not None else 0.0)
            wait = per_request * (others + ticket.weight) / ticket.weight
            return RateLimited(
                "queue",
                f"{what}; this tenant holds at least its weighted share of the queue. "
                f"Retry in about {retry_after_header(wait)} s.",
                wait,
            )
        return EngineUnavailable(
            f"{what}; the engine is saturated. Retry in about {retry_after_header(per_request)} s.",
            per_request,
        )
