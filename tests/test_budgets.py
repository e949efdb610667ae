"""One budget over rate limits and quotas (`gateway.budgets`), memory backends on fake clocks."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gateway.budgets import Budgets, Hold
from gateway.config import TenantSettings, parse_settings
from gateway.errors import RateLimited
from gateway.metrics import Metrics
from gateway.quota import MemoryQuota, QuotaExceeded
from gateway.ratelimit import MemoryRateLimiter
from tests.clock import FakeClock

pytestmark = pytest.mark.fast

NOON = dt.datetime(2026, 12, 1, 12, 0, 0, tzinfo=dt.timezone.utc).timestamp()
SETTINGS = parse_settings({"tenants": {"acme": {}}})


def budgets(
    wall: float = NOON,
) -> tuple[Budgets, FakeClock, FakeClock, Metrics]:
    """Budgets over a memory limiter (monotonic fake clock) and memory quotas (wall clock)."""
    metrics = Metrics(CollectorRegistry())
    monotonic, utc = FakeClock(), FakeClock(wall)
    limiter = MemoryRateLimiter(SETTINGS, metrics, clock=monotonic)
    quota = MemoryQuota(SETTINGS, metrics, clock=utc)
    return Budgets(limiter, quota), monotonic, utc, metrics


def acme(**limits: int | None) -> TenantSettings:
    base: dict[str, int | None] = {"rpm": 1000, "tpm": 1_000_000, "concurrency": 100}
    return TenantSettings(name="acme", **{**base, **limits})  # type: ignore[arg-type]


async def used(b: Budgets, tenant: TenantSettings) -> tuple[int, int, int]:
    """(tokens charged to the tpm bucket, to the day, to the month) as a caller sees them."""
    headers = await b.limiter.headers(tenant)
    tpm_used = tenant.tpm - int(headers["x-ratelimit-remaining-tokens"])
    day, month = await b.quota.usage(tenant)
    return tpm_used, day.used, month.used


def refusals(metrics: Metrics, limit: str) -> float | None:
    return metrics.registry.get_sample_value(
        "gateway_rate_limited_total", {"tenant": "acme", "limit": limit}
    )


async def test_reserve_then_settle_charges_what_the_engine_counted() -> None:
    """A hold takes its reservation from tpm, the day and the month; settling replaces it with
    the tokens used (less or more than reserved) in every budget."""
    b, _, _, _ = budgets()
    tenant = acme(tokens_per_day=10_000)
    small = await b.reserve(tenant, 1000)
    large = await b.reserve(tenant, 500)
    assert await used(b, tenant) == (1500, 1500, 1500)
    await b.settle(small, 120)
    await b.settle(large, 800)  # a stream that outran its estimate is charged in full
    assert await used(b, tenant) == (920, 920, 920)


async def test_hold_headers_are_the_limiters_six_as_of_admission() -> None:
    """`Hold.headers` are OpenAI's ``x-ratelimit-*`` headers after the reservation."""
    b, _, _, _ = budgets()
    hold = await b.reserve(acme(rpm=10, tpm=1000), 250)
    assert hold.headers["x-ratelimit-remaining-requests"] == "9"
    assert hold.headers["x-ratelimit-remaining-tokens"] == "750"
    assert hold.headers["x-ratelimit-limit-tokens"] == "1000"
    assert len(hold.headers) == 6


async def test_release_gives_everything_back() -> None:
    """A call that used nothing returns its tokens and its concurrency slot (the request stays
    counted in rpm: it was made)."""
    b, _, _, _ = budgets()
    tenant = acme(concurrency=1, tokens_per_day=1000)
    hold = await b.reserve(tenant, 700)
    await b.release(hold)
    assert await used(b, tenant) == (0, 0, 0)
    again = await b.reserve(tenant, 1000)  # the slot and the whole day are free again
    assert again.rate.reserved_tokens == 1000
    headers = await b.limiter.headers(tenant)
    assert headers["x-ratelimit-remaining-requests"] == str(tenant.rpm - 2)


async def test_settle_is_idempotent() -> None:
    """Settling a hold twice (an error path after the normal end) charges it once."""
    b, _, _, _ = budgets()
    tenant = acme(tokens_per_day=1000)
    hold = await b.reserve(tenant, 100)
    await b.settle(hold, 60)
    await b.settle(hold, 600)
    await b.release(hold)
    assert await used(b, tenant) == (60, 60, 60)


