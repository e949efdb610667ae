"""One request body parsed, checked and planned: in the event loop when small, in a worker
process when large, so ``/health``, ``/ready`` and every stream keep moving meanwhile.

Parsing a JSON body holds the interpreter lock from start to end, and planning it walks every
message in Python: a 21 MB Responses body of 300,000 input items held the event loop for 1.1 s
(measured on a 2-core machine), a 32 MiB one of a million messages for over 2 s. A body over
`OFFLOAD_BYTES` therefore goes to one worker process (``python -m gateway.plan_worker``, a
`gateway.child.Child` started at the first such body, one body at a time), which runs the very
code the event loop runs for a small one (`plan_body`) and sends back the `Planned` result: the
engine's body as bytes and a few facts. The decoded body never exists in the gateway process.

The worker asks the gateway for what lives in the gateway process: a Responses body's
``previous_response_id`` is looked up in the gateway's response store in one round trip.

An Anthropic ``count_tokens`` body goes the same way (`CountAsk`): it is parsed and translated
into the engine's ``/tokenize`` question there.

Frames (`gateway.child`) from gateway to worker: a pickle of the `Job`, then the body; then the
answer to each question the worker asks. From worker to gateway: pickles of ``("get", tenant,
response_id)`` (a question, answered by a pickle of the
`gateway.translate.responses_store.Stored` entry or None), then one of ``("done", result)`` (a
`Planned` body or a `CountAsk`), ``("refused", error class, message, attributes)`` (a
`gateway.errors.GatewayError`, rebuilt by the gateway) or ``("failed", traceback text)`` (a
check met a shape it did not expect: logged by the gateway as ``plan_failed`` and answered 400,
as `gateway.body.unplannable_as_400` does in the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pickle
import sys
import traceback
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

import structlog
from aiohttp import web

from gateway.affinity import session_key
from gateway.body import client_body, unplannable_as_400
from gateway.child import LENGTH, Child, WorkerFailed, frame, read_frame
from gateway.config import Settings, TenantSettings
from gateway.dialects import Dialect, PlanInput
from gateway.errors import BadRequest, GatewayError, PlanWorkerFailed
from gateway.rewrite import RequestPlan, tokenize_ask
from gateway.waiting import PRIORITY_HEADER, background_request

log = structlog.get_logger("gateway.plan_worker")
T = TypeVar("T")

OFFLOAD_BYTES = 1 << 20
"""Bodies larger than this (bytes, after any ``Content-Encoding``) are planned in the worker."""
OFFLOADED_DIALECTS = ("chat", "completions", "messages", "responses")
"""Dialects the worker can plan (it rebuilds them by name)."""
COUNT_TOKENS = "count_tokens"
"""`Job.dialect` of an Anthropic ``count_tokens`` body (`gateway.messages_api.count_ask`)."""
INPUT_ITEMS = "input_items"
"""`Job.dialect` of a page of a stored response's input items
(`gateway.translate.responses_items.items_page`): the body is the stored input, the
``headers`` the page's query parameters."""
RECYCLE_BYTES = 8 << 20
"""After a body larger than this (bytes) the worker is stopped, so the memory its decoding took
(hundreds of MB for tens of MB of JSON, kept by Python's allocator) goes back; the next large
body starts a fresh one (0.6 s measured on a 2-core machine)."""
BODY_HEADERS = (PRIORITY_HEADER, "X-Claude-Code-Session-Id", "X-Session-Id")
"""The request headers planning reads (`gateway.waiting.background_request`,
`gateway.affinity.session_key`), the only ones sent to the worker."""


@dataclass(frozen=True)
class Planned:
    """A planned body.

    Attributes:
        plan: the dialect's `RequestPlan`.
        background: the request says it is background work (`background_request`).
        session: the session it belongs to (`gateway.affinity.session_key`), or None.
    """

    plan: RequestPlan
    background: bool
    session: str | None


@dataclass(frozen=True)
class CountAsk:
    """An Anthropic ``count_tokens`` body made into the engine's question.

    Attributes:
        body: the body of vLLM's ``POST /tokenize`` (UTF-8 JSON).
        session: the session it belongs to (`gateway.affinity.session_key`), or None.
    """

    body: bytes
    session: str | None


