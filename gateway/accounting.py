"""Usage accounting for the model request path: the quota reservation and the ledger record.

One `Accounting` per app. The model request path (`gateway.proxy`) calls `Accounting.reserve`
at admission (after the tenant is known, before the per-minute limits) and `Accounting.settle`
when the request ends; a finish hook calls `Accounting.record` once per model request, on every
path, refused ones included. ``GET /v1/usage`` is answered by `Accounting.document`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable
from typing import Any

import structlog

from gateway.config import Settings, TenantSettings
from gateway.errors import BadRequest
from gateway.ledger import Ledger, UsageRecord, utc_day
from gateway.ledger_ship import Shipper, summarise_pg
from gateway.metrics import Metrics
from gateway.quota import (
    LIMIT_NAMES,
    MemoryQuota,
    Quota,
    QuotaReservation,
    iso_utc,
    quota_samples,
    windows_at,
)
from gateway.usage_report import ReportError, make_span, summarise, totals

log = structlog.get_logger(__name__)

MAX_USAGE_DAYS = 400
"""Longest span ``GET /v1/usage`` answers, in days."""


def create_quota(
    settings: Settings, metrics: Metrics, *, clock: Callable[[], float] = time.time
) -> Quota:
    """The quota backend of ``[ratelimit] backend``: `MemoryQuota` or ``RedisQuota``."""
    if settings.ratelimit.backend == "redis":
        from gateway.quota_redis import RedisQuota

        return RedisQuota(settings, metrics, clock=clock)
    return MemoryQuota(settings, metrics, clock=clock)


class Accounting:
    """The quota backend and the ledger writer of one gateway process.

    Args:
        settings: configuration at startup (``[ledger]``, ``[ratelimit]``, tenant quotas).
        metrics: the app's metrics; the quota gauges are registered on its registry.
        clock: wall-clock seconds since the Unix epoch (UTC windows, record times).
    """

    def __init__(
        self, settings: Settings, metrics: Metrics, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._settings = settings
        self._clock = clock
        self.quota = create_quota(settings, metrics, clock=clock)
        cfg = settings.ledger
        self.ledger: Ledger | None = None
        self.shipper: Shipper | None = None
        self._dsn = cfg.dsn() if cfg.enabled else ""
        if self._dsn:
            self.shipper = Shipper(cfg.path, self._dsn, metrics, cfg.ship_interval_s)
        if cfg.enabled:
            self.ledger = Ledger(
                cfg.path,
                metrics,
                flush_interval_s=cfg.flush_interval_s,
                retention_days=cfg.retention_days,
                prune_interval_s=cfg.prune_interval_s,
                max_pending=cfg.max_pending,
                clock=clock,
                outbox=self.shipper is not None,
            )
        metrics.quota.source = lambda: quota_samples(self.quota, self._settings)

    def reconfigure(self, settings: Settings) -> None:
        """Take a reloaded config: new quotas apply to the next request (ledger settings need a
        restart)."""
        self._settings = settings
        self.quota.reconfigure(settings)

    async def start(self) -> None:
        """Start the ledger writer (and its shipper to PostgreSQL); with in-process quotas,
        restore this day and month from it (Redis quotas read it when Redis is unreachable).

        Raises:
            ConfigError: ``ledger.postgres_dsn`` is set and PostgreSQL cannot be used.
        """
        if self.ledger is not None:
            await asyncio.to_thread(self.ledger.start)
            if self.shipper is not None:
                try:
                    await asyncio.to_thread(self.shipper.start)
                except BaseException:
                    await asyncio.to_thread(self.ledger.close)
                    raise
            await self.quota.restore_from(self._ledger_totals)
        await self.quota.start()

    async def _ledger_totals(self) -> tuple[dict[str, int], dict[str, int]] | None:
        """Tokens per tenant in the ledger this UTC day and this month, ``(day, month)``,
        records still queued included; None without a ledger or when it cannot be read (logged
        as ``quota_restore_failed``). In-memory quotas read them at start; Redis quotas when
        Redis becomes unreachable (`gateway.quota_redis.RedisQuota`)."""
        ledger = self.ledger
        if ledger is None:
            return None
        day, month = windows_at(self._clock())
        try:
            month_totals = await asyncio.to_thread(ledger.totals_since, month.start)
            day_totals = await asyncio.to_thread(ledger.totals_since, day.start)
        except Exception as exc:  # an unreadable ledger must not stop the gateway
            log.error("quota_restore_failed", path=str(ledger.path), error=str(exc))
            return None
        log.info(
            "quota_restored",
            path=str(ledger.path),
            backend=self.quota.backend,
            tenants=len(month_totals),
            day_tokens=sum(day_totals.values()),
            month_tokens=sum(month_totals.values()),
        )
        return day_totals, month_totals

    async def close(self) -> None:
        """Stop the quota backend, then commit what the ledger still holds and stop it."""
        await self.quota.close()
        if self.ledger is not None:
            await asyncio.to_thread(self.ledger.close)
        if self.shipper is not None:
            await asyncio.to_thread(self.shipper.close)

    async def reserve(self, tenant: TenantSettings, tokens: int) -> QuotaReservation:
        """Reserve ``tokens`` of the tenant's quotas (see `Quota.reserve`).

        Raises:
            gateway.quota.QuotaExceeded: 429 ``insufficient_quota``.
        """
        return await self.quota.reserve(tenant, tokens)

    async def settle(self, reservation: QuotaReservation, total_tokens: int) -> None:
        """Settle a quota reservation to the prompt plus completion tokens used; never raises."""
        await self.quota.settle(reservation, total_tokens)

    def record(
        self,
        *,
        tenant: str,
        key_id: str,
        subject: str | None,
        endpoint: str,
        status: int,
        prompt_tokens: int,
        completion_tokens: int,
        reasoning_tokens: int | None,
        queue_s: float | None,
        ttft_s: float | None,
        duration_s: float,
        request_id: str,
        engine: str | None = None,
        attaches: int = 0,
    ) -> None:
        """Queue the ledger record of one finished model request (see `UsageRecord`).

        Called once per model request that passed authentication, whatever its outcome
        (tokens 0 for a request refused before the engine). O(1); never raises.
        """
        if self.ledger is None:
            return
        now = self._clock()
        self.ledger.record(
            UsageRecord(
                now,
                utc_day(now),
                tenant,
                key_id,
                subject,
                endpoint,
                status,
                prompt_tokens,
                completion_tokens,
                reasoning_tokens,
                queue_s,
                ttft_s,
                duration_s,
                request_id,
                engine=engine,
                attaches=attaches,
            )
        )

    async def document(
        self, tenant: TenantSettings, since: str | None, until: str | None
    ) -> dict[str, Any]:
        """The body of ``GET /v1/usage`` for ``tenant`` (see README.md, "Usage and quotas").

        Raises:
            BadRequest: ``since``/``until`` malformed, reversed, or more than
                `MAX_USAGE_DAYS` apart (``param`` names the field).
        """
        today = dt.datetime.fromtimestamp(self._clock(), dt.timezone.utc).date()
        try:
            span = make_span(since, until, today)
        except ReportError as exc:
            param = "until" if str(exc).startswith("until") else "since"
            raise BadRequest(str(exc)[0].upper() + str(exc)[1:] + ".", param=param) from None
        if (span.until - span.since).days >= MAX_USAGE_DAYS:
            raise BadRequest(f"At most {MAX_USAGE_DAYS} days at once.", param="since")
        rows: list[dict[str, Any]] = []
        if self.ledger is not None:
            rows = await asyncio.to_thread(self._days, self.ledger, span, tenant.name)
        day, month = await self.quota.usage(tenant)
        quota: dict[str, Any] = {}
        for use in (day, month):
            if use.limit is None:
                quota[LIMIT_NAMES[use.window]] = None
                continue
            quota[LIMIT_NAMES[use.window]] = {
                "limit": use.limit,
                "used": use.used,
                "remaining": use.remaining,
                "resets_at": iso_utc(use.resets_at),
            }
        data = [{"object": "usage.day", "date": row.pop("day"), **row} for row in rows]
        return {
            "object": "usage",
            "tenant": tenant.name,
            "since": span.since.isoformat(),
            "until": span.until.isoformat(),
            "data": data,
            "total": totals(rows),
            "quota": quota,
        }

    def _days(self, ledger: Ledger, span: Any, tenant: str) -> list[dict[str, Any]]:
        """Committed records by day (records still queued are committed first); from
        PostgreSQL when the ledger is shipped there (this gateway's records shipped first), so
        every gateway answers the same; from the local file while PostgreSQL does not answer."""
        ledger.flush()
        if self.shipper is not None and self.shipper.healthy:
            self.shipper.ship(wait=False)  # this gateway's newest records, unless it is shipping
            try:
                return summarise_pg(self._dsn, span, "day", tenant=tenant)
            except ReportError as exc:
                log.error("usage_read_failed", source="postgres", error=str(exc))
        if not ledger.path.exists():
            return []
        try:
            return summarise([ledger.path], span, "day", tenant=tenant)
        except ReportError as exc:
            log.error("usage_read_failed", path=str(ledger.path), error=str(exc))
            return []
