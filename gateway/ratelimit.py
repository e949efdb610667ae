"""Per-tenant limits on requests per minute, tokens per minute and requests in flight."""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import structlog

from gateway.config import Settings, TenantSettings
from gateway.errors import RateLimited, retry_after_header
from gateway.metrics import Metrics

log = structlog.get_logger(__name__)

WINDOW_S = 60.0
"""The period of ``rpm`` and ``tpm``: a limit of N allows N per 60 s, all at once (burst N)."""

# Float rounding must not refuse a request at the very instant its Retry-After says it passes.
_EPSILON = 1e-6

HEADER_NAMES = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes ``x-ratelimit-reset-*``: ``"120ms"``, ``"8.64s"``, ``"6m0s"``.

    Below one second whole milliseconds (rounded up); from one second on Go's duration format
    (``1h2m3.5s``) with at most millisecond precision. Zero or less is ``"0s"``.
    """
    millis = math.ceil(seconds * 1000 - _EPSILON)
    if millis <= 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest // 1000}" if rest % 1000 == 0 else f"{rest / 1000:.3f}".rstrip("0")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


@dataclass
class Bucket:
    """One continuously draining budget (a leaky bucket, the state form of GCRA).

    ``level`` units were used at monotonic time ``ts`` and drain at ``limit / 60`` per second, so
    a limit of N admits N at once and then one every ``60 / N`` seconds, with no fixed window
    edge. The state is a count, not a deadline, so a reload that changes the limit keeps what was
    used.
    """

    level: float = 0.0
    ts: float = 0.0

    def drained(self, limit: int, now: float) -> float:
        """The level at ``now`` after draining at ``limit / 60`` per second (0 limit: no drain)."""
        if now <= self.ts or limit <= 0:
            return self.level
        return max(0.0, self.level - (now - self.ts) * limit / WINDOW_S)

    def set(self, level: float, now: float) -> None:
        """Record ``level`` as of ``now``."""
        self.level = max(0.0, level)
        self.ts = max(now, self.ts)


def wait_for(level: float, cost: float, limit: int) -> float:
    """Seconds until ``cost`` more fits under ``limit`` given ``level`` used; 0 if it fits now.

    ``math.inf`` when it can never fit (``cost > limit``, or a limit of 0).
    """
    if cost <= 0:
        return 0.0
    if limit <= 0 or cost > limit:
        return math.inf
    excess = level + cost - limit
    if excess <= _EPSILON:
        return 0.0
    return excess * WINDOW_S / limit


def limit_headers(rpm: int, req_level: float, tpm: int, tok_level: float) -> dict[str, str]:
    """OpenAI's six ``x-ratelimit-*`` headers for the given limits and levels used.

    ``remaining`` is what fits right now (rounded down); ``reset`` the time until the budget is
    whole again (OpenAI API reference, "Rate limits": "the time until the rate limit resets to its
    initial state").
    """

    def three(limit: int, level: float) -> tuple[str, str, str]:
        remaining = max(0, math.floor(limit - level + _EPSILON))
        reset = level * WINDOW_S / limit if limit > 0 else 0.0
        return str(limit), str(remaining), format_reset(reset)

    r = three(rpm, req_level)
    t = three(tpm, tok_level)
    return dict(zip(HEADER_NAMES, (*r, *t), strict=True))


@dataclass
class Reservation:
    """What `RateLimiter.reserve` took for one request; hand it back to `RateLimiter.settle`.

    Attributes:
        tenant: tenant name.
        reserved_tokens: tokens charged at admission (the app's estimate).
        headers: OpenAI's six ``x-ratelimit-*`` headers as of admission, for the response.
        limits: the tenant's settings the reservation was made under.
        backend: ``"memory"`` or ``"redis"``: where the charge lives (settled in the same place;
            the Redis backend's fallback makes ``"memory"`` reservations).
        lease: the Redis concurrency lease id, or None.
        settled: True once `RateLimiter.settle` ran (a second call does nothing).
    """

    tenant: str
    reserved_tokens: int
    headers: dict[str, str]
    limits: TenantSettings = field(repr=False, default_factory=TenantSettings)
    backend: str = "memory"
    lease: str | None = None
    settled: bool = False


class RateLimiter(abc.ABC):
    """Per-tenant limits: ``rpm`` and ``tpm`` (60 s leaky buckets) and ``concurrency`` (slots).

    Limits are read from the `TenantSettings` passed to each call, so a config reload applies to the
    next request and keeps the counts already used. A limit of 0 admits nothing.
    """

    backend: str = "memory"

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self._settings = settings
        self._metrics = metrics

    def reconfigure(self, settings: Settings) -> None:
        """Take a reloaded config (used for metric labels; the backend itself needs a restart)."""
        self._settings = settings

    @abc.abstractmethod
    async def reserve(self, tenant: TenantSettings, tokens: int) -> Reservation:
        """Take one request, ``tokens`` tokens and one concurrency slot for ``tenant``, atomically.

        Args:
            tenant: the tenant's current settings (limits are read from here on every call).
            tokens: the reservation estimate (see `reservation_tokens`), >= 0.

        Returns:
            The reservation, whose ``headers`` show the budget left after it.

        Raises:
            RateLimited: ``limit`` ``requests``, ``tokens`` or ``concurrency``; nothing was taken.
                ``retry_after_s`` is the real time until that limit admits this request (for
                ``concurrency``, which frees when a running request ends, 1 s); the error carries
                the six headers. A request larger than ``tpm`` can never pass: ``tokens`` with
                Retry-After 60 and a message saying so.
        """

    @abc.abstractmethod
    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """End of the request on any path: free its slot, charge ``actual_tokens`` instead.

        ``actual_tokens`` is prompt plus completion as the engine reported it (a client that went
        away is charged what was generated); more than reserved is charged too. Idempotent; never
        raises (problems are logged).
        """

    @abc.abstractmethod
    async def headers(self, tenant: TenantSettings) -> dict[str, str]:
        """The tenant's six ``x-ratelimit-*`` headers now, taking nothing (for ``/v1/models``)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect and start background work at app startup (else the first call starts it)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop background work and release connections, at app cleanup; idempotent."""

    def _refuse(
        self,
        tenant: TenantSettings,
        limit: str,
        retry_after_s: float,
        tokens: int,
        headers: Mapping[str, str],
    ) -> RateLimited:
        """Build (and count in ``gateway_rate_limited_total``) the 429 for ``limit``."""
        self._metrics.rate_limited.labels(self._settings.tenant_label(tenant.name), limit).inc()
        if limit == "requests" and math.isinf(retry_after_s):
            message = "This tenant's requests per minute (RPM) limit is 0: no request can pass."
        elif limit == "requests":
            message = (
                f"Rate limit reached for requests per minute (RPM): limit {tenant.rpm}. "
                f"Retry after {retry_after_header(retry_after_s)} s."
            )
        elif limit == "tokens" and math.isinf(retry_after_s):
            message = (
                f"Request too large for tokens per minute (TPM): limit {tenant.tpm}, "
                f"requested {tokens}. It cannot pass as it is: lower max_tokens, n or the prompt."
            )
        elif limit == "tokens":
            message = (
                f"Rate limit reached for tokens per minute (TPM): limit {tenant.tpm}, "
                f"requested {tokens}. Retry after {retry_after_header(retry_after_s)} s."
            )
        else:
            message = (
                f"Too many requests in flight: limit {tenant.concurrency}. "
                "Retry when one of them has finished."
            )
        # Infinite: it will not pass as it is (no Retry-After, not to be retried).
        return RateLimited(limit, message, retry_after_s, headers)


def check(
    tenant: TenantSettings,
    tokens: int,
    in_flight: int,
    req_level: float,
    tok_level: float,
) -> tuple[str, float] | None:
    """Which limit refuses the request and for how long, or None if all three admit it.

    When several refuse, the one with the longest wait is named: the request passes only once all
    do. ``concurrency`` has no known end (a running request must finish), so it counts as 1 s.
    """
    worst: tuple[str, float] | None = None
    if in_flight >= tenant.concurrency:
        worst = ("concurrency", 1.0)
    for name, wait in (
        ("requests", wait_for(req_level, 1, tenant.rpm)),
        ("tokens", wait_for(tok_level, tokens, tenant.tpm)),
    ):
        if wait > 0 and (worst is None or wait > worst[1]):
            worst = (name, wait)
    return worst


@dataclass
class _TenantState:
    requests: Bucket = field(default_factory=Bucket)
    tokens: Bucket = field(default_factory=Bucket)
    in_flight: int = 0


class MemoryRateLimiter(RateLimiter):
    """Limits held in this process (``[ratelimit] backend = "memory"``); one replica only.

    Args:
        clock: monotonic seconds; tests pass a fake one.
    """

    backend = "memory"

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(settings, metrics)
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}

    def _state(self, name: str) -> _TenantState:
        state = self._tenants.get(name)
        if state is None:
            state = self._tenants[name] = _TenantState()
        return state

    async def reserve(self, tenant: TenantSettings, tokens: int) -> Reservation:
        """See `RateLimiter.reserve`."""
        return self.reserve_now(tenant, tokens)

    def reserve_now(self, tenant: TenantSettings, tokens: int, *, held: int = 0) -> Reservation:
        """`reserve` without awaiting; ``held`` more requests count as in flight.

        The Redis backend falls back to this while Redis is unreachable, passing the tenant's
        requests still running here under Redis leases as ``held``.
        """
        now = self._clock()
        state = self._state(tenant.name)
        req = state.requests.drained(tenant.rpm, now)
        tok = state.tokens.drained(tenant.tpm, now)
        refused = check(tenant, tokens, state.in_flight + held, req, tok)
        if refused is not None:
            headers = limit_headers(tenant.rpm, req, tenant.tpm, tok)
            raise self._refuse(tenant, refused[0], refused[1], tokens, headers)
        state.requests.set(req + 1, now)
        state.tokens.set(tok + tokens, now)
        state.in_flight += 1
        headers = limit_headers(tenant.rpm, req + 1, tenant.tpm, tok + tokens)
        return Reservation(tenant.name, tokens, headers, limits=tenant, backend=self.backend)

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """See `RateLimiter.settle`."""
        self.settle_now(reservation, actual_tokens)

    def settle_now(self, reservation: Reservation, actual_tokens: int) -> None:
        """`settle` without awaiting."""
        if reservation.settled:
            return
        reservation.settled = True
        now = self._clock()
        state = self._state(reservation.tenant)
        state.in_flight = max(0, state.in_flight - 1)
        delta = max(0, actual_tokens) - reservation.reserved_tokens
        if delta:
            tpm = reservation.limits.tpm
            state.tokens.set(state.tokens.drained(tpm, now) + delta, now)

    async def headers(self, tenant: TenantSettings) -> dict[str, str]:
        """See `RateLimiter.headers`."""
        return self.headers_now(tenant)

    def headers_now(self, tenant: TenantSettings) -> dict[str, str]:
        """`headers` without awaiting."""
        now = self._clock()
        state = self._tenants.get(tenant.name) or _TenantState()
        return limit_headers(
            tenant.rpm,
            state.requests.drained(tenant.rpm, now),
            tenant.tpm,
            state.tokens.drained(tenant.tpm, now),
        )

    async def start(self) -> None:
        """Nothing to start: the memory backend has no connection or background task."""

    async def close(self) -> None:
        """Nothing to close; counts are kept (a closed memory limiter still works)."""