async def test_quotas_false_holds_no_quota() -> None:
    """``count_tokens`` reserves rate limits only: an exhausted quota does not refuse it, and
    nothing is charged to the day."""
    b, _, _, _ = budgets()
    tenant = acme(tokens_per_day=100)
    spent = await b.reserve(tenant, 100)
    await b.settle(spent, 100)
    hold = await b.reserve(tenant, 0, quotas=False)
    assert hold.quota is None
    await b.release(hold)
    assert (await used(b, tenant))[1] == 100


async def test_an_exhausted_day_refuses_with_insufficient_quota_until_midnight() -> None:
    """The quota's refusal: 429 ``insufficient_quota``, limit ``tokens_per_day``, Retry-After to
    the next UTC midnight; the rate limits took nothing (the request is not counted in rpm)."""
    b, _, _, metrics = budgets()
    tenant = acme(rpm=5, tokens_per_day=1000, tokens_per_month=50_000)
    hold = await b.reserve(tenant, 900)
    await b.settle(hold, 900)
    with pytest.raises(QuotaExceeded) as info:
        await b.reserve(tenant, 101)
    err = info.value
    assert (err.status, err.type, err.code) == (429, "insufficient_quota", "insufficient_quota")
    assert (err.reason, err.window) == ("tokens_per_day", "day")
    assert err.headers["Retry-After"] == str(12 * 3600)
    assert err.body()["error"]["code"] == "insufficient_quota"
    assert refusals(metrics, "tokens_per_day") == 1
    headers = await b.limiter.headers(tenant)
    assert headers["x-ratelimit-remaining-requests"] == "4"
    assert await used(b, tenant) == (900, 900, 900)


async def test_the_month_refuses_with_retry_after_to_the_first_of_next_month() -> None:
    """A monthly quota names ``tokens_per_month`` and the seconds to the next month's start;
    a request larger than the whole quota says it cannot pass as it is, with no Retry-After."""
    b, _, _, _ = budgets()
    tenant = acme(tokens_per_month=100)
    await b.reserve(tenant, 60)
    with pytest.raises(QuotaExceeded) as info:
        await b.reserve(tenant, 50)
    assert (info.value.reason, info.value.window) == ("tokens_per_month", "month")
    assert info.value.headers["Retry-After"] == str(31 * 86_400 - 12 * 3600)
    with pytest.raises(QuotaExceeded) as info:
        await b.reserve(tenant, 101)
    assert "cannot pass as it is" in info.value.message
    assert "Retry-After" not in info.value.headers


async def test_rpm_refusal_names_requests_and_when_one_fits() -> None:
    """Over rpm: 429 ``rate_limit_exceeded`` typed ``requests``, Retry-After the drain time of one
    request (60 s / rpm), the six headers; nothing is held by the refused call."""
    b, clock, _, metrics = budgets()
    tenant = acme(rpm=2, tokens_per_day=1000)
    await b.reserve(tenant, 10)
    await b.reserve(tenant, 10)
    with pytest.raises(RateLimited) as info:
        await b.reserve(tenant, 10)
    err = info.value
    assert not isinstance(err, QuotaExceeded)
    assert (err.status, err.type, err.code, err.limit) == (
        429,
        "requests",
        "rate_limit_exceeded",
        "requests",
    )
    assert err.headers["Retry-After"] == "30"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert refusals(metrics, "requests") == 1
    assert await used(b, tenant) == (20, 20, 20)  # the refused call's quota was given back
    clock.advance(30)
    await b.reserve(tenant, 10)


async def test_tpm_refusal_names_tokens_and_gives_the_quota_back() -> None:
    """Over tpm: typed ``tokens``, Retry-After until enough drains; the quota reserved before
    the rate limits refused is returned, so the day is unchanged."""
    b, _, _, _ = budgets()
    tenant = acme(tpm=600, tokens_per_day=10_000)
    await b.reserve(tenant, 500)
    with pytest.raises(RateLimited) as info:
        await b.reserve(tenant, 200)
    assert info.value.limit == "tokens"
    assert info.value.headers["Retry-After"] == "10"  # 100 tokens over, at 600 / 60 s
    assert await used(b, tenant) == (500, 500, 500)


