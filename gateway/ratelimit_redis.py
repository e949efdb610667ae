"""The Redis rate-limit backend: one budget per tenant shared by every gateway replica."""

from __future__ import annotations

import asyncio
import itertools
import math
import secrets
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
from gateway.ratelimit import MemoryRateLimiter, RateLimiter, Reservation, limit_headers

log = structlog.get_logger(__name__)

LEASE_TTL_S = 30.0
"""Life of a concurrency lease in Redis: a replica that dies frees its tenants' slots by then.
Each replica renews its running requests' leases every third of it."""
RECONNECT_S = 1.0
"""How often an unreachable Redis is probed while local limits are in force."""

# Anything redis-py raises for a server that is down, slow, read-only or out of memory.
_BACKEND_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
# The reserve script's wait for "never" (a request larger than its limit, or a limit of 0).
_NEVER = 1e18

# Shared by every script. Time comes from Redis (TIME), so replicas with different clocks agree.
# A bucket is a hash {l: level used, t: when}; it drains at limit/60 per second (ratelimit.Bucket).
_PRELUDE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local function fmt(x) return string.format('%.17g', x) end
local function level(key, limit)
  local v = redis.call('HMGET', key, 'l', 't')
  local l = tonumber(v[1]) or 0
  local ts = tonumber(v[2]) or now
  if limit > 0 and now > ts then
    l = l - (now - ts) * limit / 60
    if l < 0 then l = 0 end
  end
  return l
end
local function store(key, l, limit)
  if l < 0 then l = 0 end
  redis.call('HSET', key, 'l', fmt(l), 't', string.format('%.6f', now))
  local ttl = 60
  if limit > 0 then ttl = ttl + math.ceil(l * 60 / limit) end
  redis.call('EXPIRE', key, ttl)
end
"""

# KEYS: requests bucket, tokens bucket, leases (sorted set: lease id -> expiry).
# ARGV: rpm, tpm, concurrency, tokens, lease id, lease ttl (s).
# Returns {refused limit or '', wait s, requests level, tokens level}; takes all or nothing.
_RESERVE = (
    _PRELUDE
    + """
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, ttl = tonumber(ARGV[4]), tonumber(ARGV[6])
local req = level(KEYS[1], rpm)
local tok = level(KEYS[2], tpm)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local held = redis.call('ZCARD', KEYS[3])
local function wait(l, c, limit)
  if c <= 0 then return 0 end
  if limit <= 0 or c > limit then return 1e18 end
  local excess = l + c - limit
  if excess <= 1e-6 then return 0 end
  return excess * 60 / limit
end
local name, worst = '', 0
if held >= conc then name, worst = 'concurrency', 1 end
local wr = wait(req, 1, rpm)
if wr > 0 and (name == '' or wr > worst) then name, worst = 'requests', wr end
local wt = wait(tok, cost, tpm)
if wt > 0 and (name == '' or wt > worst) then name, worst = 'tokens', wt end
if name ~= '' then return {name, fmt(worst), fmt(req), fmt(tok)} end
store(KEYS[1], req + 1, rpm)
store(KEYS[2], tok + cost, tpm)
redis.call('ZADD', KEYS[3], now + ttl, ARGV[5])
redis.call('PEXPIRE', KEYS[3], math.ceil(ttl * 1000) + 1000)
return {'', '0', fmt(req + 1), fmt(tok + cost)}
"""
)

# KEYS: tokens bucket, leases. ARGV: tpm, token correction, lease id.
# The correction applies only if this call removed the lease, so running it twice (a retry after
# a cancellation) charges once. Returns 1 if the lease was held.
_SETTLE = (
    _PRELUDE
    + """
local tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
local held = redis.call('ZREM', KEYS[2], ARGV[3])
if held == 1 and delta ~= 0 then store(KEYS[1], level(KEYS[1], tpm) + delta, tpm) end
return held
"""
)

# KEYS: requests bucket, tokens bucket. ARGV: rpm, tpm. Returns {requests level, tokens level}.
_PEEK = (
    _PRELUDE
    + """
