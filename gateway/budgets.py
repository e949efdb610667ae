"""One interface over a tenant's token and request budgets: reserve, settle, release.

`Budgets` puts the per-minute limits (``rpm``, ``tpm``, ``concurrency``: `gateway.ratelimit`,
memory or Redis, `gateway.limiter`) and the long-window quotas (``tokens_per_day``,
``tokens_per_month``: `gateway.quota`, memory or Redis, `gateway.accounting`) behind one
reserve-then-settle discipline, so the model path takes and gives back one `Hold`: reserved
before admission, settled to the tokens the engine counted when the call ends, on any path.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import TenantSettings
from gateway.quota import MemoryQuota, Quota, QuotaReservation
from gateway.ratelimit import MemoryRateLimiter, RateLimiter, Reservation


@dataclass
class Hold:
    """What one call holds against its tenant's budgets.

    Attributes:
        rate: the rate-limit reservation (one request, its tokens, a concurrency slot).
        quota: the quota reservation, or None when quotas were not asked (``count_tokens``).
    """

    rate: Reservation
    quota: QuotaReservation | None = None

    @property
    def headers(self) -> dict[str, str]:
        """OpenAI's six ``x-ratelimit-*`` headers as of the reservation."""
        return self.rate.headers


class Budgets:
    """The rate limiter and the quotas of one gateway process as one budget.

    Args:
        limiter: the ``[ratelimit] backend``'s limiter (memory or Redis).
        quota: the quota backend (memory, restored from the ledger, or Redis).
    """

    def __init__(self, limiter: RateLimiter, quota: Quota) -> None:
        self.limiter = limiter
        self.quota = quota

    async def reserve(self, tenant: TenantSettings, tokens: int, *, quotas: bool = True) -> Hold:
        """Take ``tokens`` (>= 0) of the quotas (unless ``quotas`` is False), then one request,
        ``tokens`` of ``tpm`` and a concurrency slot; all or nothing.

        Raises:
            gateway.quota.QuotaExceeded: 429 ``insufficient_quota``; nothing held.
            gateway.errors.RateLimited: 429 ``rate_limit_exceeded`` (``requests``, ``tokens``,
                ``concurrency``); nothing held.
        """
        quota = await self.quota.reserve(tenant, tokens) if quotas else None
        try:
            rate = await self.limiter.reserve(tenant, tokens)
        except BaseException:
            if quota is not None:
                await self.quota.settle(quota, 0)
            raise
        return Hold(rate, quota)

    async def settle(self, hold: Hold, tokens: int) -> None:
        """The call ended having used ``tokens`` (prompt plus completion, the engine's count):
        charge them instead of the reservation and free the slot. Idempotent; never raises."""
        await self.limiter.settle(hold.rate, tokens)
        if hold.quota is not None:
            await self.quota.settle(hold.quota, tokens)

    @property
    def in_memory(self) -> bool:
        """Both backends are in this process's memory (`settle_now` applies)."""
        return isinstance(self.limiter, MemoryRateLimiter) and isinstance(self.quota, MemoryQuota)

    def settle_now(self, hold: Hold, tokens: int) -> None:
        """`settle` without awaiting; only when `in_memory`."""
        limiter, quota = self.limiter, self.quota
        assert isinstance(limiter, MemoryRateLimiter) and isinstance(quota, MemoryQuota)
        limiter.settle_now(hold.rate, tokens)
        if hold.quota is not None:
            quota.settle_now(hold.quota, tokens)

    async def release(self, hold: Hold) -> None:
        """The call used no tokens (refused or counted nothing): give everything back."""
        await self.settle(hold, 0)
