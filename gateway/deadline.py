"""Refusing at the door what the client will not wait for: a request's deadline, the predicted
wait for an engine slot, and the engine speeds the prediction uses.

A client states how long it waits for bytes: the official SDKs send their read timeout in
``x-stainless-read-timeout`` (``openai`` 3.x and ``anthropic`` 2.x Python SDKs, on every request)
and ``x-stainless-timeout`` (the ``anthropic`` SDKs and Claude Code; seconds, a float); a tenant
may have a default (``tenants.NAME.deadline_s``) for clients that send neither. A non-streamed
answer sends no byte before it is complete, so the deadline bounds its whole wait: queue, prefill
and generation. A stream the gateway keeps alive while it waits (``engine.queued_comment_after_s``,
then a beat every ``server.sse_keepalive_s``, `gateway.waiting`) only needs its first bytes
inside the deadline, so it is admitted whatever the queue.

`Forecaster` predicts when a request would get an engine slot: the work ahead of it in the fair
queue (the order `gateway.admission` would grant: its own tenant's earlier waiters and every
other tenant's waiter whose virtual finish comes first) and the remaining work of the requests
at the engine, laid out on the engines' slots. A request's work is its prompt at the measured
prefill speed plus its expected output (the running mean of recent answers, at most its
``max_tokens``) at the measured decode speed. A request whose predicted slot comes after its
deadline is refused at once (`DeadlineUnmeetable`: 503, Anthropic 529) with the ``Retry-After``
after which the prediction says it would finish in time. The prediction error is exported as
``gateway_queue_start_forecast_error_seconds``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from gateway.admission import AdmissionQueue, Ticket
from gateway.config import DeadlineSettings, ServerSettings
from gateway.errors import EngineUnavailable, retry_after_header
from gateway.metrics import DEADLINE_REASONS, Metrics

if TYPE_CHECKING:
    from gateway.state import ModelCall

log = structlog.get_logger("gateway.deadline")

DEADLINE_HEADERS = ("x-stainless-read-timeout", "x-stainless-timeout")
"""The clients' read timeout, in seconds, first found wins: the Python SDKs send both (the
``openai`` SDK only the first); Claude Code (its bundled ``anthropic`` SDK) the second."""
MAX_DEADLINE_S = 86_400.0
"""A stated deadline above a day is treated as none (the queue never holds a request that long)."""
KEEPALIVE_FALLBACK_S = 5.0
"""The beat of a queued stream when ``server.sse_keepalive_s`` is 0 (`gateway.waiting`)."""
RATE_EWMA_ALPHA = 0.2
"""Weight of the newest sample in the moving seconds-per-token averages."""
OUTPUT_EWMA_ALPHA = 0.1
"""Weight of the newest answer in the moving mean of output tokens per choice."""
MIN_PREFILL_SAMPLE_TOKENS = 256
"""Shorter prompts are not timed: their time to first token is mostly fixed overhead."""
MIN_DECODE_SAMPLE_TOKENS = 16
"""Shorter answers are not timed: a few tokens say little about the decode speed."""
MIN_SAMPLE_S = 0.05
RATE_BOUNDS = (0.5, 1_000_000.0)
"""Tokens/s outside these are taken as these (a clock hiccup, a fully cached prompt)."""

REASON_QUEUE, REASON_STREAM = DEADLINE_REASONS
"""``reason`` label values of ``gateway_deadline_refusals_total``: ``queue``, a non-streamed
request whose slot comes after its deadline; ``stream_silence``, a stream whose keep-alives
would come too late for its deadline (``queued_comment_after_s`` or ``sse_keepalive_s`` at or
above it) and whose slot comes after it."""


class DeadlineUnmeetable(EngineUnavailable):
    """503 (Anthropic 529 ``overloaded_error``): the predicted wait exceeds the client's deadline.

    ``Retry-After``: seconds until the prediction says the request would finish in time.
    """

    code = "engine_overloaded"
    reason = "deadline"


def stated_deadline(headers: Mapping[str, str]) -> tuple[float, str] | None:
    """The client's read timeout from its headers: ``(seconds, header name)``, or None.

    The first of `DEADLINE_HEADERS` that holds a number in (0, `MAX_DEADLINE_S`] wins. Other
    values (``NOT_GIVEN``, which the ``anthropic`` SDK sends on streams, text, negative, zero,
    NaN, infinite, over a day) are ignored with a debug log line: a malformed optional header
    never fails a request.
    """
    for name in DEADLINE_HEADERS:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw[:32])
        except ValueError:
            value = math.nan
        if math.isfinite(value) and 0 < value <= MAX_DEADLINE_S:
            return value, name
        log.debug("deadline_header_ignored", header=name)
    return None


def keepalive_in_time(deadline_s: float, queued_after_s: float, server: ServerSettings) -> bool:
    """True when a waiting stream's bytes reach its client inside ``deadline_s``: its headers
    after ``queued_after_s`` in the queue (0: none while queued), then a beat every
    ``server.sse_keepalive_s`` (5 s when 0)."""
    beat = server.sse_keepalive_s or KEEPALIVE_FALLBACK_S
    return 0 < queued_after_s < deadline_s and beat < deadline_s


@dataclass(frozen=True)
class Work:
    """A request's expected work at the engine, in tokens: its prompt (the engine's count when
    known, else the gateway's estimate) and its expected output (all choices)."""

    prompt: int
    output: int


