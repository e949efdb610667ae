"""The metrics listener: gateway families plus the engine's ``vllm:*`` series in one scrape.

Served on ``[metrics] host:port`` (loopback by default), never on the public port. When the keys
file holds ``QWEN38_METRICS_TOKEN`` a scrape must send it as a bearer token.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Iterator

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from gateway.launcher_status import LauncherStatusCollector
from gateway.state import LIVE, METRICS, UPSTREAM

log = structlog.get_logger("gateway.metrics")
ENGINE_PREFIX = "vllm:"
# The classic text format (0.0.4), which every Prometheus 2.x and 3.x scrapes.
EXPOSITION_CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
METRICS_TOKEN_SETTING = "QWEN38_METRICS_TOKEN"
_CREATED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


def engine_families(text: str) -> str:
    """Keep only the ``vllm:*`` families of an exposition text, unchanged, comments included.

    Args:
        text: the engine's ``/metrics`` body (Prometheus text format 0.0.4).

    Returns:
        The ``# HELP``/``# TYPE`` lines and samples whose metric name starts with ``vllm:``, in
        their order, newline-terminated; "" when there is none. Other families the engine exposes
        (``http_*``, ``process_*``, ``python_*``) are dropped so the joint scrape never holds a
        family twice (the gateway exports its own ``process_*``).
    """
    kept = []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ", "# UNIT ")):
            name = line[7:].split(" ", 1)[0]
        elif line.startswith("#") or not line:
            continue
        else:
            name = line
        if name.startswith(ENGINE_PREFIX):
            kept.append(line)
    return "\n".join(kept) + "\n" if kept else ""


class WithoutCreated(Collector):
    """A collector showing a registry without the ``*_created`` samples of counters and histograms.

    prometheus_client adds a creation-timestamp sample to every counter and histogram child; in
    the text format 0.0.4 each becomes its own gauge family (``gateway_requests_created``),
    doubling the series for nothing Prometheus 2.x reads from that format.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        """The registry's families, ``<family>_created`` samples removed."""
        for family in self._registry.collect():
            if family.type in _CREATED_TYPES:
                created = family.name + "_created"
                family.samples = [s for s in family.samples if s.name != created]
            yield family


class EngineScrape:
    """Fetches the engine's metrics over the socket, cached for ``metrics.engine_scrape_cache_s``.

    Sets ``gateway_engine_scrape_ok`` to 1 after a fetch that returned 200 within
    ``metrics.engine_scrape_timeout_s``, else 0 (and the scrape carries no engine series).
    """

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self._text = ""
        self._at = float("-inf")
        self._lock = asyncio.Lock()

    async def text(self) -> str:
        """The engine's ``vllm:*`` families, or "" when the engine did not answer in time."""
        settings = self._app[LIVE].current.settings.metrics
        metrics = self._app[METRICS]
        async with self._lock:
            if time.monotonic() - self._at < settings.engine_scrape_cache_s:
                return self._text
            raw = await self._app[UPSTREAM].metrics_text(settings.engine_scrape_timeout_s)
            if raw is None:
                metrics.engine_scrape_ok.set(0)
                self._text = ""
            else:
                metrics.engine_scrape_ok.set(1)
                self._text = engine_families(raw)
            self._at = time.monotonic()
            return self._text


def bearer_matches(authorization: str | None, token: str) -> bool:
    """True when ``authorization`` is ``Bearer <token>`` (scheme in any case), in constant time.

    The comparison time depends on the lengths only (`hmac.compare_digest`), never on how much
    of the token was right.
    """
    scheme, _, credential = (authorization or "").strip().partition(" ")
    sent = credential.strip().encode("utf-8", "surrogatepass")
    expected = token.encode("utf-8", "surrogatepass")
    same = hmac.compare_digest(sent, expected)
    return same and scheme.lower() == "bearer"


def create_metrics_app(gateway_app: web.Application) -> web.Application:
    """The ``/metrics`` application for the gateway app ``gateway_app`` (shares its registry).

    ``GET /metrics`` answers 200 with the gateway families followed by the engine's, even when
    the engine is down (``gateway_engine_scrape_ok`` 0); 401 with ``WWW-Authenticate`` when
    ``QWEN38_METRICS_TOKEN`` is set in the keys file and the scrape does not send it. The token
    is read at each scrape, so a reload changes it. Any other path is 404.
    """
    scrape = EngineScrape(gateway_app)
    view = CollectorRegistry(auto_describe=False)
    view.register(WithoutCreated(gateway_app[METRICS].registry))
    view.register(
        LauncherStatusCollector(
            lambda: gateway_app[LIVE].current.settings.engine.launcher_status_file
        )
    )

    async def metrics_handler(request: web.Request) -> web.Response:
        token = gateway_app[LIVE].current.keys.setting(METRICS_TOKEN_SETTING)
        if token and not bearer_matches(request.headers.get("Authorization"), token):
            return web.json_response(
                {"error": "unauthorized"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="qwen38-gateway metrics"'},
            )
        engine_text = await scrape.text()
        body = generate_latest(view) + engine_text.encode()
        return web.Response(body=body, headers={"Content-Type": EXPOSITION_CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    return app
