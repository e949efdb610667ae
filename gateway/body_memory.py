"""The memory held by model requests' bodies, bounded by ``server.bodies_max_bytes``.

While a body uploads, the gateway holds its reads and then the bytes joined from them; once
parsed, the Python objects of the client body (a translated request keeps them for the rest of
the request) and the engine body encoded from them (about as long as the body); a
``previous_response_id`` adds the stored conversation it continues (`RequestPlan.held_extra`). Those objects are 0.5 to 19 times the
JSON's bytes (a string costs its characters at 1, 2 or 4 bytes each plus a 49-byte header, a
dict at least 64 bytes, every value a pointer), so a bound counted in body bytes would hold up
to 19 times what it says (case C27's kind). `held_estimate` is an upper estimate of the parsed
objects from the bytes alone, made before the body is parsed, in a few passes at C speed;
`BodyMemory` admits a request only while the holds of every model request in the process
(reading, waiting in the queue, at an engine) fit the bound, so a flood of large or
parse-expensive bodies is refused at the door instead of growing the process. A body being read
holds what has arrived of it, counted as it arrives, never what its ``Content-Length`` promises:
a client that sends headers with a huge length and then nothing (or a byte a minute) holds only
what it sent, and one tenant's uploads in progress together hold at most its weighted share of
the bound. The bytes and the decoded text of a body live only while it is parsed and planned,
one body at a time (that stretch never awaits), so at most one body's ``2 x max_body_bytes`` is
held beside the bound.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from gateway.body import STEP_BYTES, read_body
from gateway.config import ServerSettings
from gateway.errors import (
    EngineUnavailable,
    GatewayError,
    PayloadTooLarge,
    RateLimited,
    retry_after_header,
)
from gateway.metrics import Metrics

# A string's characters take 1, 2 or 4 bytes each in CPython (PEP 393: the widest character
# of the string decides): 4 when the body holds a character past U+FFFF (a UTF-8 lead byte
# F0-F4, or an escaped surrogate pair).
_SURROGATE_ESCAPE_RE = re.compile(rb"\\u[dD][89abAB]")
_ASTRAL_LEADS = bytes(range(0xF0, 0xF5))
_NOT_ASTRAL_LEAD = bytes(b for b in range(256) if b not in _ASTRAL_LEADS)
# Every byte but the structural ones, the backslash and the astral lead bytes, deleted in one
# pass (`bytes.translate`) so that everything below runs over what is left.
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b'"{[:,\\' + _ASTRAL_LEADS)
# Bytes of parsed objects per structural character (CPython 3.11, 64-bit; fitted with
# tracemalloc over 19 shapes, from one long string to 400,000 empty objects, to stay at or
# above each): a string's header and pointer, half per quote (keys are shared within a body);
# a dict entry per colon; a small dict per brace; a list header per bracket; a value's pointer
# and a number's object per comma.
_PER_QUOTE = 16
_PER_COLON = 40
_PER_BRACE = 160
_PER_BRACKET = 56
_PER_COMMA = 32


def held_estimate(raw: bytes) -> int:
    """Bytes of the Python objects a JSON body of ``raw`` parses into: an upper estimate, 1.0 to
    1.6 times the measured size for text, messages, tool schemas and numbers (2.1 for a recorded
    Codex request), up to 4 for Latin-1 text and 8 for lists of one-character strings (which
    CPython shares). Structural characters inside strings count as structure, which only
    raises it."""
    tally = _Tally()
    tally.add(raw, b"")
    return tally.estimate()


async def held_estimate_in_steps(raw: bytes) -> int:
    """`held_estimate` of ``raw``, the same number, made `gateway.body.STEP_BYTES` at a time
    with other requests run between steps (a 10 MB body is some 40 ms of passes)."""
    if len(raw) <= STEP_BYTES:
        return held_estimate(raw)
    tally = _Tally()
    reach = _PATTERN_BYTES - 1
    for start in range(0, len(raw), STEP_BYTES):
        # The patterns are searched again across the seam with the previous step.
        tally.add(raw[start : start + STEP_BYTES], raw[max(0, start - reach) : start + reach])
        await asyncio.sleep(0)
    return tally.estimate()


_PATTERN_BYTES = 4
"""The longest pattern `_Tally` searches for: ``\\uD8``, an escaped high surrogate's start."""


