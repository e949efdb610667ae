"""The wait prediction behind deadline refusals (gateway/deadline.py), in process: the clients'
timeout headers, the fair queue's order as predicted, the slot layout, the speeds learned from
finished requests, Retry-After and the error metric."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission import AdmissionQueue, Ticket
from gateway.config import DeadlineSettings, ServerSettings
from gateway.deadline import (
    Forecast,
    Forecaster,
    Work,
    keepalive_in_time,
    retry_after_s,
    stated_deadline,
)
from gateway.metrics import Metrics
from tests.clock import FakeClock
from tests.test_admission import drain_order

pytestmark = pytest.mark.fast

SPEEDS = DeadlineSettings(
    decode_tokens_per_s=10.0, prefill_tokens_per_s=1000.0, expected_output_tokens=100
)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    """One sample's value from the registry (0 when absent)."""
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"x-stainless-read-timeout": "600"}, (600.0, "x-stainless-read-timeout")),
        ({"x-stainless-timeout": "7.5"}, (7.5, "x-stainless-timeout")),
        (
            {"x-stainless-read-timeout": "12", "x-stainless-timeout": "30"},
            (12.0, "x-stainless-read-timeout"),
        ),
        (
            {"x-stainless-timeout": "NOT_GIVEN", "x-stainless-read-timeout": "600"},
            (600.0, "x-stainless-read-timeout"),
        ),
        (
            {"x-stainless-read-timeout": "NOT_GIVEN", "x-stainless-timeout": "9"},
            (9.0, "x-stainless-timeout"),
        ),
        ({"x-stainless-timeout": "-5"}, None),
        ({"x-stainless-timeout": "0"}, None),
        ({"x-stainless-timeout": "nan"}, None),
        ({"x-stainless-timeout": "inf"}, None),
        ({"x-stainless-timeout": "1e400"}, None),
        ({"x-stainless-timeout": "86401"}, None),
        ({"x-stainless-timeout": "ten"}, None),
        ({"x-stainless-timeout": ""}, None),
        ({}, None),
    ],
)
def test_a_stated_timeout_is_read_and_a_malformed_one_ignored(
    headers: dict[str, str], expected: tuple[float, str] | None
) -> None:
    """Both SDK headers are read (read timeout first); any unusable value counts as none."""
    assert stated_deadline(headers) == expected


def test_a_stream_is_kept_alive_when_its_beats_come_inside_the_deadline() -> None:
    """Queued streams get bytes after queued_comment_after_s, then every sse_keepalive_s."""
    server = ServerSettings(sse_keepalive_s=5.0)
    assert keepalive_in_time(10.0, 3.0, server)
    assert not keepalive_in_time(4.0, 3.0, server)  # the beat after the opening is too late
    assert not keepalive_in_time(2.0, 3.0, server)  # opened after the client gave up
    assert not keepalive_in_time(600.0, 0.0, server)  # no keep-alives while queued
    assert keepalive_in_time(6.0, 1.0, ServerSettings(sse_keepalive_s=0.0))  # 5 s fallback


@pytest.mark.parametrize("seed", range(40))
def test_the_predicted_order_is_the_fair_queues_grant_order(seed: int) -> None:
    """ahead_of names exactly the waiters the weighted fair queue grants before a newcomer."""
    rng = random.Random(seed)
    queue = AdmissionQueue(1, 1000, 60.0, Metrics(CollectorRegistry()))
    weights = {name: rng.choice((0.5, 1.0, 2.0, 4.0)) for name in "abcde"}
    holder = queue.enqueue("z", 1.0, 50)
    waiting = []
    for _ in range(rng.randint(0, 14)):
        tenant = rng.choice("abcde")
        waiting.append(
            queue.enqueue(
                tenant, weights[tenant], rng.randint(10, 5000), background=rng.random() < 0.2
            )
        )
    tenant = rng.choice("abcdez")
    background = rng.random() < 0.3
    predicted = queue.ahead_of(tenant, background=background)
    newcomer = queue.enqueue(tenant, weights.get(tenant, 1.0), 300, background=background)
    order = drain_order(queue, holder, [*waiting, newcomer])
    assert predicted == order[: order.index(newcomer)]


def track_waiting(queue: AdmissionQueue, forecaster: Forecaster, tenant: str, work: Work) -> Ticket:
    """Enqueue and track one request the way the model path does."""
    forecast = forecaster.forecast(queue, SPEEDS, tenant, work)
    ticket = queue.enqueue(tenant, 1.0, work.prompt + work.output)
    forecaster.track(ticket, work, forecast)
    return ticket


