"""Per-tenant limits with the memory backend, on a fake clock."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from gateway.config import Settings, TenantSettings, parse_settings
from gateway.errors import RateLimited
from gateway.limiter import create_rate_limiter
from gateway.metrics import Metrics
from gateway.ratelimit import (
    HEADER_NAMES,
    MemoryRateLimiter,
    RateLimiter,
    format_reset,
)
from tests.clock import FakeClock

pytestmark = pytest.mark.fast


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def settings() -> Settings:
    return parse_settings({"tenants": {"acme": {"rpm": 2, "tpm": 1000, "concurrency": 4}}})


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(CollectorRegistry())


@pytest.fixture
def limiter(settings: Settings, metrics: Metrics, clock: FakeClock) -> RateLimiter:
    return create_rate_limiter(settings, metrics, clock=clock)


def tenant(**limits: int) -> TenantSettings:
    base = {"rpm": 1000, "tpm": 1_000_000, "concurrency": 100}
    return TenantSettings(name="acme", **{**base, **limits})


async def refused(limiter: RateLimiter, who: TenantSettings, tokens: int) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        await limiter.reserve(who, tokens)
    return info.value


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-3, "0s"),
        (0.12, "120ms"),
        (0.0001, "1ms"),
        (1, "1s"),
        (8.64, "8.64s"),
        (59.9999, "1m0s"),
        (86.4, "1m26.4s"),
        (360, "6m0s"),
        (3725.5, "1h2m5.5s"),
    ],
)
def test_format_reset_matches_openai_durations(seconds: float, text: str) -> None:
    """Reset headers use OpenAI's format: milliseconds below 1 s, else Go-style h/m/s."""
    assert format_reset(seconds) == text


def test_factory_picks_memory_backend(settings: Settings, metrics: Metrics) -> None:
    """The default backend is memory and reports itself up."""
    limiter = create_rate_limiter(settings, metrics)
    assert isinstance(limiter, MemoryRateLimiter)
    sample = metrics.registry.get_sample_value(
        "gateway_ratelimit_backend_up", {"backend": "memory"}
    )
    assert sample == 1


async def test_c13_rpm_burst_then_429_with_honest_retry_after(
    limiter: RateLimiter, settings: Settings, clock: FakeClock
) -> None:
    """rpm=2: two pass at once, the third gets 429 requests whose Retry-After is when it passes."""
    acme = settings.tenant("acme")
    for _ in range(2):
        res = await limiter.reserve(acme, 10)
        await limiter.settle(res, 10)
    error = await refused(limiter, acme, 10)
    assert error.status == 429
    assert error.type == "requests"
    assert error.code == "rate_limit_exceeded"
    assert error.retry_after_s == pytest.approx(30.0)
    assert error.headers["Retry-After"] == "30"
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    clock.advance(29.9)
    await refused(limiter, acme, 10)
    clock.advance(0.1)
    assert (await limiter.reserve(acme, 10)).tenant == "acme"


@pytest.mark.parametrize("rpm", [7, 13, 45, 60, 600])
async def test_retry_after_whole_seconds_is_enough(
    limiter: RateLimiter, clock: FakeClock, rpm: int
) -> None:
    """Waiting the whole seconds of Retry-After is always enough, and never more than 1 s extra."""
    who = tenant(rpm=rpm, concurrency=10_000)
    for _ in range(rpm):
        await limiter.reserve(who, 0)
    error = await refused(limiter, who, 0)
    retry = int(error.headers["Retry-After"])
    assert retry >= 1
    assert retry - 1 < error.retry_after_s <= retry
    clock.advance(retry - 1)
    if error.retry_after_s > retry - 1 + 1e-3:
        await refused(limiter, who, 0)
    clock.advance(1)
    await limiter.reserve(who, 0)


async def test_rpm_refills_continuously(limiter: RateLimiter, clock: FakeClock) -> None:
    """rpm=60 admits 60 at once, then one more every second (no fixed window edge)."""
    who = tenant(rpm=60)
    for _ in range(60):
        await limiter.reserve(who, 0)
    await refused(limiter, who, 0)
    for _ in range(3):
        clock.advance(1.0)
        await limiter.reserve(who, 0)
        error = await refused(limiter, who, 0)
        assert error.retry_after_s == pytest.approx(1.0)


