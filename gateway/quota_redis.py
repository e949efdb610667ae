"""Daily and monthly token quotas in Redis, shared by every gateway replica.

Used when ``[ratelimit] backend = "redis"``, on the same Redis as the per-minute limits. While
Redis is unreachable each replica counts locally, starting from what it knows of the tenant's
day and month (see `RedisQuota`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.config import Settings, TenantSettings
from gateway.metrics import Metrics
from gateway.quota import (
    WINDOWS,
    MemoryQuota,
    Quota,
    QuotaReservation,
    Totals,
    Window,
    WindowUse,
    has_quota,
    limit_of,
    refusal,
    windows_at,
)

log = structlog.get_logger(__name__)

EXPIRY_GRACE_S = 3600
"""A window's counter is deleted by Redis this long after the window ends."""
REFRESH_S = 15.0
"""How often the quota gauges of configured tenants are refreshed from Redis."""
RECONNECT_S = 1.0
"""How often an unreachable Redis is probed while local counts are in force."""

_BACKEND_ERRORS = (RedisError, OSError, asyncio.TimeoutError)

# KEYS: day counter, month counter. ARGV: day limit, month limit (-1: none), tokens,
# day TTL, month TTL (seconds, from this host's clock). Returns {refusing window or '', day used, month used};
# charges both windows or neither. The month is checked first: when both refuse, the request
# passes only once the later window resets.
_RESERVE = """
local d = tonumber(redis.call('GET', KEYS[1]) or '0')
local m = tonumber(redis.call('GET', KEYS[2]) or '0')
local dl, ml, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local function over(used, limit)
  if limit < 0 then return false end
  if cost <= 0 then return used >= limit end
  return used + cost > limit
end
if over(m, ml) then return {'month', d, m} end
if over(d, dl) then return {'day', d, m} end
d = redis.call('INCRBY', KEYS[1], cost)
redis.call('EXPIRE', KEYS[1], ARGV[4])
m = redis.call('INCRBY', KEYS[2], cost)
redis.call('EXPIRE', KEYS[2], ARGV[5])
return {'', d, m}
"""

# KEYS: day and month counters now, day and month counters reserved in. ARGV: actual tokens,
# reserved tokens, day TTL, month TTL (seconds). A window that is still the same gets the
# difference; one that has ended gives its reservation back and the current one gets it all.
_SETTLE = """
local actual, reserved = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for i = 1, 2 do
  local delta = actual
  if KEYS[i] == KEYS[i + 2] then
    delta = actual - reserved
  elseif redis.call('EXISTS', KEYS[i + 2]) == 1 then
    redis.call('DECRBY', KEYS[i + 2], reserved)
  end
  local v = redis.call('INCRBY', KEYS[i], delta)
  if v < 0 then
    redis.call('SET', KEYS[i], 0)
    v = 0
  end
  redis.call('EXPIRE', KEYS[i], ARGV[2 + i])
  out[i] = v
end
return out
"""


def _add(counts: dict[str, int], more: Mapping[str, int]) -> None:
    for name, tokens in more.items():
        counts[name] = counts.get(name, 0) + max(0, int(tokens))


def _ttls(wins: tuple[Window, Window], now: float) -> tuple[int, int]:
    """Seconds each window's counter lives: to the window's end (this host's clock) + grace."""
    day, month = (math.ceil(w.end - now) + EXPIRY_GRACE_S for w in wins)
    return day, month


@dataclass(frozen=True)
class _Settlement:
    """A settle script call, kept for a retry when Redis did not take it."""

    tenant: str
    keys: tuple[str, str, str, str]
    args: tuple[int, int, int, int]
    windows: tuple[str, str]