@dataclass(frozen=True)
class Forecast:
    """When a request would get its slot and finish, in seconds from now.

    Attributes:
        start_s: the predicted wait for an engine slot.
        prefill_s: its own prompt at the prefill speed.
        output_s: its expected output at the decode speed.
        ahead: requests predicted to be granted before it (queued) plus those at the engines.
    """

    start_s: float
    prefill_s: float
    output_s: float
    ahead: int

    @property
    def finish_s(self) -> float:
        """The predicted end of the answer."""
        return self.start_s + self.prefill_s + self.output_s


class _Tracked:
    __slots__ = ("forecast", "observed", "ticket", "work")

    def __init__(self, ticket: Ticket, work: Work, forecast: Forecast) -> None:
        self.ticket = ticket
        self.work = work
        self.forecast = forecast
        self.observed = False


class Forecaster:
    """Engine speeds learned from finished requests, and the wait they predict for a newcomer.

    Speeds are moving averages of seconds per token (alpha `RATE_EWMA_ALPHA`), so one cached
    prompt prefilled at a million tokens/s moves them little: prefill from streamed requests
    (prompt tokens / engine time to the first token, prompts of at least
    `MIN_PREFILL_SAMPLE_TOKENS`), decode from streamed requests (tokens after the first / time
    after it) and from non-streamed ones (output / engine time less the prompt's predicted
    prefill), answers of at least `MIN_DECODE_SAMPLE_TOKENS`. Until measured, ``[deadline]``
    ``prefill_tokens_per_s`` and ``decode_tokens_per_s`` stand (30 tokens/s: one V100 decoding
    one sequence, DEPLOYMENT-NOTES). The expected output of a choice is the moving mean of
    finished answers of the same thinking mode (alpha `OUTPUT_EWMA_ALPHA`; ``[deadline]
    expected_output_tokens`` until the first), never above the request's own ``max_tokens``. An
    answer that used its whole output budget was cut there, so it only says the answer would
    have been at least that long: it may raise the mean, never lower it (a tenant's many
    ``max_tokens: 5`` requests do not make every long answer look short).

    Args:
        metrics: the ``gateway_forecast_*`` and ``gateway_queue_start_forecast_error_seconds``
            families.
        clock: the app's monotonic clock (the admission queue's).
    """

    def __init__(self, metrics: Metrics, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._clock = clock
        self._prefill_spt: float | None = None
        self._decode_spt: float | None = None
        self._output: dict[bool, float] = {}
        self._tracked: dict[int, _Tracked] = {}
        self._settings: DeadlineSettings | None = None  # the last given, for `export`'s gauges
        self._exported = False

    def speeds(
        self, settings: DeadlineSettings, thinking: bool = False
    ) -> tuple[float, float, float]:
        """``(prefill tokens/s, decode tokens/s, expected output tokens per choice)`` in force;
        the output of answers with thinking on or off (a thinking answer is often ten times
        longer)."""
        prefill = 1 / self._prefill_spt if self._prefill_spt else settings.prefill_tokens_per_s
        decode = 1 / self._decode_spt if self._decode_spt else settings.decode_tokens_per_s
        output = self._output.get(thinking, float(settings.expected_output_tokens))
        return prefill, decode, output

    def expected_work(
        self, settings: DeadlineSettings, prompt: int, budget: int, n: int, thinking: bool = False
    ) -> Work:
        """`Work` of a request of ``prompt`` tokens, ``budget`` output tokens at most (all
        choices), ``n`` choices, thinking on or off."""
        mean = self.speeds(settings, thinking)[2]
        return Work(prompt, min(budget, math.ceil(mean * max(1, n))))

    def _seconds(self, settings: DeadlineSettings, work: Work) -> tuple[float, float]:
        prefill, decode, _ = self.speeds(settings)
        return work.prompt / prefill, work.output / decode

    def forecast(
        self,
        queue: AdmissionQueue,
        settings: DeadlineSettings,
        tenant: str,
        work: Work,
        *,
        background: bool = False,
    ) -> Forecast:
        """Predict a newcomer's wait for a slot if it were enqueued now (`AdmissionQueue.enqueue`
        with the same arguments), and its own prefill and output times.

        The waiters ahead are those the fair queue grants first (`AdmissionQueue.ahead_of`);
        they and the requests at the engines (each its expected work less the time it already
        ran, at least 0) are laid out on the slots of the engines in rotation (all of them when
        none is) in grant order, each on the slot that frees first; the newcomer starts when a
        slot frees after them. Session affinity and requests
        arriving later are not foreseen, so the prediction leans early.
        """
        running_now = _granted_at_once(queue)
        if running_now is not None:
            own_prefill, own_output = self._seconds(settings, work)
            return Forecast(0.0, own_prefill, own_output, running_now)
        now = self._clock()
        engines = [e for e in queue.engines.values() if e.ready] or list(queue.engines.values())
        busy: dict[str | None, list[float]] = {}
        for entry in self._tracked.values():
            ticket = entry.ticket
            if ticket.granted and ticket.granted_at is not None:
                prefill_s, output_s = self._seconds(settings, entry.work)
                left = max(0.0, prefill_s + output_s - (now - ticket.granted_at))
                busy.setdefault(ticket.engine, []).append(left)
        ahead = queue.ahead_of(tenant, background=background)
        slots: list[float] = []
        running = free = 0
        for engine in engines:
            taken = sorted(busy.get(engine.name, ()))[: engine.slots]
            running += len(taken)
            slots.extend(taken)
            free += engine.slots - len(taken)
        # Free slots start at 0; the waiters ahead take at most one each, so more than one
        # beyond them never decides the start (thousands of slots cost nothing per request).
        slots.extend([0.0] * min(free, len(ahead) + 1))
        heapq.heapify(slots)
        for ticket in ahead:
            known = self._tracked.get(id(ticket))
            if known is None or known.ticket is not ticket:
                continue  # enqueued outside the model path: no work known
            prefill_s, output_s = self._seconds(settings, known.work)
            heapq.heapreplace(slots, slots[0] + prefill_s + output_s)
        own_prefill, own_output = self._seconds(settings, work)
        start = slots[0] if slots else 0.0
        return Forecast(start, own_prefill, own_output, len(ahead) + running)

    def track(self, ticket: Ticket, work: Work, forecast: Forecast) -> None:
        """Remember an enqueued request's work (the prediction of later ones counts it) and its
        predicted start (`started` measures the error); `settled` forgets it."""
        self._tracked[id(ticket)] = _Tracked(ticket, work, forecast)

    def started(self, ticket: Ticket) -> None:
        """The request got its slot: observe actual minus predicted start, once (requests
        granted at once as predicted are not observed: both are 0)."""
        entry = self._tracked.get(id(ticket))
        if entry is None or entry.observed or entry.ticket is not ticket:
            return
        entry.observed = True
        actual = ticket.waited_s
        predicted = entry.forecast.start_s
        if actual <= 0 and predicted <= 0:
            return
        error = actual - predicted
        direction = "late" if error >= 0 else "early"
        self._metrics.forecast_error.labels(direction).observe(abs(error))
        log.debug("wait_forecast", predicted_start_s=round(predicted, 3), waited_s=round(actual, 3))

    def settled(
        self,
        ticket: Ticket,
        settings: DeadlineSettings,
        *,
        prompt: int | None,
        completion: int | None,
        choices: int,
        first_token_s: float | None,
        complete: bool,
        thinking: bool = False,
        budget: int | None = None,
    ) -> None:
        """Forget a finished request and learn from it.

        Args:
            ticket: its admission ticket (released).
            settings: ``[deadline]`` (the defaults standing before a measurement).
            prompt, completion: the engine's token counts (None: unknown).
            choices: sequences generated (``n``).
            first_token_s: clock reading of its first token at the client (streams), or None.
            complete: the answer ran to its end at the engine (not cut, not refused, a 200).
            thinking: it ran with thinking on (the output mean is kept per mode).
            budget: its output budget per choice (None: unknown); an answer that reached it
                only raises the expected output.
        """
        entry = self._tracked.pop(id(ticket), None)
        granted = ticket.granted_at
        if not complete or granted is None or prompt is None or completion is None:
            return
        mean = completion / max(1, choices)
        old = self._output.get(thinking)
        capped = budget is not None and mean >= budget
        if old is None or not capped or mean > old:
            self._output[thinking] = mean if old is None else old + OUTPUT_EWMA_ALPHA * (mean - old)
        engine_s = self._clock() - granted
        if entry is not None and first_token_s is not None and first_token_s >= granted:
            first = first_token_s - granted
            if prompt >= MIN_PREFILL_SAMPLE_TOKENS and first >= MIN_SAMPLE_S:
                self._prefill_spt = _average(self._prefill_spt, first / prompt)
            decode_s, decoded = engine_s - first, completion - 1
        else:
            decode_s = engine_s - prompt / self.speeds(settings)[0]
            decoded = completion
        if decoded >= MIN_DECODE_SAMPLE_TOKENS and decode_s >= MIN_SAMPLE_S:
            self._decode_spt = _average(self._decode_spt, decode_s / decoded)

    def export(self, settings: DeadlineSettings) -> None:
        """Show the speeds in force in the ``gateway_forecast_*`` gauges, read when scraped
        with the settings last given here (at start and on every reload: a request that
        started before a reload does not bring its older defaults back when it settles)."""
        self._settings = settings
        if self._exported:
            return
        self._exported = True
        speed, output = self._metrics.forecast_speed, self._metrics.forecast_output
        speed.labels("prefill").set_function(lambda: self._gauge(0))
        speed.labels("decode").set_function(lambda: self._gauge(1))
        output.labels("false").set_function(lambda: self._gauge(2, thinking=False))
        output.labels("true").set_function(lambda: self._gauge(2, thinking=True))

    def _gauge(self, index: int, *, thinking: bool = False) -> float:
        settings = self._settings
        assert settings is not None
        return self.speeds(settings, thinking)[index]

    def refused(self, label: str, dialect: str, reason: str) -> None:
        """Count one refusal (``gateway_deadline_refusals_total``)."""
        self._metrics.deadline_refusals.labels(label, dialect, reason).inc()

    def tracked(self) -> int:
        """Requests remembered now (bounded by the queue and the slots)."""
        return len(self._tracked)


def _granted_at_once(queue: AdmissionQueue) -> int | None:
    """The requests at the engines when a newcomer would be granted at once (nobody waits and
    an engine it may go to has a free slot: the ready ones, or all when none is), else None.
    The full layout of `Forecaster.forecast` then predicts a start of 0 too."""
    if queue.depth:
        return None
    running = 0
    some_ready = free_ready = free_any = False
    for engine in queue.engines.values():
        running += min(engine.in_flight, engine.slots)
        free = engine.in_flight < engine.slots
        free_any = free_any or free
        if engine.ready:
            some_ready = True
            free_ready = free_ready or free
    return running if (free_ready if some_ready else free_any) else None


def _average(old: float | None, sample: float) -> float:
    low, high = 1 / RATE_BOUNDS[1], 1 / RATE_BOUNDS[0]
    sample = min(high, max(low, sample))
    return sample if old is None else old + RATE_EWMA_ALPHA * (sample - old)


def retry_after_s(deadline_s: float, forecast: Forecast, own_s: float) -> float:
    """Seconds until the request would finish by its deadline, the work ahead draining in the
    meantime: ``start + own - deadline``, at least until its slot would come inside the deadline,
    at most until the queue ahead is gone (a request longer than its deadline fits never)."""
    start = forecast.start_s
    return min(start, max(start - deadline_s, start + own_s - deadline_s))


def door_check(
    call: ModelCall,
    queue: AdmissionQueue,
    forecaster: Forecaster,
    headers: Mapping[str, str],
) -> None:
    """Refuse ``call`` at once when its client will not wait for it; no effect without a deadline.

    The deadline is the client's (`stated_deadline`), else its tenant's ``deadline_s``. A stream
    whose keep-alives reach the client in time (`keepalive_in_time`) is admitted; any other
    request is refused when its predicted slot comes after its deadline: the work ahead alone
    says it cannot finish in time, whatever its own answer's length (unknown before it runs).

    Raises:
        DeadlineUnmeetable: the refusal (counted in ``gateway_deadline_refusals_total``, logged
            once as ``deadline_refused``).
    """
    settings = call.settings
    if not settings.deadline.enabled:
        return
    stated = stated_deadline(headers)
    if stated is not None:
        deadline_s, source = stated
    elif call.caller.tenant.deadline_s > 0:
        deadline_s, source = call.caller.tenant.deadline_s, "tenant"
    else:
        return
    plan = call.plan
    assert plan is not None
    queued_after = settings.engine.queued_comment_after_s
    if plan.stream and keepalive_in_time(deadline_s, queued_after, settings.server):
        return
    _, forecast = predict(call, queue, forecaster)
    if forecast.start_s <= deadline_s:
        return
    own = forecast.prefill_s if plan.stream else forecast.prefill_s + forecast.output_s
    wait = retry_after_s(deadline_s, forecast, own)
    reason = REASON_STREAM if plan.stream else REASON_QUEUE
    forecaster.refused(call.caller.label, call.dialect.name, reason)
    log.info(
        "deadline_refused",
        deadline_s=round(deadline_s, 3),
        source=source,
        stream=plan.stream,
        predicted_start_s=round(forecast.start_s, 3),
        predicted_finish_s=round(forecast.finish_s, 3),
        ahead=forecast.ahead,
        retry_after_s=retry_after_header(wait),
    )
    raise DeadlineUnmeetable(
        f"The engine is busy: this request would wait about {math.ceil(forecast.start_s)} s "
        f"for it ({forecast.ahead} requests ahead), longer than the client's timeout of "
        f"{deadline_s:g} s. Retry in about {retry_after_header(wait)} s, or stream the "
        "request (a stream is kept alive while it waits).",
        wait,
    )


def plan_work(call: ModelCall, forecaster: Forecaster) -> Work:
    """The expected `Work` of ``call`` (its plan's prompt and output budget)."""
    plan = call.plan
    assert plan is not None
    return forecaster.expected_work(
        call.settings.deadline,
        plan.prompt_fallback,
        plan.output_tokens,
        plan.n,
        bool(plan.thinking),
    )


def predict(
    call: ModelCall, queue: AdmissionQueue, forecaster: Forecaster
) -> tuple[Work, Forecast]:
    """``call``'s expected work (`plan_work`) and `Forecaster.forecast` for it as
    `gateway.proxy` would enqueue it."""
    tenant = call.caller.tenant
    work = plan_work(call, forecaster)
    forecast = forecaster.forecast(
        queue, call.settings.deadline, tenant.name, work, background=call.background
    )
    return work, forecast


def enqueued(call: ModelCall, forecaster: Forecaster, work: Work, forecast: Forecast) -> None:
    """Track ``call``'s ticket (just enqueued, its work and prediction from `predict`)."""
    assert call.ticket is not None
    forecaster.track(call.ticket, work, forecast)


def finished(call: ModelCall, forecaster: Forecaster) -> None:
    """Forget ``call``'s ticket and learn the engine's speeds from it (an answer the engine
    completed: its final usage came)."""
    ticket = call.ticket
    if ticket is None:
        return
    usage = call.usage
    first = call.context.started + call.ttft_s if call.ttft_s is not None else None
    forecaster.settled(
        ticket,
        call.settings.deadline,
        prompt=usage.prompt_tokens,
        completion=usage.completion_tokens,
        choices=call.plan.n if call.plan is not None else 1,
        first_token_s=first,
        complete=usage.settled and usage.source == "engine",
        thinking=call.plan is not None and bool(call.plan.thinking),
        budget=call.plan.max_output if call.plan is not None else None,
    )
