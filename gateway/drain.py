"""Graceful shutdown state shared by the listener and every model request path.

The drain on SIGTERM (uvicorn's and Kubernetes' order): stop accepting, fail what waits in the
queue with 503 and ``Retry-After`` (it never started), refuse new model requests with the same
503, let requests at the engine run for up to ``server.shutdown_grace_s``, then end the ones
still open: a stream gets one final SSE error event (code ``shutting_down``) instead of a silent
cut, and its access line says ``reason="shutdown"``, not a client disconnect.

A request path takes part by running its engine call inside ``with drain.track():`` and, when
it catches `asyncio.CancelledError`, asking `Drain.cut_by_shutdown` whether the cancellation was
the drain's, in which case it ends its response with `Drain.error` and returns instead of
re-raising. The whole request runs inside ``with drain.answering():``, so the drain also waits
for the stages before the engine, and one cut there is answered 503.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from gateway.errors import EngineUnavailable

SHUTDOWN_MESSAGE = "qwen38-gateway shutdown"
# Retry-After for requests refused during a drain: a restart of the gateway takes a few seconds;
# a client behind a load balancer retries on another replica at once anyway.
RETRY_AFTER_SHUTDOWN_S = 5.0


class Drain:
    """Shutdown state: `begin` at SIGTERM, `expire` when the grace ends.

    Attributes:
        announced: True from `announce` on: ``/ready`` answers 503 so that load balancers
            (HAProxy's health check) stop sending new connections, while requests are still
            served for ``server.drain_delay_s``.
        draining: True from `begin` on: new model requests are refused.
        expired: True from `expire` on: requests still open are being ended.
        forced: True from `force` on: a second signal, the process exits at once; requests
            still open are cut without an answer's end (logged ``reason="shutdown"``, not as
            clients that left).
    """

    def __init__(self) -> None:
        self.announced = False
        self.draining = False
        self.expired = False
        self.forced = False
        self.began_at: float | None = None
        self._tasks: dict[asyncio.Task[object], int] = {}  # task: how many `track`s hold it
        self._tracking = _Tracking(self, answering=False)
        self._answering = _Tracking(self, answering=True)
        self._uploading: set[asyncio.Task[object]] = set()  # tasks reading a request's body
        self._upload = _Marking(self._uploading)
        self._cut: set[asyncio.Task[object]] = set()  # uploads the drain ended
        self._requests: set[asyncio.Task[object]] = set()  # tasks inside `answering`
        self._delegated: set[asyncio.Task[object]] = set()  # answered by another task's work
        self._delegating = _Marking(self._delegated)

    @staticmethod
    def error() -> EngineUnavailable:
        """The 503 for requests refused or ended by the drain (``Retry-After`` 5 s)."""
        return EngineUnavailable(
            "The gateway is shutting down. Retry shortly.",
            retry_after_s=RETRY_AFTER_SHUTDOWN_S,
            code="shutting_down",
            reason="shutdown",
        )

    @property
    def open_requests(self) -> int:
        """Model requests inside `answering` now (one per client connection; a request's
        retry leader runs in a task of its own, tracked but not counted here)."""
        return len(self._requests)

    @property
    def busy(self) -> bool:
        """Some task is inside `track` or `answering`: what the drain waits for."""
        return bool(self._tasks)

    def track(self) -> _Tracking:
        """Register the current task as a model request the drain waits for and may end, until
        the outermost ``track`` of the task ends (they nest). A context manager."""
        return self._tracking

    def answering(self) -> _Tracking:
        """`track` a whole model request, from reading its body to its answer: the drain waits
        for it at every stage (the body, its plan, a prompt count before admission, the queue,
        the engine), and a cancellation by `expire` that reaches here (a stage that had sent
        nothing yet: the engine stage ends its own answer) becomes `error` raised, a 503 the
        error middleware answers, not a connection cut as if the client had left. A context
        manager.

        Raises:
            EngineUnavailable: the grace ended before the request had sent anything (`error`).
        """
        return self._answering

    def uploading(self) -> _Marking:
        """A context manager around the read of a request's body: the drain ends such a read
        as it begins (`end_uploads`)."""
        return self._upload

    def delegating(self) -> _Marking:
        """A context manager around a request's wait for a generation another task runs (a
        retry flight's leader task, or the flight a retry attached to): `expire` ends that
        task, whose stream then ends with the drain's error event, and this one relays that
        end; cancelling the waiting one too would answer a second time on a stream already
        under way."""
        return self._delegating

    def end_uploads(self) -> int:
        """Cancel every request still reading its body (their ``answering`` answers 503); how
        many. Once the listeners close, aiohttp reads nothing more from any connection
        (``RequestHandler.close``), so such a body can never arrive: waiting for it would
        only hold the drain for its grace."""
        cut = [task for task in self._uploading if not task.done()]
        for task in cut:
            self._cut.add(task)
            task.cancel(SHUTDOWN_MESSAGE)
        return len(cut)

    def cut_by_shutdown(self) -> bool:
        """True inside a tracked task whose cancellation came from `expire`, or from
        `end_uploads`."""
        task = asyncio.current_task()
        return (self.expired and task in self._tasks) or task in self._cut

    def announce(self) -> None:
        """A drain is coming: ``/ready`` says 503 from now on."""
        self.announced = True

    def begin(self) -> None:
        """Start draining: from now on `draining` is True."""
        self.announced = True
        if not self.draining:
            self.draining = True
            self.began_at = time.monotonic()

    def force(self) -> None:
        """A second signal: the process exits now, cutting what is still open."""
        self.forced = True

    def expire(self) -> int:
        """The grace is over: cancel every tracked task (their requests end with `error`);
        returns how many requests (`open_requests`) that ends."""
        self.expired = True
        requests = len(self._requests)
        for task in list(self._tasks):
            if task not in self._delegated:  # it ends with the task it waits for
                task.cancel(SHUTDOWN_MESSAGE)
        return requests


class _Tracking:
    """The context manager of `Drain.track` (``answering`` False) and `Drain.answering`.

    One object per drain serves every request: what it tracks is the current task, counted in
    the drain's table (entries nest). A class rather than a generator-based context manager:
    it is entered and left twice by every model request.
    """

    __slots__ = ("_answering", "_drain")

    def __init__(self, drain: Drain, *, answering: bool) -> None:
        self._drain = drain
        self._answering = answering

    def __enter__(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            tasks = self._drain._tasks
            tasks[task] = tasks.get(task, 0) + 1
            if self._answering:
                self._drain._requests.add(task)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        drain = self._drain
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - always inside a handler task
            return
        # Whether the drain cut this request is read before the task leaves the table.
        cut = (
            self._answering
            and kind is not None
            and issubclass(kind, asyncio.CancelledError)
            and not drain.forced
            and drain.cut_by_shutdown()
        )
        tasks = drain._tasks
        held = tasks.pop(task) - 1
        if held:
            tasks[task] = held
        else:
            drain._cut.discard(task)
        if self._answering:
            drain._requests.discard(task)
        if cut:
            if hasattr(task, "uncancel"):
                task.uncancel()  # handled: the 503 below is the answer
            error = drain.error()
            error.headers["Connection"] = "close"  # nothing more is read on this connection
            raise error from None


class _Marking:
    """`Drain.uploading`'s and `Drain.delegating`'s context manager: the current task is in
    ``tasks`` meanwhile. One object per drain and set serves every request."""

    __slots__ = ("_tasks",)

    def __init__(self, tasks: set[asyncio.Task[object]]) -> None:
        self._tasks = tasks

    def __enter__(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.discard(task)
