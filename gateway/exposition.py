"""The metrics listener: gateway families plus the engine's ``vllm:*`` series in one scrape.

Served on ``[metrics] host:port`` (loopback by default), never on the public port. When the keys
file holds ``QWEN38_METRICS_TOKEN`` a scrape must send it as a bearer token.
"""

from __future__ import annotations

import asyncio
import hmac
import time

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import generate_latest

from gateway.app import ENGINE, LIVE, METRICS

log = structlog.get_logger("gateway.metrics")
ENGINE_PREFIX = "vllm:"
# The classic text format (0.0.4), which every Prometheus 2.x and 3.x scrapes.
EXPOSITION_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def engine_families(text: str) -> str:
    """Keep only the ``vllm:*`` families of an exposition text, unchanged, comments included.

    Other families the engine exposes (``http_*``, ``process_*``, ``python_*``) are dropped so the
    joint scrape never holds a family twice.
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


class EngineScrape:
    """Fetches the engine's metrics over the socket, cached for ``cache_s`` seconds."""

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
            try:
                raw = await self._app[ENGINE].metrics_text(settings.engine_scrape_timeout_s)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                metrics.engine_scrape_ok.set(0)
                log.debug("engine_scrape_failed", error=type(exc).__name__)
                self._text = ""
            else:
                metrics.engine_scrape_ok.set(1)
                self._text = engine_families(raw)
            self._at = time.monotonic()
            return self._text


def create_metrics_app(gateway_app: web.Application) -> web.Application:
    """The ``/metrics`` application for the gateway app ``gateway_app`` (shares its registry)."""
    scrape = EngineScrape(gateway_app)

    async def metrics_handler(request: web.Request) -> web.Response:
        token = gateway_app[LIVE].current.keys.setting("QWEN38_METRICS_TOKEN")
        if token:
            sent = request.headers.get("Authorization", "")
            expected = f"Bearer {token}"
            if not hmac.compare_digest(sent.encode(), expected.encode()):
                return web.json_response({"error": "unauthorized"}, status=401)
        engine_text = await scrape.text()
        body = generate_latest(gateway_app[METRICS].registry) + engine_text.encode()
        return web.Response(body=body, headers={"Content-Type": EXPOSITION_CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    return app