class _Tally:
    """What `held_estimate` counts, summed over the pieces of a body."""

    def __init__(self) -> None:
        self.size = 0
        self.ascii = True
        self.escape = False  # a \\u escape
        self.astral = False  # a UTF-8 lead byte of a character past U+FFFF
        self.surrogate = False  # an escaped surrogate (half of a character past U+FFFF)
        self.structure = 0

    def add(self, piece: bytes, seam: bytes) -> None:
        """Count ``piece``; ``seam`` is the bytes around its start (a pattern across the start
        of a later piece is found in its seam, never in the piece alone)."""
        self.size += len(piece)
        self.ascii = self.ascii and piece.isascii()
        structure = piece.translate(None, _NOT_STRUCTURAL)  # keeps backslashes: a cheap test
        for text, backslash in ((piece, b"\\" in structure), (seam, b"\\" in seam)):
            if backslash and b"\\u" in text:
                self.escape = True
                if not self.surrogate and _SURROGATE_ESCAPE_RE.search(text) is not None:
                    self.surrogate = True
        self.astral = self.astral or bool(structure.translate(None, _NOT_ASTRAL_LEAD))
        self.structure += (
            _PER_QUOTE * structure.count(b'"')
            + _PER_COLON * structure.count(b":")
            + _PER_BRACE * structure.count(b"{")
            + _PER_BRACKET * structure.count(b"[")
            + _PER_COMMA * structure.count(b",")
        )

    def estimate(self) -> int:
        """The estimate of everything added (`held_estimate`)."""
        if self.astral or self.surrogate:  # PEP 393: 4 bytes a character in the string
            wide = 4
        elif self.escape or not self.ascii:  # an escape may stand for any character
            wide = 2
        else:
            wide = 1
        return wide * self.size + self.structure


@dataclass
class BodyHold:
    """One request's share of the bound: its tenant, the bytes it holds now, and whether its
    body is still arriving (`BodyMemory.reading`)."""

    tenant: str
    weight: float
    size: int = 0
    reading: bool = False