async def test_tpm_refuses_with_time_until_tokens_free(
    limiter: RateLimiter, clock: FakeClock
) -> None:
    """tpm=1000 with 800 used: 300 more must wait until 100 have drained (6 s)."""
    who = tenant(tpm=1000)
    await limiter.reserve(who, 800)
    error = await refused(limiter, who, 300)
    assert error.type == "tokens"
    assert error.retry_after_s == pytest.approx(6.0)
    assert error.headers["x-ratelimit-remaining-tokens"] == "200"
    assert "tokens per minute" in error.message
    clock.advance(6.0)
    await limiter.reserve(who, 300)


async def test_request_larger_than_tpm_is_refused_as_too_large(limiter: RateLimiter) -> None:
    """A reservation above tpm can never pass: 429 tokens, no Retry-After but
    ``x-should-retry: false``, a message saying so."""
    who = tenant(tpm=1000)
    error = await refused(limiter, who, 1600)
    assert error.type == "tokens"
    assert "Retry-After" not in error.headers
    assert error.headers["x-should-retry"] == "false"
    assert "too large" in error.message
    assert "1600" in error.message
    headers = await limiter.headers(who)
    assert headers["x-ratelimit-remaining-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-requests"] == str(who.rpm)


async def test_refusal_takes_nothing(limiter: RateLimiter) -> None:
    """A request refused for tokens takes neither a request, tokens nor a slot."""
    who = tenant(rpm=5, tpm=1000, concurrency=2)
    await limiter.reserve(who, 900)
    before = await limiter.headers(who)
    for _ in range(5):
        await refused(limiter, who, 200)
    assert await limiter.headers(who) == before
    await limiter.reserve(who, 100)


async def test_settle_refunds_unused_tokens(limiter: RateLimiter) -> None:
    """Reserved 900, used 100: the 800 are available again at once."""
    who = tenant(tpm=1000)
    res = await limiter.reserve(who, 900)
    await refused(limiter, who, 800)
    await limiter.settle(res, 100)
    await limiter.reserve(who, 800)


async def test_settle_charges_more_than_reserved(limiter: RateLimiter) -> None:
    """Used more than reserved: the excess is charged and delays the next request accordingly."""
    who = tenant(tpm=1000)
    res = await limiter.reserve(who, 100)
    await limiter.settle(res, 1500)
    error = await refused(limiter, who, 100)
    # 1500 used + 100 asked - 1000 allowed = 600 tokens to drain at 1000/60 per second.
    assert error.retry_after_s == pytest.approx(36.0)


async def test_disconnect_is_charged_what_was_generated(
    limiter: RateLimiter, clock: FakeClock
) -> None:
    """A request cut short is settled to its real usage: the rest of the reservation comes back."""
    who = tenant(tpm=10_000)
    res = await limiter.reserve(who, 8000)
    await limiter.settle(res, 50 + 120)
    headers = await limiter.headers(who)
    assert headers["x-ratelimit-remaining-tokens"] == str(10_000 - 170)


async def test_n_choices_reservation_settles_to_usage(limiter: RateLimiter) -> None:
    """An ``n`` > 1 reservation (prompt + n * max_tokens) is settled to the usage of all choices."""
    who = tenant(tpm=2000)
    res = await limiter.reserve(who, 10 + 4 * 400)
    await refused(limiter, who, 500)
    await limiter.settle(res, 10 + 4 * 100)
    await limiter.reserve(who, 1500)


async def test_concurrency_slot_held_until_settle(limiter: RateLimiter) -> None:
    """concurrency=1: a second request is refused (Retry-After 1) until the first settles."""
    who = tenant(concurrency=1)
    res = await limiter.reserve(who, 1)
    error = await refused(limiter, who, 1)
    assert error.type == "concurrency"
    assert error.headers["Retry-After"] == "1"
    await limiter.settle(res, 1)
    await limiter.reserve(who, 1)


async def test_settle_is_idempotent(limiter: RateLimiter) -> None:
    """Settling twice frees one slot and charges once."""
    who = tenant(concurrency=2, tpm=1000)
    first = await limiter.reserve(who, 100)
    await limiter.reserve(who, 100)
    await limiter.settle(first, 300)
    await limiter.settle(first, 300)
    headers = await limiter.headers(who)
    assert headers["x-ratelimit-remaining-tokens"] == "600"
    await limiter.reserve(who, 100)
    error = await refused(limiter, who, 1)
    assert error.type == "concurrency"


