"""The admission queue: slots, weighted fair order, refusals, timeouts and cancellation."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission import DEFAULT_SERVICE_S, AdmissionQueue, Ticket
from gateway.errors import EngineUnavailable, RateLimited
from gateway.metrics import Metrics
from tests.clock import FakeClock

pytestmark = pytest.mark.fast


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(CollectorRegistry())


def queue_of(
    metrics: Metrics,
    max_concurrency: int = 1,
    queue_size: int = 64,
    queue_timeout_s: float = 30.0,
    **kwargs: object,
) -> AdmissionQueue:
    return AdmissionQueue(
        max_concurrency,
        queue_size,
        queue_timeout_s,
        metrics,
        **kwargs,  # type: ignore[arg-type]
    )


def drain_order(queue: AdmissionQueue, holder: Ticket, waiting: list[Ticket]) -> list[Ticket]:
    """Release the running ticket, then each granted one (one slot), until every waiter has
    run; the waiters in the order granted."""
    order: list[Ticket] = []
    current = holder
    left = list(waiting)
    while left:
        current.release()
        granted = [t for t in left if t.granted]
        assert len(granted) == 1
        current = granted[0]
        left.remove(current)
        order.append(current)
    current.release()
    return order


def grant_order(queue: AdmissionQueue, first: Ticket, waiting: list[Ticket]) -> list[str]:
    """Finish requests one at a time (one slot) and return the tenants in the order granted."""
    return [ticket.tenant for ticket in drain_order(queue, first, waiting)]


async def test_grants_at_once_while_a_slot_is_free(metrics: Metrics) -> None:
    """With free slots and nobody waiting a ticket is granted at enqueue; release frees it."""
    queue = queue_of(metrics, max_concurrency=2)
    a = queue.enqueue("a", 1.0, 100)
    b = queue.enqueue("b", 1.0, 100)
    assert a.granted and b.granted
    assert await a.wait() is True
    assert queue.in_flight == 2
    c = queue.enqueue("c", 1.0, 100)
    assert not c.granted and queue.depth == 1
    a.release()
    a.release()
    assert c.granted and queue.in_flight == 2 and queue.depth == 0
    b.release()
    c.release()
    assert queue.in_flight == 0


async def test_own_requests_stay_in_order(metrics: Metrics) -> None:
    """One tenant's waiters are granted first come, first served, whatever their costs."""
    queue = queue_of(metrics)
    first = queue.enqueue("a", 1.0, 10)
    costs = [5000, 10, 800, 1, 30000, 70]
    waiting = [queue.enqueue("a", 1.0, c) for c in costs]
    order_costs = []
    current = first
    for _ in costs:
        current.release()
        current = next(t for t in waiting if t.granted)
        waiting.remove(current)
        order_costs.append(current.cost)
    assert order_costs == costs


async def test_flooding_tenant_cannot_starve_another(metrics: Metrics) -> None:
    """A enqueues 30, B 3 slightly later: B's are all served long before A's backlog drains."""
    queue = queue_of(metrics)
    first = queue.enqueue("a", 1.0, 1000)
    a_waiting = [queue.enqueue("a", 1.0, 1000) for _ in range(29)]
    b_waiting = [queue.enqueue("b", 1.0, 1000) for _ in range(3)]
    order = grant_order(queue, first, a_waiting + b_waiting)
    last_b = max(i for i, tenant in enumerate(order) if tenant == "b")
    assert last_b <= 6
    assert order.count("a") == 29


async def test_fair_by_tokens_not_requests(metrics: Metrics) -> None:
    """8k-token requests of A do not crowd out 100-token requests of B: B gets ~80 per A's one."""
    queue = queue_of(metrics, queue_size=100)
    first = queue.enqueue("a", 1.0, 8000)
    a_waiting = [queue.enqueue("a", 1.0, 8000) for _ in range(5)]
    b_waiting = [queue.enqueue("b", 1.0, 100) for _ in range(60)]
    order = grant_order(queue, first, a_waiting + b_waiting)
    # Virtual finish times: A 8000 after its first; B 100 .. 6000, all below it.
    assert order[:60] == ["b"] * 60


