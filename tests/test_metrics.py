"""The metric families, the engine-series filter, the scrape authorisation and the metrics app."""

from __future__ import annotations

import hmac
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.config import Settings, parse_settings
from gateway.exposition import (
    EXPOSITION_CONTENT_TYPE,
    WithoutCreated,
    bearer_matches,
    create_metrics_app,
    engine_families,
)
from gateway.keys_file import load_keys_file
from gateway.metrics import (
    DURATION_BUCKETS,
    QUEUE_WAIT_BUCKETS,
    RATE_LIMITS,
    TTFT_BUCKETS,
    UPSTREAM_ERROR_KINDS,
    Metrics,
)
from tests.conftest import DEFAULT_KEYS, write_keys
from tests.test_prometheus_rules import CONTRACT_METRICS

pytestmark = pytest.mark.fast

# DESIGN section 7, then the documented extensions: exposed name -> (type, label names).
CONTRACT = {k: v for k, v in CONTRACT_METRICS.items() if k.startswith("gateway_")}

ENGINE_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen3.8-27b"} 1.0
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 3.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="qwen3.8-27b"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="qwen3.8-27b"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="qwen3.8-27b"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="qwen3.8-27b"} 0.52
# HELP process_open_fds Number of open file descriptors.
# TYPE process_open_fds gauge
process_open_fds 31.0
"""


def exposition(metrics: Metrics) -> str:
    """The scrape text of the gateway families as the metrics listener renders them."""
    view = CollectorRegistry(auto_describe=False)
    view.register(WithoutCreated(metrics.registry))
    return generate_latest(view).decode()


def test_families_have_the_contracted_names_types_and_labels() -> None:
    """Every gateway_* family of DESIGN section 7 exists with its type and exact label names."""
    metrics = Metrics(CollectorRegistry())
    declared = dict(re.findall(r"^# TYPE (gateway_\S+) (\S+)$", exposition(metrics), re.M))
    assert declared == {name: kind for name, (kind, _) in CONTRACT.items()}
    by_name = {
        "gateway_requests_total": metrics.requests,
        "gateway_request_duration_seconds": metrics.request_duration,
        "gateway_time_to_first_token_seconds": metrics.ttft,
        "gateway_tokens_total": metrics.tokens,
        "gateway_requests_in_flight": metrics.in_flight,
        "gateway_queue_wait_seconds": metrics.queue_wait,
        "gateway_rate_limited_total": metrics.rate_limited,
        "gateway_auth_failures_total": metrics.auth_failures,
        "gateway_client_disconnects_total": metrics.client_disconnects,
        "gateway_upstream_errors_total": metrics.upstream_errors,
        "gateway_config_reloads_total": metrics.config_reloads,
        "gateway_ratelimit_backend_up": metrics.ratelimit_backend_up,
    }
    for name, family in by_name.items():
        labels = CONTRACT[name][1]
        family.labels(**{label: "x" for label in labels})
        with pytest.raises(ValueError):
            family.labels(**{label: "x" for label in (*labels, "extra")})


def test_process_families_sit_beside_the_gateway_families() -> None:
    """The registry carries process_* (memory, CPU, descriptors) for the gateway process."""
    text = exposition(Metrics(CollectorRegistry()))
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("process metrics need /proc")
    assert "process_resident_memory_bytes" in text
    assert "process_open_fds" in text


def test_histogram_buckets_cover_the_service() -> None:
    """TTFT spans 50 ms to 10 min, durations reach 30 min, queue waits the longest queue timeout."""
    for buckets in (TTFT_BUCKETS, DURATION_BUCKETS, QUEUE_WAIT_BUCKETS):
        assert list(buckets) == sorted(set(buckets))
    assert (TTFT_BUCKETS[0], TTFT_BUCKETS[-1]) == (0.05, 600)
    assert DURATION_BUCKETS[-1] == 1800
    assert QUEUE_WAIT_BUCKETS[-1] >= Settings().engine.queue_timeout_s
    text = exposition(Metrics(CollectorRegistry()))
    assert "gateway_time_to_first_token_seconds" in text


def test_prime_creates_zero_series_for_every_tenant_label() -> None:
    """After prime, alerts and dashboards find zero-valued series for each tenant label."""
    settings = parse_settings({"tenants": {"acme": {}, "beta": {}}})
    metrics = Metrics(CollectorRegistry())
    metrics.prime(settings.tenant_labels())
    found = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition(metrics))
        for s in family.samples
    }
    for tenant in ("acme", "beta", "default", "unknown"):
        assert found[("gateway_requests_in_flight", (("tenant", tenant),))] == 0
        for kind in ("prompt", "completion"):
            assert found[("gateway_tokens_total", (("tenant", tenant), ("type", kind)))] == 0
        for limit in RATE_LIMITS:
            key = ("gateway_rate_limited_total", (("limit", limit), ("tenant", tenant)))
            assert found[key] == 0
    for result in ("ok", "error"):
        assert found[("gateway_config_reloads_total", (("result", result),))] == 0
    for kind in UPSTREAM_ERROR_KINDS:
        assert found[("gateway_upstream_errors_total", (("kind", kind),))] == 0
    tenants = {dict(labels).get("tenant") for _, labels in found} - {None}
    assert tenants == {"acme", "beta", "default", "unknown"}


def test_engine_families_keeps_vllm_lines_unchanged_and_drops_the_rest() -> None:
    """Only vllm:* HELP, TYPE and sample lines survive, byte for byte and in order."""
    kept = engine_families(ENGINE_TEXT)
    expected = [line for line in ENGINE_TEXT.splitlines() if "vllm:" in line]
    assert kept == "\n".join(expected) + "\n"
    assert engine_families("# HELP process_open_fds x\nprocess_open_fds 3\n") == ""
    assert engine_families("") == ""


def test_without_created_hides_only_the_creation_samples() -> None:
    """Counters and histograms lose their _created samples; a gauge named *_created stays."""
    registry = CollectorRegistry()
    Counter("jobs", "Jobs.", registry=registry).inc()
    Histogram("wait_seconds", "Wait.", registry=registry).observe(1)
    Gauge("backup_created", "Time of the last backup.", registry=registry).set(5)
    view = CollectorRegistry(auto_describe=False)
    view.register(WithoutCreated(registry))
    text = generate_latest(view).decode()
    assert "jobs_created" not in text and "wait_seconds_created" not in text
    assert "jobs_total 1.0" in text and "wait_seconds_count 1.0" in text
    assert "backup_created 5.0" in text
    assert "jobs_created" in generate_latest(registry).decode()


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer s3cret-token", True),
        ("bearer s3cret-token", True),
        ("BEARER   s3cret-token  ", True),
        ("Bearer s3cret-toke", False),
        ("Bearer s3cret-tokenx", False),
        ("Basic s3cret-token", False),
        ("s3cret-token", False),
        ("Bearer", False),
        ("", False),
        (None, False),
        ("Bearer s3cret-t\udcffken", False),
        ("Bearer s3cret-t\ud800ken", False),
        ("Bearer s3cret-tökén", False),
    ],
)
def test_bearer_matches(header: str | None, ok: bool) -> None:
    """Only ``Bearer <token>`` (any case, surrounding spaces) matches, never a prefix or other scheme."""
    assert bearer_matches(header, "s3cret-token") is ok


def test_bearer_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token is compared with hmac.compare_digest, also when the scheme is wrong."""
    calls: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert not bearer_matches("Basic tok", "tok")
    assert bearer_matches("Bearer tok", "tok")
    assert calls == [(b"tok", b"tok"), (b"tok", b"tok")]


