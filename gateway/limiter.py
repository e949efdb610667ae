"""The rate limiter ``[ratelimit] backend`` names: local memory or Redis shared by replicas."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.config import Settings
from gateway.metrics import Metrics
from gateway.ratelimit import MemoryRateLimiter, RateLimiter
from gateway.ratelimit_redis import RedisRateLimiter


def create_rate_limiter(
    settings: Settings, metrics: Metrics, *, clock: Callable[[], float] = time.monotonic
) -> RateLimiter:
    """The limiter ``[ratelimit] backend`` names: `MemoryRateLimiter` or `RedisRateLimiter`.

    The Redis limiter connects lazily and falls back to local limits while Redis is unreachable, so
    this never fails for a Redis that is down. Call `RateLimiter.close` at shutdown.
    """
    if settings.ratelimit.backend == "redis":
        return RedisRateLimiter(settings, metrics, clock=clock)
    metrics.ratelimit_backend_up.labels("memory").set(1)
    return MemoryRateLimiter(settings, metrics, clock=clock)