return {fmt(level(KEYS[1], tonumber(ARGV[1]))), fmt(level(KEYS[2], tonumber(ARGV[2])))}
"""
)

# KEYS: leases. ARGV: ttl (s), lease ids. Extends leases still present (XX: never resurrects one
# that a settle removed while this call was on its way).
_RENEW = (
    _PRELUDE
    + """
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000) + 1000)
return 1
"""
)


@dataclass(frozen=True)
class _Settlement:
    """A settle script call: free ``lease`` in ``lease_key``, correct the tokens by ``delta``."""

    limits: TenantSettings
    lease_key: str
    lease: str
    delta: int


def _wait_s(text: Any) -> float:
    value = float(text)
    return math.inf if value >= _NEVER else value


class RedisRateLimiter(RateLimiter):
    """Limits in Redis (``[ratelimit] backend = "redis"``), shared by every replica.

    Each call is one atomic Lua script (`redis.asyncio.Redis.register_script`) on keys
    ``{key_prefix}:rl:{TENANT}:req|tok|lease`` (the tenant in braces keeps a tenant's keys in one
    Redis Cluster slot). Buckets behave exactly as in `MemoryRateLimiter`, timed by the Redis
    server's clock. Concurrency slots are leases in a sorted set that expire after ``lease_ttl_s``
    (default `LEASE_TTL_S`) unless renewed; this replica renews its running requests' leases every
    third of it, so a crashed replica cannot hold slots for longer.

    If Redis fails (connection, timeout, error reply), calls fall back to a local
    `MemoryRateLimiter` at once and never raise; ``ratelimit_backend_down`` is logged once per
    outage, ``gateway_ratelimit_backend_up{backend="redis"}`` drops to 0, and Redis is probed every
    `RECONNECT_S` until ``ratelimit_backend_up``. During an outage each replica enforces the full
    limits on its own, counting its requests still running under Redis leases as in flight.
    """

    backend = "redis"

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        lease_ttl_s: float = LEASE_TTL_S,
    ) -> None:
        super().__init__(settings, metrics)
        cfg = settings.ratelimit
        self._lease_ttl_s = lease_ttl_s
        self._prefix = cfg.key_prefix
        # One quick retry replaces a pooled connection that died with a restarted Redis; anything
        # more would make a request wait on a Redis that is down.
        self._client: aioredis.Redis = aioredis.Redis.from_url(
            cfg.redis_url,
            socket_timeout=cfg.redis_timeout_s,
            socket_connect_timeout=cfg.redis_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._reserve = self._client.register_script(_RESERVE)
        self._settle = self._client.register_script(_SETTLE)
        self._peek = self._client.register_script(_PEEK)
        self._renew = self._client.register_script(_RENEW)
        self._local = MemoryRateLimiter(settings, metrics, clock=clock)
        self._up_gauge = metrics.ratelimit_backend_up.labels("redis")
        self._up = True
        self._known = False  # whether Redis answered or failed at least once
        self._replica = secrets.token_hex(6)
        self._lease_ids = itertools.count()
        self._leases: dict[str, str] = {}  # lease id -> leases key, for renewal
        self._held: dict[str, int] = {}  # tenant -> requests running here under a lease
        # Settlements Redis could not take (lease id -> call), retried once it answers again.
        self._pending: dict[str, _Settlement] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def up(self) -> bool:
        """False while Redis is unreachable and local limits are in force."""
        return self._up

    def reconfigure(self, settings: Settings) -> None:
        """See `RateLimiter.reconfigure`."""
        super().reconfigure(settings)
        self._local.reconfigure(settings)

    def _keys(self, tenant: str) -> tuple[str, str, str]:
        base = f"{self._prefix}:rl:{{{tenant}}}"
        return f"{base}:req", f"{base}:tok", f"{base}:lease"

    async def start(self) -> None:
        """Probe Redis once (setting the metric and logging an outage) and start renewals."""
        self._ensure_task()
        try:
            await self._client.ping()
        except _BACKEND_ERRORS as exc:
            self._mark_down(exc)
        else:
            self._mark_up()

    async def reserve(self, tenant: TenantSettings, tokens: int) -> Reservation:
        """See `RateLimiter.reserve`; falls back to local limits while Redis is unreachable."""
        self._ensure_task()
        if self._up:
            req_key, tok_key, lease_key = self._keys(tenant.name)
            lease = f"{self._replica}:{next(self._lease_ids)}"
            args = (tenant.rpm, tenant.tpm, tenant.concurrency, tokens, lease, self._lease_ttl_s)
            try:
                reply = await self._reserve(keys=(req_key, tok_key, lease_key), args=args)
            except asyncio.CancelledError:
                # The script may have run: give back whatever it took.
                undo = _Settlement(tenant, lease_key, lease, -tokens)
                self._detach(self._settle_remote(undo))
                raise
            except _BACKEND_ERRORS as exc:
                self._mark_down(exc)
            else:
                self._mark_up()
                limit, wait, req, tok = (x.decode() for x in reply)
                headers = limit_headers(tenant.rpm, float(req), tenant.tpm, float(tok))
                if limit:
                    raise self._refuse(tenant, limit, _wait_s(wait), tokens, headers)
                self._leases[lease] = lease_key
                self._held[tenant.name] = self._held.get(tenant.name, 0) + 1
                return Reservation(
                    tenant.name, tokens, headers, limits=tenant, backend="redis", lease=lease
                )
        return self._local.reserve_now(tenant, tokens, held=self._held.get(tenant.name, 0))

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """See `RateLimiter.settle`.

        While Redis is unreachable the settlement waits (without delaying the caller) and is sent
        when Redis answers again; if the lease has expired by then, only the slot was freed.
        """
        if reservation.settled:
            return
        if reservation.backend != "redis" or reservation.lease is None:
            self._local.settle_now(reservation, actual_tokens)
            return
        reservation.settled = True
        lease = reservation.lease
        lease_key = self._leases.pop(lease, None) or self._keys(reservation.tenant)[2]
        left = self._held.get(reservation.tenant, 1) - 1
        if left > 0:
            self._held[reservation.tenant] = left
        else:
            self._held.pop(reservation.tenant, None)
        delta = max(0, actual_tokens) - reservation.reserved_tokens
        job = _Settlement(reservation.limits, lease_key, lease, delta)
        if not self._up:
            self._pending[lease] = job
            return
        try:
            await self._settle_remote(job)
        except asyncio.CancelledError:
            # Settling twice is harmless (the script charges only while it holds the lease).
            self._detach(self._settle_remote(job))
            raise

    async def _settle_remote(self, job: _Settlement) -> None:
        """Run the settle script; never raises. If Redis fails, keep it for when Redis is back."""
        tok_key = self._keys(job.limits.name)[1]
        args = (job.limits.tpm, job.delta, job.lease)
        try:
            await self._settle(keys=(tok_key, job.lease_key), args=args)
        except _BACKEND_ERRORS as exc:
            self._mark_down(exc)
            self._pending[job.lease] = job
        except Exception:
            log.exception("ratelimit_settle_failed", backend="redis", tenant=job.limits.name)

    async def headers(self, tenant: TenantSettings) -> dict[str, str]:
        """See `RateLimiter.headers`; local figures while Redis is unreachable."""
        self._ensure_task()
        if self._up:
            req_key, tok_key, _ = self._keys(tenant.name)
            try:
                reply = await self._peek(keys=(req_key, tok_key), args=(tenant.rpm, tenant.tpm))
            except _BACKEND_ERRORS as exc:
                self._mark_down(exc)
            else:
                self._mark_up()
                req, tok = (float(x) for x in reply)
                return limit_headers(tenant.rpm, req, tenant.tpm, tok)
        return self._local.headers_now(tenant)

    async def close(self) -> None:
        """Stop renewing and probing, finish pending settlements, close the connection pool."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._client.aclose()

    def _detach(self, work: Any) -> None:
        """Run ``work`` to completion even though its caller was cancelled."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _ensure_task(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._maintain())

    async def _maintain(self) -> None:
        """Probe Redis every `RECONNECT_S` while it is down; renew leases every third of the TTL."""
        loop = asyncio.get_running_loop()
        renew_at = loop.time() + self._lease_ttl_s / 3
        while True:
            await asyncio.sleep(min(RECONNECT_S, self._lease_ttl_s / 3))
            try:
                if not self._up:
                    await self._client.ping()
                    self._mark_up()
                    renew_at = 0.0
                if self._pending:
                    pending, self._pending = self._pending, {}
                    for job in pending.values():
                        await self._settle_remote(job)
                if loop.time() >= renew_at:
                    renew_at = loop.time() + self._lease_ttl_s / 3
                    await self._renew_leases()
            except _BACKEND_ERRORS as exc:
                self._mark_down(exc)
            except Exception:
                log.exception("ratelimit_maintenance_failed", backend="redis")

    async def _renew_leases(self) -> None:
        by_key: dict[str, list[str]] = {}
        for lease, key in self._leases.items():
            by_key.setdefault(key, []).append(lease)
        for key, leases in by_key.items():
            await self._renew(keys=(key,), args=(self._lease_ttl_s, *leases))

    def _mark_down(self, exc: BaseException) -> None:
        if self._known and not self._up:
            return
        self._up = False
        self._known = True
        self._up_gauge.set(0)
        log.warning(
            "ratelimit_backend_down",
            backend="redis",
            error=f"{type(exc).__name__}: {exc}",
            fallback="memory",
        )

    def _mark_up(self) -> None:
        if self._known and self._up:
            return
        if not self._up:
            log.info("ratelimit_backend_up", backend="redis")
        self._up = True
        self._known = True
        self._up_gauge.set(1)