async def test_weights_share_the_engine(metrics: Metrics) -> None:
    """Weight 3 against weight 1 with equal costs: three grants to one while both wait."""
    queue = queue_of(metrics)
    first = queue.enqueue("x", 1.0, 100)
    heavy = [queue.enqueue("a", 3.0, 100) for _ in range(12)]
    light = [queue.enqueue("b", 1.0, 100) for _ in range(12)]
    order = grant_order(queue, first, heavy + light)
    assert order[:16].count("a") == 12
    assert order[:16].count("b") == 4


async def test_queue_full_429_for_tenant_at_share_503_for_others(metrics: Metrics) -> None:
    """A full queue answers 429 queue to the tenant holding its share, 503 to another tenant."""
    queue = queue_of(metrics, queue_size=4)
    running = queue.enqueue("a", 1.0, 10)
    waiting = [queue.enqueue("a", 1.0, 10) for _ in range(4)]
    with pytest.raises(RateLimited) as limited:
        queue.enqueue("a", 1.0, 10, label="acme")
    assert limited.value.type == "queue"
    assert limited.value.status == 429
    assert int(limited.value.headers["Retry-After"]) >= 1
    with pytest.raises(EngineUnavailable) as unavailable:
        queue.enqueue("b", 1.0, 10)
    assert unavailable.value.status == 503
    assert int(unavailable.value.headers["Retry-After"]) == DEFAULT_SERVICE_S
    assert queue.depth == 4
    get = metrics.registry.get_sample_value
    assert get("gateway_rate_limited_total", {"tenant": "acme", "limit": "queue"}) == 1
    assert get("gateway_queue_depth") == 4
    for ticket in (running, *waiting):
        ticket.release()
    assert queue.depth == 0 and queue.in_flight == 0


async def test_tenant_below_share_of_full_queue_gets_503(metrics: Metrics) -> None:
    """B holds 1 of a full queue of 4 shared with A: B's next gets 503, not 429."""
    queue = queue_of(metrics, queue_size=4)
    queue.enqueue("a", 1.0, 10)
    for _ in range(3):
        queue.enqueue("a", 1.0, 10)
    queue.enqueue("b", 1.0, 10)
    with pytest.raises(EngineUnavailable):
        queue.enqueue("b", 1.0, 10)
    with pytest.raises(RateLimited):
        queue.enqueue("a", 1.0, 10)


async def test_503_retry_after_from_measured_drain_rate(metrics: Metrics) -> None:
    """Requests measured at 10 s of engine time each: a full queue says Retry-After 10."""
    clock = FakeClock(500.0)
    queue = queue_of(metrics, queue_size=1, clock=clock)
    for _ in range(3):
        ticket = queue.enqueue("a", 1.0, 10)
        clock.advance(10.0)
        ticket.release()
    assert queue.drain_rate == pytest.approx(0.1)
    queue.enqueue("a", 1.0, 10)
    queue.enqueue("a", 1.0, 10)
    with pytest.raises(EngineUnavailable) as info:
        queue.enqueue("b", 1.0, 10)
    assert info.value.headers["Retry-After"] == "10"


async def test_drain_rate_scales_with_slots(metrics: Metrics) -> None:
    """Four slots at 8 s of engine time per request drain 0.5 requests a second."""
    clock = FakeClock(500.0)
    queue = queue_of(metrics, max_concurrency=4, clock=clock)
    ticket = queue.enqueue("a", 1.0, 10)
    clock.advance(8.0)
    ticket.release()
    assert queue.drain_rate == pytest.approx(0.5)


async def test_queue_size_zero_refuses_when_busy(metrics: Metrics) -> None:
    """queue_size=0: a request finding every slot busy gets 503 at once."""
    queue = queue_of(metrics, queue_size=0)
    queue.enqueue("a", 1.0, 10)
    with pytest.raises(EngineUnavailable):
        queue.enqueue("a", 1.0, 10)


async def test_queue_timeout_gives_503_and_leaves_queue(metrics: Metrics) -> None:
    """A waiter past queue_timeout_s gets 503 (its tenant is below its share) and is removed."""
    queue = queue_of(metrics, queue_timeout_s=0.2)
    running = queue.enqueue("a", 1.0, 10)
    waiter = queue.enqueue("b", 1.0, 10)
    with pytest.raises(EngineUnavailable) as info:
        await asyncio.wait_for(waiter.wait(), 5)
    assert "0.2 s" in info.value.message
    assert queue.depth == 0
    waiter.release()
    running.release()
    assert queue.in_flight == 0


