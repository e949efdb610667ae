"""The gateway with its rate limiter replaced by one that admits everything: the "limits off" row.

The configuration has no switch that turns rate limiting off (``[ratelimit]`` only picks a
backend, and a limit of 0 refuses everything), so the benchmark's baseline for the issue 8
target "all on at most 20% above limits off" is the same ``serve`` command with
`gateway.app.create_rate_limiter` answering `Unlimited`. Everything else (auth, rewrites,
admission queue, metrics, access log) runs unchanged.

Run: ``python -m tests.perf.nolimits --config FILE`` (the arguments of ``qwen38-gateway serve``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import gateway.app
from gateway.cli import main as gateway_main
from gateway.config import Settings, TenantSettings
from gateway.metrics import Metrics
from gateway.ratelimit import RateLimiter, Reservation


class Unlimited(RateLimiter):
    """Takes nothing, refuses nothing, sends no ``x-ratelimit-*`` headers."""

    backend = "none"

    async def reserve(self, tenant: TenantSettings, tokens: int) -> Reservation:
        """A reservation that holds nothing."""
        return Reservation(tenant.name, tokens, {}, limits=tenant, backend=self.backend)

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """Nothing to give back."""
        reservation.settled = True

    async def headers(self, tenant: TenantSettings) -> dict[str, str]:
        """No limit headers."""
        return {}

    async def start(self) -> None:
        """Nothing to start."""

    async def close(self) -> None:
        """Nothing to close."""


def _unlimited(
    settings: Settings, metrics: Metrics, *, clock: Callable[[], float] | None = None
) -> RateLimiter:
    return Unlimited(settings, metrics)


def main() -> int:
    """``serve`` with `Unlimited` as the rate limiter; returns the exit code."""
    gateway.app.create_rate_limiter = _unlimited  # type: ignore[assignment]
    return gateway_main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