async def test_longest_wait_is_named_when_several_limits_refuse(limiter: RateLimiter) -> None:
    """rpm exhausted (30 s) and the slot taken (1 s): the answer names requests, 30 s."""
    who = tenant(rpm=2, concurrency=1)
    res = await limiter.reserve(who, 0)
    await limiter.settle(res, 0)
    await limiter.reserve(who, 0)
    error = await refused(limiter, who, 0)
    assert error.type == "requests"
    assert error.retry_after_s == pytest.approx(30.0)


async def test_limit_zero_admits_nothing(limiter: RateLimiter) -> None:
    """rpm=0 refuses every request, not to be retried (``x-should-retry: false``, no
    Retry-After); concurrency=0 likewise."""
    error = await refused(limiter, tenant(rpm=0), 0)
    assert error.type == "requests"
    assert error.headers["x-should-retry"] == "false" and "Retry-After" not in error.headers
    assert "is 0" in error.message
    error = await refused(limiter, tenant(concurrency=0), 0)
    assert error.type == "concurrency"


async def test_reload_changes_limits_and_keeps_counts(limiter: RateLimiter) -> None:
    """A new tpm applies to the next request and the tokens already used still count."""
    before = tenant(tpm=1000)
    await limiter.reserve(before, 900)
    after = dataclasses.replace(before, tpm=2000)
    headers = await limiter.headers(after)
    assert headers["x-ratelimit-limit-tokens"] == "2000"
    assert headers["x-ratelimit-remaining-tokens"] == "1100"
    await limiter.reserve(after, 1000)
    await refused(limiter, after, 200)


async def test_tenants_are_independent(limiter: RateLimiter, settings: Settings) -> None:
    """Tenant acme at its limit does not affect tenant beta."""
    acme = settings.tenant("acme")
    for _ in range(2):
        await limiter.reserve(acme, 1)
    await refused(limiter, acme, 1)
    beta = settings.tenant("beta")
    assert (await limiter.reserve(beta, 1)).tenant == "beta"


async def test_headers_after_reserve(limiter: RateLimiter) -> None:
    """The reservation carries the six headers as of after it."""
    who = tenant(rpm=60, tpm=6000)
    res = await limiter.reserve(who, 1500)
    assert set(res.headers) == set(HEADER_NAMES)
    assert res.headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "4500",
        "x-ratelimit-reset-tokens": "15s",
    }


async def test_headers_take_nothing(limiter: RateLimiter) -> None:
    """Reading the headers (for /v1/models) uses no request or token."""
    who = tenant(rpm=1)
    for _ in range(5):
        headers = await limiter.headers(who)
    assert headers["x-ratelimit-remaining-requests"] == "1"
    await limiter.reserve(who, 0)


async def test_refusals_counted_with_bounded_tenant_label(
    limiter: RateLimiter, settings: Settings, metrics: Metrics
) -> None:
    """gateway_rate_limited_total counts per limit; tenants without a table count as default."""
    stranger = settings.tenant("stranger")
    stranger = dataclasses.replace(stranger, concurrency=0)
    acme = dataclasses.replace(settings.tenant("acme"), rpm=0)
    await refused(limiter, stranger, 1)
    await refused(limiter, acme, 1)
    await refused(limiter, acme, 1)
    get = metrics.registry.get_sample_value
    assert get("gateway_rate_limited_total", {"tenant": "default", "limit": "concurrency"}) == 1
    assert get("gateway_rate_limited_total", {"tenant": "acme", "limit": "requests"}) == 2
    assert get("gateway_rate_limited_total", {"tenant": "stranger", "limit": "concurrency"}) is None


async def test_retry_after_beyond_a_minute_after_an_overrun(limiter: RateLimiter) -> None:
    """An overrun far past tpm is paid off honestly: Retry-After may exceed 60 s."""
    who = tenant(tpm=1000)
    res = await limiter.reserve(who, 100)
    await limiter.settle(res, 3000)
    error = await refused(limiter, who, 100)
    # 3000 used + 100 asked - 1000 allowed = 2100 tokens to drain at 1000/60 per second.
    assert error.headers["Retry-After"] == "126"