async def test_queue_timeout_429_for_waiting_behind_own_backlog(metrics: Metrics) -> None:
    """Timed out behind its own tenant's share of the queue: 429 queue; otherwise 503."""
    queue = queue_of(metrics, queue_size=8, queue_timeout_s=0.2)
    running = queue.enqueue("x", 1.0, 10)
    a_waiters = [queue.enqueue("a", 1.0, 10) for _ in range(3)]
    b_waiter = queue.enqueue("b", 1.0, 10)
    results = await asyncio.gather(
        *(w.wait() for w in (*a_waiters, b_waiter)), return_exceptions=True
    )
    kinds = [type(r).__name__ for r in results]
    assert kinds == ["EngineUnavailable", "RateLimited", "RateLimited", "EngineUnavailable"]
    assert queue.depth == 0
    running.release()
    assert queue.in_flight == 0


async def test_wait_with_max_wait_returns_false_then_true(metrics: Metrics) -> None:
    """wait(max_wait) returns False while still queued (for ': queued' comments), then True."""
    queue = queue_of(metrics)
    running = queue.enqueue("a", 1.0, 10)
    waiter = queue.enqueue("b", 1.0, 10)
    assert await waiter.wait(0.05) is False
    assert await waiter.wait(0.05) is False
    asyncio.get_running_loop().call_later(0.05, running.release)
    assert await waiter.wait(5) is True
    assert waiter.waited_s >= 0.1
    waiter.release()


async def test_cancelled_waiter_gives_its_place_back(metrics: Metrics) -> None:
    """Cancelling a waiting coroutine removes its ticket; the next one is granted instead."""
    queue = queue_of(metrics)
    running = queue.enqueue("a", 1.0, 10)
    cancelled = queue.enqueue("b", 1.0, 10)
    after = queue.enqueue("c", 1.0, 10)
    task = asyncio.create_task(cancelled.wait())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert queue.depth == 1
    running.release()
    assert after.granted
    assert not cancelled.granted
    after.release()
    assert queue.in_flight == 0 and queue.depth == 0


async def test_cancel_racing_grant_frees_the_slot(metrics: Metrics) -> None:
    """A waiter granted and cancelled before it resumes still frees its slot."""
    queue = queue_of(metrics)
    running = queue.enqueue("a", 1.0, 10)
    waiter = queue.enqueue("b", 1.0, 10)
    task = asyncio.create_task(waiter.wait())
    await asyncio.sleep(0.01)
    running.release()
    assert waiter.granted
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert queue.in_flight == 0


async def test_many_cancellations_leak_nothing(metrics: Metrics) -> None:
    """2000 waiters cancelled while one request runs: no place, slot or line entry stays behind."""
    queue = queue_of(metrics, queue_size=100)
    running = queue.enqueue("a", 1.0, 10)
    survivor = queue.enqueue("s", 1.0, 10)
    for round_ in range(20):
        tickets = [queue.enqueue(f"t{i % 7}", 1.0, 10 + round_) for i in range(99)]
        tasks = [asyncio.create_task(t.wait()) for t in tickets]
        await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert queue.depth == 1
        assert sum(len(t.waiters) for t in queue._tenants.values()) <= 2 * queue.depth + 64 + 99
    running.release()
    assert survivor.granted
    survivor.release()
    assert queue.in_flight == 0 and queue.depth == 0
    assert not queue._tenants and not queue._waiting
    assert metrics.registry.get_sample_value("gateway_queue_depth") == 0


async def test_release_before_wait_and_wait_after_release(metrics: Metrics) -> None:
    """A ticket released while queued never gets a slot; waiting on it afterwards is an error."""
    queue = queue_of(metrics)
    running = queue.enqueue("a", 1.0, 10)
    waiter = queue.enqueue("b", 1.0, 10)
    waiter.release()
    running.release()
    assert queue.in_flight == 0
    with pytest.raises(RuntimeError):
        await waiter.wait()