def test_the_wait_is_the_work_ahead_on_one_slot() -> None:
    """One slot: the running request's remaining work plus the work of every queued request
    the fair queue grants first."""
    clock = FakeClock()
    queue = AdmissionQueue(1, 64, 600.0, Metrics(CollectorRegistry()), clock=clock)
    forecaster = Forecaster(Metrics(CollectorRegistry()), clock)
    work = Work(prompt=1000, output=100)  # 1 s of prefill, 10 s of output at SPEEDS
    running = track_waiting(queue, forecaster, "a", work)
    assert running.granted
    clock.advance(4.0)
    track_waiting(queue, forecaster, "a", work)
    track_waiting(queue, forecaster, "b", work)
    forecast = forecaster.forecast(queue, SPEEDS, "a", Work(prompt=2000, output=50))
    assert forecast.start_s == pytest.approx(7.0 + 11.0 + 11.0)
    assert (forecast.prefill_s, forecast.output_s) == (pytest.approx(2.0), pytest.approx(5.0))
    assert forecast.finish_s == pytest.approx(36.0)
    assert forecast.ahead == 3
    # A tenant that has had no share yet goes before a's second request (fair order).
    other = forecaster.forecast(queue, SPEEDS, "c", work)
    assert (other.start_s, other.ahead) == (pytest.approx(7.0 + 11.0), 2)
    # A request past its expected time counts as about to end, never as negative work.
    clock.advance(20.0)
    assert forecaster.forecast(queue, SPEEDS, "a", work).start_s == pytest.approx(22.0)


def test_the_work_ahead_is_laid_out_on_several_slots() -> None:
    """Two slots: each request ahead goes to the slot that frees first."""
    clock = FakeClock()
    queue = AdmissionQueue(2, 64, 600.0, Metrics(CollectorRegistry()), clock=clock)
    forecaster = Forecaster(Metrics(CollectorRegistry()), clock)
    assert forecaster.forecast(queue, SPEEDS, "a", Work(10, 10)).start_s == 0.0
    track_waiting(queue, forecaster, "a", Work(0, 300))  # 30 s
    assert forecaster.forecast(queue, SPEEDS, "b", Work(10, 10)).start_s == 0.0  # a free slot
    track_waiting(queue, forecaster, "b", Work(0, 100))  # 10 s
    track_waiting(queue, forecaster, "c", Work(0, 50))  # after b: 10 .. 15 s
    track_waiting(queue, forecaster, "d", Work(0, 100))  # after c: 15 .. 25 s
    assert forecaster.forecast(queue, SPEEDS, "e", Work(0, 10)).start_s == pytest.approx(25.0)


def test_only_engines_in_rotation_take_the_work_ahead() -> None:
    """Two one-slot engines, one out of rotation: the work ahead runs on the other alone."""
    clock = FakeClock()
    queue = AdmissionQueue(
        1, 64, 600.0, Metrics(CollectorRegistry()), clock=clock, engines=[("e1", 1), ("e2", 1)]
    )
    forecaster = Forecaster(Metrics(CollectorRegistry()), clock)
    track_waiting(queue, forecaster, "a", Work(0, 100))  # 10 s on e1
    track_waiting(queue, forecaster, "b", Work(0, 200))  # 20 s on e2
    track_waiting(queue, forecaster, "c", Work(0, 50))  # waits for e1: 10 .. 15 s
    assert forecaster.forecast(queue, SPEEDS, "d", Work(0, 10)).start_s == pytest.approx(15.0)
    queue.set_ready("e1", False)
    # e2 alone: its 20 s, then c's 5 s.
    assert forecaster.forecast(queue, SPEEDS, "d", Work(0, 10)).start_s == pytest.approx(25.0)


def test_the_expected_output_is_the_running_mean_capped_by_the_budget() -> None:
    """A max_tokens far above the usual answer is not what the wait is predicted with."""
    forecaster = Forecaster(Metrics(CollectorRegistry()), FakeClock())
    assert forecaster.expected_work(SPEEDS, 500, 32_768, 1) == Work(500, 100)
    assert forecaster.expected_work(SPEEDS, 500, 40, 1) == Work(500, 40)
    assert forecaster.expected_work(SPEEDS, 500, 32_768, 3) == Work(500, 300)


