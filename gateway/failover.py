"""Failover between engines: rotation apart from health, and a request's wait on a failing engine.

An engine is *in rotation* while new requests may be placed on it (`gateway.placement`): ready
(`gateway.engine_state.EngineState`) and not *stalled*. The health poller
(`gateway.engine_watch.poll_health`) marks an engine stalled at the first probe that is slow
(no answer within ``engine.rotation_timeout_s``) or failed while nothing else came from the
engine, and clears it at the first probe answered 200 or the first answer the engine sends
(`gateway.engines.Engines.post`: a one-slot engine whose ``/health`` lagged behind a
non-streamed request sends nothing until it is done). ``down`` keeps its slower rule
(``engine.unhealthy_after_s``): alerts, ``/ready`` and quarantine deaths follow ``down`` only.

A request already sent to an engine that leaves rotation waits for its first byte only as long
as the engine might still answer (`Rotation.post`, several engines): when the engine stalls with
the request still unread in its socket (a stopped process reads nothing; a live one reads a
request at once even while busy), the request never reached the engine and goes to another one
(`EngineStalled`: not a death, not its retry); when the engine is declared down, a request that
got no byte is treated like one whose engine died under it (`EngineUnreachable` with ``sent``:
retried once elsewhere, a death for the quarantine, as for a crash). A request the engine read
stays while the engine is only stalled: a one-slot engine in a long prefill may answer
``/health`` late and still be working on it. When an engine is marked down with nothing at all
from it for ``engine.unhealthy_after_s``, its open answers end too (`gateway.engines`): a
stream gets its dialect's error event instead of waiting for ``engine.read_timeout_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from gateway.engine_http import EngineConnection
from gateway.errors import EngineUnreachable
from gateway.upstream import SENDING, Upstream, UpstreamAnswer, unread_bytes

log = structlog.get_logger("gateway.upstream")

STALLED = "stalled"
DOWN = "down"


class EngineStalled(EngineUnreachable):
    """503: the request was sent to an engine that stopped answering before it read a byte of
    it (stalled, nothing from it since the send); it goes to another engine. Never a death."""

    def __init__(self) -> None:
        super().__init__(sent=False)


class Rotation:
    """Which engines are stalled, and the wait of requests at them.

    Args:
        apply: called with (engine, stalled) after each change: the owner recomputes the
            engine's place in the admission queue's rotation.
    """

    def __init__(self, apply: Callable[[str, bool], None]) -> None:
        self.stalled: dict[str, str] = {}
        self._apply = apply
        self._left: dict[str, asyncio.Future[str]] = {}

    def set(self, engine: str, live: bool, reason: str | None) -> None:
        """The poller's verdict on ``engine``: ``live`` (a probe answered 200) or not (slow or
        failed with no byte from the engine meanwhile); logs each change
        (``engine_out_of_rotation`` with the reason, ``engine_in_rotation``)."""
        if live:
            if self.stalled.pop(engine, None) is None:
                return
            log.info("engine_in_rotation", engine=engine)
        else:
            if engine in self.stalled:
                return
            self.stalled[engine] = reason or "no answer"
            log.warning("engine_out_of_rotation", engine=engine, reason=reason)
            self.signal(engine, STALLED)
        self._apply(engine, engine in self.stalled)

    def signal(self, engine: str, why: str) -> None:
        """Wake the requests waiting for a first byte of ``engine``: it is ``why`` (`STALLED`,
        `DOWN`)."""
        waiting = self._left.pop(engine, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(why)

    def _next(self, engine: str) -> asyncio.Future[str]:
        waiting = self._left.get(engine)
        if waiting is None or waiting.done():
            waiting = self._left[engine] = asyncio.get_running_loop().create_future()
        return waiting

    async def post(
        self,
        upstream: Upstream,
        path: str,
        body: bytes,
        request_id: str,
        *,
        stream: bool,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamAnswer:
        """`Upstream.post`, given up when the engine fails before the answer's first byte.

        Raises:
            EngineStalled: the engine left rotation with the request still unread in its
                socket (`gateway.upstream.unread_bytes`): it never saw it. The POST is closed;
                an engine that resumes finds its client gone.
            EngineUnreachable: (``sent``) the engine was declared down before the first byte.
            Everything `Upstream.post` raises.
        """
        held: list[EngineConnection] = []
        sending = SENDING.set(held)
        try:
            task = asyncio.ensure_future(
                upstream.post(path, body, request_id, stream=stream, sent=sent)
            )
        finally:
            SENDING.reset(sending)
        try:
            while True:
                left = self._next(upstream.name)
                either: set[asyncio.Future[Any]] = {task, left}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    return task.result()
                if left.result() == DOWN:
                    raise upstream.failed(EngineUnreachable(sent=True))
                if unread_bytes(held):
                    raise upstream.failed(EngineStalled())
        finally:
            task.cancel()
