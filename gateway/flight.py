"""One generation that several client connections may share: its answer kept, bounded, for them.

A `Flight` belongs to the first request of a body (the leader, which runs the model path) and
records what the leader's client is sent: for a stream the status line, the headers and every
byte written (opening events, keep-alives, the answer's events, a final error event); for a
non-streamed answer its status, headers and body. Other connections (followers,
`gateway.retries`) attached to it read that record from its start and then follow it live.

Bounds: one flight keeps at most ``retries.buffer_bytes`` (and all flights together at most
``retries.max_bytes``, `Flights`). Past the bound the flight is *cut*: no connection may attach
any more (`attachable` turns False), bytes every attached follower has already written are
dropped, and a follower that falls more than the bound behind the answer is ended with its
API's error event (`gateway.retries.FollowerBehind`; its access line says ``client_stalled``): the buffer never grows past the bound whatever the
answer's length.

Connections: ``clients`` counts the connections reading the flight (the leader's while it is
connected, plus every follower). When the last one leaves, a generation at the engine keeps
running ``retries.orphan_grace_s`` for a retry to attach, then is cancelled (the leader's task,
whose path then ends as a client that went away: 499, aborted at the engine); a flight still in
the admission queue is cancelled at once, so a queued request whose client left still leaves
the queue at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Protocol

ENTRY_OVERHEAD_BYTES = 512
"""Bytes counted for a flight's record itself (its object, its index slots) besides its data."""
CHUNK_OVERHEAD_BYTES = 48
"""Bytes counted per recorded write besides its data: a ``bytes`` object's header (33 bytes in
CPython) and its list slot, rounded up; small events would otherwise be undercounted."""


class Budget(Protocol):
    """The shared byte bound of every flight (`gateway.retries.Flights`)."""

    def take(self, size: int) -> bool:
        """Take ``size`` bytes for a flight's record; False when they do not fit."""

    def give(self, size: int) -> None:
        """Give back ``size`` bytes."""


class Follower:
    """One follower's place in a flight: the index of the next chunk it writes.

    Attributes:
        pos: absolute chunk index (chunks already dropped count too).
        lost: it fell behind the bound (or its client stopped reading) and must end.
    """

    __slots__ = ("lost", "pos")

    def __init__(self) -> None:
        self.pos = 0
        self.lost = False