def settle_one(
    forecaster: Forecaster,
    queue: AdmissionQueue,
    clock: FakeClock,
    *,
    prompt: int,
    completion: int,
    first_after_s: float | None,
    total_s: float,
) -> None:
    """Run one request on an idle one-slot queue for ``total_s`` and settle it."""
    work = Work(prompt, completion)
    forecast = forecaster.forecast(queue, SPEEDS, "a", work)
    ticket = queue.enqueue("a", 1.0, prompt + completion)
    forecaster.track(ticket, work, forecast)
    start = clock()
    clock.advance(total_s)
    ticket.release(prompt + completion)
    forecaster.settled(
        ticket,
        SPEEDS,
        prompt=prompt,
        completion=completion,
        choices=1,
        first_token_s=None if first_after_s is None else start + first_after_s,
        complete=True,
    )


def test_speeds_are_learned_from_finished_requests() -> None:
    """Streams time the prefill and the decode; non-streamed answers the decode; the gauges
    show the speeds in force; nothing stays tracked."""
    clock = FakeClock()
    metrics = Metrics(CollectorRegistry())
    queue = AdmissionQueue(1, 64, 600.0, metrics, clock=clock)
    forecaster = Forecaster(metrics, clock)
    forecaster.export(SPEEDS)
    assert sample(metrics, "gateway_forecast_tokens_per_second", phase="decode") == 10.0
    # A stream: 4,000 prompt tokens in 2 s, then 201 tokens in 10 s.
    settle_one(forecaster, queue, clock, prompt=4000, completion=201, first_after_s=2.0, total_s=12)
    prefill, decode, output = forecaster.speeds(SPEEDS)
    assert (prefill, decode, output) == (pytest.approx(2000.0), pytest.approx(20.0), 201)
    assert sample(metrics, "gateway_forecast_tokens_per_second", phase="prefill") == 2000.0
    assert sample(metrics, "gateway_forecast_output_tokens", thinking="false") == 201
    assert sample(metrics, "gateway_forecast_output_tokens", thinking="true") == 100
    # Non-streamed: 2,000 prompt tokens (1 s at 2,000/s), then 100 tokens in 4 s: 25 tokens/s.
    settle_one(forecaster, queue, clock, prompt=2000, completion=100, first_after_s=None, total_s=5)
    _, decode, output = forecaster.speeds(SPEEDS)
    spt = 1 / 20 + 0.2 * (1 / 25 - 1 / 20)
    assert decode == pytest.approx(1 / spt)
    assert output == pytest.approx(201 + 0.1 * (100 - 201))
    # Too short to time: the speeds stay.
    settle_one(forecaster, queue, clock, prompt=10, completion=3, first_after_s=0.01, total_s=0.02)
    assert forecaster.speeds(SPEEDS)[1] == pytest.approx(decode)
    assert forecaster.tracked() == 0


def answer_once(
    forecaster: Forecaster,
    queue: AdmissionQueue,
    clock: FakeClock,
    completion: int,
    *,
    budget: int | None = None,
    thinking: bool = False,
) -> None:
    """One complete non-streamed answer of ``completion`` tokens (50 prompt tokens, 1 s)."""
    ticket = queue.enqueue("a", 1.0, 100)
    forecaster.track(ticket, Work(50, completion), Forecast(0, 0, 0, 0))
    clock.advance(1)
    ticket.release()
    forecaster.settled(
        ticket,
        SPEEDS,
        prompt=50,
        completion=completion,
        choices=1,
        first_token_s=None,
        complete=True,
        thinking=thinking,
        budget=budget,
    )


def test_the_expected_output_is_kept_per_thinking_mode() -> None:
    """Long thinking answers do not lengthen the expected output of answers without thinking."""
    clock = FakeClock()
    queue = AdmissionQueue(1, 64, 600.0, Metrics(CollectorRegistry()), clock=clock)
    forecaster = Forecaster(Metrics(CollectorRegistry()), clock)
    answer_once(forecaster, queue, clock, 3000, thinking=True)
    assert forecaster.expected_work(SPEEDS, 10, 32_768, 1, thinking=True) == Work(10, 3000)
    assert forecaster.expected_work(SPEEDS, 10, 32_768, 1, thinking=False) == Work(10, 100)


def test_answers_cut_at_their_budget_never_shorten_the_expected_output() -> None:
    """Many answers that hit a tiny max_tokens leave the expected output where the answers that
    ended by themselves put it; one cut above it still raises it."""
    clock = FakeClock()
    queue = AdmissionQueue(1, 64, 600.0, Metrics(CollectorRegistry()), clock=clock)
    forecaster = Forecaster(Metrics(CollectorRegistry()), clock)

    def answer(completion: int, budget: int) -> None:
        answer_once(forecaster, queue, clock, completion, budget=budget)

    answer(900, 4096)  # ended by itself: the mean is 900
    for _ in range(50):
        answer(4, 4)  # max_tokens 4, used to the end
    assert forecaster.speeds(SPEEDS)[2] == 900
    answer(3, 4)  # ended by itself below its budget: a real short answer counts
    assert forecaster.speeds(SPEEDS)[2] == pytest.approx(900 + 0.1 * (3 - 900))
    before = forecaster.speeds(SPEEDS)[2]
    answer(2000, 2000)  # cut at 2,000: at least that long, so the mean rises
    assert forecaster.speeds(SPEEDS)[2] > before


