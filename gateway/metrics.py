"""The gateway's Prometheus families, on an injected `CollectorRegistry`.

Label values come only from bounded sets: configured tenants plus ``default`` and ``unknown``
(`Settings.tenant_label`), route templates plus ``other``, status codes, and the fixed reason and
kind vocabularies below. Never a key, key hash, IP, user agent or any client-chosen string.
The registry also carries the standard ``process_*`` families (memory, CPU, open file
descriptors) of the gateway process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

# Time to first token on a V100 at ~30 tok/s: tens of ms for a cached short prompt, minutes of
# prefill for a 254,976-token prompt; 50 ms .. 10 min.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
# Whole requests: a thinking answer of 32k tokens at 30 tok/s is ~18 min; up to 30 min.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800)
# Time spent waiting for the engine in the admission queue (bounded by engine.queue_timeout_s).
QUEUE_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800)
# |actual - predicted| start of a queued request (gateway.deadline): a second is good on a
# queue of minutes; up to the queue timeout.
FORECAST_ERROR_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
FORECAST_DIRECTIONS = ("late", "early")
FORECAST_PHASES = ("prefill", "decode")
DIALECTS = ("chat", "completions", "messages", "responses")
# gateway.deadline: a non-streamed request's slot after its deadline; a stream whose keep-alives
# would come too late for its deadline and whose slot comes after it.
DEADLINE_REASONS = ("queue", "stream_silence")

ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/responses/{response_id}",
    "/v1/responses/{response_id}/cancel",
    "/v1/responses/{response_id}/input_items",
    "/v1/models",
    "/v1/models/{id}",
    "/v1/usage",
    "/health",
    "/ready",
    "other",
)
AUTH_FAILURE_REASONS = (
    "missing",
    "malformed",
    "unknown",
    "expired",
    "revoked",
    "bad_signature",
    "bad_claims",
    "unknown_kid",
    "bad_algorithm",
)
UPSTREAM_ERROR_KINDS = (
    "connect",
    "timeout",
    "disconnect",
    "stream_error",
    "bad_response",
    "status_5xx",
    "too_large",
)
RATE_LIMITS = (
    "requests",
    "tokens",
    "concurrency",
    "queue",
    "memory",
    "tokens_per_day",
    "tokens_per_month",
)
# vLLM's usage has no reasoning count (OpenAI-compatible ``usage``): completion includes it.
TOKEN_TYPES = ("prompt", "completion")
RELOAD_RESULTS = ("ok", "error")
RATELIMIT_BACKENDS = ("memory", "redis")
QUOTA_WINDOWS = ("day", "month")

# (tenant label, window, limit tokens, used tokens), computed at scrape time.
QuotaSample = tuple[str, str, float, float]


class QuotaGauges(Collector):
    """``gateway_quota_limit_tokens`` and ``gateway_quota_used_tokens`` by tenant and window.

    Read at scrape time from ``source`` (set by the quota backend's owner), so a window that
    rolled over shows its new, empty count without waiting for a request. Labels: configured
    tenants with a quota (``default`` standing for the tenants without a table) and ``day`` or
    ``month``.
    """

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[QuotaSample]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The two families (declared even when no tenant has a quota)."""
        limit = GaugeMetricFamily(
            "gateway_quota_limit_tokens",
            "Token quota of a tenant per window (day: the UTC day, month: the UTC month).",
            labels=("tenant", "window"),
        )
        used = GaugeMetricFamily(
            "gateway_quota_used_tokens",
            "Tokens charged in the current quota window, running requests' reservations included.",
            labels=("tenant", "window"),
        )
        for tenant, window, quota, spent in self.source() if self.source is not None else ():
            limit.add_metric((tenant, window), quota)
            used.add_metric((tenant, window), spent)
        yield limit
        yield used


# (engine name, slots, requests in flight, in rotation), computed at scrape time.
SlotSample = tuple[str, int, int, bool]


class EngineSlotGauges(Collector):
    """``gateway_engine_slots``, ``gateway_engine_in_flight`` and ``gateway_engine_in_rotation``
    by engine, read at scrape time from ``source`` (the admission queue's own counts, `gateway.placement.EngineSlots`). The
    ``engine`` label takes the configured engine names only."""

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[SlotSample]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The three families (declared even before the queue exists)."""
        slots = GaugeMetricFamily(
            "gateway_engine_slots",
            "Requests this engine takes at once (its max_concurrency).",
            labels=("engine",),
        )
        busy = GaugeMetricFamily(
            "gateway_engine_in_flight",
            "Requests holding a slot of this engine now.",
            labels=("engine",),
        )
        rotation = GaugeMetricFamily(
            "gateway_engine_in_rotation",
            "1 while new requests may be placed on this engine (ready, its probes answered).",
            labels=("engine",),
        )
        for name, capacity, in_flight, live in self.source() if self.source is not None else ():
            slots.add_metric((name,), capacity)
            busy.add_metric((name,), in_flight)
            rotation.add_metric((name,), 1.0 if live else 0.0)
        yield slots
        yield busy
        yield rotation


def _remember_children(family: MetricWrapperBase) -> None:
    """Answer ``family.labels(*values)`` from a dict after its first call with those values.

    prometheus_client keeps one child per label values and returns it on every call (after
    checking the values, turning each into a string and taking a lock: a few µs, a dozen times
    per request); the gateway never removes a child, and its label values come from bounded
    sets (the module doc), so the dict stays small. Keyword labels go to the original.
    """
    children: dict[tuple[Any, ...], Any] = {}
    find = family.labels

    def labels(*values: Any, **named: Any) -> Any:
        if named:
            return find(*values, **named)
        child = children.get(values)
        if child is None:
            child = children[values] = find(*values)
        return child

    family.labels = labels  # type: ignore[method-assign]


class Metrics:
    """All gateway metric families, registered on one registry.

    Args:
        registry: where to register; tests pass a fresh one, the server its own (never the
            process-global default, so two apps in one process do not collide).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        ProcessCollector(registry=registry)
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by tenant, route template and HTTP status code.",
            ("tenant", "route", "code"),
            registry=registry,
        )
        self.request_duration = Histogram(
            "gateway_request_duration_seconds",
            "Time from request received to last byte sent.",
            ("tenant", "route"),
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Time from request received to the first generated token reaching the client.",
            ("tenant",),
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens as reported by the engine's usage, by tenant and type (prompt|completion).",
            ("tenant", "type"),
            registry=registry,
        )
        self.in_flight = Gauge(
            "gateway_requests_in_flight",
            "Model requests admitted and not finished, by tenant.",
            ("tenant",),
            registry=registry,
        )
        self.queue_depth = Gauge(
            "gateway_queue_depth",
            "Requests waiting in the admission queue for an engine slot.",
            registry=registry,
        )
        self.body_memory = Gauge(
            "gateway_body_memory_bytes",
            "Estimated memory held by the bodies of model requests in this process (being read, "
            "queued or at an engine), bounded by server.bodies_max_bytes.",
            registry=registry,
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time a request waited in the admission queue.",
            ("tenant",),
            buckets=QUEUE_WAIT_BUCKETS,
            registry=registry,
        )
        self.rate_limited = Counter(
            "gateway_rate_limited",
            "Requests refused with 429, by tenant and limit "
            "(requests|tokens|concurrency|queue|memory|...).",
            ("tenant", "limit"),
            registry=registry,
        )
        self.auth_failures = Counter(
            "gateway_auth_failures",
            "Requests refused with 401, by reason.",
            ("reason",),
            registry=registry,
        )
        self.client_disconnects = Counter(
            "gateway_client_disconnects",
            "Clients that went away before their answer was complete.",
            ("tenant",),
            registry=registry,
        )
        self.upstream_errors = Counter(
            "gateway_upstream_errors",
            "Failures talking to the engine, by kind.",
            ("kind",),
            registry=registry,
        )
        self.quarantined = Counter(
            "gateway_quarantined_requests",
            "Requests refused with 422 request_quarantined (at the engine at repeated deaths).",
            ("tenant",),
            registry=registry,
        )
        self.quarantine_entries = Gauge(
            "gateway_quarantine_entries",
            "Request fingerprints quarantined now.",
            registry=registry,
        )
        self.engine_retries = Counter(
            "gateway_engine_retries",
            "Requests sent to the engine again after it died before answering a byte.",
            registry=registry,
        )
        self.prompt_counts = Counter(
            "gateway_prompt_counts",
            "Prompts counted by the engine's /tokenize before admission (their ceiling was refused).",
            registry=registry,
        )
        self.prompt_ceiling_exceeded = Counter(
            "gateway_prompt_ceiling_exceeded",
            "Requests whose engine prompt count exceeded the reserved prompt ceiling.",
            registry=registry,
        )
        self.engine_up = Gauge(
            "gateway_engine_up",
            "1 when the engine answers /health with 200, else 0.",
            registry=registry,
        )
        self.engine_ready = Gauge(
            "gateway_engine_ready",
            "1 when the engine is healthy and warm (model routes are served), else 0.",
            registry=registry,
        )
        self.engine_available = Gauge(
            "gateway_engine_status",
            "1 when this engine is healthy and warm (it takes requests), else 0.",
            ["engine"],
            registry=registry,
        )
        self.engine_requests = Counter(
            "gateway_engine_requests",
            "Requests granted a slot of this engine.",
            ["engine"],
            registry=registry,
        )
        self.engine_failovers = Counter(
            "gateway_engine_failovers",
            "Requests moved off this engine after it failed before answering a byte.",
            ["engine"],
            registry=registry,
        )
        self.keys_loaded = Gauge(
            "gateway_keys_loaded",
            "API keys currently loaded from the keys file.",
            registry=registry,
        )
        self.config_reloads = Counter(
            "gateway_config_reloads",
            "Reloads of the config and keys files, by result (ok|error).",
            ("result",),
            registry=registry,
        )
        self.engine_scrape_ok = Gauge(
            "gateway_engine_scrape_ok",
            "1 when the last fetch of the engine's /metrics succeeded, else 0.",
            registry=registry,
        )
        self.ratelimit_backend_up = Gauge(
            "gateway_ratelimit_backend_up",
            "1 when the rate-limit backend answers (0: Redis unreachable, local limits in force).",
            ("backend",),
            registry=registry,
        )

        self.ledger_records = Counter(
            "gateway_ledger_records",
            "Usage records committed to the usage ledger.",
            registry=registry,
        )
        self.ledger_write_errors = Counter(
            "gateway_ledger_write_errors",
            "Failed attempts to open or write the usage ledger (full disk, read-only path).",
            registry=registry,
        )
        self.ledger_dropped = Counter(
            "gateway_ledger_dropped_records",
            "Usage records dropped because the ledger could not be written for too long.",
            registry=registry,
        )
        self.ledger_pending = Gauge(
            "gateway_ledger_pending_records",
            "Usage records waiting in memory for their commit.",
            registry=registry,
        )
        self.ledger_shipped = Counter(
            "gateway_ledger_shipped_records",
            "Usage records shipped from the SQLite outbox to PostgreSQL (ledger.postgres_dsn).",
            registry=registry,
        )
        self.ledger_unshipped = Gauge(
            "gateway_ledger_unshipped_records",
            "Usage records committed to the SQLite outbox and not yet in PostgreSQL.",
            registry=registry,
        )
        self.fleet_redis_up = Gauge(
            "gateway_fleet_redis_up",
            "1 when the fleet's Redis (fleet.redis_url) answers; 0 when it does not or none is set.",
            registry=registry,
        )
        self.engine_lease_held = Gauge(
            "gateway_engine_lease_held",
            "1 while this gateway holds the fleet lease of the engine, else 0.",
            ("engine",),
            registry=registry,
        )
        self.forecast_error = Histogram(
            "gateway_queue_start_forecast_error_seconds",
            "How far a queued request's slot came from its predicted time (late: after it).",
            ("direction",),
            buckets=FORECAST_ERROR_BUCKETS,
            registry=registry,
        )
        self.deadline_refusals = Counter(
            "gateway_deadline_refusals",
            "Requests refused at once because the predicted wait exceeds the client's timeout.",
            ("tenant", "dialect", "reason"),
            registry=registry,
        )
        self.forecast_speed = Gauge(
            "gateway_forecast_tokens_per_second",
            "Engine speed the wait prediction uses (measured, else [deadline]), by phase.",
            ("phase",),
            registry=registry,
        )
        self.forecast_output = Gauge(
            "gateway_forecast_output_tokens",
            "Output tokens per choice the wait prediction expects (running mean of answers), by "
            "thinking mode.",
            ("thinking",),
            registry=registry,
        )
        self.quota = QuotaGauges()
        registry.register(self.quota)
        self.engine_slots = EngineSlotGauges()
        registry.register(self.engine_slots)
        for family in vars(self).values():
            if isinstance(family, MetricWrapperBase) and family._labelnames:
                _remember_children(family)

    # The usage ledger's writer thread reports through these (gateway.ledger.LedgerMetrics).
    def ledger_written(self, count: int) -> None:
        """``count`` records were committed."""
        self.ledger_records.inc(count)

    def ledger_write_error(self) -> None:
        """Opening or writing the ledger failed once."""
        self.ledger_write_errors.inc()

    def ledger_dropped_records(self, count: int) -> None:
        """``count`` records were dropped (``max_pending`` exceeded)."""
        self.ledger_dropped.inc(count)

    def ledger_pending_records(self, count: int) -> None:
        """``count`` records wait in memory."""
        self.ledger_pending.set(count)

    def prime(self, tenant_labels: tuple[str, ...]) -> None:
        """Create the zero-valued children Prometheus alerts and dashboards expect to exist."""
        for tenant in tenant_labels:
            self.in_flight.labels(tenant)
            self.quarantined.labels(tenant)
            for limit in RATE_LIMITS:
                self.rate_limited.labels(tenant, limit)
            for kind in TOKEN_TYPES:
                self.tokens.labels(tenant, kind)
            for dialect in DIALECTS:
                for reason in DEADLINE_REASONS:
                    self.deadline_refusals.labels(tenant, dialect, reason)
        for result in RELOAD_RESULTS:
            self.config_reloads.labels(result)
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(kind)
        for direction in FORECAST_DIRECTIONS:
            self.forecast_error.labels(direction)

    def prime_engines(self, names: Iterable[str]) -> None:
        """Create the per-engine children (``engine`` label: the configured names)."""
        for name in names:
            self.engine_available.labels(name)
            self.engine_requests.labels(name)
            self.engine_failovers.labels(name)
