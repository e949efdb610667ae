"""Which engine a granted request goes to: free slots, health, session affinity with bounded load.

The admission queue (`gateway.admission`) decides *which request* runs next (tenant fairness,
global over every engine); this module decides *where*: among the engines with a free slot, the
one that already holds the request's session in its prefix cache (its ``home``), unless that
engine is loaded well beyond the least-loaded one.

Load of an engine ``e``: ``(in flight at e + waiters whose home is e) / slots of e``, requests
per slot, i.e. the expected wait at ``e`` in units of one request's engine time. A request whose
home has no free slot moves to the least-loaded free engine ``m`` when
``load(home) > factor x load(m)``, ``load(m)`` counting the request itself
(``engine.affinity_load_factor``, default 1.5: the bounded-load rule of consistent hashing with
bounded loads, Mirrokni, Thorup and Zadimoghaddam, SODA 2018, where no bin takes more than
``1 + epsilon`` times the average; HAProxy's ``hash-balance-factor 150`` is the same 1.5). With
one slot per engine an idle engine always takes a request whose home is busy (``2 > 1.5 x 1``),
so no engine idles while a request waits; with more slots per engine a session may wait up to
half a request's engine time for its own engine before moving. Otherwise it waits for its home,
keeping its place in the fair order.

Health: only ready engines take requests while any engine is ready; when none is, every engine
is eligible (the request then waits for its engine at the proxy, as with a single engine).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable


class EngineSlots:
    """One engine's slots as the admission queue counts them.

    Attributes:
        name: the engine's configured name.
        slots: its ``max_concurrency``.
        in_flight: requests granted to it and not yet released (never above ``slots`` unless a
            reload lowered ``slots`` under running requests).
        homed: waiters in the queue whose session's home is this engine.
        ready: the engine's health as the poller last saw it (`gateway.upstream.EngineState`).
        grants: requests granted to it since start.
        peak: the most requests it ever had in flight at once.
    """

    __slots__ = ("grants", "homed", "in_flight", "name", "peak", "ready", "slots")

    def __init__(self, name: str, slots: int) -> None:
        self.name = name
        self.slots = slots
        self.in_flight = 0
        self.homed = 0
        self.ready = True
        self.grants = 0
        self.peak = 0

    @property
    def free(self) -> bool:
        """True while it has a free slot."""
        return self.in_flight < self.slots

    def load(self, extra: int = 0) -> float:
        """Requests per slot: in flight plus homed waiters (plus ``extra``), over the slots."""
        return (self.in_flight + self.homed + extra) / self.slots


def eligible(engines: Iterable[EngineSlots]) -> list[EngineSlots]:
    """The engines that may take requests: the ready ones, or all when none is ready."""
    every = list(engines)
    ready = [e for e in every if e.ready]
    return ready or every


def place(
    home: str | None,
    avoid: Collection[str],
    engines: dict[str, EngineSlots],
    factor: float,
) -> EngineSlots | None:
    """The engine a request goes to now, or None when it should keep waiting.

    Args:
        home: the engine holding the request's session (`gateway.affinity`), or None.
        avoid: engines this request must not go to (one that failed under it).
        engines: every engine by name.
        factor: ``engine.affinity_load_factor`` (>= 1); a session moves off its home when its
            home's load exceeds ``factor`` times the least-loaded free engine's.

    Returns:
        An engine with a free slot, or None (no free eligible engine, or the request waits for
        its busy home).
    """
    if len(engines) == 1:
        # One engine (production's single V100): it takes every request, ready or not, avoided
        # or not (there is nowhere else to go), as soon as it has a free slot.
        (only,) = engines.values()
        return only if only.in_flight < only.slots else None
    candidates = [e for e in eligible(engines.values()) if e.name not in avoid]
    if not candidates and avoid:
        candidates = eligible(engines.values())  # nowhere else to go: any engine
    free = [e for e in candidates if e.free]
    if not free:
        return None
    own = engines.get(home) if home is not None else None
    if own is not None and own in candidates:
        if own.free:
            return own
        best = min(free, key=lambda e: (e.load(1), -e.slots))
        # The waiter itself is among ``own.homed``.
        return best if own.load() > factor * best.load(1) else None
    return min(free, key=lambda e: (e.load(), e.grants))