def test_a_cut_request_teaches_nothing_and_is_forgotten() -> None:
    """A request that did not complete (cut, refused by the engine) moves no speed."""
    clock = FakeClock()
    queue = AdmissionQueue(1, 64, 600.0, Metrics(CollectorRegistry()), clock=clock)
    forecaster = Forecaster(Metrics(CollectorRegistry()), clock)
    ticket = queue.enqueue("a", 1.0, 100)
    forecaster.track(ticket, Work(50, 50), Forecast(0, 0, 0, 0))
    clock.advance(30)
    ticket.release()
    forecaster.settled(
        ticket, SPEEDS, prompt=5000, completion=500, choices=1, first_token_s=None, complete=False
    )
    assert forecaster.speeds(SPEEDS) == (1000.0, 10.0, 100)
    assert forecaster.tracked() == 0


def test_the_forecast_error_is_observed_once_per_queued_request() -> None:
    """actual - predicted start goes to the histogram by direction; at-once grants are skipped."""
    clock = FakeClock()
    metrics = Metrics(CollectorRegistry())
    queue = AdmissionQueue(1, 64, 600.0, metrics, clock=clock)
    forecaster = Forecaster(metrics, clock)
    first = track_waiting(queue, forecaster, "a", Work(0, 100))  # 10 s predicted
    forecaster.started(first)
    second = track_waiting(queue, forecaster, "b", Work(0, 100))
    third = track_waiting(queue, forecaster, "c", Work(0, 100))
    clock.advance(13.0)
    first.release()
    forecaster.started(second)
    forecaster.started(second)
    clock.advance(2.0)
    second.release()
    forecaster.started(third)
    name = "gateway_queue_start_forecast_error_seconds"
    assert sample(metrics, f"{name}_count", direction="late") == 1  # 13 s for 10 s
    assert sample(metrics, f"{name}_sum", direction="late") == pytest.approx(3.0)
    assert sample(metrics, f"{name}_count", direction="early") == 1  # 15 s for 20 s
    assert sample(metrics, f"{name}_sum", direction="early") == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("deadline", "start", "own", "expected"),
    [
        (10.0, 30.0, 5.0, 25.0),  # finishes by the deadline once 25 s of work drained
        (10.0, 30.0, 0.0, 20.0),  # at least until its slot comes inside the deadline
        (10.0, 30.0, 60.0, 30.0),  # longer than its deadline: when the queue ahead is gone
    ],
)
def test_retry_after_is_when_the_request_would_finish_in_time(
    deadline: float, start: float, own: float, expected: float
) -> None:
    """Retry-After: start + own - deadline, clamped to [start - deadline, start]."""
    forecast = Forecast(start, own, 0.0, 3)
    assert retry_after_s(deadline, forecast, own) == pytest.approx(expected)
    assert math.ceil(expected) >= 1


def test_forecast_gauges_keep_a_reloads_defaults_when_an_older_request_settles() -> None:
    """The ``gateway_forecast_*`` gauges show the defaults of the last reload (`export`) until a
    speed is measured: a request that started before the reload settling with its own older
    settings does not bring those back."""
    clock = FakeClock()
    metrics = Metrics(CollectorRegistry())
    queue = AdmissionQueue(1, 64, 600.0, metrics, clock=clock)
    forecaster = Forecaster(metrics, clock)
    forecaster.export(SPEEDS)
    reloaded = dataclasses.replace(SPEEDS, prefill_tokens_per_s=555.0, expected_output_tokens=77)
    forecaster.export(reloaded)
    assert sample(metrics, "gateway_forecast_tokens_per_second", phase="prefill") == 555.0
    # An old request settles with the settings it started under: too short to measure a speed.
    ticket = queue.enqueue("a", 1.0, 10)
    forecaster.track(ticket, Work(5, 5), forecaster.forecast(queue, SPEEDS, "a", Work(5, 5)))
    clock.advance(0.001)
    ticket.release(10)
    forecaster.settled(
        ticket, SPEEDS, prompt=5, completion=5, choices=1, first_token_s=None, complete=True
    )
    assert sample(metrics, "gateway_forecast_tokens_per_second", phase="prefill") == 555.0
    assert sample(metrics, "gateway_forecast_output_tokens", thinking="true") == 77
