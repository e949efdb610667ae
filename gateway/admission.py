"""The admission queue: a bounded number of requests at the engine, the others wait fairly."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from enum import Enum

from gateway.errors import EngineUnavailable, GatewayError, RateLimited, retry_after_header
from gateway.metrics import Metrics

SERVICE_EWMA_ALPHA = 0.2
"""Weight of the newest request's engine time in the moving average behind the drain rate."""

DEFAULT_SERVICE_S = 30.0
"""Assumed engine time per request until one has been measured: about 900 tokens at the ~30
tokens/s one V100 generates."""

# Cancelled waiters stay in their tenant's line until they reach its head; past this many dead
# entries (and more dead than live) the line is rebuilt, so a storm of cancellations cannot grow
# it without bound.
_LINE_SLACK = 64


class _State(Enum):
    WAITING = "waiting"
    GRANTED = "granted"
    DONE = "done"


class Ticket:
    """One request's place at the engine: granted at once, or waiting in the queue.

    Always call `release` in a ``finally``; it is idempotent and correct in every state.
    """

    __slots__ = (
        "_alarm",
        "_error",
        "_queue",
        "_state",
        "background",
        "behind_own",
        "cost",
        "enqueued_at",
        "granted_at",
        "label",
        "seq",
        "start",
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
        seq: int,
    ) -> None:
        self._queue = queue
        self._state = _State.WAITING
        self._alarm: asyncio.Future[None] | None = None
        self._error: GatewayError | None = None
        self.tenant = tenant
        self.label = label
        self.weight = weight
        self.cost = cost
        self.seq = seq
        self.start = 0.0
        self.behind_own = False
        self.background = False
        self.enqueued_at = enqueued_at
        self.granted_at: float | None = None

    @property
    def granted(self) -> bool:
        """True while the ticket holds an engine slot."""
        return self._state is _State.GRANTED

    @property
    def released(self) -> bool:
        """True once the ticket was released (or failed by a closed queue)."""
        return self._state is _State.DONE

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
        if self.granted:
            return True
        if self.released:
            raise RuntimeError("ticket already released")
        queue = self._queue
        loop = asyncio.get_running_loop()
        start = queue.clock()
        try:
            while True:
                if self._state is _State.GRANTED:
                    return True
                if self._state is _State.DONE:
                    if self._error is not None:
                        raise self._error  # the queue was closed by `close`
                    raise RuntimeError("ticket released while waiting")
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
                # One future per wait, rung by the grant itself (the task resumes on the next
                # turn of the loop), by a reload, a release from elsewhere, or this timer.
                alarm = self._alarm = loop.create_future()
                timer = loop.call_later(timeout, _ring, alarm)
                try:
                    await alarm
                finally:
                    timer.cancel()
                    self._alarm = None
        except asyncio.CancelledError:
            self.release()
            raise

    def _ring(self) -> None:
        """Wake the task waiting on this ticket, if any."""
        if self._alarm is not None:
            _ring(self._alarm)

    def release(self, used: int | None = None) -> None:
        """Give the place or slot back and grant the next ticket; idempotent, never raises.

        Args:
            used: tokens the request actually cost at the engine (prompt plus completion; 0 if
                it never reached it); the tenant's share is charged this instead of the
                reservation. None keeps the reservation as the charge.
        """
        state = self._state
        self._state = _State.DONE
        if state is _State.WAITING:
            self._queue._forget(self)
        elif state is _State.GRANTED:
            self._queue._finish(self, used)


def _ring(alarm: asyncio.Future[None]) -> None:
    if not alarm.done():
        alarm.set_result(None)


class _Tenant:
    """A tenant's waiters (first come, first served; its background requests in a line of their
    own, served when no interactive one waits) and its virtual finish time ``finish``: the
    weighted tokens it was charged since the queue was last idle, lifted to the virtual time
    whenever it starts waiting anew."""

    __slots__ = ("finish", "later", "live", "waiters", "weight")

    def __init__(self, weight: float) -> None:
        self.waiters: deque[Ticket] = deque()
        self.later: deque[Ticket] = deque()
        self.live = 0
        self.weight = weight
        self.finish = 0.0

    def lines(self) -> tuple[deque[Ticket], deque[Ticket]]:
        """The interactive line, then the background line."""
        return self.waiters, self.later

    def head(self) -> deque[Ticket]:
        """The line whose first entry is served next (dead entries dropped first)."""
        for line in self.lines():
            while line and line[0]._state is not _State.WAITING:
                line.popleft()
            if line:
                return line
        raise AssertionError("a waiting tenant has a live waiter")


