"""The admission queue: a bounded number of requests at the engines, the others wait fairly.

One queue for every engine behind the gateway: tenant fairness is global, and each request is
granted a free slot of one engine (`gateway.placement`: health, session affinity with bounded
load), so no engine ever has more requests in flight than its slots."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from gateway.errors import (
    RETRY_AFTER_DOWN_S,
    EngineUnavailable,
    GatewayError,
    RateLimited,
    retry_after_header,
)
from gateway.metrics import Metrics
from gateway.placement import EngineSlots, place
from gateway.ticket import Ticket as Ticket
from gateway.ticket import _State

SERVICE_EWMA_ALPHA = 0.2
"""Weight of the newest request's engine time in the moving average behind the drain rate."""

DEFAULT_SERVICE_S = 30.0
"""Assumed engine time per request until one has been measured: about 900 tokens at the ~30
tokens/s one V100 generates."""

# Cancelled waiters stay in their tenant's line until they reach its head; past this many dead
# entries (and more dead than live) the line is rebuilt, so a storm of cancellations cannot grow
# it without bound.
_LINE_SLACK = 64
# Waiters of one tenant looked at for one that can be placed now (affinity may skip a head whose
# engine is busy); beyond them the tenant waits for the next release.
_PLACE_SCAN = 32


def _join(line: deque[Ticket], ticket: Ticket) -> None:
    """Put ``ticket`` in its tenant's line: a background one at the end, an interactive one
    before the tenant's first waiting background request (lines hold at most
    ``engine.queue_size`` entries)."""
    if not ticket.background:
        for index, waiter in enumerate(line):
            if waiter.background and waiter._state is _State.WAITING:
                line.insert(index, ticket)
                return
    line.append(ticket)