class BodyMemory:
    """The bodies of every model request in this process, bounded in estimated memory.

    Args:
        limit: ``server.bodies_max_bytes``.
        metrics: ``gateway_body_memory_bytes`` (held now) and
            ``gateway_rate_limited_total{limit="memory"}`` (refusals of a tenant at its share).
        per_request_s: the expected seconds until one request at the engines finishes (what
            frees memory): the admission queue's ``1 / drain_rate``, for ``Retry-After``.
        upload_idle_s: ``server.body_timeout_s``, the longest an upload that stopped sending
            holds its bytes before it is refused (408), for ``Retry-After``.

    A request that would take the total past ``limit`` is refused as a full queue is: 429
    ``memory`` when its tenant already holds at least its weighted share of the bound (its own
    backlog is the cause), else 503 (the gateway is saturated); one whose estimate alone exceeds
    the bound is a 413, since it could never be held. While bodies arrive, a tenant's uploads
    together may hold at most its weighted share of the bound, the other tenants holding now
    counted at no less than weight 1 (a tenant of weight 1 alone: half), else 429 ``memory``;
    one upload alone may grow to the bound. ``Retry-After`` is the time for requests at the
    engines to finish (`per_request_s`, scaled by the tenant's share for a 429) when the bodies
    already read hold at least the bytes that must free for this one; else those bytes are held
    by uploads still arriving, which free only when they end or stall for ``upload_idle_s``,
    and ``Retry-After`` is that.
    """

    def __init__(
        self,
        limit: int,
        metrics: Metrics,
        per_request_s: Callable[[], float],
        *,
        upload_idle_s: float,
    ) -> None:
        self.limit = limit
        self.held = 0
        self.reading = 0  # of `held`, by bodies still arriving
        self._metrics = metrics
        self._per_request_s = per_request_s
        self._upload_idle_s = upload_idle_s
        self._tenants: dict[str, BodyHold] = {}  # tenant -> bytes held and its weight
        self._weights: dict[str, float] = {}
        self._reading: dict[str, int] = {}  # tenant -> bytes its uploads in progress hold
        metrics.body_memory.set_function(lambda: self.held)  # read when scraped

    def take(self, hold: BodyHold, size: int, label: str) -> None:
        """Set ``hold``'s bytes to ``size``: a request reading its body (``hold.reading``), then
        holding it parsed.

        Raises:
            PayloadTooLarge: ``size`` alone is over the bound.
            RateLimited, EngineUnavailable: it does not fit beside what others hold, or its
                tenant's uploads would pass its share (see the class doc); ``hold`` keeps what
                it held before.
        """
        extra = size - hold.size
        if extra <= 0:
            self._move(hold, extra)
            return
        what = f"Request bodies fill this gateway's memory bound ({self.limit} bytes)"
        if hold.reading:
            uploading = self._reading.get(hold.tenant, 0) - hold.size  # its other uploads
            if uploading > 0:
                others = max(1.0, self._others(hold.tenant))
                share = self.limit * hold.weight / (others + hold.weight)
                if uploading + size > share:
                    self._metrics.rate_limited.labels(label, "memory").inc()
                    wait = self._upload_idle_s
                    raise RateLimited(
                        "memory",
                        f"{what}; this tenant's uploads in progress hold its weighted share "
                        f"of it. Retry in about {retry_after_header(wait)} s.",
                        wait,
                    )
        if self.held + extra <= self.limit:
            self._move(hold, extra)
            return
        if size > self.limit:
            raise PayloadTooLarge(
                f"Request body too large to hold: its parsed form takes about {size} bytes "
                f"of memory; this gateway holds at most {self.limit} for all requests."
            )
        mine = self._tenants.get(hold.tenant)
        held_here = (mine.size if mine is not None else 0) - hold.size  # its other requests
        others = self._others(hold.tenant)
        share = self.limit * hold.weight / (others + hold.weight)
        per_request = max(0.001, self._per_request_s())
        read = self.held - self.reading  # freed as requests finish
        stalled = read < self.held + extra - self.limit
        if held_here > 0 and held_here + extra > share:
            self._metrics.rate_limited.labels(label, "memory").inc()
            wait = (
                self._upload_idle_s
                if stalled
                else per_request * (others + hold.weight) / hold.weight
            )
            raise RateLimited(
                "memory",
                f"{what}; this tenant holds at least its weighted share of it. "
                f"Retry in about {retry_after_header(wait)} s.",
                wait,
            )
        wait = self._upload_idle_s if stalled else per_request
        raise EngineUnavailable(
            f"{what}; the gateway is saturated. Retry in about {retry_after_header(wait)} s.",
            wait,
        )

    def read(self, hold: BodyHold) -> None:
        """``hold``'s body ended arriving (read whole, refused or abandoned): what it holds no
        longer counts as an upload in progress. Idempotent."""
        if hold.reading:
            self._count_reading(hold.tenant, -hold.size)
            hold.reading = False

    def release(self, hold: BodyHold) -> None:
        """The request ended: everything ``hold`` held is free. Idempotent."""
        self._move(hold, -hold.size)

    def _others(self, tenant: str) -> float:
        """The summed weights of the other tenants holding now."""
        return sum(w for t, w in self._weights.items() if t != tenant)

    def _count_reading(self, tenant: str, delta: int) -> None:
        self.reading += delta
        left = self._reading.get(tenant, 0) + delta
        if left > 0:
            self._reading[tenant] = left
        else:
            self._reading.pop(tenant, None)

    def _move(self, hold: BodyHold, delta: int) -> None:
        if delta == 0:
            return
        hold.size += delta
        self.held += delta
        if hold.reading:
            self._count_reading(hold.tenant, delta)
        entry = self._tenants.get(hold.tenant)
        if entry is None:
            entry = self._tenants[hold.tenant] = BodyHold(hold.tenant, hold.weight)
        entry.size += delta
        if entry.size <= 0:
            del self._tenants[hold.tenant]
            self._weights.pop(hold.tenant, None)
        else:
            self._weights[hold.tenant] = hold.weight


async def read_held(
    request: web.Request, memory: BodyMemory, hold: BodyHold, server: ServerSettings, label: str
) -> bytes:
    """Read a model request's body within ``server.bodies_max_bytes``: while it arrives it holds
    twice the bytes received so far (the reads, then the bytes joined from them; of a chunked or
    compressed body, what it decoded into so far), grown read by read; once read, before it is
    parsed, the `held_estimate` of its parsed form plus its length again (the engine body
    encoded from it, about as long). The caller releases ``hold`` when the request's bodies are
    dropped.

    Raises:
        PayloadTooLarge, RequestTimeout, BadRequest: see `gateway.body.read_body`; 413 also for
            a body whose parsed form alone would exceed the bound.
        RateLimited, EngineUnavailable: the bound is full, or the tenant's uploads in progress
            hold its share (see `BodyMemory.take`); refused mid-upload, the connection closes.
    """

    def received(size: int) -> None:
        try:
            memory.take(hold, 2 * size, label)
        except GatewayError as error:
            error.headers["Connection"] = "close"  # the rest of the body is not read
            raise

    hold.reading = True
    try:
        raw = await read_body(request, server.max_body_bytes, server.body_timeout_s, received)
    finally:
        memory.read(hold)
    try:
        estimate = await held_estimate_in_steps(raw)
        memory.take(hold, estimate + len(raw), label)  # parsed, then the engine body
    except GatewayError:
        del raw  # not kept by the traceback beyond the hold that counted it
        raise
    return raw