class AdmissionQueue:
    """Weighted fair admission to an engine that runs ``max_concurrency`` requests at once.

    A request is granted at once while a slot is free and nobody waits. Otherwise it waits in
    its tenant's first-come-first-served line, and a freed slot goes to the head of the line of
    the waiting tenant with the smallest virtual finish time (start-time fair queueing: Goyal,
    Vin and Cheng, "Start-time Fair Queueing", SIGCOMM 1996), ties to the earliest arrival.
    Granting charges the tenant ``cost / weight`` (its token reservation); when the request
    ends the charge is corrected to the tokens it actually used (prompt plus completion), as the
    virtual token counter of Sheng et al., "Fairness in Serving Large Language Models" (OSDI
    2024) counts served tokens. So a tenant of 8k-token answers gets the same tokens per unit of
    weight as one of 100-token answers, and a tenant that sets no ``max_tokens`` (reserving the
    whole default budget) is not pushed back for tokens it never uses. A tenant that starts
    waiting is lifted to the virtual time (the start of the latest grant), so idling banks no
    credit, and a short request arriving behind another tenant's backlog is served right after
    the request running now. Choosing the next tenant scans the waiting tenants: a handful.

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
        self._grants = 0
        self._depth = 0
        self._seq = itertools.count()
        self._vtime = 0.0
        # Every tenant charged since the queue was last idle; those with live waiters; their
        # total weight.
        self._tenants: dict[str, _Tenant] = {}
        self._waiting: dict[str, _Tenant] = {}
        self._total_weight = 0.0
        self._service_s: float | None = None
        self._closed: Callable[[], GatewayError] | None = None
        metrics.queue_depth.set(0)

    @property
    def in_flight(self) -> int:
        """Tickets holding an engine slot."""
        return self._in_flight

    @property
    def grants(self) -> int:
        """Slots granted since the queue was made (a request that saw no other grant while it
        held the only slot had the engine to itself)."""
        return self._grants

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

    def enqueue(
        self,
        tenant: str,
        weight: float,
        cost: int,
        *,
        label: str | None = None,
        background: bool = False,
    ) -> Ticket:
        """Ask for an engine slot for one request.

        Args:
            tenant: tenant name (fairness is per name).
            weight: the tenant's ``weight`` (> 0).
            cost: the request's token reservation (prompt estimate plus output budget).
            label: the tenant's metrics label (`Settings.tenant_label`); the name when None.
            background: the request said it is background work (a chat UI's title or tags):
                it waits behind its own tenant's interactive requests; across tenants nothing
                changes.

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
        ticket = Ticket(self, tenant, label or tenant, weight, cost, now, next(self._seq))
        ticket.background = background
        if self._in_flight < self.max_concurrency and self._depth == 0:
            state = self._tenant(tenant, weight)
            self._grant(ticket, state, max(state.finish, self._vtime), now)
            return ticket
        if self._depth >= self.queue_size:
            ticket._state = _State.DONE
            entry = self._waiting.get(tenant)
            held = entry.live if entry is not None else 0
            others = self._total_weight - (entry.weight if entry is not None else 0.0)
            at_share = held > 0 and held >= self.queue_size * weight / (others + weight)
            raise self._refusal(
                ticket, f"The queue is full ({self.queue_size} requests waiting)", at_share
            )
        state = self._tenant(tenant, weight)
        if state.live == 0:
            state.finish = max(state.finish, self._vtime)
            self._waiting[tenant] = state
            self._total_weight += weight
        elif state.weight != weight:
            self._total_weight += weight - state.weight
        state.weight = weight
        state.live += 1
        (state.later if background else state.waiters).append(ticket)
        self._depth += 1
        # Waiting behind its own tenant's backlog of at least its weighted share of the queue:
        # if this request times out, that backlog is the cause (429), not the engine (503).
        ticket.behind_own = (
            state.live >= 2 and state.live >= self._depth * weight / self._total_weight
        )
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
        for state in list(self._waiting.values()):
            for line in state.lines():
                for ticket in line:
                    if ticket._state is not _State.WAITING:
                        continue
                    ticket._state = _State.DONE
                    ticket._error = error()
                    ticket._ring()
                    failed += 1
                line.clear()
            state.live = 0
        self._waiting.clear()
        self._total_weight = 0.0
        self._depth = 0
        self._metrics.queue_depth.set(0)
        self._idle_check()
        return failed

    def reconfigure(self, max_concurrency: int, queue_size: int, queue_timeout_s: float) -> None:
        """Apply reloaded ``[engine]`` values; waiters keep their places and see the new timeout.

        A smaller queue refuses newcomers until it has drained below the new size; a larger
        ``max_concurrency`` grants waiters at once.
        """
        self.max_concurrency = max_concurrency
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        for state in self._waiting.values():
            for line in state.lines():
                for ticket in line:
                    ticket._ring()  # waiters recompute their deadlines
        self._dispatch()

    def _tenant(self, tenant: str, weight: float) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(weight)
        return state

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
        ticket._ring()
        state = self._tenants[ticket.tenant]
        self._leave(ticket.tenant, state)
        if len(state.waiters) + len(state.later) > 2 * state.live + _LINE_SLACK:
            state.waiters = deque(t for t in state.waiters if t._state is _State.WAITING)
            state.later = deque(t for t in state.later if t._state is _State.WAITING)
        self._metrics.queue_depth.set(self._depth)
        self._idle_check()

    def _finish(self, ticket: Ticket, used: int | None) -> None:
        """Free a granted ticket's slot, learn its engine time, charge what it used, and grant
        the next waiter."""
        self._in_flight -= 1
        if ticket.granted_at is not None:
            sample = max(0.0, self.clock() - ticket.granted_at)
            old = self._service_s
            self._service_s = sample if old is None else old + SERVICE_EWMA_ALPHA * (sample - old)
        state = self._tenants.get(ticket.tenant)
        if used is not None and state is not None:
            state.finish += (max(0, used) - ticket.cost) / ticket.weight
        self._dispatch()

    def _grant(self, ticket: Ticket, state: _Tenant, start: float, now: float) -> None:
        """Give ``ticket`` a slot at virtual ``start``; its tenant is charged its reservation."""
        ticket._state = _State.GRANTED
        ticket.granted_at = now
        ticket.start = start
        self._vtime = max(self._vtime, start)
        state.finish = start + ticket.cost / ticket.weight
        self._in_flight += 1
        self._grants += 1
        self._metrics.queue_wait.labels(ticket.label).observe(now - ticket.enqueued_at)

    def _dispatch(self) -> None:
        """Grant waiters while slots are free: the head of the line of the waiting tenant with
        the smallest virtual finish time, ties to the earliest arrival."""
        while self._in_flight < self.max_concurrency and self._depth > 0:
            best: deque[Ticket] | None = None
            best_state: _Tenant | None = None
            best_key = (0.0, 0)
            for state in self._waiting.values():
                line = state.head()
                key = (state.finish, line[0].seq)
                if best is None or key < best_key:
                    best, best_state, best_key = line, state, key
            assert best is not None and best_state is not None
            ticket = best.popleft()
            self._leave(ticket.tenant, best_state)
            self._grant(ticket, best_state, best_state.finish, self.clock())
            ticket._ring()
        self._metrics.queue_depth.set(self._depth)
        self._idle_check()

    def _leave(self, tenant: str, state: _Tenant) -> None:
        """One of the waiters of ``tenant`` (``state``) left the queue (granted or gone)."""
        state.live -= 1
        self._depth -= 1
        if state.live <= 0:
            state.waiters.clear()
            state.later.clear()
            del self._waiting[tenant]
            self._total_weight -= state.weight

    def _idle_check(self) -> None:
        """Nobody waits and nothing runs: the next busy period starts at virtual time 0 (virtual
        times only order waiters)."""
        if self._depth == 0 and self._in_flight == 0:
            self._total_weight = 0.0
            self._vtime = 0.0
            self._tenants.clear()
            self._waiting.clear()

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
            others = self._total_weight - (entry.weight if entry is not None else 0.0)
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