class _Tenant:
    """A tenant's waiters (first come, first served) and its virtual finish time ``finish``:
    the weighted tokens it was charged since the queue was last idle, lifted to the virtual
    time whenever it starts waiting anew."""

    __slots__ = ("finish", "live", "waiters", "weight")

    def __init__(self, weight: float) -> None:
        self.waiters: deque[Ticket] = deque()
        self.live = 0
        self.weight = weight
        self.finish = 0.0


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

    Several engines: a freed slot goes to the fair order's first waiter that can be placed on an
    engine with a free slot (`gateway.placement.place`: a session's own engine unless it is loaded
    beyond ``affinity_load_factor`` times the least-loaded one; only ready engines while any is);
    a tenant whose waiters all wait for their busy home engines lets the next tenant go. Each
    engine's in-flight count never exceeds its slots.

    Args:
        max_concurrency: requests at the engine at once (``engine.max_concurrency``), for one
            engine named ``default``; ignored when ``engines`` is given.
        queue_size: requests waiting, all tenants together (``engine.queue_size``).
        queue_timeout_s: longest wait from `enqueue` (``engine.queue_timeout_s``).
        metrics: ``gateway_queue_depth``, ``gateway_queue_wait_seconds``,
            ``gateway_rate_limited_total{limit="queue"}``.
        clock: monotonic seconds (measurements and deadlines).
        engines: ``(name, slots)`` of each engine, in the config's order (`Settings.engine_specs`).
        affinity_load_factor: ``engine.affinity_load_factor``.
    """

    def __init__(
        self,
        max_concurrency: int,
        queue_size: int,
        queue_timeout_s: float,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        engines: Sequence[tuple[str, int]] | None = None,
        affinity_load_factor: float = 1.5,
    ) -> None:
        pairs = engines if engines else [("default", max_concurrency)]
        self.engines: dict[str, EngineSlots] = {n: EngineSlots(n, c) for n, c in pairs}
        self.affinity_load_factor = affinity_load_factor
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
        # Read when scraped: the queue changes twice per request, a scrape comes every 15 s.
        metrics.queue_depth.set_function(lambda: self._depth)

    @property
    def max_concurrency(self) -> int:
        """Slots of all engines together."""
        total = 0
        for engine in self.engines.values():
            total += engine.slots
        return total

    @property
    def in_flight(self) -> int:
        """Tickets holding an engine slot."""
        return self._in_flight

    def set_ready(self, engine: str, ready: bool) -> None:
        """Record an engine's health (the poller's ready state); a ready engine takes waiters."""
        slots = self.engines.get(engine)
        if slots is None or slots.ready == ready:
            return
        slots.ready = ready
        if ready:
            self._dispatch()

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
        home: str | None = None,
        background: bool = False,
    ) -> Ticket:
        """Ask for an engine slot for one request.

        Args:
            tenant: tenant name (fairness is per name).
            weight: the tenant's ``weight`` (> 0).
            cost: the request's token reservation (prompt estimate plus output budget).
            label: the tenant's metrics label (`Settings.tenant_label`); the name when None.
            home: the engine holding the request's session (`gateway.affinity`), or None.
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
        ticket.home = home if home in self.engines else None
        ticket.background = background
        if self._depth == 0:
            self._home(ticket, 1)  # counted as its home's waiter while placed, as in _dispatch
            engine = place(ticket.home, ticket.avoid, self.engines, self.affinity_load_factor)
            self._home(ticket, -1)
            if engine is not None:
                state = self._tenant(tenant, weight)
                self._grant(ticket, state, max(state.finish, self._vtime), now, engine)
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
        _join(state.waiters, ticket)
        self._depth += 1
        self._home(ticket, 1)
        # Waiting behind its own tenant's backlog of at least its weighted share of the queue:
        # if this request times out, that backlog is the cause (429), not the engine (503).
        ticket.behind_own = (
            state.live >= 2 and state.live >= self._depth * weight / self._total_weight
        )
        return ticket

    def ahead_of(self, tenant: str, *, background: bool = False) -> list[Ticket]:
        """The waiters a newcomer enqueued now would be granted after, in grant order: its
        tenant's waiters before its place (`_join`) and every waiter whose virtual finish
        (its tenant's, plus the reservations of its tenant's waiters before it, per weight)
        is at most the newcomer's; nothing changes (`gateway.deadline` predicts with it)."""
        keyed: list[tuple[float, int, Ticket]] = []
        mine = self._tenants.get(tenant)
        key = max(mine.finish, self._vtime) if mine is not None else self._vtime
        if mine is not None and mine.live > 0:
            key = mine.finish
            for waiter in mine.waiters:
                if waiter._state is _State.WAITING:
                    if waiter.background and not background:
                        break
                    keyed.append((key, waiter.seq, waiter))
                    key += waiter.cost / waiter.weight
        for name, state in self._waiting.items():
            if name == tenant:
                continue
            other = state.finish
            for waiter in state.waiters:
                if waiter._state is not _State.WAITING:
                    continue
                if other > key:
                    break
                keyed.append((other, waiter.seq, waiter))
                other += waiter.cost / waiter.weight
        keyed.sort(key=lambda item: item[:2])
        return [ticket for _, _, ticket in keyed]

    def close(self, error: Callable[[], GatewayError]) -> int:
        """Stop admitting (a shutdown): every waiter fails at once with ``error()``, and so does
        every later `enqueue`; tickets holding a slot keep it until released.

        Returns:
            The number of waiters failed (they were never started).
        """
        self._closed = error
        failed = 0
        for state in list(self._waiting.values()):
            for ticket in state.waiters:
                if ticket._state is not _State.WAITING:
                    continue
                ticket._state = _State.DONE
                ticket._error = error()
                ticket._ring()
                failed += 1
            state.waiters.clear()
            state.live = 0
        self._waiting.clear()
        self._total_weight = 0.0
        self._depth = 0
        self._idle_check()
        return failed

    def reconfigure(
        self,
        max_concurrency: int | Mapping[str, int],
        queue_size: int,
        queue_timeout_s: float,
        affinity_load_factor: float | None = None,
    ) -> None:
        """Apply reloaded ``[engine]`` values; waiters keep their places and see the new timeout.

        ``max_concurrency``: the slots of the one engine, or of each engine by name (engines not
        named keep theirs; the set of engines changes only with a restart). A smaller queue
        refuses newcomers until it has drained below the new size; more slots grant waiters at
        once; fewer take effect as running requests end.
        """
        if isinstance(max_concurrency, int):
            if len(self.engines) == 1:
                next(iter(self.engines.values())).slots = max_concurrency
        else:
            for name, slots in max_concurrency.items():
                if name in self.engines:
                    self.engines[name].slots = slots
        if affinity_load_factor is not None:
            self.affinity_load_factor = affinity_load_factor
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        for state in self._waiting.values():
            for ticket in state.waiters:
                ticket._ring()  # waiters recompute their deadlines
        self._dispatch()

    def _tenant(self, tenant: str, weight: float) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(weight)
        return state

    def _expire(self, ticket: Ticket) -> RateLimited | EngineUnavailable:
        """Remove a waiter whose ``queue_timeout_s`` passed; the error to raise for it: 503
        when no engine is in rotation (the wait was the engine's absence, whatever this
        tenant's backlog), else `_refusal`."""
        what = f"Waited {self.queue_timeout_s:g} s in the queue for the engine"
        error: RateLimited | EngineUnavailable
        if not any(slots.ready for slots in self.engines.values()):
            error = EngineUnavailable(
                f"{what}, which is not available (down or restarting). Retry later.",
                RETRY_AFTER_DOWN_S,
            )
        else:
            error = self._refusal(ticket, what, ticket.behind_own)
        ticket.release()
        return error

    def _forget(self, ticket: Ticket) -> None:
        """Drop a waiter that left (released, cancelled or timed out) from the queue."""
        ticket._ring()
        self._home(ticket, -1)
        state = self._tenants[ticket.tenant]
        self._leave(ticket.tenant, state)
        waiters = state.waiters
        if len(waiters) > 2 * state.live + _LINE_SLACK:
            state.waiters = deque(t for t in waiters if t._state is _State.WAITING)
        self._idle_check()

    def _finish(self, ticket: Ticket, used: int | None) -> None:
        """Free a granted ticket's slot, learn its engine time, charge what it used, and grant
        the next waiter."""
        self._in_flight -= 1
        if ticket.engine is not None:
            self.engines[ticket.engine].in_flight -= 1
        if ticket.granted_at is not None:
            sample = max(0.0, self.clock() - ticket.granted_at)
            old = self._service_s
            self._service_s = sample if old is None else old + SERVICE_EWMA_ALPHA * (sample - old)
        state = self._tenants.get(ticket.tenant)
        if used is not None and state is not None:
            state.finish += (max(0, used) - ticket.cost) / ticket.weight
        self._dispatch()

    def _requeue(self, ticket: Ticket) -> None:
        """Put a granted ticket back at the head of its tenant's line (`Ticket.requeue`)."""
        self._in_flight -= 1
        if ticket.engine is not None:
            self.engines[ticket.engine].in_flight -= 1
        ticket.engine = None
        ticket._state = _State.WAITING
        ticket.granted_at = None
        ticket.enqueued_at = self.clock()  # a new wait, bounded by queue_timeout_s again
        state = self._tenant(ticket.tenant, ticket.weight)
        state.finish = max(0.0, state.finish - ticket.cost / ticket.weight)  # charged again
        if state.live == 0:
            state.finish = max(state.finish, self._vtime)
            self._waiting[ticket.tenant] = state
            self._total_weight += state.weight
        state.live += 1
        state.waiters = deque(t for t in state.waiters if t is not ticket)  # a stale entry
        state.waiters.appendleft(ticket)
        self._depth += 1
        self._home(ticket, 1)
        self._dispatch()

    def _home(self, ticket: Ticket, delta: int) -> None:
        """Count a waiter in (or out of) its home engine's load."""
        if ticket.home is not None:
            self.engines[ticket.home].homed += delta

    def _grant(
        self, ticket: Ticket, state: _Tenant, start: float, now: float, engine: EngineSlots
    ) -> None:
        """Give ``ticket`` a slot on ``engine`` at virtual ``start``; its tenant is charged its
        reservation."""
        ticket._state = _State.GRANTED
        ticket.granted_at = now
        ticket.start = start
        ticket.engine = engine.name
        engine.in_flight += 1
        engine.grants += 1
        engine.peak = max(engine.peak, engine.in_flight)
        self._vtime = max(self._vtime, start)
        state.finish = start + ticket.cost / ticket.weight
        self._in_flight += 1
        self._grants += 1
        self._metrics.queue_wait.labels(ticket.label).observe(now - ticket.enqueued_at)

    def _dispatch(self) -> None:
        """Grant waiters while slots are free: from the line of the waiting tenant with the
        smallest virtual finish time (ties to the earliest arrival), its first waiter that
        `place` puts on an engine now; a tenant with none is passed over until the next call."""
        factor = self.affinity_load_factor
        passed: set[str] = set()
        while self._depth > 0 and any(e.free for e in self.engines.values()):
            best: _Tenant | None = None
            best_name = ""
            best_key = (0.0, 0)
            for name, state in self._waiting.items():
                if name in passed:
                    continue
                waiters = state.waiters
                while waiters[0]._state is not _State.WAITING:
                    waiters.popleft()
                key = (state.finish, waiters[0].seq)
                if best is None or key < best_key:
                    best, best_name, best_key = state, name, key
            if best is None:
                break
            chosen: Ticket | None = None
            engine: EngineSlots | None = None
            for waiter in itertools.islice(best.waiters, _PLACE_SCAN):
                if waiter._state is _State.WAITING:
                    engine = place(waiter.home, waiter.avoid, self.engines, factor)
                    if engine is not None:
                        chosen = waiter
                        break
            if chosen is None or engine is None:
                passed.add(best_name)
                continue
            if best.waiters[0] is chosen:
                best.waiters.popleft()
            elif len(best.waiters) > 2 * best.live + _LINE_SLACK:
                best.waiters = deque(t for t in best.waiters if t._state is _State.WAITING)
            self._home(chosen, -1)
            self._leave(chosen.tenant, best)
            # Granted out of line order: it leaves the state WAITING now and is skipped later.
            self._grant(chosen, best, best.finish, self.clock(), engine)
            chosen._ring()
        self._idle_check()

    def _leave(self, tenant: str, state: _Tenant) -> None:
        """One of the waiters of ``tenant`` (``state``) left the queue (granted or gone)."""
        state.live -= 1
        self._depth -= 1
        if state.live <= 0:
            state.waiters.clear()
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
