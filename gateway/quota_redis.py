"""Daily and monthly token quotas in Redis, shared by every gateway replica.

Used when ``[ratelimit] backend = "redis"``, on the same Redis as the per-minute limits.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
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
    (keep replicas on NTP). While Redis is unreachable, quotas are counted locally from zero
    (each replica enforces the whole quota on its own traffic) and settlements wait for Redis;
    the outage is logged once as ``quota_backend_down``.
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
                return QuotaReservation(
                    tenant.name, tokens, (wins[0].key, wins[1].key), backend="redis"
                )
        return self._local.reserve_now(tenant, tokens)

    async def settle(self, reservation: QuotaReservation, actual_tokens: int) -> None:
        """See `Quota.settle`. Runs to completion even if the caller is cancelled."""
        if reservation.settled:
            return
        if reservation.backend != "redis":
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
        await asyncio.shield(self._settle_remote(job))

    async def _settle_remote(self, job: _Settlement) -> None:
        """Run the settle script; never raises. If Redis fails, keep the job for a retry."""
        try:
            day, month = await self._settle(keys=job.keys, args=job.args)
        except _BACKEND_ERRORS as exc:
            self._mark_down(exc)
            self._pending.append(job)
            return
        except Exception:
            log.exception("quota_settle_failed", backend="redis", tenant=job.tenant)
            return
        self._seen[job.tenant] = {"day": (job.windows[0], day), "month": (job.windows[1], month)}

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
        return self._local.usage_now(tenant)

    def gauge_values(self) -> list[tuple[str, str, int]]:
        """See `Quota.gauge_values`: the shared counts as of this replica's last call."""
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