# ------------------------------------------------------------------ the metrics app in-process


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short private directory for the keys file and the (absent) engine socket."""
    path = Path(tempfile.mkdtemp(prefix="q38x-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def metrics_client(aiohttp_client: Any, directory: Path, extra: str = "") -> Any:
    """A test client of the metrics app of a gateway whose engine socket does not exist."""
    keys_file = directory / "keys.env"
    write_keys(keys_file, DEFAULT_KEYS, extra=extra)
    settings = parse_settings(
        {
            "engine": {"socket": str(directory / "absent.sock"), "health_interval_s": 0.05},
            "auth": {"keys_file": str(keys_file)},
            "ledger": {"path": str(directory / "usage.sqlite3")},
            "metrics": {"engine_scrape_timeout_s": 0.5, "engine_scrape_cache_s": 0},
            "tenants": {"acme": {}},
        }
    )
    gateway = create_app(settings, keys=load_keys_file(keys_file))
    await aiohttp_client(gateway)
    return await aiohttp_client(create_metrics_app(gateway))


async def test_scrape_without_an_engine_is_200_with_scrape_ok_zero(
    aiohttp_client: Any, short_dir: Path
) -> None:
    """With no engine socket the scrape still answers 200: gateway series, scrape_ok 0."""
    client = await metrics_client(aiohttp_client, short_dir)
    r = await client.get("/metrics")
    assert r.status == 200
    assert r.headers["Content-Type"] == EXPOSITION_CONTENT_TYPE
    text = await r.text()
    assert "gateway_engine_scrape_ok 0.0" in text
    assert "gateway_keys_loaded 3.0" in text
    assert "vllm:" not in text
    assert (await client.get("/other")).status == 404


async def test_scrape_token_from_the_keys_file(aiohttp_client: Any, short_dir: Path) -> None:
    """QWEN38_METRICS_TOKEN in the keys file makes the scrape 401 without it, 200 with it."""
    client = await metrics_client(aiohttp_client, short_dir, extra="QWEN38_METRICS_TOKEN=tok-123\n")
    refused = await client.get("/metrics")
    assert refused.status == 401
    assert refused.headers["WWW-Authenticate"].startswith("Bearer")
    assert "gateway_" not in await refused.text()
    wrong = await client.get("/metrics", headers={"Authorization": "Bearer tok-12"})
    assert wrong.status == 401
    ok = await client.get("/metrics", headers={"Authorization": "Bearer tok-123"})
    assert ok.status == 200
    assert "tok-123" not in await ok.text()


def test_metrics_listener_defaults_to_loopback_9400() -> None:
    """Without a [metrics] table the listener is 127.0.0.1:9400 (DESIGN sections 3 and 7)."""
    metrics = Settings().metrics
    assert (metrics.enabled, metrics.host, metrics.port) == (True, "127.0.0.1", 9400)
    assert Settings().server.port != metrics.port