async def test_reconfigure_more_slots_grants_waiters(metrics: Metrics) -> None:
    """Raising max_concurrency on reload grants waiting tickets at once."""
    queue = queue_of(metrics)
    queue.enqueue("a", 1.0, 10)
    waiters = [queue.enqueue("b", 1.0, 10) for _ in range(3)]
    queue.reconfigure(3, 64, 30.0)
    assert [w.granted for w in waiters] == [True, True, False]
    assert queue.in_flight == 3 and queue.depth == 1


async def test_reconfigure_shorter_timeout_reaches_current_waiters(metrics: Metrics) -> None:
    """A reload that shortens queue_timeout_s applies to requests already waiting."""
    queue = queue_of(metrics, queue_timeout_s=60.0)
    queue.enqueue("a", 1.0, 10)
    waiter = queue.enqueue("b", 1.0, 10)
    task = asyncio.create_task(waiter.wait())
    await asyncio.sleep(0.05)
    queue.reconfigure(1, 64, 0.01)
    with pytest.raises(EngineUnavailable):
        await asyncio.wait_for(task, 2)


async def test_reconfigure_smaller_queue_keeps_waiters(metrics: Metrics) -> None:
    """Shrinking queue_size keeps those already waiting and refuses newcomers."""
    queue = queue_of(metrics, queue_size=8)
    queue.enqueue("a", 1.0, 10)
    waiters = [queue.enqueue("b", 1.0, 10) for _ in range(5)]
    queue.reconfigure(1, 2, 30.0)
    assert queue.depth == 5
    with pytest.raises(EngineUnavailable):
        queue.enqueue("c", 1.0, 10)
    assert all(not w.granted for w in waiters)


async def test_queue_wait_observed_per_tenant_label(metrics: Metrics) -> None:
    """gateway_queue_wait_seconds gets one observation per grant, under the given label."""
    clock = FakeClock(500.0)
    queue = queue_of(metrics, clock=clock)
    first = queue.enqueue("a", 1.0, 10, label="acme")
    second = queue.enqueue("b", 1.0, 10, label="default")
    clock.advance(2.5)
    first.release()
    assert second.waited_s == pytest.approx(2.5)
    get = metrics.registry.get_sample_value
    assert get("gateway_queue_wait_seconds_count", {"tenant": "acme"}) == 1
    assert get("gateway_queue_wait_seconds_sum", {"tenant": "acme"}) == 0
    assert get("gateway_queue_wait_seconds_sum", {"tenant": "default"}) == pytest.approx(2.5)


async def test_unused_reservation_is_not_charged(metrics: Metrics) -> None:
    """A tenant reserving 32k tokens but using 100 shares the engine by the tokens it used."""
    queue = queue_of(metrics, queue_size=100)
    first = queue.enqueue("x", 1.0, 100)
    big = [queue.enqueue("a", 1.0, 32_768) for _ in range(10)]
    small = [queue.enqueue("b", 1.0, 100) for _ in range(10)]
    left, order, current = big + small, [], first
    while left:
        current.release(100)
        current = next(t for t in left if t.granted)
        left.remove(current)
        order.append(current.tenant)
    current.release(100)
    assert order[:10].count("a") == 5 and order[:10].count("b") == 5


async def test_reservation_charged_when_usage_unknown(metrics: Metrics) -> None:
    """Released without usage, a request is charged its reservation: 8k waits for 80 of 100."""
    queue = queue_of(metrics, queue_size=200)
    first = queue.enqueue("x", 1.0, 100)
    a_waiting = [queue.enqueue("a", 1.0, 8000) for _ in range(2)]
    b_waiting = [queue.enqueue("b", 1.0, 100) for _ in range(100)]
    order = grant_order(queue, first, a_waiting + b_waiting)
    assert order[0] == "a" and order[1:81] == ["b"] * 80 and order[81] == "a"