def body_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The `BODY_HEADERS` of a request's ``headers``, as the worker gets them."""
    return {name: headers[name] for name in BODY_HEADERS if name in headers}


@dataclass(frozen=True)
class Job:
    """What the worker needs beside the body: the dialect's name, the request's credential
    (the body must not carry it, `gateway.body.client_body`), the `BODY_HEADERS` it sent and
    the fixed facts of `gateway.dialects.PlanInput`."""

    dialect: str
    authorization: str | None
    headers: dict[str, str]
    settings: Settings
    tenant: TenantSettings
    request_id: str
    salt_secret: bytes


def plan_body(
    dialect: Dialect,
    raw: bytes,
    authorization: str | None,
    headers: Mapping[str, str],
    given: PlanInput,
) -> Planned:
    """Parse and check ``raw`` (`gateway.body.client_body`), then let ``dialect`` plan it.

    ``given.body`` is ignored: the parsed ``raw`` takes its place.

    Raises:
        BadRequest: not JSON, the request's own credential in it, a value no answer can carry,
            or a check met a shape it did not expect (`gateway.body.unplannable_as_400`).
        GatewayError: the dialect refused the body (bad field, unknown model, policy).
    """
    body = client_body(raw, authorization)
    with unplannable_as_400():
        background = background_request(headers, body)
        facts = PlanInput(
            body, given.settings, given.tenant, given.request_id, given.salt_secret, background
        )
        plan = dialect.plan(facts)
    return Planned(plan, background, session_key(headers, body))


class PlanWorker:
    """The worker process for large bodies: started on first use, one body at a time, started
    again after it died.

    Args:
        store: answers the worker's look-ups (its ``get(tenant, response_id)``, as
            `gateway.translate.responses_store.ResponseStore.get`).
    """

    def __init__(self, store: Any) -> None:
        self._child = Child("gateway.plan_worker")
        self._store = store
        self._turns = FairTurns()

    async def plan(self, job: Job, raw: bytes) -> Planned:
        """`plan_body` of ``raw`` in the worker.

        Raises:
            GatewayError: what `plan_body` raises, rebuilt from the worker's answer.
            PlanWorkerFailed: the worker died or broke the protocol (logged).
        """
        planned = await self._run(job, raw)
        assert isinstance(planned, Planned), "the worker answers a plan job with a plan"
        return planned

    async def count(self, job: Job, raw: bytes) -> CountAsk:
        """`gateway.messages_api.count_ask` of ``raw`` in the worker (``job.dialect`` is
        `COUNT_TOKENS`).

        Raises:
            GatewayError: what ``count_ask`` raises, rebuilt from the worker's answer.
            PlanWorkerFailed: the worker died or broke the protocol (logged).
        """
        ask = await self._run(job, raw)
        assert isinstance(ask, CountAsk), "the worker answers a count job with a count ask"
        return ask

    async def list_items(self, job: Job, stored: bytes) -> bytes:
        """`gateway.translate.responses_items.items_page` of ``stored`` in the worker
        (``job.dialect`` is `INPUT_ITEMS`, ``job.headers`` the query): the page's JSON.

        Raises:
            GatewayError: what ``items_page`` raises, rebuilt from the worker's answer.
            PlanWorkerFailed: the worker died or broke the protocol (logged).
        """
        page = await self._run(job, stored)
        assert isinstance(page, bytes), "the worker answers a listing job with its page"
        return page

    async def _run(self, job: Job, raw: bytes) -> Any:
        """One job, in its tenant's turn (`FairTurns`): tried again once in a fresh process
        when the worker failed before it answered anything (it had died while idle)."""
        async with self._turns.turn(job.tenant.name):
            try:
                try:
                    return await self._exchange(job, raw)
                except _NoAnswer as first:
                    log.warning("plan_worker_restarted", error=repr(first.__cause__)[:200])
                try:
                    return await self._exchange(job, raw)
                except _NoAnswer as second:
                    raise _failed(job, second.__cause__) from second.__cause__
            finally:
                if len(raw) > RECYCLE_BYTES:
                    self._child.stop()  # idle now: its memory goes back with it

    async def _exchange(self, job: Job, raw: bytes) -> Any:
        """The job's frames to the worker and its answers back.

        Raises:
            _NoAnswer: the worker failed before its first frame (chained to why).
            PlanWorkerFailed: it failed later, or the job (sending the body included) took
                ``server.plan_timeout_s`` (logged).
        """
        child = self._child
        answered = done = False
        loop = asyncio.get_running_loop()
        within_s = job.settings.server.plan_timeout_s
        deadline = loop.time() + within_s

        async def within(step: Awaitable[T]) -> T:
            return await asyncio.wait_for(step, max(0.0, deadline - loop.time()))

        try:
            await child.started()
            # The body's length, then the body itself: `frame` would copy it in one stretch.
            await within(child.send(frame(pickle.dumps(job)), LENGTH.pack(len(raw)), raw))
            while True:
                read = await within(child.read_frame())
                answered = True
                answer = pickle.loads(read)
                if answer[0] == "get":
                    entry = self._store.get(answer[1], answer[2])
                    await within(child.send(frame(pickle.dumps(entry))))
                    continue
                done = True
                return _outcome(answer)
        except WorkerFailed as exc:
            if not answered:
                raise _NoAnswer() from exc
            raise _failed(job, exc) from exc
        except asyncio.TimeoutError as exc:
            raise _failed(job, exc, f"no answer within {within_s:g} s") from None
        except (pickle.UnpicklingError, EOFError, TypeError, IndexError, ValueError) as exc:
            raise _failed(job, exc) from exc
        finally:
            if not done:
                child.stop()

    async def close(self) -> None:
        """Stop the worker process (the gateway shuts down)."""
        await self._child.close()


