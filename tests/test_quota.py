"""Daily and monthly token quotas: UTC windows, reserve/settle, the 429, Redis shared counts."""

from __future__ import annotations

import asyncio
import datetime as dt
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from gateway.config import RatelimitSettings, Settings, TenantSettings, parse_settings
from gateway.metrics import Metrics
from gateway.quota import MemoryQuota, QuotaExceeded, quota_samples, windows_at
from gateway.quota_redis import EXPIRY_GRACE_S, RedisQuota
from tests.test_ratelimit_redis import REDIS_SERVER, RedisServer


def utc(*args: int) -> float:
    return dt.datetime(*args, tzinfo=dt.timezone.utc).timestamp()  # type: ignore[misc]


class Clock:
    """A settable wall clock (seconds since the epoch)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


ACME = TenantSettings(name="acme", tokens_per_day=1000, tokens_per_month=2500)
SETTINGS = parse_settings(
    {"tenants": {"acme": {"tokens_per_day": 1000, "tokens_per_month": 2500}, "beta": {}}}
)


def test_windows_are_utc_days_and_calendar_months() -> None:
    """Day and month windows start at UTC midnight and the 1st; December rolls into January."""
    day, month = windows_at(utc(2026, 12, 31, 23, 59, 59))
    assert (day.key, month.key) == ("2026-12-31", "2026-12")
    assert day.end == utc(2027, 1, 1) and month.end == utc(2027, 1, 1)
    assert month.start == utc(2026, 12, 1)
    day, month = windows_at(utc(2028, 2, 29, 12))
    assert (day.key, month.key, month.end) == ("2028-02-29", "2028-02", utc(2028, 3, 1))


def test_config_keys_parse_and_inherit() -> None:
    """tokens_per_day/month parse as integers, inherit from default, and reject negatives."""
    settings = parse_settings(
        {"tenants": {"default": {"tokens_per_month": 10}, "acme": {"tokens_per_day": 5}}}
    )
    assert settings.tenant("acme").tokens_per_day == 5
    assert settings.tenant("acme").tokens_per_month == 10
    assert settings.tenant("someone").tokens_per_day is None
    with pytest.raises(ValueError, match="tokens_per_day"):
        parse_settings({"tenants": {"acme": {"tokens_per_day": -1}}})


def memory(clock: Clock) -> tuple[MemoryQuota, Metrics]:
    metrics = Metrics(CollectorRegistry())
    return MemoryQuota(SETTINGS, metrics, clock=clock), metrics


async def test_over_daily_quota_is_429_insufficient_quota_until_midnight() -> None:
    """Reservations beyond the day's quota get 429 insufficient_quota, Retry-After to midnight."""
    clock = Clock(utc(2026, 12, 1, 23, 0, 0))
    quota, metrics = memory(clock)
    first = await quota.reserve(ACME, 600)
    await quota.settle(first, 700)  # a stream that used more than reserved is charged in full
    await quota.settle(first, 1)  # settling twice changes nothing
    with pytest.raises(QuotaExceeded) as info:
        await quota.reserve(ACME, 301)
    err = info.value
    assert (err.status, err.type, err.code, err.window) == (429, "insufficient_quota",
                                                            "insufficient_quota", "day")  # fmt: skip
    assert err.headers["Retry-After"] == "3600"
    assert "300 remain" in err.message and "2026-12-02T00:00:00Z" in err.message
    # The reservation is prompt plus max_tokens: the advice names both (a prompt alone can be
    # what does not fit).
    assert "Lower max_tokens, n or the prompt" in err.message
    assert err.body()["error"]["type"] == "insufficient_quota"
    assert (
        metrics.registry.get_sample_value(
            "gateway_rate_limited_total", {"tenant": "acme", "limit": "tokens_per_day"}
        )
        == 1
    )
    await quota.reserve(ACME, 300)  # exactly what is left passes
    with pytest.raises(QuotaExceeded, match="exceeded your daily"):
        await quota.reserve(ACME, 1)
    clock.now = utc(2026, 12, 2, 0, 0, 0)  # the next UTC day: the day is new, the month is not
    await quota.reserve(ACME, 1000)
    with pytest.raises(QuotaExceeded) as info:
        await quota.reserve(ACME, 501)  # both windows refuse: the later reset is named
    assert info.value.window == "month"
    assert info.value.headers["Retry-After"] == str(30 * 86_400)
    day, month = await quota.usage(ACME)
    assert (day.used, day.remaining, month.used, month.remaining) == (1000, 0, 2000, 500)