async def test_short_request_goes_next_behind_another_backlog(metrics: Metrics) -> None:
    """A newcomer waits for the running request only, not for another tenant's queued ones."""
    queue = queue_of(metrics)
    running = queue.enqueue("long", 1.0, 2000)
    backlog = [queue.enqueue("long", 1.0, 2000) for _ in range(3)]
    for ticket in backlog[:2]:
        running.release(2000)
        running = ticket
    short = queue.enqueue("short", 1.0, 20)
    running.release(2000)
    assert short.granted and not backlog[2].granted
    short.release(20)
    assert backlog[2].granted
    backlog[2].release(2000)


async def test_idle_tenant_banks_no_credit(metrics: Metrics) -> None:
    """A tenant idle while another was served 20 times then alternates with it, not 20 in a row."""
    queue = queue_of(metrics, queue_size=100)
    current = queue.enqueue("a", 1.0, 100)
    keep = queue.enqueue("a", 1.0, 100)
    a_waiting = [keep]
    for _ in range(20):
        a_waiting.append(queue.enqueue("a", 1.0, 100))
        current.release(100)
        current = a_waiting.pop(0)
    b_waiting = [queue.enqueue("b", 1.0, 100) for _ in range(6)]
    a_more = [queue.enqueue("a", 1.0, 100) for _ in range(6)]
    order = grant_order(queue, current, a_waiting + b_waiting + a_more)
    assert "a" in order[:3] and order[:8].count("b") <= 5


async def test_close_fails_waiters_and_later_requests(metrics: Metrics) -> None:
    """Closing fails every waiter and every later enqueue with the error; a granted one keeps
    its slot until released."""
    queue = queue_of(metrics)
    running = queue.enqueue("a", 1.0, 10)
    waiting = [queue.enqueue(t, 1.0, 10) for t in ("a", "b", "b")]
    tasks = [asyncio.create_task(t.wait()) for t in waiting]
    await asyncio.sleep(0)
    assert queue.close(lambda: EngineUnavailable("shutting down", 1.0)) == 3
    for task in tasks:
        with pytest.raises(EngineUnavailable):
            await task
    assert queue.depth == 0 and running.granted and queue.in_flight == 1
    with pytest.raises(EngineUnavailable):
        queue.enqueue("c", 1.0, 10)
    running.release(10)
    assert queue.in_flight == 0
    assert metrics.registry.get_sample_value("gateway_queue_depth") == 0


async def test_background_waits_behind_its_own_tenants_interactive_requests(
    metrics: Metrics,
) -> None:
    """A tenant's background request (a chat UI's title) is served after that tenant's later
    interactive request, in order among its background ones; another tenant's order is unchanged."""
    queue = queue_of(metrics)
    running = queue.enqueue("x", 1.0, 100)
    title = queue.enqueue("a", 1.0, 100, background=True)
    tags = queue.enqueue("a", 1.0, 100, background=True)
    answer = queue.enqueue("a", 1.0, 100)
    other = queue.enqueue("b", 1.0, 100)
    order = []
    current = running
    for _ in range(4):
        current.release()
        current = next(t for t in (title, tags, answer, other) if t.granted)
        order.append(current)
    current.release()
    assert order.index(answer) < order.index(title) < order.index(tags)
    assert order[0] is answer and other in order[:2]
    assert queue.depth == 0 and queue.in_flight == 0


async def test_a_cancelled_background_waiter_leaves_no_trace(metrics: Metrics) -> None:
    """Background waiters cancelled or released while queued leave depth and lines empty."""
    queue = queue_of(metrics)
    running = queue.enqueue("x", 1.0, 100)
    titles = []
    for _ in range(200):
        titles.append(queue.enqueue("a", 1.0, 100, background=True))
        if len(titles) > 1:
            titles[-2].release()
    answer = queue.enqueue("a", 1.0, 100)
    assert queue.depth == 2
    running.release()
    assert answer.granted and not titles[-1].granted
    answer.release()
    assert titles[-1].granted
    titles[-1].release()
    assert queue.depth == 0 and queue.in_flight == 0


@pytest.mark.parametrize("tier", [[], {}, ["flex"], 5, None, "flex", "default"])
def test_background_signal_takes_any_json_service_tier(tier: object) -> None:
    """``service_tier`` of any JSON type is read without error; only the string "flex" marks
    background work (a list or object there once answered 500)."""
    from gateway.waiting import background_request

    assert background_request({}, {"service_tier": tier}) is (tier == "flex")
