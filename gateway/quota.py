"""Token quotas over long windows: ``tokens_per_day`` (UTC day) and ``tokens_per_month``.

The same reserve-then-settle discipline as ``tpm`` (`gateway.ratelimit`): admission reserves the
request's reservation estimate (prompt estimate plus ``max_tokens`` for each choice) in the
current day and month; the end of the request, on any path, replaces it with the tokens really
used (the engine's usage, or what was streamed before a cut). A request is charged to the
windows current when it ends, as the usage ledger dates it, so ledger, quota and reports agree.

A tenant whose reservation does not fit gets 429 with OpenAI's ``insufficient_quota`` type and
code (OpenAI API reference, "Error codes": "429 - You exceeded your current quota") and a
``Retry-After`` to the start of the window that refused it (the next UTC midnight, or the first
day of the next month).

This module holds the window arithmetic, the error, the in-process backend and the Prometheus
gauge samples; ``gateway.quota_redis`` shares the counts between replicas.
"""

from __future__ import annotations

import abc
import datetime as dt
import math
import operator
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gateway.config import Settings, TenantSettings
from gateway.errors import RateLimited
from gateway.metrics import QUOTA_WINDOWS, Metrics

WINDOWS = QUOTA_WINDOWS
"""Quota windows: the UTC calendar day and the UTC calendar month."""
LIMIT_NAMES = {"day": "tokens_per_day", "month": "tokens_per_month"}
_UTC = dt.timezone.utc

Totals = Callable[[], Awaitable[tuple[Mapping[str, int], Mapping[str, int]] | None]]
"""Reads the tokens used per tenant this UTC day and this month, ``(day, month)``; None when
they cannot be read. `gateway.accounting.Accounting` reads them from the usage ledger."""


@dataclass(frozen=True)
class Window:
    """One quota window as of some instant.

    Attributes:
        name: ``day`` or ``month``.
        key: ``YYYY-MM-DD`` or ``YYYY-MM`` (UTC).
        start: first second of the window, seconds since the Unix epoch.
        end: first second of the next window.
    """

    name: str
    key: str
    start: float
    end: float


def windows_at(now: float) -> tuple[Window, Window]:
    """The UTC day and calendar month containing ``now`` (seconds since the Unix epoch).

    The last answer is kept: every request asks, and the day changes once a day.
    """
    last = _last_windows
    if last is not None and last[0].start <= now < last[0].end:
        return last
    moment = dt.datetime.fromtimestamp(now, _UTC)
    day0 = dt.datetime(moment.year, moment.month, moment.day, tzinfo=_UTC)
    month0 = dt.datetime(moment.year, moment.month, 1, tzinfo=_UTC)
    if moment.month == 12:
        month1 = dt.datetime(moment.year + 1, 1, 1, tzinfo=_UTC)
    else:
        month1 = dt.datetime(moment.year, moment.month + 1, 1, tzinfo=_UTC)
    day = Window("day", day0.strftime("%Y-%m-%d"), day0.timestamp(), day0.timestamp() + 86_400)
    month = Window("month", month0.strftime("%Y-%m"), month0.timestamp(), month1.timestamp())
    return _remember((day, month))


_last_windows: tuple[Window, Window] | None = None


def _remember(windows: tuple[Window, Window]) -> tuple[Window, Window]:
    global _last_windows
    _last_windows = windows
    return windows


def limit_of(tenant: TenantSettings, window: str) -> int | None:
    """The tenant's quota for ``window`` (``day`` or ``month``), None when it has none."""
    return tenant.tokens_per_day if window == "day" else tenant.tokens_per_month


def has_quota(tenant: TenantSettings) -> bool:
    """Whether the tenant has a daily or a monthly quota."""
    return tenant.tokens_per_day is not None or tenant.tokens_per_month is not None