class RedisQuota(Quota):
    """Quotas in Redis: counters ``{key_prefix}:q:{TENANT}:day:YYYY-MM-DD`` and ``:month:YYYY-MM``.

    Each call is one atomic Lua script; counters expire `EXPIRY_GRACE_S` after their window.
    Only tenants with a quota cost a Redis call. Window boundaries come from this host's clock
    (keep replicas on NTP).

    While Redis is unreachable (logged once per outage as ``quota_backend_down``), quotas are
    counted locally. The first call of an outage seeds the local counts of each tenant and
    window with the larger of the last count read from Redis and this replica's usage ledger
    (the reader given to `restore_from`) plus the reservations of its requests still running;
    its own charges are added from then on. A request admitted through Redis that ends during
    the outage is settled in the local counts and its settlement waits for Redis. When Redis
    answers again the shared counters are used as they are: they get the waiting settlements
    but not the tokens charged locally during the outage (those are in the ledger).
    """

    backend = "redis"

    def __init__(
        self, settings: Settings, metrics: Metrics, *, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(settings, metrics, clock=clock)
        cfg = settings.ratelimit
        self._prefix = cfg.key_prefix
        self._client: aioredis.Redis = aioredis.Redis.from_url(
            cfg.redis_url,
            socket_timeout=cfg.redis_timeout_s,
            socket_connect_timeout=cfg.redis_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._reserve = self._client.register_script(_RESERVE)
        self._settle = self._client.register_script(_SETTLE)
        self._local = MemoryQuota(settings, metrics, clock=clock)
        self._totals: Totals | None = None
        self._open: dict[int, QuotaReservation] = {}  # id -> reservations not settled yet
        self._outages = 0  # outages begun so far
        self._seeded = 0  # the outage the local counts were seeded for
        self._seeding = asyncio.Lock()
        self._up = True
        self._pending: list[_Settlement] = []
        self._seen: dict[str, dict[str, tuple[str, int]]] = {}  # tenant -> window -> (key, used)
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def reconfigure(self, settings: Settings) -> None:
        """See `Quota.reconfigure`."""
        super().reconfigure(settings)
        self._local.reconfigure(settings)

    def _key(self, tenant: str, window: Window) -> str:
        return f"{self._prefix}:q:{{{tenant}}}:{window.name}:{window.key}"

    def _note(self, tenant: str, wins: tuple[Window, Window], day: Any, month: Any) -> None:
        self._seen[tenant] = {"day": (wins[0].key, int(day)), "month": (wins[1].key, int(month))}

    async def restore_from(self, totals: Totals) -> None:
        """Keep ``totals`` (the usage ledger's reader) to seed the local counts of an outage."""
        self._totals = totals

    async def start(self) -> None:
        """Start the maintenance task (gauge refresh, reconnects, pending settlements)."""
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._maintain())

    async def reserve(self, tenant: TenantSettings, tokens: int) -> QuotaReservation:
        """See `Quota.reserve`; local counts while Redis is unreachable."""
        if not has_quota(tenant):
            return QuotaReservation(tenant.name, 0, backend="none", settled=True)
        if self._up:
            now = self._clock()
            wins = windows_at(now)
            keys = (self._key(tenant.name, wins[0]), self._key(tenant.name, wins[1]))
            limits = [limit_of(tenant, w) for w in WINDOWS]
            args = (
                *(-1 if x is None else x for x in limits),
                tokens,
                *_ttls(wins, now),
            )
            try:
                reply = await self._reserve(keys=keys, args=args)
            except _BACKEND_ERRORS as exc:
                self._mark_down(exc)
            else:
                self._mark_up()
                window, day, month = reply[0].decode() if reply[0] else "", reply[1], reply[2]
                self._note(tenant.name, wins, day, month)
                if window:
                    win = wins[WINDOWS.index(window)]
                    used = day if window == "day" else month
                    raise self.count_refusal(tenant, refusal(tenant, win, used, tokens, now))
                return self._opened(
                    QuotaReservation(
                        tenant.name, tokens, (wins[0].key, wins[1].key), backend="redis"
                    )
                )
        local = await self._fallback()
        return self._opened(local.reserve_now(tenant, tokens))

    def _opened(self, reservation: QuotaReservation) -> QuotaReservation:
        self._open[id(reservation)] = reservation
        return reservation

    async def settle(self, reservation: QuotaReservation, actual_tokens: int) -> None:
        """See `Quota.settle`. Runs to completion even if the caller is cancelled."""
        if reservation.settled:
            return
        if reservation.backend != "redis":
            self._open.pop(id(reservation), None)
            self._local.settle_now(reservation, actual_tokens)
            return
        reservation.settled = True
        now = self._clock()
        wins = windows_at(now)
        name = reservation.tenant
        old = [Window(w, k, 0, 0) for w, k in zip(WINDOWS, reservation.keys, strict=True)]
        job = _Settlement(
            name,
            (
                self._key(name, wins[0]),
                self._key(name, wins[1]),
                self._key(name, old[0]),
                self._key(name, old[1]),
            ),
            (
                max(0, actual_tokens),
                reservation.tokens,
                *_ttls(wins, now),
            ),
            (wins[0].key, wins[1].key),
        )
        await asyncio.shield(self._settle_redis(reservation, job))

    async def _settle_redis(self, reservation: QuotaReservation, job: _Settlement) -> None:
        """Settle a reservation taken in Redis; during an outage in the local counts too (seeded
        while it was still open, so they hold its reservation). Never raises."""
        try:
            if await self._settle_remote(job):
                return
            local = await self._fallback()
            local.settle_now(
                QuotaReservation(reservation.tenant, reservation.tokens, reservation.keys),
                job.args[0],
            )
        finally:
            self._open.pop(id(reservation), None)

    async def _settle_remote(self, job: _Settlement) -> bool:
        """Run the settle script; never raises. If Redis fails, keep the job for a retry.

        Returns:
            False when Redis was unreachable (the job waits), True otherwise.
        """
        try:
            day, month = await self._settle(keys=job.keys, args=job.args)
        except _BACKEND_ERRORS as exc:
            self._mark_down(exc)
            self._pending.append(job)
            return False
        except Exception:
            log.exception("quota_settle_failed", backend="redis", tenant=job.tenant)
            return True
        self._seen[job.tenant] = {"day": (job.windows[0], day), "month": (job.windows[1], month)}
        return True

    async def _fallback(self) -> MemoryQuota:
        """The local counts, seeded for the current outage (see `RedisQuota`); never raises
        but `asyncio.CancelledError`."""
        if self._seeded != self._outages:
            async with self._seeding:
                if self._seeded != self._outages:
                    outage = self._outages
                    self._local = await self._seed()
                    self._seeded = outage
        return self._local

    async def _seed(self) -> MemoryQuota:
        """New local counts: per tenant and window, the larger of the last count read from
        Redis and the ledger's total plus the reservations still open."""
        wins = windows_at(self._clock())
        day: dict[str, int] = {}
        month: dict[str, int] = {}
        for res in list(self._open.values()):  # before the read: counted once at least
            for counts, window, key in zip((day, month), wins, res.keys, strict=True):
                if key == window.key:
                    counts[res.tenant] = counts.get(res.tenant, 0) + res.tokens
        read = None
        try:
            read = await self._totals() if self._totals is not None else None
        except Exception:  # the reader logs an unreadable ledger; anything else counts too
            log.exception("quota_restore_failed", backend="redis")
        if read is not None:
            for counts, totals in zip((day, month), read, strict=True):
                _add(counts, totals)
        for name, seen in self._seen.items():
            for counts, window in zip((day, month), wins, strict=True):
                key, used = seen.get(window.name, ("", 0))
                if key == window.key:
                    counts[name] = max(counts.get(name, 0), int(used))
        local = MemoryQuota(self._settings, self._metrics, clock=self._clock)
        local.restore(day, month)
        log.info(
            "quota_local_counts",
            backend="redis",
            tenants=len(month),
            day_tokens=sum(day.values()),
            month_tokens=sum(month.values()),
        )
        return local

    async def usage(self, tenant: TenantSettings) -> tuple[WindowUse, WindowUse]:
        """See `Quota.usage`; local counts while Redis is unreachable."""
        wins = windows_at(self._clock())
        if self._up:
            keys = [self._key(tenant.name, w) for w in wins]
            try:
                values = await self._client.mget(keys)
            except _BACKEND_ERRORS as exc:
                self._mark_down(exc)
            else:
                used = [int(v or 0) for v in values]
                self._note(tenant.name, wins, used[0], used[1])
                day, month = (
                    WindowUse(w.name, limit_of(tenant, w.name), max(0, u), w.end)
                    for w, u in zip(wins, used, strict=True)
                )
                return day, month
        local = await self._fallback()
        return local.usage_now(tenant)

    def gauge_values(self) -> list[tuple[str, str, int]]:
        """See `Quota.gauge_values`: the shared counts as of this replica's last call; the
        local counts while Redis is unreachable."""
        if not self._up and self._seeded == self._outages:
            return self._local.gauge_values()
        wins = windows_at(self._clock())
        best: dict[tuple[str, str], int] = {}
        for name, seen in self._seen.items():
            label = self._settings.tenant_label(name)
            for window in wins:
                key, used = seen.get(window.name, ("", 0))
                value = used if key == window.key else 0
                best[(label, window.name)] = max(best.get((label, window.name), 0), value)
        return [(label, window, used) for (label, window), used in best.items()]

    async def close(self) -> None:
        """Stop the maintenance task, try pending settlements once, close the pool."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        pending, self._pending = self._pending, []
        for job in pending:
            await self._settle_remote(job)
        await self._client.aclose()

    async def _maintain(self) -> None:
        """Probe Redis while it is down, send waiting settlements, refresh the gauges."""
        loop = asyncio.get_running_loop()
        refresh_at = 0.0
        while True:
            try:
                if not self._up:
                    await self._client.ping()
                    self._mark_up()
                if self._pending:
                    pending, self._pending = self._pending, []
                    for job in pending:
                        await self._settle_remote(job)
                if self._up and loop.time() >= refresh_at:
                    refresh_at = loop.time() + REFRESH_S
                    for tenant in self._settings.tenants.values():
                        if has_quota(tenant):
                            await self.usage(tenant)
            except _BACKEND_ERRORS as exc:
                self._mark_down(exc)
            except Exception:
                log.exception("quota_maintenance_failed", backend="redis")
            await asyncio.sleep(RECONNECT_S)

    def _mark_down(self, exc: BaseException) -> None:
        if not self._up:
            return
        self._up = False
        self._outages += 1
        log.warning(
            "quota_backend_down",
            backend="redis",
            error=f"{type(exc).__name__}: {exc}",
            fallback="memory",
        )

    def _mark_up(self) -> None:
        if self._up:
            return
        self._up = True
        log.info("quota_backend_up", backend="redis")
