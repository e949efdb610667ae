"""A gateway's part in a fleet: its engine leases, and the quarantine and key revocations it
shares with the other gateways through Redis (``[fleet] redis_url``; see `gateway.fleet`).

- Quarantine: deaths go to the shared hash (`gateway.quarantine_redis`) and every gateway takes
  the hash as its view every ``fleet.sync_interval_s``.
- Revocations: an API key this gateway's keys file no longer lists (a ``keys revoke``, an edit)
  is published at once, as the SHA-256 digest of its secret, in the sorted set
  ``<key_prefix>:keys:revoked`` (score: when). Every gateway reads the set every
  ``fleet.sync_interval_s`` and refuses those keys (`gateway.auth.RevokedSet`) even while its own
  copy of the keys file still lists them: a key revoked on one host is refused by every gateway
  within the first host's file poll (``auth.reload_poll_s``) plus one sync interval, about 1.5 s
  with the defaults. A key added back to a keys file it had left is taken out of the set.
  Entries are kept `REVOKED_KEEP_S`; by then the keys file has reached every host.

While Redis does not answer, each gateway keeps the last shared view (the quarantine it knew,
the keys it knew revoked) and its own file's; deaths it saw wait and are pushed once Redis is
back (``gateway_fleet_redis_up`` 0 meanwhile, logged once per outage).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import redis.asyncio as aioredis
import structlog
from aiohttp import web

from gateway.config import Settings
from gateway.fleet import BACKEND_ERRORS, EngineLeases, FleetError, connect
from gateway.metrics import Metrics
from gateway.quarantine import Quarantine
from gateway.quarantine_redis import ADD_SCRIPT, PRUNE_SCRIPT, add_args, hash_key, parse_records
from gateway.state import LIVE, METRICS, QUARANTINE, LiveRef

log = structlog.get_logger("gateway.fleet")

REVOKED_KEEP_S = 30 * 86_400.0
"""How long a published revocation is kept in Redis (seconds)."""
_PRUNE_EVERY_S = 60.0


class FleetSync:
    """The shared quarantine and revocations of one gateway (see the module docstring).

    Args:
        client: the fleet's Redis.
        settings: ``[fleet]`` and ``[quarantine]`` at start.
        quarantine: this gateway's quarantine (its deaths are pushed, its view replaced).
        live: the live configuration (its authenticator's revoked keys are published and its
            `RevokedSet` filled).
        metrics: ``gateway_fleet_redis_up``.
        clock: Unix seconds.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        settings: Settings,
        quarantine: Quarantine,
        live: LiveRef,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        prefix = settings.fleet.key_prefix
        self._interval_s = settings.fleet.sync_interval_s
        self._quarantine_key = hash_key(prefix)
        self._revoked_key = f"{prefix}:keys:revoked"
        self._quarantine = quarantine
        self._live = live
        self._metrics = metrics
        self._clock = clock
        self._add = client.register_script(ADD_SCRIPT)
        self._prune = client.register_script(PRUNE_SCRIPT)
        self._deaths: list[tuple[list[str], float]] = []
        self._published: set[bytes] = set()
        self._wake = asyncio.Event()
        self._up = True
        self._next_prune = 0.0
        self._task: asyncio.Task[None] | None = None
        quarantine.shared_push = self.push_deaths

    def push_deaths(self, fingerprints: list[str], now: float) -> None:
        """Queue one death for each fingerprint, pushed to Redis at once (`Quarantine._count`)."""
        self._deaths.append((fingerprints, now))
        self.wake()

    def wake(self) -> None:
        """Sync now rather than at the next interval (a reload, a death)."""
        self._wake.set()

    def start(self) -> None:
        """Sync every ``fleet.sync_interval_s`` until `stop`."""
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop syncing after a last push of what waits (when Redis answers)."""
        if self._task is not None:
            # Repeated: asyncio.wait_for may swallow one cancellation on Python 3.11 (gh-86296).
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=0.1)
            self._task = None
        await self.sync()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            self._wake.clear()
            await self.sync()

    async def sync(self) -> bool:
        """Push deaths and revocations, read the shared quarantine and revocations; False when
        Redis did not answer (never raises)."""
        try:
            await self._push_deaths()
            await self._publish_revocations()
            await self._read()
        except BACKEND_ERRORS as exc:
            if self._up:
                self._up = False
                self._metrics.fleet_redis_up.set(0)
                log.error("fleet_redis_down", error=type(exc).__name__, action="sync")
            return False
        if not self._up:
            self._up = True
            self._published = set()  # a restarted Redis lost them: publish again next time
            log.info("fleet_redis_up", action="sync")
        self._metrics.fleet_redis_up.set(1)
        return True

    async def _push_deaths(self) -> None:
        settings = self._quarantine.settings
        while self._deaths:
            fingerprints, now = self._deaths[0]
            added = await self._add(
                keys=(self._quarantine_key,), args=add_args(settings, fingerprints, now)
            )
            self._deaths.pop(0)
            for fp in added or ():
                fp = fp.decode() if isinstance(fp, bytes) else str(fp)
                log.warning("request_quarantined_in_fleet", fingerprint=fp)
        now = self._clock()
        if now >= self._next_prune:
            self._next_prune = now + _PRUNE_EVERY_S
            await self._prune(keys=(self._quarantine_key,), args=(now, settings.window_s))
            await self._client.zremrangebyscore(self._revoked_key, 0, now - REVOKED_KEEP_S)
            self._published = set()  # re-published (keeping their time) if Redis lost them

    async def _publish_revocations(self) -> None:
        auth = self._live.current.auth
        local = set(auth.revoked)
        new = local - self._published
        present = {key.digest for key in auth.keys.api_keys}
        back = {d for d in self._published - local if d in present}
        if new:
            now = self._clock()
            added = await self._client.zadd(self._revoked_key, {d.hex(): now for d in new}, nx=True)
            if added:
                log.info("keys_revocation_published", keys=int(added))
        if back:
            await self._client.zrem(self._revoked_key, *(d.hex() for d in back))
        self._published = (self._published | new) - back

    async def _read(self) -> None:
        if not self._deaths and self._quarantine.enabled:
            raw = await self._client.hgetall(self._quarantine_key)
            self._quarantine.replace(parse_records(raw))
        members = await self._client.zrangebyscore(
            self._revoked_key, self._clock() - REVOKED_KEEP_S, "+inf"
        )
        digests = set()
        for member in members:
            text = member.decode() if isinstance(member, bytes) else str(member)
            with contextlib.suppress(ValueError):
                digests.add(bytes.fromhex(text))
        self._live.current.auth.fleet_revoked.digests = frozenset(digests)


FLEET_SYNC = web.AppKey("fleet_sync", FleetSync)


async def fleet_ctx(app: web.Application) -> AsyncIterator[None]:
    """With ``[fleet] redis_url``: take the engine leases (or refuse to start), sync, and at
    the end release the leases. Without it: nothing.

    Raises:
        FleetError: an engine owned by another gateway, or the fleet's Redis unreachable.
    """
    settings = app[LIVE].current.settings
    if not settings.fleet.redis_url:
        yield
        return
    client = connect(settings)
    leases = EngineLeases(client, settings, app[METRICS])
    try:
        await leases.acquire()
        sync = FleetSync(client, settings, app[QUARANTINE], app[LIVE], app[METRICS])
        if not await sync.sync():
            raise FleetError("fleet.redis_url: the fleet's Redis stopped answering at start")
    except BaseException:
        await leases.release()
        await client.aclose()
        raise
    app[FLEET_SYNC] = sync
    leases.start()
    sync.start()
    yield
    await sync.stop()
    await leases.release()
    await client.aclose()