async def test_request_larger_than_the_quota_says_it_cannot_pass() -> None:
    """A reservation larger than the whole quota is refused with a message saying so, and
    not to be retried: no Retry-After (no window's end lets it pass), ``x-should-retry: false``."""
    quota, _ = memory(Clock(utc(2026, 12, 1, 12)))
    with pytest.raises(QuotaExceeded, match="cannot pass as it is") as info:
        await quota.reserve(ACME, 1001)
    assert "Retry-After" not in info.value.headers
    assert info.value.headers["x-should-retry"] == "false"


async def test_request_across_midnight_is_charged_to_the_day_it_ends() -> None:
    """A request reserved before midnight and ended after it counts in the new day only."""
    clock = Clock(utc(2026, 12, 1, 23, 59, 59))
    quota, _ = memory(clock)
    running = await quota.reserve(ACME, 900)
    clock.now = utc(2026, 12, 2, 0, 0, 5)
    await quota.settle(running, 400)
    day, month = await quota.usage(ACME)
    assert (day.used, month.used) == (400, 400)


async def test_tenant_without_quota_is_counted_and_unlimited() -> None:
    """A tenant without quota always passes; its use is counted for a quota added later."""
    quota, _ = memory(Clock(utc(2026, 12, 1, 12)))
    beta = SETTINGS.tenant("beta")
    res = await quota.reserve(beta, 10**9)
    await quota.settle(res, 50)
    day, _ = await quota.usage(beta)
    assert (day.limit, day.used, day.remaining) == (None, 50, None)


async def test_restore_seeds_the_day_and_month() -> None:
    """Totals restored at startup count against the quotas."""
    quota, metrics = memory(Clock(utc(2026, 12, 1, 12)))
    quota.restore({"acme": 990}, {"acme": 2000})
    with pytest.raises(QuotaExceeded):
        await quota.reserve(ACME, 11)
    metrics.quota.source = lambda: quota_samples(quota, SETTINGS)
    get = metrics.registry.get_sample_value
    assert get("gateway_quota_used_tokens", {"tenant": "acme", "window": "day"}) == 990
    assert get("gateway_quota_limit_tokens", {"tenant": "acme", "window": "month"}) == 2500
    assert get("gateway_quota_limit_tokens", {"tenant": "beta", "window": "day"}) is None


# ------------------------------------------------------------------------------------- Redis


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A throwaway redis-server; skipped when the binary is missing."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    workdir = Path(tempfile.mkdtemp(prefix="q38q-", dir="/tmp"))
    server = RedisServer(workdir)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def redis_settings(url: str) -> Settings:
    return Settings(
        ratelimit=RatelimitSettings(backend="redis", redis_url=url, key_prefix="tq"),
        tenants=SETTINGS.tenants,
    )


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[tuple[RedisQuota, RedisQuota]]:
    clock = Clock(utc(2026, 12, 1, 23, 59, 0))
    made = [
        RedisQuota(redis_settings(redis_server.url), Metrics(CollectorRegistry()), clock=clock)
        for _ in range(2)
    ]
    yield made[0], made[1]
    for quota in made:
        await quota.close()


async def test_redis_quota_is_shared_by_replicas_and_rolls_at_midnight(
    replicas: tuple[RedisQuota, RedisQuota], redis_server: RedisServer
) -> None:
    """Two replicas charge one Redis count; the next UTC day starts afresh on both."""
    one, two = replicas
    clock = one._clock
    assert isinstance(clock, Clock)
    res = await one.reserve(ACME, 700)
    with pytest.raises(QuotaExceeded) as info:
        await two.reserve(ACME, 400)
    assert info.value.headers["Retry-After"] == "60"
    await one.settle(res, 500)
    res2 = await two.reserve(ACME, 400)
    await two.settle(res2, 450)
    day, month = await one.usage(ACME)
    assert (day.used, month.used) == (950, 950)
    client = aioredis.Redis.from_url(redis_server.url)
    ttl = await client.ttl("tq:q:{acme}:day:2026-12-01")
    assert 60 < ttl <= 60 + EXPIRY_GRACE_S
    await client.aclose()
    clock.now = utc(2026, 12, 2, 0, 0, 1)
    res3 = await two.reserve(ACME, 1000)
    await two.settle(res3, 100)
    day, month = await one.usage(ACME)
    assert (day.used, month.used) == (100, 1050)