def iso_utc(ts: float) -> str:
    """``ts`` as an RFC 3339 UTC timestamp with a ``Z`` (e.g. ``2026-12-02T00:00:00Z``)."""
    return dt.datetime.fromtimestamp(ts, _UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class QuotaExceeded(RateLimited):
    """429 ``insufficient_quota``: the reservation does not fit in the tenant's day or month.

    Attributes:
        window: ``day`` or ``month``, the window that refused (the later one if both did).
        retry_after_s: seconds until that window ends (sent as ``Retry-After``); infinite for
            a request larger than the whole quota (`gateway.errors.RateLimited`).
    """

    code = "insufficient_quota"

    def __init__(self, window: str, message: str, retry_after_s: float) -> None:
        super().__init__("insufficient_quota", message, retry_after_s)
        self.reason = LIMIT_NAMES[window]
        self.window = window


@dataclass(frozen=True)
class WindowUse:
    """A tenant's use of one window, for ``/v1/usage`` and the gauges.

    Attributes:
        window: ``day`` or ``month``.
        limit: the quota in tokens, or None.
        used: tokens charged in the window, including reservations of requests still running.
        resets_at: the window's end, seconds since the Unix epoch.
    """

    window: str
    limit: int | None
    used: int
    resets_at: float

    @property
    def remaining(self) -> int | None:
        """Tokens left (never negative), None without a quota."""
        return None if self.limit is None else max(0, self.limit - self.used)


@dataclass
class QuotaReservation:
    """What `Quota.reserve` charged; hand it back to `Quota.settle` exactly once (idempotent).

    Attributes:
        tenant: tenant name.
        tokens: tokens reserved in each window (0 when nothing was reserved).
        keys: the window keys charged, ``(day key, month key)``.
        backend: ``memory`` or ``redis``, where the charge lives.
        settled: True once settled.
    """

    tenant: str
    tokens: int
    keys: tuple[str, str] = ("", "")
    backend: str = "memory"
    settled: bool = False


def refusal(
    tenant: TenantSettings, window: Window, used: float, tokens: int, now: float
) -> QuotaExceeded:
    """The 429 for ``window`` refusing ``tokens`` more with ``used`` already charged."""
    limit = limit_of(tenant, window.name) or 0
    what = "daily" if window.name == "day" else "monthly"
    name = LIMIT_NAMES[window.name]
    wait = max(0.0, window.end - now)
    resets = iso_utc(window.end)
    if tokens > limit:
        message = (
            f"This request can reserve up to {tokens} tokens (prompt plus max_tokens), more than "
            f"your whole {what} token quota ({name}: {limit}); it cannot pass as it is: lower "
            "max_tokens, n or the prompt."
        )
        wait = math.inf  # no window's end lets it pass
    elif used >= limit:
        message = (
            f"You exceeded your {what} token quota ({name}: {limit}, used {int(used)}). It "
            f"resets at {resets}; retry after {math.ceil(wait)} s."
        )
    else:
        message = (
            f"This request can reserve up to {tokens} tokens (prompt plus max_tokens) but "
            f"{limit - int(used)} remain of your {what} token quota ({name}: {limit}). Lower "
            f"max_tokens, n or the prompt, or retry after it resets at {resets} "
            f"({math.ceil(wait)} s)."
        )
    return QuotaExceeded(window.name, message, wait)


_END = operator.attrgetter("end")


def first_refusal(
    tenant: TenantSettings, wins: Iterable[Window], used: Mapping[str, float], tokens: int
) -> Window | None:
    """The window that refuses ``tokens`` more (the later-ending one first), or None."""
    for window in sorted(wins, key=_END, reverse=True):
        limit = limit_of(tenant, window.name)
        if limit is not None and tokens > 0 and used[window.name] + tokens > limit:
            return window
        if limit is not None and tokens == 0 and used[window.name] >= limit:
            return window
    return None


class Quota(abc.ABC):
    """Per-tenant daily and monthly token quotas; limits are read from each call's settings.

    Args:
        settings: the configuration (tenant tables for the gauges; reloads via `reconfigure`).
        metrics: where refusals are counted (``gateway_rate_limited_total``).
        clock: wall-clock seconds since the Unix epoch (window boundaries are UTC dates).
    """

    backend = "memory"

    def __init__(
        self, settings: Settings, metrics: Metrics, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._clock = clock

    def reconfigure(self, settings: Settings) -> None:
        """Take a reloaded config (new limits apply to the next request; counts are kept)."""
        self._settings = settings

    @abc.abstractmethod
    async def reserve(self, tenant: TenantSettings, tokens: int) -> QuotaReservation:
        """Charge ``tokens`` to the tenant's current day and month, all or nothing.

        Raises:
            QuotaExceeded: a window has less than ``tokens`` left; nothing was charged.
        """

    @abc.abstractmethod
    async def settle(self, reservation: QuotaReservation, actual_tokens: int) -> None:
        """Replace the reservation by ``actual_tokens`` (prompt plus completion used).

        Charged to the windows current now. Idempotent; never raises.
        """

    @abc.abstractmethod
    async def usage(self, tenant: TenantSettings) -> tuple[WindowUse, WindowUse]:
        """The tenant's day and month use now (including running requests' reservations)."""

    @abc.abstractmethod
    def gauge_values(self) -> list[tuple[str, str, int]]:
        """``(tenant label, window, used)`` for the gauges, from what this replica knows."""

    async def restore_from(self, totals: Totals) -> None:  # noqa: B027 - optional hook
        """Take the reader of the tokens already used (the usage ledger's), at app startup."""

    async def start(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Connect and start background work at app startup."""

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Stop background work; idempotent."""

    def count_refusal(self, tenant: TenantSettings, exc: QuotaExceeded) -> QuotaExceeded:
        """Count ``exc`` in ``gateway_rate_limited_total`` and return it."""
        label = self._settings.tenant_label(tenant.name)
        self._metrics.rate_limited.labels(label, exc.reason).inc()
        return exc


@dataclass
class _Counts:
    keys: dict[str, str] = field(default_factory=dict)  # window -> key of the counted window
    used: dict[str, int] = field(default_factory=dict)  # window -> tokens

    def roll(self, wins: tuple[Window, Window]) -> None:
        for window in wins:
            if self.keys.get(window.name) != window.key:
                self.keys[window.name] = window.key
                self.used[window.name] = 0


class MemoryQuota(Quota):
    """Quotas counted in this process (``[ratelimit] backend = "memory"``).

    Every tenant's use is counted, with a quota or not, so a quota added by a reload applies to
    the tokens already used today. `restore` seeds the counts from the usage ledger at startup,
    so a restart does not reset a tenant's day or month.
    """

    backend = "memory"

    def __init__(
        self, settings: Settings, metrics: Metrics, *, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(settings, metrics, clock=clock)
        self._tenants: dict[str, _Counts] = {}

    def _counts(self, name: str, wins: tuple[Window, Window]) -> _Counts:
        counts = self._tenants.get(name)
        if counts is None:
            counts = self._tenants[name] = _Counts()
        counts.roll(wins)
        return counts

    def restore(self, day: Mapping[str, int], month: Mapping[str, int]) -> None:
        """Add tokens already used this day and this month (per tenant), e.g. from the ledger."""
        wins = windows_at(self._clock())
        for totals, window in ((day, "day"), (month, "month")):
            for name, tokens in totals.items():
                counts = self._counts(name, wins)
                counts.used[window] += max(0, int(tokens))

    async def restore_from(self, totals: Totals) -> None:
        """`restore` what ``totals`` reads now; nothing when it reads None."""
        read = await totals()
        if read is not None:
            self.restore(*read)

    async def reserve(self, tenant: TenantSettings, tokens: int) -> QuotaReservation:
        """See `Quota.reserve`."""
        return self.reserve_now(tenant, tokens)

    def reserve_now(self, tenant: TenantSettings, tokens: int) -> QuotaReservation:
        """`reserve` without awaiting (also the Redis backend's fallback)."""
        now = self._clock()
        wins = windows_at(now)
        counts = self._counts(tenant.name, wins)
        refused = first_refusal(tenant, wins, counts.used, tokens)
        if refused is not None:
            exc = refusal(tenant, refused, counts.used[refused.name], tokens, now)
            raise self.count_refusal(tenant, exc)
        for window in WINDOWS:
            counts.used[window] += tokens
        return QuotaReservation(tenant.name, tokens, (wins[0].key, wins[1].key), self.backend)

    async def settle(self, reservation: QuotaReservation, actual_tokens: int) -> None:
        """See `Quota.settle`."""
        self.settle_now(reservation, actual_tokens)

    def settle_now(self, reservation: QuotaReservation, actual_tokens: int) -> None:
        """`settle` without awaiting."""
        if reservation.settled:
            return
        reservation.settled = True
        counts = self._counts(reservation.tenant, windows_at(self._clock()))
        actual = max(0, actual_tokens)
        for index, window in enumerate(WINDOWS):
            if counts.keys[window] == reservation.keys[index]:
                delta = actual - reservation.tokens
            else:  # reserved in a window that has ended: charge the whole use to this one
                delta = actual
            counts.used[window] = max(0, counts.used[window] + delta)

    async def usage(self, tenant: TenantSettings) -> tuple[WindowUse, WindowUse]:
        """See `Quota.usage`."""
        return self.usage_now(tenant)

    def usage_now(self, tenant: TenantSettings) -> tuple[WindowUse, WindowUse]:
        """`usage` without awaiting."""
        wins = windows_at(self._clock())
        counts = self._tenants.get(tenant.name) or _Counts()
        counts.roll(wins)
        day, month = (
            WindowUse(w.name, limit_of(tenant, w.name), counts.used[w.name], w.end) for w in wins
        )
        return day, month

    def gauge_values(self) -> list[tuple[str, str, int]]:
        """See `Quota.gauge_values`: unconfigured tenants as ``default`` (the largest of them)."""
        wins = windows_at(self._clock())
        best: dict[tuple[str, str], int] = {}
        for name, counts in self._tenants.items():
            counts.roll(wins)
            label = self._settings.tenant_label(name)
            for window in WINDOWS:
                key = (label, window)
                best[key] = max(best.get(key, 0), counts.used[window])
        return [(label, window, used) for (label, window), used in best.items()]


def quota_samples(quota: Quota, settings: Settings) -> list[tuple[str, str, float, float]]:
    """``(tenant, window, limit, used)`` for `gateway.metrics.QuotaGauges`.

    One sample per configured tenant table and window with a quota; ``default``'s used value is
    the largest among the tenants without a table of their own.
    """
    seen = {(t, w): u for t, w, u in quota.gauge_values()}
    out = []
    for name, tenant in settings.tenants.items():
        for window in WINDOWS:
            limit = limit_of(tenant, window)
            if limit is not None:
                out.append((name, window, float(limit), float(seen.get((name, window), 0))))
    return out