class _NoAnswer(Exception):
    """The worker failed before it sent any frame of this job."""


def _failed(job: Job, cause: BaseException | None, why: str = "") -> PlanWorkerFailed:
    """The 503 of a job the worker could not finish, logged once as ``plan_worker_failed``;
    its message names what failed (a listing reads no request body)."""
    error = why or f"{type(cause).__name__}: {cause}"
    log.error("plan_worker_failed", error=error[:200], job=job.dialect)
    if job.dialect == INPUT_ITEMS:
        return PlanWorkerFailed("list this stored response's input items")
    return PlanWorkerFailed()


class FairTurns:
    """One holder at a time; waiters are served one tenant after another (round robin, in the
    order tenants first waited), each tenant's in the order they came.

    A tenant sending many large bodies then delays another tenant's large body by at most one
    body of each tenant waiting, not by all of its own.
    """

    def __init__(self) -> None:
        self._busy = False
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        """Wait for ``tenant``'s turn, hold it for the block, then hand it on."""
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, tenant: str) -> None:
        if not self._busy and not self._waiting:
            self._busy = True
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # the turn came as the wait was cancelled: hand it on
            else:
                queue = self._waiting.get(tenant)
                if queue is not None and waiter in queue:
                    queue.remove(waiter)
                    if not queue:
                        del self._waiting[tenant]
            raise

    def _release(self) -> None:
        while self._waiting:
            tenant, queue = next(iter(self._waiting.items()))
            waiter = queue.popleft()
            if queue:
                self._waiting.move_to_end(tenant)
            else:
                del self._waiting[tenant]
            if not waiter.done():
                waiter.set_result(None)  # still busy: the turn passes straight on
                return
        self._busy = False


PLAN_WORKER = web.AppKey("plan_worker", PlanWorker)


def _outcome(answer: tuple[Any, ...]) -> Any:
    """The worker's final answer: its result, or its error raised."""
    kind = answer[0]
    if kind == "done":
        return answer[1]
    if kind == "refused" and isinstance(answer[1], type) and issubclass(answer[1], GatewayError):
        error = answer[1].__new__(answer[1])
        Exception.__init__(error, answer[2])
        error.__dict__.update(answer[3])
        raise error
    if kind == "failed":
        log.error("plan_failed", exception=str(answer[1]))
        raise BadRequest(
            "The request body holds a value of a type or shape this server cannot process."
        )
    raise WorkerFailed(f"unexpected answer {str(kind)[:40]}")