async def test_redis_down_falls_back_to_local_counts(
    replicas: tuple[RedisQuota, RedisQuota], redis_server: RedisServer
) -> None:
    """With Redis gone, reservations are counted locally and never raise a backend error."""
    one, _ = replicas
    redis_server.stop()
    res = await one.reserve(ACME, 900)
    assert res.backend == "memory"
    with pytest.raises(QuotaExceeded):
        await one.reserve(ACME, 200)
    await one.settle(res, 10)


class LedgerTotals:
    """A usage ledger's reader as `gateway.accounting.Accounting` gives it: ``(day, month)``."""

    def __init__(self, day: int = 0, month: int = 0) -> None:
        self.day = day
        self.month = month
        self.reads = 0

    async def __call__(self) -> tuple[dict[str, int], dict[str, int]]:
        self.reads += 1
        return {"acme": self.day}, {"acme": self.month}


async def redis_quota(url: str, totals: LedgerTotals) -> RedisQuota:
    clock = Clock(utc(2026, 12, 1, 12))
    quota = RedisQuota(redis_settings(url), Metrics(CollectorRegistry()), clock=clock)
    await quota.restore_from(totals)
    await quota.start()
    return quota


async def test_redis_outage_counts_on_from_the_last_redis_count_or_the_ledger(
    redis_server: RedisServer,
) -> None:
    """Redis gone: local counts start from the larger of the last Redis count and the ledger,
    so the tenant gets what was left of its day, not a new one."""
    ledger = LedgerTotals(day=200, month=200)
    one = await redis_quota(redis_server.url, ledger)
    fresh = await redis_quota(redis_server.url, LedgerTotals(day=900, month=900))
    try:
        await one.settle(await one.reserve(ACME, 600), 550)
        assert ledger.reads == 0  # Redis up: the ledger is not read
        redis_server.stop()
        with capture_logs() as logs:
            day, month = await one.usage(ACME)
            assert (day.used, day.remaining, month.used) == (550, 450, 550)
            with pytest.raises(QuotaExceeded, match="450 remain"):
                await one.reserve(ACME, 451)
            res = await one.reserve(ACME, 450)
            assert res.backend == "memory"
            with pytest.raises(QuotaExceeded, match="exceeded your daily"):
                await one.reserve(ACME, 1)
            await one.settle(res, 400)
            day, _ = await one.usage(ACME)
            assert (day.used, day.remaining) == (950, 50)
        assert [e["event"] for e in logs] == ["quota_backend_down", "quota_local_counts"]
        assert ledger.reads == 1  # once per outage
        assert ("acme", "day", 950) in one.gauge_values()
        # A replica that never read Redis starts from its ledger.
        with pytest.raises(QuotaExceeded, match="100 remain"):
            await fresh.reserve(ACME, 101)
        day, _ = await fresh.usage(ACME)
        assert day.used == 900
    finally:
        await one.close()
        await fresh.close()


async def test_request_running_across_a_redis_outage_is_counted_once(
    redis_server: RedisServer,
) -> None:
    """A request admitted through Redis and ended during the outage is charged once locally and
    once in Redis when it returns; what was charged locally is not added to Redis; a second
    outage starts again from Redis's count and the ledger, not from the first outage's."""
    ledger = LedgerTotals()
    quota = await redis_quota(redis_server.url, ledger)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        running = await quota.reserve(ACME, 300)
        # A restarted Redis with persistence comes back with what it held.
        await client.save()
        await client.aclose()
        redis_server.stop()
        day, _ = await quota.usage(ACME)
        assert day.used == 300  # the reservation still running
        await quota.settle(running, 120)
        ledger.day = ledger.month = 120  # its ledger record
        day, _ = await quota.usage(ACME)
        assert day.used == 120
        local = await quota.reserve(ACME, 880)
        with pytest.raises(QuotaExceeded):
            await quota.reserve(ACME, 1)
        redis_server.start()
        client = aioredis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 5
        while (quota._pending or not quota._up) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not quota._pending
        await quota.settle(local, 500)  # charged locally, the outage's: Redis is not told
        ledger.day = ledger.month = 620
        assert await client.get("tq:q:{acme}:day:2026-12-01") == b"120"
        day, _ = await quota.usage(ACME)
        assert day.used == 120
        redis_server.stop()
        day, _ = await quota.usage(ACME)
        assert day.used == 620  # the ledger's, not 120 + 880 left from the first outage
        assert ledger.reads == 2
    finally:
        await quota.close()
        await client.aclose()
