"""Retries attach instead of duplicating: one generation for a request and its retries.

A model request's *copy* is its tenant, its route and the SHA-256 of its body as received
(after any ``Content-Encoding``: byte-identical bodies match, a re-serialised one does not).
The first request of a copy leads: it runs the model path and its answer is recorded
(`gateway.flight.Flight`). A later request of the same copy attaches to it instead of running
(no rate limit, quota or engine slot taken, no ledger record of its own; the leader's record
counts it in ``attaches``) when one of these rules holds:

1. **Idempotency-Key** (every generating API, streamed or not; ``count_tokens`` generates
   nothing and never reads the header): the same tenant and key within
   ``retries.idempotency_ttl_s`` (24 h) of the first request's end. A running generation is
   attached to (the new connection gets the stream from its first byte, then live); a finished
   one is replayed (same status, headers, body or events, ids). The same key with another body
   (or route) is 409 ``idempotency_key_reused``. Kept for replay: answers from the engine with a
   status below 500 (an engine 4xx such as a prompt over the context is replayed as the same
   error); a 5xx, an engine failure mid-stream, or a refusal before the engine (429, 503) is not
   kept, so a retry with the key runs again.
2. **A marked SDK retry** (``x-stainless-retry-count`` of 1 or more, what the ``openai`` and
   ``anthropic`` SDKs send on their retries): attaches to a running copy (a stream without a
   key only until its headers went out: the SDKs never retry a stream after them, so nothing
   of it is recorded past them), or replays a copy that finished, answered to nobody (its
   clients had all gone), less than ``retries.retry_window_s`` ago.
3. **An unmarked resend** (no key, retry count 0 or absent: Claude Code's resend after it closed
   its first connection): attaches only to a copy none of whose clients is connected any more:
   running in its orphan grace (below), or finished unanswered within ``retry_window_s``. An
   identical body while the first copy's client is still connected runs separately: two users
   of one tenant sending the same prompt each get their own generation.

A generation whose clients have all gone keeps running ``retries.orphan_grace_s`` (10 s) when
it is at the engine, for a retry to attach (the SDKs wait 0.5-8 s before retrying); then it is
cancelled as before (aborted at the engine, the leader's record 499). A queued request whose
client left still leaves the queue at once. One generation keeps at most
``retries.buffer_bytes`` of its answer for attaching; a longer one cannot be attached to or
replayed any more: a key match gets 409 ``idempotency_replay_unavailable``, an SDK retry or a
resend runs again. All kept answers together hold at most ``retries.max_bytes`` (the oldest
finished ones are forgotten first).

Keys are client data: only their SHA-256 is kept, logs show its first 12 hex digits, and a key
is looked up within the caller's tenant only (another tenant's key never matches).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.body import STEP_BYTES
from gateway.config import RetriesSettings
from gateway.errors import BadGateway, BadRequest, ClientError, GatewayError
from gateway.flight import ENTRY_OVERHEAD_BYTES, Flight, Follower
from gateway.relay import TAP, close_delimited
from gateway.state import BODY_MEMORY, DRAIN, METRICS, ModelCall

log = structlog.get_logger("gateway.retries")

IDEMPOTENCY_HEADER = "Idempotency-Key"
RETRY_COUNT_HEADER = "x-stainless-retry-count"
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_KEY_CHARS = 255
"""The longest ``Idempotency-Key`` accepted (Stripe's limit; the IETF draft sets none)."""
MATCHES = ("key", "sdk_retry", "resend")
OUTCOMES = ("attach", "replay", "conflict", "unavailable")
_NOT_COPIED = frozenset({"x-request-id", "content-length", "transfer-encoding", "date", "server"})


class IdempotencyConflict(ClientError):
    """409: an ``Idempotency-Key`` already used with another body (or route) by this tenant."""

    status = 409
    code = "idempotency_key_reused"
    reason = "idempotency_conflict"


class ReplayUnavailable(ClientError):
    """409: the key's answer is longer than the gateway keeps for replay, or was not kept."""

    status = 409
    code = "idempotency_replay_unavailable"
    reason = "replay_unavailable"


class FollowerBehind(ReplayUnavailable):
    """409, as a stream's final error event: an attached connection fell more than
    ``retries.buffer_bytes`` behind the generation, so the rest of the answer is no longer kept
    for it (`gateway.flight.Flight`). The access line keeps the status sent and says
    ``client_stalled``."""

    reason = "client_stalled"


async def body_digest(route: str, raw: bytes) -> bytes:
    """SHA-256 of the route, a NUL and the body bytes: the copy a request belongs to (with its
    tenant). Hashed `gateway.body.STEP_BYTES` at a time, other requests run between steps."""
    digest = hashlib.sha256(route.encode() + b"\0")
    view = memoryview(raw)
    for start in range(0, len(view), STEP_BYTES):
        if start:
            await asyncio.sleep(0)
        digest.update(view[start : start + STEP_BYTES])
    return digest.digest()


def idempotency_key(request: web.Request) -> bytes | None:
    """SHA-256 of the request's ``Idempotency-Key``, or None without one.

    Raises:
        BadRequest: the key is empty, longer than `MAX_KEY_CHARS` or not printable ASCII (the
            message never quotes it).
    """
    value = request.headers.get(IDEMPOTENCY_HEADER)
    if value is None:
        return None
    if not 0 < len(value) <= MAX_KEY_CHARS or not (value.isascii() and value.isprintable()):
        raise BadRequest(
            f"{IDEMPOTENCY_HEADER} must be 1 to {MAX_KEY_CHARS} printable ASCII characters.",
            param=IDEMPOTENCY_HEADER,
        )
    return hashlib.sha256(value.encode()).digest()


def retry_count(request: web.Request) -> int:
    """The SDK's ``x-stainless-retry-count`` (0 when absent or not a small integer)."""
    value = request.headers.get(RETRY_COUNT_HEADER, "").strip()
    return int(value) if value.isdigit() and len(value) < 6 else 0


class Flights:
    """Every flight of the process, by key and by copy; the shared byte bound.

    Args:
        clock: monotonic seconds.
        registry: where the ``gateway_retries_total`` and ``gateway_retry_buffer_bytes``
            families are registered.
    """

    def __init__(self, clock: Callable[[], float], registry: CollectorRegistry) -> None:
        self._clock = clock
        self._keys: dict[tuple[str, bytes], Flight] = {}
        self._copies: dict[tuple[str, bytes], list[Flight]] = {}
        self._kept_keyed: OrderedDict[Flight, float] = OrderedDict()
        self._kept_unkeyed: OrderedDict[Flight, float] = OrderedDict()
        self.bytes = 0
        self.max_bytes = RetriesSettings().max_bytes
        self.matches = Counter(
            "gateway_retries",
            "Requests answered from another request's generation, by what matched them (key, "
            "sdk_retry, resend) and outcome (attach: to a running one; replay: a finished one; "
            "conflict: a key reused with another body; unavailable: not kept for replay).",
            ("match", "outcome"),
            registry=registry,
        )
        for match in MATCHES:
            for outcome in OUTCOMES:
                self.matches.labels(match, outcome)
        self.buffered = Gauge(
            "gateway_retry_buffer_bytes",
            "Bytes of answers kept for retries to attach to or replay (retries.max_bytes bounds).",
            registry=registry,
        )
        self.buffered.set_function(lambda: self.bytes)  # read when scraped

    # -- the shared bound (`gateway.flight.Budget`) --

    def take(self, size: int) -> bool:
        """Take ``size`` bytes, forgetting the oldest kept answers if needed; False if they
        still do not fit."""
        while self.bytes + size > self.max_bytes and (self._kept_unkeyed or self._kept_keyed):
            oldest = self._kept_unkeyed or self._kept_keyed
            self._forget(next(iter(oldest)))
        if self.bytes + size > self.max_bytes:
            return False
        self.bytes += size
        return True

    def give(self, size: int) -> None:
        """Give back ``size`` bytes."""
        self.bytes -= size

    # -- matching --

    def find(
        self,
        settings: RetriesSettings,
        tenant: str,
        digest: bytes,
        key: bytes | None,
        retries: int,
    ) -> tuple[Flight | None, str]:
        """The flight a request attaches to and the rule that matched (module doc), or
        ``(None, "")`` when it leads.

        Raises:
            IdempotencyConflict: ``key`` was used by ``tenant`` with another copy.
            ReplayUnavailable: ``key``'s answer is not kept (too long, or not replayable).
        """
        self.max_bytes = settings.max_bytes
        now = self._clock()
        self._purge(now)
        if key is not None:
            found = self._keys.get((tenant, key))
            if found is None:
                return None, ""
            if found.digest != digest:
                self.matches.labels("key", "conflict").inc()
                raise IdempotencyConflict(
                    f"This {IDEMPOTENCY_HEADER} was already used with a different request "
                    "(another body or route); use a new key for a new request.",
                    headers={"x-should-retry": "false"},
                )
            if not found.attachable:
                self.matches.labels("key", "unavailable").inc()
                raise ReplayUnavailable(
                    f"The answer to this {IDEMPOTENCY_HEADER} is longer than the gateway keeps "
                    "for replay (retries.buffer_bytes) or was not kept; use a new key to run "
                    "the request again.",
                    headers={"x-should-retry": "false"},
                )
            return found, "key"
        for flight in reversed(self._copies.get((tenant, digest), ())):
            if not flight.attachable:
                continue
            if flight.done and flight.delivered:
                continue
            if retries > 0:
                return flight, "sdk_retry"
            if flight.clients == 0:
                return flight, "resend"
        return None, ""

    def open(
        self,
        settings: RetriesSettings,
        call: ModelCall,
        digest: bytes,
        key: bytes | None,
        sdk: bool,
    ) -> Flight:
        """Register the flight of a request that leads its copy. Its generation outlives its
        clients for ``orphan_grace_s`` only when a retry is to be expected: the request has an
        ``Idempotency-Key``, or it is a non-streamed request of an SDK that retries (``sdk``:
        it sent ``x-stainless-retry-count``); any other is cancelled as soon as its last client
        leaves, as without retries."""
        assert call.plan is not None
        tenant = call.caller.tenant.name
        flight = Flight(
            request_id=call.context.request_id,
            tenant=tenant,
            digest=digest,
            key=key,
            stream=call.plan.stream,
            limit=settings.buffer_bytes,
            budget=self,
            clock=self._clock,
        )
        if key is not None or (sdk and not call.plan.stream):
            flight.set_grace(settings.orphan_grace_s)
        flight.running = lambda: call.ticket is not None and call.ticket.granted_at is not None
        if key is not None:
            self._keys[(tenant, key)] = flight
        self._copies.setdefault((tenant, digest), []).append(flight)
        return flight

    def close(self, settings: RetriesSettings, flight: Flight, keep: bool) -> None:
        """The leader's path ended: keep the flight for replay (``keep``: an answer from the
        engine below 500) while its rule allows, else forget it."""
        flight.set_grace(0.0)
        if flight.key is not None and keep and not flight.attachable:
            # Too long to replay: the key is remembered (its retries get 409), not the answer.
            flight.release()
            self._drop_copy(flight)
        elif not keep or not flight.attachable or not (flight.key or not flight.delivered):
            self._forget(flight)
            return
        if not self.take(ENTRY_OVERHEAD_BYTES):
            self._forget(flight)
            return
        flight.overhead = ENTRY_OVERHEAD_BYTES
        if flight.key is None:
            self._kept_unkeyed[flight] = self._clock() + settings.retry_window_s
        else:
            self._kept_keyed[flight] = self._clock() + settings.idempotency_ttl_s
            if flight.delivered:  # only the key finds it
                self._drop_copy(flight)

    def _purge(self, now: float) -> None:
        for kept in (self._kept_unkeyed, self._kept_keyed):
            while kept:
                flight, expires = next(iter(kept.items()))
                if expires > now:
                    break
                self._forget(flight)

    def _drop_copy(self, flight: Flight) -> None:
        copies = self._copies.get((flight.tenant, flight.digest))
        if copies is not None and flight in copies:
            copies.remove(flight)
            if not copies:
                del self._copies[(flight.tenant, flight.digest)]

    def _forget(self, flight: Flight) -> None:
        self._drop_copy(flight)
        if flight.key is not None and self._keys.get((flight.tenant, flight.key)) is flight:
            del self._keys[(flight.tenant, flight.key)]
        self._kept_unkeyed.pop(flight, None)
        self._kept_keyed.pop(flight, None)
        self.give(flight.overhead)
        flight.overhead = 0
        flight.release()

    def end_orphans(self) -> int:
        """End every generation no client reads (`Flight.end_if_orphaned`); how many. A drain
        calls it once its listeners are closed: a retry could attach to such a generation only
        on a new connection, so it would run to its end, or to the grace, for nobody."""
        return sum(flight.end_if_orphaned() for flight in self._known())

    def _known(self) -> list[Flight]:
        """Every flight known (running or kept), once: by its copy, its key, or both."""
        known = {id(f): f for copies in self._copies.values() for f in copies}
        known.update((id(f), f) for f in self._keys.values())
        return list(known.values())

    def __len__(self) -> int:
        """Flights known (running or kept)."""
        return len(self._known())


FLIGHTS = web.AppKey("flights", Flights)


def key_hash(key: bytes | None) -> str | None:
    """What logs show of an ``Idempotency-Key``: 12 hex digits of its SHA-256."""
    return key.hex()[:12] if key is not None else None


async def lead(
    request: web.Request,
    call: ModelCall,
    flight: Flight,
    run: Callable[[], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """Run the model path (``run``) as ``flight``'s leader in a task of its own, so that the
    generation can outlive the leader's connection while others read it (`Flight.lost`);
    record its answer and keep or forget the flight at the end."""
    flights = call.context.app[FLIGHTS]
    settings = call.settings.retries
    if flight.stream:
        request[TAP] = flight
    task: asyncio.Task[web.StreamResponse] = asyncio.ensure_future(run())
    flight.task = task
    keep = False
    result: web.StreamResponse | None = None
    error: BaseException | None = None
    try:
        with call.context.app[DRAIN].delegating():  # a drain ends the task, not this wait
            result = await _await_leader(task, flight)
        keep = _replayable(call, result.status)
        return result
    except GatewayError as exc:
        error = exc
        keep = _replayable(call, exc.status)
        raise
    except BaseException as exc:
        error = exc
        raise
    finally:
        body: bytes | None = None
        if not flight.stream and isinstance(result, web.Response):
            raw = result.body
            if isinstance(raw, bytes):
                flight.opened(result.status, result.headers)
                body = raw
        if flight.stream and flight.status is not None and not flight.done:
            flight.cut = True  # the stream ended without its end: nothing whole to replay
        if keep and isinstance(error, GatewayError):
            # Kept for replay as the bytes its client got, not as the exception (its traceback
            # refers to this request).
            shown = call.dialect.adapt_error(error)
            headers = {**shown.headers, "Content-Type": "application/json"}
            flight.rendered = (shown.status, headers, call.dialect.error_body(shown))
        flight.finish(body=body, error=error)
        flight.settle()
        call.attaches = flight.attaches
        if flight.detached:
            # The leader's own client left; its answer went to the connections attached (or is
            # kept for them): the record keeps the status of that answer, charged once here,
            # and the reason says the client left.
            call.context.reason = call.context.reason or "retry_detached"
            call.context.app[METRICS].client_disconnects.labels(call.caller.label).inc()
        flights.close(settings, flight, keep)


async def _await_leader(
    task: asyncio.Task[web.StreamResponse], flight: Flight
) -> web.StreamResponse:
    """The leader's result; a cancellation of the leader's handler (its client gone) leaves
    the task running when `Flight.lost` says so, else ends it as before."""
    cancels = 0
    while True:
        try:
            return await _outcome(task)
        except asyncio.CancelledError:
            if task.done():
                raise
            cancels += 1
            if cancels == 1 and flight.lost():
                log.info("retry_leader_detached", clients=flight.clients)
                current = asyncio.current_task()
                if current is not None and hasattr(current, "uncancel"):
                    current.uncancel()  # handled: the handler waits for the generation
                continue
            flight.cut = True
            task.cancel()
            return await task


async def _outcome(task: asyncio.Task[web.StreamResponse]) -> web.StreamResponse:
    """``await asyncio.shield(task)``: the task's result, and a cancellation of the caller leaves
    the task running; a bare future woken by the task's end does it in one callback instead of
    shield's outer future and its two."""
    if not task.done():
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task.add_done_callback(functools.partial(_wake, waiter))
        await waiter
    return task.result()


def _wake(waiter: asyncio.Future[None], _task: object) -> None:
    if not waiter.done():  # a caller cancelled meanwhile left it cancelled
        waiter.set_result(None)


def _replayable(call: ModelCall, status: int) -> bool:
    context = call.context
    worst = max(status, context.error_status)
    return call.usage.reached_engine and worst < 500 and status != 499


async def follow(
    request: web.Request, call: ModelCall, flight: Flight, match: str
) -> web.StreamResponse:
    """Answer ``call`` from ``flight``: its recorded answer from the first byte, then live.

    The request holds no slot, reservation, body memory or ledger record of its own
    (``context.call`` is cleared, so `gateway.middleware.finish_request`, which releases a
    leader's body hold, never sees this one: it is released here); its access line says
    ``reason="retry_attached"`` or ``"retry_replayed"``.

    Raises:
        GatewayError: the error the flight's leader got before any response (replayed).
        BadGateway: the generation ended without an answer to give.
    """
    context = call.context
    outcome = "replay" if flight.done else "attach"
    call.context.app[FLIGHTS].matches.labels(match, outcome).inc()
    context.call = None
    if call.body_hold is not None:
        call.context.app[BODY_MEMORY].release(call.body_hold)
    context.reason = "retry_attached" if outcome == "attach" else "retry_replayed"
    structlog.contextvars.bind_contextvars(attached_to=flight.request_id)
    log.info(
        "retry_matched",
        match=match,
        outcome=outcome,
        attached_to=flight.request_id,
        key_hash=key_hash(flight.key),
    )
    follower = flight.join()
    completed = False
    try:
        with call.context.app[DRAIN].delegating():  # a drain ends the leader's task instead
            if flight.stream:
                response = await _follow_stream(request, call, flight, follower)
            else:
                response = await _follow_json(flight)
        completed = not follower.lost
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        # Its client left, before or after the headers: 499 ``client_disconnect`` and counted,
        # as a leader's client (`gateway.relay.client_gone`), however the leaving was noticed.
        context.status = 499
        context.reason = "client_disconnect"
        call.context.app[METRICS].client_disconnects.labels(call.caller.label).inc()
        raise
    finally:
        flight.leave(follower, completed=completed)


def _headers(flight: Flight) -> dict[str, str]:
    headers = {k: v for k, v in flight.headers.items() if k.lower() not in _NOT_COPIED}
    headers[REPLAYED_HEADER] = "true"
    return headers


def _failure(flight: Flight) -> GatewayError:
    if isinstance(flight.error, GatewayError):
        return flight.error
    if flight.done and not flight.stream and flight.error is None and flight.body is None:
        return ReplayUnavailable(
            "The answer is longer than the gateway keeps for another connection "
            "(retries.buffer_bytes); send the request again.",
        )
    return BadGateway("The generation this request attached to ended without an answer.")


def _replayed_error(flight: Flight) -> web.Response | None:
    """The kept error answer of ``flight`` (an engine 4xx), as its client got it."""
    if flight.rendered is None:
        return None
    status, headers, body = flight.rendered
    return web.Response(status=status, body=body, headers={**headers, REPLAYED_HEADER: "true"})


async def _follow_json(flight: Flight) -> web.StreamResponse:
    while not flight.done:
        await flight.changed().wait()
    replayed = _replayed_error(flight)
    if replayed is not None:
        return replayed
    if flight.body is None or flight.status is None:
        raise _failure(flight)
    return web.Response(status=flight.status, body=flight.body, headers=_headers(flight))


async def _follow_stream(
    request: web.Request, call: ModelCall, flight: Flight, follower: Follower
) -> web.StreamResponse:
    while flight.status is None and not flight.done:
        await flight.changed().wait()
    replayed = _replayed_error(flight)
    if replayed is not None:
        return replayed
    if flight.status is None:
        raise _failure(flight)
    response = web.StreamResponse(status=flight.status, headers=_headers(flight))
    response.headers["x-request-id"] = call.context.request_id
    close_delimited(request, response)
    await response.prepare(request)
    call.context.status = flight.status
    timeout = call.settings.server.client_write_timeout_s
    while True:
        changed = flight.changed()
        data = flight.pending(follower)
        if follower.lost:
            return await _end_behind(request, call, response, timeout)
        if data:
            try:
                await asyncio.wait_for(response.write(data), timeout)
            except asyncio.TimeoutError:
                follower.lost = True
                break
            continue
        if flight.done:
            # The stream it relayed ended as the leader's did: with its error event, logged so.
            call.context.error_status = call.context.error_status or flight.error_status
            await response.write_eof()
            return response
        await changed.wait()
    return _stalled(request, call, response)


async def _end_behind(
    request: web.Request, call: ModelCall, response: web.StreamResponse, timeout: float
) -> web.StreamResponse:
    """The follower fell more than the flight's bound behind (`Flight._trim` dropped what it
    had not written): like any failure after the headers, its stream ends with its dialect's
    error event (`FollowerBehind`), logged once as ``retry_follower_behind``; the access line
    keeps the status sent, ``error_status`` 409 and reason ``client_stalled``. A client that
    does not take even that event within ``server.client_write_timeout_s`` is cut off (499)."""
    error = FollowerBehind(
        "This connection fell more than retries.buffer_bytes behind the generation it was "
        "attached to, and the rest of the answer is not kept for it; send the request again "
        "(with a new Idempotency-Key, if it had one)."
    )
    context = call.context
    context.error_status = error.status
    context.reason = error.reason
    log.warning("retry_follower_behind", error_status=error.status)
    event = call.dialect.error_event(error)
    try:
        await asyncio.wait_for(response.write(event), timeout)
        await asyncio.wait_for(response.write_eof(), timeout)
    except asyncio.TimeoutError:
        return _stalled(request, call, response)
    except ConnectionResetError:
        pass
    return response


def _stalled(
    request: web.Request, call: ModelCall, response: web.StreamResponse
) -> web.StreamResponse:
    """The follower's client took no bytes for ``server.client_write_timeout_s``: 499
    ``client_stalled``, its connection aborted."""
    call.context.status = 499
    call.context.reason = "client_stalled"
    if request.transport is not None:
        request.transport.abort()
    return response