class Flight:
    """One generation's record and its readers (see the module doc).

    Args:
        request_id: the leader's ``x-request-id``.
        tenant: the tenant name (flights are only ever matched within one tenant).
        digest: SHA-256 of the route and the body (`gateway.retries.body_digest`).
        key: SHA-256 of the ``Idempotency-Key``, or None.
        stream: the leader asked for a stream.
        limit: ``retries.buffer_bytes``.
        budget: the bound shared by every flight.
        clock: monotonic seconds.
    """

    __slots__ = (
        "_budget",
        "_changed",
        "_clock",
        "_grace",
        "_held",
        "_leader_state",
        "_limit",
        "_timer",
        "attaches",
        "base",
        "body",
        "chunks",
        "clients",
        "cut",
        "delivered",
        "detached",
        "digest",
        "done",
        "error",
        "error_status",
        "finished_at",
        "followers",
        "headers",
        "key",
        "overhead",
        "rendered",
        "request_id",
        "running",
        "size",
        "started",
        "status",
        "stream",
        "task",
        "tenant",
    )

    def __init__(
        self,
        *,
        request_id: str,
        tenant: str,
        digest: bytes,
        key: bytes | None,
        stream: bool,
        limit: int,
        budget: Budget,
        clock: Callable[[], float],
    ) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.digest = digest
        self.key = key
        self.stream = stream
        self._limit = limit
        self._budget = budget
        self._clock = clock
        self.started = clock()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.base = 0
        self.size = 0
        self._held = 0
        self.body: bytes | None = None
        self.cut = False
        self.done = False
        self.error: BaseException | None = None
        self.error_status = 0  # the leader's stream ended with an error event of this status
        self.finished_at: float | None = None
        self.delivered = False
        self.clients = 1
        self.attaches = 0
        self.detached = False
        self.followers: list[Follower] = []
        self.task: asyncio.Task[Any] | None = None
        self.overhead = 0
        self.rendered: tuple[int, dict[str, str], bytes] | None = None
        self.running: Callable[[], bool] = _never
        self._grace = 0.0
        self._leader_state: bool | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._changed: asyncio.Event | None = None  # made when first waited for

    @property
    def attachable(self) -> bool:
        """A new connection may attach: the whole answer so far is kept and none failed."""
        if self.cut:
            return False
        if not self.done or self.rendered is not None:
            return True
        return self.error is None and (self.body is not None or self.stream)

    def changed(self) -> asyncio.Event:
        """An event set at the next change (data, headers, the end)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        # Most flights never have a follower: no event is made until one waits.
        changed = self._changed
        if changed is not None:
            self._changed = None
            changed.set()

    # -- the leader's side (`gateway.relay.ClientStream` calls these as its tap) --

    def opened(self, status: int, headers: Mapping[str, str]) -> None:
        """The leader's stream sent (or would have sent) its status line and headers.

        A stream without an ``Idempotency-Key`` takes no new follower from here on: the SDKs
        retry a stream only before its headers arrive, and its generation is not kept for a
        resend once its client left, so recording it would cost memory nobody reads."""
        self.status = status
        self.headers = dict(headers)
        if self.stream and self.key is None:
            self.cut = True
        self._notify()

    def sent(self, data: bytes) -> None:
        """The leader's stream wrote ``data`` (kept while within the bounds)."""
        if not data or (self.cut and not self.followers):
            return  # nobody can read it: a plain stream past its headers costs nothing here
        self.chunks.append(data)
        cost = len(data) + CHUNK_OVERHEAD_BYTES
        self.size += cost
        if not self.cut and not self._hold(cost):
            self.cut = True
        if self.cut:
            self._trim()
        self._notify()

    def ended(self, error_status: int = 0) -> None:
        """The leader's stream ended (its last bytes were `sent`); ``error_status``: with an
        error event of that status (0: none), which its followers' streams end with too."""
        self.error_status = error_status
        self.done = True
        self.finished_at = self._clock()
        if self.clients > 0:
            self.delivered = True
        self._notify()

    def lost(self) -> bool:
        """The leader's client went away (a failed write, or its handler cancelled): True when
        the generation goes on without it (followers read it, or it is at the engine and may
        still be attached to within ``orphan_grace_s``), False for the usual end (499, the
        engine request aborted). Decided once; later calls give the same answer."""
        if self._leader_state is not None:
            return self._leader_state
        self.clients -= 1
        keep = not self.done and (
            self.clients > 0 or (self.attachable and self._grace > 0 and self.running())
        )
        self._leader_state = keep
        if keep:
            self.detached = True
            if self.clients == 0:
                self._arm()
        return keep

    def finish(self, *, body: bytes | None, error: BaseException | None) -> None:
        """The leader's path ended: a non-streamed ``body`` (None when not kept), or the
        ``error`` it raised before any response; followers waiting are woken."""
        self.body = body  # followers waiting read it even when it is not kept for replay
        if body is not None and not self.cut and not self._hold(len(body)):
            self.cut = True
        self.error = error
        if not self.done:
            self.ended()
        self._notify()

    def set_grace(self, seconds: float) -> None:
        """``retries.orphan_grace_s`` of the leader's configuration snapshot."""
        self._grace = seconds

    # -- followers --

    def join(self) -> Follower:
        """A follower attaches; it reads from the flight's first byte."""
        follower = Follower()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.followers.append(follower)
        self.clients += 1
        self.attaches += 1
        return follower

    def leave(self, follower: Follower, *, completed: bool) -> None:
        """A follower left (``completed``: it got the whole answer)."""
        if follower in self.followers:
            self.followers.remove(follower)
        self.clients -= 1
        if completed:
            self.delivered = True
        if self.clients == 0 and not self.done:
            self._arm()
        elif self.cut:
            self._trim()

    def pending(self, follower: Follower) -> bytes:
        """The bytes ``follower`` has not written yet (empty when it is level), moving it on."""
        start = follower.pos - self.base
        if follower.lost or start >= len(self.chunks):
            return b""
        data = b"".join(self.chunks[start:])
        follower.pos = self.base + len(self.chunks)
        if self.cut:
            self._trim()
        return data

    # -- bounds and expiry --

    def _hold(self, size: int) -> bool:
        if self._held + size > self._limit or not self._budget.take(size):
            return False
        self._held += size
        return True

    def settle(self) -> None:
        """The leader is done: drop what refers back to its request (its task and result, its
        call, its error's traceback), so a flight kept for replay holds only its answer."""
        self.task = None
        self.running = _never
        if self.rendered is not None:
            self.error = None

    def release(self) -> None:
        """Give every byte this flight holds back to the shared bound (it is forgotten: no new
        connection finds it; followers still reading hold the data until they are done)."""
        self._budget.give(self._held)
        self._held = 0
        self.cut = True

    def held(self) -> int:
        """Bytes this flight counts against the shared bound."""
        return self._held

    def _trim(self) -> None:
        """Drop the chunks every follower has written; a follower still more than the bound
        behind is marked lost. The bytes held past what is kept are given back."""
        while True:
            end = self.base + len(self.chunks)
            keep_from = min((f.pos for f in self.followers), default=end)
            drop = keep_from - self.base
            if drop > 0:
                self.size -= sum(len(c) + CHUNK_OVERHEAD_BYTES for c in self.chunks[:drop])
                del self.chunks[:drop]
                self.base = keep_from
            if self.size <= self._limit or not self.followers:
                break
            laggard = min(self.followers, key=lambda f: f.pos)
            laggard.lost = True
            self.followers.remove(laggard)
        if self._held > self.size:
            self._budget.give(self._held - self.size)
            self._held = self.size

    def _arm(self) -> None:
        """No client reads the flight: keep it ``orphan_grace_s`` when it is at the engine and
        may still be attached to, else end it now."""
        if self.attachable and self._grace > 0 and self.running():
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(self._grace, self._expire)
        else:
            self._expire()

    def end_if_orphaned(self) -> bool:
        """End the generation now when no client reads it (one kept for ``orphan_grace_s`` in
        case a retry attaches); True when it did. For a drain: no connection can attach any
        more once the listeners are closed."""
        if self.clients > 0 or self.done or self.task is None:
            return False
        if self._timer is not None:
            self._timer.cancel()
        self._expire()
        return True

    def _expire(self) -> None:
        self._timer = None
        if self.clients == 0 and not self.done and self.task is not None:
            self.cut = True  # ending: nobody may attach to it any more
            self.task.cancel("no client reads this generation")


def _never() -> bool:
    return False
