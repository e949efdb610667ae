"""Several gateways as one service: the fleet's Redis, this gateway's id, and engine leases.

With ``[fleet] redis_url`` set, each engine this gateway is configured with is leased in Redis
(``<key_prefix>:engine-lease:<engine>``, the engine named by where it is: `configured_engines`): ``SET NX PX`` with a value naming this
gateway plus a random token, renewed every third of ``fleet.lease_ttl_s`` by a compare-and-
``PEXPIRE`` script, released at stop by a compare-and-delete script (the Redis manual's
"Distributed locks with Redis", single-instance case). The queue and slots of an engine live in
the one gateway that holds its lease; a second gateway configured with the same engine refuses to
start with a `FleetError` naming the engine, the setting and the owner. A gateway that died
without releasing its leases (``kill -9``, a lost host) gives them up when they expire; the same
gateway restarted (the same ``fleet.gateway_id``) takes its own leases over at once.

Without ``redis_url`` there is no lease: a single gateway owns its engines by configuration.

While Redis is unreachable the gateway keeps serving its engines (fail-open:
``gateway_fleet_redis_up`` 0, logged once per outage); when it answers again every lease is
renewed or, if it expired meanwhile (a Redis restart without persistence), taken again. A lease
found held by another gateway is logged (``engine_lease_lost``) and shows as
``gateway_engine_lease_held`` 0.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Sequence

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.config import ConfigError, Settings
from gateway.metrics import Metrics

log = structlog.get_logger("gateway.fleet")

BACKEND_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
"""Anything redis-py raises for a server that is down, slow, read-only or out of memory."""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class FleetError(ConfigError):
    """The gateway cannot take its place in the fleet (an engine owned by another gateway, the
    fleet's Redis unreachable at start); the message names the engine and the setting."""


def gateway_id(settings: Settings) -> str:
    """``fleet.gateway_id``, or ``<hostname>:<server.port>`` when it is empty."""
    return settings.fleet.gateway_id or f"{socket.gethostname()}:{settings.server.port}"


def configured_engines(settings: Settings) -> list[tuple[str, str, str]]:
    """The configured engines as ``(name, setting, lease)``: the engine's name, the dotted
    setting that configures it (for errors) and the name of its lease. A lone ``[engine]
    socket`` is one engine, ``default``.

    The lease is named after what the engine is: an engine on a Unix socket is reachable from
    its own host only, so ``<hostname>:<socket path>`` (two hosts each running an engine named
    ``default`` on their own socket run two engines); an engine reached by URL is the URL.
    """
    host = socket.gethostname()
    if not settings.engines:
        return [("default", "engine.socket", f"{host}:{settings.engine.socket}")]
    return [
        (spec.name, f"engines[{i}].name", spec.url or f"{host}:{spec.socket}")
        for i, spec in enumerate(settings.engine_specs)
    ]


def connect(settings: Settings) -> aioredis.Redis:
    """A client of ``fleet.redis_url`` with ``fleet.redis_timeout_s`` and one quick retry (a
    pooled connection that died with a restarted Redis is replaced)."""
    cfg = settings.fleet
    return aioredis.Redis.from_url(
        cfg.redis_url,
        socket_timeout=cfg.redis_timeout_s,
        socket_connect_timeout=cfg.redis_timeout_s,
        retry=Retry(NoBackoff(), 1),
    )


class EngineLeases:
    """This gateway's leases on its engines (see the module docstring).

    Args:
        client: the fleet's Redis.
        settings: ``[fleet]`` (prefix, TTL) and the engines.
        metrics: ``gateway_engine_lease_held``, ``gateway_fleet_redis_up``.
    """

    def __init__(self, client: aioredis.Redis, settings: Settings, metrics: Metrics) -> None:
        self._client = client
        self._ttl_ms = int(settings.fleet.lease_ttl_s * 1000)
        self._prefix = settings.fleet.key_prefix
        self.owner = gateway_id(settings)
        self.token = f"{self.owner} {secrets.token_hex(16)}"
        self.engines = configured_engines(settings)
        self._lease_names = {name: lease for name, _, lease in self.engines}
        self._metrics = metrics
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self.held: set[str] = set()
        self._up = True
        self._task: asyncio.Task[None] | None = None

    def key(self, engine: str) -> str:
        """The Redis key of ``engine``'s lease (``<prefix>:engine-lease:<lease name>``)."""
        return f"{self._prefix}:engine-lease:{self._lease_names.get(engine, engine)}"

    async def acquire(self) -> None:
        """Take every engine's lease, or none.

        Raises:
            FleetError: an engine's lease is held by another gateway, or Redis does not answer
                (``fleet.redis_url`` named, never its password).
        """
        try:
            for name, setting, _ in self.engines:
                await self._take(name, setting)
        except BACKEND_ERRORS as exc:
            await self.release()
            raise FleetError(
                f"fleet.redis_url: the fleet's Redis does not answer ({type(exc).__name__}); "
                "the engine leases cannot be taken"
            ) from None
        except FleetError:
            await self.release()
            raise
        self._metrics.fleet_redis_up.set(1)

    async def _take(self, name: str, setting: str) -> None:
        key = self.key(name)
        if await self._client.set(key, self.token, nx=True, px=self._ttl_ms):
            self._took(name)
            return
        holder = await self._client.get(key)
        text = holder.decode(errors="replace") if isinstance(holder, bytes) else str(holder or "")
        owner = text.split(" ")[0]
        if owner == self.owner:
            # This gateway restarted before its old lease expired: take it over.
            await self._client.set(key, self.token, px=self._ttl_ms)
            self._took(name)
            return
        if holder is None:  # expired between the two calls
            await self._take(name, setting)
            return
        left = await self._client.pttl(key)
        raise FleetError(
            f"{setting} = {name!r}: engine {name!r} is owned by gateway {owner!r} (Redis lease "
            f"{key}, {max(left, 0) / 1000:.1f} s left). An engine is served by one gateway: "
            f"remove it from this gateway's configuration, or stop {owner!r} first"
        )

    def _took(self, name: str) -> None:
        self.held.add(name)
        self._metrics.engine_lease_held.labels(name).set(1)
        log.info("engine_lease_taken", engine=name, key=self.key(name), gateway=self.owner)

    def start(self) -> None:
        """Renew the leases every third of the TTL until `release`."""
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_ms / 3000)
            await self.renew()

    async def renew(self) -> None:
        """Renew each lease, taking again an expired one; never raises."""
        try:
            for name, _, _ in self.engines:
                key = self.key(name)
                if await self._renew(keys=(key,), args=(self.token, self._ttl_ms)):
                    held = True
                else:
                    held = bool(await self._client.set(key, self.token, nx=True, px=self._ttl_ms))
                self._set_held(name, held)
        except BACKEND_ERRORS as exc:
            if self._up:
                self._up = False
                self._metrics.fleet_redis_up.set(0)
                log.error("fleet_redis_down", error=type(exc).__name__, action="lease_renewal")
            return
        if not self._up:
            self._up = True
            self._metrics.fleet_redis_up.set(1)
            log.info("fleet_redis_up", action="lease_renewal")

    def _set_held(self, name: str, held: bool) -> None:
        if held and name not in self.held:
            self.held.add(name)
            log.info("engine_lease_taken", engine=name, key=self.key(name), gateway=self.owner)
        elif not held and name in self.held:
            self.held.discard(name)
            log.error("engine_lease_lost", engine=name, key=self.key(name), gateway=self.owner)
        self._metrics.engine_lease_held.labels(name).set(1 if held else 0)

    async def release(self, names: Sequence[str] | None = None) -> None:
        """Stop renewing and delete the leases still this gateway's; never raises."""
        if self._task is not None:
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=0.1)
            self._task = None
        for name in list(names if names is not None else self.held):
            try:
                await self._release(keys=(self.key(name),), args=(self.token,))
            except BACKEND_ERRORS as exc:
                log.warning("engine_lease_release_failed", engine=name, error=type(exc).__name__)
            self.held.discard(name)
            self._metrics.engine_lease_held.labels(name).set(0)
            log.info("engine_lease_released", engine=name, gateway=self.owner)