class _Lookup:
    """The worker's stand-in for the response store: each look-up asks the gateway."""

    def __init__(self, stdin: BinaryIO, stdout: BinaryIO) -> None:
        self._stdin = stdin
        self._stdout = stdout

    def get(self, tenant: str, response_id: str) -> Any:
        self._stdout.write(frame(pickle.dumps(("get", tenant, response_id))))
        self._stdout.flush()
        answer = read_frame(self._stdin)
        if answer is None:
            raise SystemExit(0)
        return pickle.loads(answer)

    def put_json(self, *args: Any) -> bool:
        raise AssertionError("planning stores nothing")


def _dialect(name: str, lookup: _Lookup) -> Dialect:
    """The dialect called ``name`` (one of `OFFLOADED_DIALECTS`), as the gateway builds it."""
    if name == "responses":
        from gateway.responses_api import responses_dialect

        return responses_dialect(lookup)  # type: ignore[arg-type]
    if name == "messages":
        from gateway.messages_api import ANTHROPIC

        return ANTHROPIC
    from gateway.dialects import CHAT, COMPLETIONS

    return {"chat": CHAT, "completions": COMPLETIONS}[name]


def _finished(plan: RequestPlan) -> RequestPlan:
    """``plan`` as it travels back: with its ``/tokenize`` body built (counted in
    ``held_extra``), so no count of its prompt decodes the body in the event loop, and without
    the decoded chat body a translated plan keeps (only its ``stop``, which the Anthropic
    answer reads): the gateway needs the engine's bytes, not the decoded body."""
    ask = tokenize_ask(plan.body) or b""
    plan = dataclasses.replace(plan, tokenize_body=ask, held_extra=plan.held_extra + len(ask))
    translated = getattr(plan, "translated", None)
    if translated is None:
        return plan
    stop = translated.chat.get("stop")
    light = dataclasses.replace(translated, chat={} if stop is None else {"stop": stop})
    return dataclasses.replace(plan, translated=light)  # type: ignore[call-arg]


def _serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """The worker's loop: one body after another until stdin closes. Whatever a body makes
    planning or its answer's pickling raise is answered ``("failed", ...)``; the loop itself
    ends only when the gateway goes (a crash is logged as JSON, as the gateway logs)."""
    from gateway.logs import configure_logging

    configure_logging(stream=sys.stderr)  # stdout carries the frames
    lookup = _Lookup(stdin, stdout)
    try:
        while True:
            head = read_frame(stdin)
            if head is None:
                return
            job: Job = pickle.loads(head)
            raw = read_frame(stdin) or b""
            structlog.contextvars.bind_contextvars(request_id=job.request_id)
            answer = _answer(job, raw, lookup)
            del raw
            stdout.write(frame(answer))
            stdout.flush()
    except (BrokenPipeError, KeyboardInterrupt):
        return  # the gateway went
    except Exception:
        log.exception("plan_worker_crashed")
        raise SystemExit(1) from None


def _answer(job: Job, raw: bytes, lookup: _Lookup) -> bytes:
    """The pickled answer to one job (see the module doc)."""
    answer: tuple[Any, ...]
    try:
        result: Any
        if job.dialect == COUNT_TOKENS:
            from gateway.messages_api import count_ask

            result = count_ask(raw, job.authorization, job.headers, job.settings, job.tenant)
        elif job.dialect == INPUT_ITEMS:
            from gateway.translate.responses_items import items_page

            result = items_page(raw, job.headers)
        else:
            given = PlanInput(None, job.settings, job.tenant, job.request_id, job.salt_secret)
            dialect = _dialect(job.dialect, lookup)
            planned = plan_body(dialect, raw, job.authorization, job.headers, given)
            result = dataclasses.replace(planned, plan=_finished(planned.plan))
        answer = ("done", result)
    except GatewayError as exc:
        answer = ("refused", type(exc), exc.args[0] if exc.args else "", exc.__dict__)
    except Exception:  # what unplannable_as_400 logs: here, for the gateway to log
        answer = ("failed", traceback.format_exc(limit=20)[-4000:])
    try:
        return pickle.dumps(answer)
    except Exception:  # an answer that cannot travel is the same kind of fault
        return pickle.dumps(("failed", traceback.format_exc(limit=20)[-4000:]))


if __name__ == "__main__":
    # Through the module's own name, so what is pickled names gateway.plan_worker, not __main__.
    from gateway.plan_worker import _serve as serve

    serve(sys.stdin.buffer, sys.stdout.buffer)
