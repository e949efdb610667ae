"""The metrics listener: gateway families plus every engine's ``vllm:*`` series in one scrape.

Served on ``[metrics] host:port`` (loopback by default), never on the public port. When the keys
file holds ``QWEN38_METRICS_TOKEN`` a scrape must send it as a bearer token.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
from collections.abc import Iterator

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from gateway.launcher_status import LauncherStatusCollector
from gateway.state import ENGINES, LIVE, METRICS

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


_LABEL_RE = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def label_engine(line: str, engine: str) -> str:
    """One sample line of the engine's exposition with ``engine="<engine>"`` as its first label.

    vLLM labels its series ``engine="0"`` (its engine core's index); that value is kept as
    ``vllm_engine``, so ``engine`` is always the configured name (a bounded label set, the same
    as every ``gateway_engine_*`` family's). Lines that do not parse are returned unchanged.
    """
    brace, space = line.find("{"), line.find(" ")
    escaped = engine.replace("\\", "\\\\").replace('"', '\\"')
    if brace == -1 or (space != -1 and space < brace):
        name, _, rest = line.partition(" ")
        return f'{name}{{engine="{escaped}"}} {rest}'
    pairs, at = [], brace + 1
    while at < len(line) and line[at] != "}":
        match = _LABEL_RE.match(line, at)
        if match is None:
            return line
        key = "vllm_engine" if match.group(1) == "engine" else match.group(1)
        pairs.append(f'{key}="{match.group(2)}"')
        at = match.end()
    labels = ",".join([f'engine="{escaped}"', *pairs])
    return f"{line[:brace]}{{{labels}}}{line[at + 1 :]}"


def merge_engines(texts: list[tuple[str, str]]) -> str:
    """Every engine's ``vllm:*`` families (`engine_families` output) as one exposition text:
    each family's ``# HELP``/``# TYPE`` once, then the samples of every engine, each labelled
    with its engine (`label_engine`). ``texts``: (engine name, its kept text) in config order.
    """
    families: dict[str, tuple[list[str], list[str]]] = {}
    for engine, text in texts:
        current = ""
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                current = parts[2] if len(parts) > 2 else current
                meta, _ = families.setdefault(current, ([], []))
                if line not in meta:
                    meta.append(line)
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            family = current if current and name.startswith(current) else name
            families.setdefault(family, ([], []))[1].append(label_engine(line, engine))
    lines = [line for meta, samples in families.values() for line in (*meta, *samples)]
    return "\n".join(lines) + "\n" if lines else ""


class EngineScrape:
    """Fetches every engine's metrics (over its socket or URL) at once, cached for
    ``metrics.engine_scrape_cache_s``; each engine's ``vllm:*`` samples carry its ``engine``.

    Sets ``gateway_engine_scrape_ok`` to 1 when every engine that answers ``/health`` (ready or
    warming) returned 200 within ``metrics.engine_scrape_timeout_s``, else 0; an engine whose
    fetch failed has no series in that scrape.
    """

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self._text = ""
        self._at = float("-inf")
        self._lock = asyncio.Lock()

    async def text(self) -> str:
        """The engines' ``vllm:*`` families, "" when none answered in time."""
        settings = self._app[LIVE].current.settings.metrics
        metrics = self._app[METRICS]
        fleet = self._app[ENGINES]
        async with self._lock:
            if time.monotonic() - self._at < settings.engine_scrape_cache_s:
                return self._text
            names = list(fleet.upstreams)
            raws = await asyncio.gather(
                *(fleet.upstreams[n].metrics_text(settings.engine_scrape_timeout_s) for n in names)
            )
            failed = [
                n
                for n, raw in zip(names, raws, strict=True)
                if raw is None and fleet.states[n].status in ("ready", "warming")
            ]
            metrics.engine_scrape_ok.set(0 if failed or all(r is None for r in raws) else 1)
            kept = [
                (n, engine_families(raw))
                for n, raw in zip(names, raws, strict=True)
                if raw is not None
            ]
            self._text = merge_engines(kept)
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
            lambda: [
                (spec.name, spec.launcher_status_file)
                for spec in gateway_app[LIVE].current.settings.engine_specs
            ]
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