async def test_a_request_larger_than_tpm_can_never_pass() -> None:
    """More tokens than the whole tpm: ``tokens``, not to be retried (``x-should-retry: false``,
    no Retry-After) and a message saying it cannot pass as it is."""
    b, _, _, _ = budgets()
    with pytest.raises(RateLimited) as info:
        await b.reserve(acme(tpm=1000), 1001)
    assert (info.value.limit, info.value.headers["x-should-retry"]) == ("tokens", "false")
    assert "Retry-After" not in info.value.headers
    assert "cannot pass as it is" in info.value.message


async def test_concurrency_refusal_frees_with_a_settle() -> None:
    """At the concurrency limit: typed ``concurrency``, Retry-After 1; a settled hold frees its
    slot for the next call."""
    b, _, _, _ = budgets()
    tenant = acme(concurrency=1, tokens_per_day=1000)
    first = await b.reserve(tenant, 10)
    with pytest.raises(RateLimited) as info:
        await b.reserve(tenant, 10)
    assert (info.value.limit, info.value.headers["Retry-After"]) == ("concurrency", "1")
    assert (await used(b, tenant))[1] == 10
    await b.settle(first, 5)
    await b.reserve(tenant, 10)


async def test_quota_is_checked_before_the_rate_limits() -> None:
    """When both a quota and a rate limit refuse, the quota's 429 comes (it lasts longer) and
    the rate limits were not asked."""
    b, _, _, metrics = budgets()
    tenant = acme(concurrency=1, tokens_per_day=100)
    await b.reserve(tenant, 100)
    with pytest.raises(QuotaExceeded):
        await b.reserve(tenant, 1)
    assert refusals(metrics, "concurrency") in (None, 0.0)


async def test_a_call_across_midnight_is_charged_to_the_day_it_ends() -> None:
    """Reserved at 23:59:59 and settled after midnight: the new day holds the whole use, the
    month (the same) its reservation replaced."""
    wall = dt.datetime(2026, 12, 1, 23, 59, 59, tzinfo=dt.timezone.utc).timestamp()
    b, _, utc, _ = budgets(wall)
    tenant = acme(tokens_per_day=1000)
    hold = await b.reserve(tenant, 900)
    utc.advance(10)
    await b.settle(hold, 300)
    assert await used(b, tenant) == (300, 300, 300)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.integers(0, 400)),
        st.tuples(st.just("settle"), st.integers(0, 600)),
        st.tuples(st.just("release"), st.just(0)),
        st.tuples(st.just("resettle"), st.integers(0, 600)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, day=st.integers(0, 3000), tpm=st.integers(100, 5000), slots=st.integers(1, 4))
async def test_charges_are_settled_tokens_plus_open_reservations(
    ops: list[tuple[str, int]], day: int, tpm: int, slots: int
) -> None:
    """Any interleaving of reserve, settle, release and repeated settles (time standing still):
    every budget holds exactly the settled tokens plus the open holds' reservations, a refusal
    holds nothing, and a reservation passes exactly when it fits every limit."""
    b, _, _, _ = budgets()
    tenant = acme(tpm=tpm, concurrency=slots, tokens_per_day=day)
    open_holds: list[Hold] = []
    closed: list[Hold] = []
    settled = 0
    for op, tokens in ops:
        charged = settled + sum(h.rate.reserved_tokens for h in open_holds)
        if op == "reserve":
            fits = (
                charged + tokens <= day
                and (tokens == 0 or charged + tokens <= tpm)
                and len(open_holds) < slots
            )
            if tokens == 0 and charged >= day:
                fits = False
            try:
                open_holds.append(await b.reserve(tenant, tokens))
                assert fits
            except RateLimited:
                assert not fits
        elif op in ("settle", "release") and open_holds:
            hold = open_holds.pop(0)
            actual = tokens if op == "settle" else 0
            await (b.settle(hold, actual) if op == "settle" else b.release(hold))
            settled += actual
            closed.append(hold)
        elif op == "resettle" and closed:
            await b.settle(closed[0], tokens)
        charged = settled + sum(h.rate.reserved_tokens for h in open_holds)
        tpm_used, day_used, month_used = await used(b, tenant)
        assert day_used == month_used == charged
        assert tpm_used == min(charged, tpm)
