"""One request's place in the admission queue (`gateway.admission`): waiting, granted, done."""

from __future__ import annotations

import asyncio
from enum import Enum
from typing import TYPE_CHECKING

from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.admission import AdmissionQueue


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
        "avoid",
        "background",
        "behind_own",
        "cost",
        "engine",
        "enqueued_at",
        "granted_at",
        "home",
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
        # The engine holding the request's session (affinity), engines it must not go to, and
        # the engine its slot is on once granted.
        self.home: str | None = None
        self.avoid: frozenset[str] = frozenset()
        self.engine: str | None = None

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
                two and at least the tenant's weighted share of the queue then, while an engine
                is in rotation.
            EngineUnavailable: the same timeout otherwise (the engine is saturated overall, or
                no engine is in rotation: down or restarting).
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

    def requeue(self, avoid: str | None = None) -> None:
        """Give a granted slot back and wait again, first in line, for a slot on another engine.

        For a request its engine failed before it was sent (or that got no byte): it keeps its
        place ahead of its tenant's later requests, its tenant is not charged twice, and it is
        never placed on ``avoid`` again while another engine can take it.

        Raises:
            RuntimeError: the ticket does not hold a slot.
        """
        if self._state is not _State.GRANTED:
            raise RuntimeError("only a granted ticket can be requeued")
        if avoid is not None:
            self.avoid = self.avoid | {avoid}
        self._queue._requeue(self)


def _ring(alarm: asyncio.Future[None]) -> None:
    if not alarm.done():
        alarm.set_result(None)
