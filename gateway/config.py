"""Gateway configuration: the TOML file, parsed once into frozen dataclasses.

Every key has a default and a missing file means all defaults. Unknown keys and values of the
wrong type or range fail at load with a `ConfigError` naming the key and the value, so a bad file
never half-applies. Per-request code only reads the resulting objects.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from engine.tomlfile import load_toml
from gateway.config_tables import ConfigError as ConfigError
from gateway.config_tables import build_table
from gateway.secret_scan import CREDENTIAL_SHAPE_RE

DEFAULT_CONFIG_PATH = "/etc/qwen38/gateway.toml"
CONFIG_ENV = "QWEN38_GATEWAY_CONFIG"
TENANT_NAME_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
TENANT_NAME_RULE = (
    "1-64 letters, digits, '_', '.', '-', starting with a letter or digit, and not shaped like a "
    "credential (sk-..., a JWT): logs would show such a name as [redacted]"
)


def valid_tenant_name(name: str) -> bool:
    """A tenant name as keys, tokens and ``[tenants.*]`` may give it: `TENANT_NAME_RE`, and no
    credential's shape (`gateway.secret_scan.CREDENTIAL_SHAPE_RE`), since every log line
    redacts those and the tenant of an access line would read ``[redacted]``."""
    return bool(TENANT_NAME_RE.match(name)) and CREDENTIAL_SHAPE_RE.search(name) is None


DEFAULT_TENANT = "default"
UNKNOWN_TENANT = "unknown"


@dataclass(frozen=True)
class ServerSettings:
    """``[server]``: the public listener.

    ``max_body_bytes`` defaults to 32 MiB: a 254,976-token prompt is about 1 MB of text, so this
    leaves room for JSON escaping (CJK as ``\\uXXXX`` is 6 bytes a character) and tool schemas.
    ``bodies_max_bytes`` (1 GiB) bounds the memory the bodies of all model requests hold at once
    (being read, parsed, waiting in the queue, at an engine), each counted as the estimate of its
    bytes, decoded text and parsed objects (`gateway.body_memory`), a body still arriving as the
    bytes received so far: a request past it is refused like one past a full queue (429
    ``memory`` at the tenant's share, else 503), one that alone exceeds it with 413.

    The three timeouts protect the listener, which faces clients directly (seconds):
    ``keepalive_timeout_s`` closes a connection that sends no complete request line and headers
    for that long (idle keep-alive, slowloris); ``body_timeout_s`` is the longest pause while a
    body uploads (then 408); ``client_write_timeout_s`` the longest a client may leave a stream
    unread before it counts as gone (499) and its engine request is aborted, so a stalled reader
    cannot hold the engine's only slot. nginx uses 60 s for the same three.
    ``plan_timeout_s`` bounds the work on one body over 1 MiB in the plan worker
    (`gateway.plan_worker`), from sending it the body to its answer (a 32 MiB body takes about
    3 s); a worker that takes longer is stopped and the request gets 503.

    TLS: with ``tls_cert_file`` (PEM chain) and ``tls_key_file`` (PEM key) the listener serves
    HTTPS only (TLS 1.2 and 1.3, Python's default cipher policy); both files are re-read on
    SIGHUP and when they change, without dropping open connections. Without them the listener
    speaks plain HTTP, which is accepted on a loopback address only, unless ``plain_http = true``
    says a TLS proxy in front terminates TLS (clients send bearer keys).

    ``sse_keepalive_s``: while a stream's headers are out but no event comes (queued, or the
    engine's prefill of a long prompt), an SSE comment line is sent this often so that idle
    timeouts of clients and proxies do not fire; 0 sends none (a queued stream still beats every
    5 s). ``sse_progress_event_s``: on the Messages and Responses APIs, a waiting stream's
    keep-alive is replaced this often by an event of the API that changes nothing (``message_delta``,
    ``response.in_progress``): Claude Code's and Codex's idle timers count events, not comments
    or pings (`gateway.waiting`); 0 sends none.

    ``shutdown_grace_s``: on SIGTERM, requests at the engine get this long to finish; queued ones
    get 503 at once; the process exits within the grace plus about 2 s. ``drain_delay_s``: before
    that, ``/ready`` answers 503 for this long while requests are still served, so that a load
    balancer in front (HAProxy's ``/ready`` check, ``deploy/haproxy/haproxy.cfg``) takes the
    gateway out before its listener closes; 0 (the default, no load balancer) skips it.
    """

    host: str = "0.0.0.0"
    port: int = 8000
    max_body_bytes: int = 33_554_432
    bodies_max_bytes: int = 1_073_741_824
    shutdown_grace_s: float = 30.0
    drain_delay_s: float = 0.0
    keepalive_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    plan_timeout_s: float = 60.0
    client_write_timeout_s: float = 60.0
    tls_cert_file: str = ""
    tls_key_file: str = ""
    plain_http: bool = False
    sse_keepalive_s: float = 5.0
    sse_progress_event_s: float = 15.0


@dataclass(frozen=True)
class MetricsSettings:
    """``[metrics]``: the Prometheus listener, separate from the public port.

    A scrape bearer token, when wanted, lives in the keys file (``QWEN38_METRICS_TOKEN``), never here.
    ``tls_cert_file`` / ``tls_key_file``: as in ``[server]``, for the metrics listener.
    """

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 9400
    tls_cert_file: str = ""
    tls_key_file: str = ""
    engine_scrape_timeout_s: float = 2.0
    engine_scrape_cache_s: float = 1.0


@dataclass(frozen=True)
class EngineSettings:
    """``[engine]``: how to reach the engine and how much of it to use.

    Timeouts in seconds. ``pool_idle_s`` must stay below the engine's 5 s uvicorn keep-alive
    (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, "Environment Variables" in the vLLM docs) so the gateway never reuses a
    connection the engine is closing. ``read_timeout_s`` is the longest silence tolerated between
    two reads of a streamed answer (and before its headers): long prompts take minutes of prefill
    before the first byte on a V100, so it defaults to 15 minutes. A non-streaming answer is
    silent until it is complete, so no read timeout applies to it.

    The total time limit of a request at the engine, the same for streamed and non-streamed
    answers: ``request_timeout_s`` when set (> 0), else derived from the request as
    ``read_timeout_s + n x max_tokens / min_tokens_per_s`` (the prefill allowance plus the
    request's whole output budget at a speed well below the engine's: one V100 decodes about 30
    tokens/s, the default assumes 5), so a working engine is never cut; ``min_tokens_per_s = 0``
    and ``request_timeout_s = 0`` mean no total limit. When it fires the client gets 504
    (``upstream_timeout``; an error event on a stream) and the engine request is aborted.
    ``ready_file``, when set, is the file the launcher (``qwen38-engine serve``) creates once its
    warm-up request succeeded: until it exists a healthy engine counts as ``warming``.
    ``launcher_status_file``, when set, is the launcher's status JSON; the metrics listener
    exports it as ``qwen38_engine_*`` series (restarts by reason, hangs, stall seconds).
    ``drift_check_interval_s``: how often the gateway's in-flight count is compared with the
    engine's ``vllm:num_requests_running`` (drift is logged).
    ``unhealthy_after_s``: how long ``/health`` probes must keep timing out (or failing without
    an answer) before a ready engine is marked down; a refused connection, a missing socket or a
    non-200 answer marks it down at once (`gateway.engine_watch.poll_health`). Default 10 s: at
    least five failed probes of 1 s, well above a loaded engine's slow ``/health``.
    ``health_interval_s``: seconds between two probes (0.5: vLLM's ``/health`` is a cheap answer
    of its API server). ``rotation_timeout_s`` (several engines): a probe unanswered this long,
    with no byte from the engine meanwhile, takes the engine out of rotation for new requests
    until a probe answers again (`gateway.failover`): a hung engine is out within
    ``health_interval_s + rotation_timeout_s`` (0.8 s by default); ``down`` (alerts,
    ``/ready``) still takes ``unhealthy_after_s``.
    ``queued_comment_after_s``: a stream that waits this long in the admission queue gets its
    headers, its dialect's opening events and keep-alives while it waits (`gateway.waiting`).
    ``queue_timeout_s``: the longest wait in that queue, 30 minutes by default so that agent
    clients (Claude Code, Codex) behind a few other turns on a one-slot engine are served
    instead of refused; a streamed request is kept alive meanwhile, a non-streamed one is bound
    by its client's read timeout (README, "Long waits and retries").
    ``max_answer_bytes``: the largest non-streamed engine answer relayed (a larger one is a 502,
    the engine request aborted); ``max_event_bytes``: the largest single streamed event (past
    it the stream ends with a 502 error event). A 32,768-token answer is about 150 KB of JSON,
    one vLLM event a few hundred bytes (a few KB with ``top_logprobs``).

    Several engines (``[[engines]]`` tables, `EngineSpec`): ``socket``, ``max_concurrency``,
    ``ready_file`` and ``launcher_status_file`` move to each engine's table; every other key here
    is shared by all of them. ``affinity``: a session's requests go to the engine that served it
    last (its prefix cache, `gateway.affinity`), unless that engine's load would exceed
    ``affinity_load_factor`` times the least-loaded engine's (`gateway.admission`).
    """

    socket: str = "/run/qwen38/engine.sock"
    model: str = "qwen3.8-27b"
    max_model_len: int = 254_976
    max_concurrency: int = 1
    queue_size: int = 64
    queue_timeout_s: float = 1800.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 900.0
    request_timeout_s: float = 0.0
    min_tokens_per_s: float = 5.0
    pool_idle_s: float = 4.0
    health_interval_s: float = 0.5
    rotation_timeout_s: float = 0.3
    unhealthy_after_s: float = 10.0
    queued_comment_after_s: float = 3.0
    ready_file: str = ""
    launcher_status_file: str = ""
    drift_check_interval_s: float = 30.0
    max_answer_bytes: int = 33_554_432
    max_event_bytes: int = 8_388_608
    affinity: bool = True
    affinity_load_factor: float = 1.5


ENGINE_NAME_RE = re.compile(r"\A[a-z0-9][a-z0-9_-]{0,31}\Z")
DEFAULT_ENGINE = "default"
PER_ENGINE_KEYS = ("socket", "max_concurrency", "ready_file", "launcher_status_file")
"""``[engine]`` keys that belong to each ``[[engines]]`` table when several engines are listed."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine behind the gateway: a ``[[engines]]`` table, or the lone ``[engine] socket``.

    Attributes:
        name: the engine's name (``[a-z0-9][a-z0-9_-]{0,31}``: a metrics label value, a systemd
            instance name, a ledger column); ``default`` for the lone ``[engine]`` engine.
        socket: the engine's Unix socket (an engine on this host).
        url: ``https://host:port`` of an engine on another host (TLS; plain ``http`` only on a
            loopback address). Exactly one of ``socket`` and ``url``.
        max_concurrency: requests the gateway sends this engine at once (its slots).
        ready_file: the launcher's warm-up marker of this engine (empty: none).
        launcher_status_file: the launcher's status JSON of this engine (empty: none).
    """

    name: str = DEFAULT_ENGINE
    socket: str = ""
    url: str = ""
    max_concurrency: int = 1
    ready_file: str = ""
    launcher_status_file: str = ""

    @property
    def address(self) -> str:
        """The socket path or the URL: where the engine is reached (logs, messages)."""
        return self.socket or self.url


@dataclass(frozen=True)
class ModelSettings:
    """``[model]``: the public model id clients send and see.

    ``accepted`` lists further names a request may carry in ``model`` (coding clients such as
    Claude Code and Codex send whatever name their user configured); ``"*"`` accepts any name.
    Answers always show ``alias``.
    """

    alias: str = "qwen3.8-27b"
    accepted: tuple[str, ...] = ()

    def accepts(self, name: str) -> bool:
        """True when a request naming ``name`` is served (the alias or an accepted name)."""
        return name == self.alias or name in self.accepted or "*" in self.accepted


@dataclass(frozen=True)
class ResponsesSettings:
    """``[responses]``: stored responses of ``/v1/responses`` (``store: true``).

    Off by default: Codex and most coding clients send ``store: false`` and the whole history.
    When on, responses are kept in this process's memory only (not shared by replicas, lost at
    restart), at most ``store_max_items`` of them and ``store_max_bytes`` in all (compact JSON
    bytes, as held, plus a per-entry overhead), each for ``store_ttl_s`` seconds, visible only
    to the tenant that created them; when full, the tenant holding the most gives up its oldest
    (`gateway.translate.responses_store`).
    """

    store: bool = False
    store_max_items: int = 10_000
    store_max_bytes: int = 268_435_456
    store_ttl_s: float = 86_400.0


@dataclass(frozen=True)
class RetriesSettings:
    """``[retries]``: retries attach to the generation they repeat (`gateway.retries`).

    ``idempotency_ttl_s``: how long after its end a request with an ``Idempotency-Key`` is
    replayed to the same key (24 h, as common API practice). ``retry_window_s``: how long an
    answer nobody received is kept for a marked SDK retry or a resend. ``orphan_grace_s``: how
    long a generation at the engine keeps running after its last client left, for a retry to
    attach (0: cancelled at once, as without retries). ``buffer_bytes``: the most of one answer
    kept for attaching and replay; ``max_bytes``: all kept answers together.
    """

    enabled: bool = True
    idempotency_ttl_s: float = 86_400.0
    retry_window_s: float = 60.0
    orphan_grace_s: float = 10.0
    buffer_bytes: int = 4_194_304
    max_bytes: int = 67_108_864


@dataclass(frozen=True)
class ThinkingSettings:
    """``[thinking]``: the mode used when neither the request nor the tenant decides."""

    default: bool = True


@dataclass(frozen=True)
class AuthSettings:
    """``[auth]``: where credentials live and how JWTs are checked.

    ``jwt_leeway_s`` is the clock-skew allowance for ``exp``/``nbf``/``iat``;
    ``reload_poll_s`` how often the keys file is checked for changes (a key rotation applies
    within 2 s by default).
    ``allow_empty_keys``: a reload that finds no API key and no signing key in the keys file is
    refused (the keys in force stay) unless this is true: an in-place rewrite (``cat > file``)
    shows an empty file for a moment, and loading it would lock every tenant out.
    """

    keys_file: str = "/etc/qwen38/api-keys.env"
    jwt_leeway_s: float = 30.0
    jwt_max_ttl_s: float = 86_400.0
    reload_poll_s: float = 1.0
    allow_empty_keys: bool = False


@dataclass(frozen=True)
class RatelimitSettings:
    """``[ratelimit]``: where limit counters live (``memory`` for one process, ``redis`` to share)."""

    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "qwen38"
    redis_timeout_s: float = 0.5


@dataclass(frozen=True)
class LedgerSettings:
    """``[ledger]``: the usage ledger, one SQLite record per finished model request.

    ``path`` is the database file (its directory is created if missing); one file per replica, or
    one file shared by the replicas of one host (SQLite's WAL mode takes several writers on one
    machine, never over a network file system). ``flush_interval_s`` is the longest a finished
    request waits in memory before it is committed and fsynced: a ``kill -9`` or a crash loses at
    most the records of that last interval. ``retention_days`` of records are kept (0: forever);
    older ones are deleted every ``prune_interval_s``. ``max_pending`` bounds the records held in
    memory while the file cannot be written (full disk, read-only path); beyond it the oldest are
    dropped and counted.

    ``postgres_dsn`` (a libpq connection string or URI; empty: none): the SQLite file becomes the
    outbox of a PostgreSQL ledger shared by every gateway (`gateway.ledger_ship`). Records are
    shipped every ``ship_interval_s``, exactly once (keyed by their ``record_id``); an outage of
    PostgreSQL never blocks a request and is caught up. ``usage report`` and ``GET /v1/usage``
    then read PostgreSQL. The DSN is a secret when it carries a password: keep the password in a
    libpq password file (``passfile=...``) or set the whole DSN in the environment variable
    ``QWEN38_LEDGER_POSTGRES_DSN`` (it wins over the file); it is never logged.
    """

    enabled: bool = True
    path: str = "/var/lib/qwen38/usage.sqlite3"
    flush_interval_s: float = 0.5
    retention_days: int = 400
    prune_interval_s: float = 3600.0
    max_pending: int = 100_000
    postgres_dsn: str = ""
    ship_interval_s: float = 0.5

    def dsn(self) -> str:
        """The PostgreSQL DSN in force: ``$QWEN38_LEDGER_POSTGRES_DSN`` when set, else
        ``postgres_dsn`` (empty: no PostgreSQL, the SQLite file is the ledger)."""
        return os.environ.get(POSTGRES_DSN_ENV, "") or self.postgres_dsn


POSTGRES_DSN_ENV = "QWEN38_LEDGER_POSTGRES_DSN"


@dataclass(frozen=True)
class FleetSettings:
    """``[fleet]``: several gateways as one service, coordinated through Redis (`gateway.fleet`).

    ``redis_url`` empty (the default): a single gateway; no engine lease, the quarantine in its
    state file, revocations from the local keys file only. Set (usually the same Redis as
    ``[ratelimit] redis_url``): each configured engine is leased in Redis by this gateway (a
    second gateway configured with it refuses to start), quarantine deaths and revoked key ids
    are shared with the other gateways, and ``sync_interval_s`` is how often this gateway reads
    what the others published. ``gateway_id`` names this gateway in the leases and in errors
    (default ``<hostname>:<server.port>``); it must be unique in the fleet. ``lease_ttl_s``: a
    lease of a gateway that died without releasing it expires after this long, renewed every
    third of it.
    """

    redis_url: str = ""
    key_prefix: str = "qwen38"
    gateway_id: str = ""
    lease_ttl_s: float = 10.0
    sync_interval_s: float = 0.5
    redis_timeout_s: float = 0.5


@dataclass(frozen=True)
class QuarantineSettings:
    """``[quarantine]``: poison requests, at the engine each time it died (`gateway.quarantine`).

    A request fingerprint with ``deaths`` engine deaths within ``window_s`` is refused (422
    ``request_quarantined``) for ``duration_s``. Defaults: two deaths, because one death alone
    is as often the engine's or the GPU's own fault; a one-hour window, long enough for a client
    to retry through a restart of a few minutes; a day of quarantine, because a request that
    crashed the engine twice will crash it again, and operators can clear a fingerprint any
    time. ``state_file`` (empty: memory only, no CLI) keeps the state across restarts and is
    what ``qwen38-gateway quarantine`` edits; the gateway re-reads it every ``poll_s``.
    """

    enabled: bool = True
    deaths: int = 2
    window_s: float = 3600.0
    duration_s: float = 86_400.0
    state_file: str = "/var/lib/qwen38/quarantine.json"
    poll_s: float = 1.0


@dataclass(frozen=True)
class DeadlineSettings:
    """``[deadline]``: refusing at once a request its client will not wait for (`gateway.deadline`).

    ``enabled``: a request whose client states a read timeout (``x-stainless-read-timeout`` or
    ``x-stainless-timeout``, or its tenant's ``deadline_s``) and whose predicted wait for an
    engine slot exceeds it gets 503 (Anthropic 529) with ``Retry-After`` at once; false admits
    it as before (the prediction and its metrics stay). The speeds stand until the first
    finished requests measure them: ``decode_tokens_per_s`` per sequence (one V100 decodes about
    30, DEPLOYMENT-NOTES), ``prefill_tokens_per_s`` of prompt; ``expected_output_tokens`` is the
    output per choice assumed until answers have been seen.
    """

    enabled: bool = True
    decode_tokens_per_s: float = 30.0
    prefill_tokens_per_s: float = 1000.0
    expected_output_tokens: int = 500


@dataclass(frozen=True)
class LoggingSettings:
    """``[logging]``: level of the JSON log on stdout."""

    level: Literal["debug", "info", "warning", "error"] = "info"


@dataclass(frozen=True)
class TenantSettings:
    """One ``[tenants.NAME]`` table; unset keys inherit from ``[tenants.default]``.

    Attributes:
        name: tenant name (from the table header).
        rpm: requests per minute.
        tpm: tokens per minute, prompt plus completion.
        concurrency: requests in flight for this tenant.
        weight: share of the engine under contention (relative to other tenants' weights).
        max_tokens: output budget sent upstream and reserved when the client sets none; 32,768 is
            the Qwen3.8-27B card's recommended output length for most queries.
        thinking_default: this tenant's default thinking mode, or None for ``[thinking] default``.
        thinking_allowed: False forces thinking off; an explicit request for it gets 403.
        tokens_per_day: prompt plus completion tokens per UTC day, or None for no daily quota.
        tokens_per_month: prompt plus completion tokens per UTC calendar month, or None.
        deadline_s: seconds this tenant's clients wait for an answer when a request states no
            read timeout of its own (`gateway.deadline`); 0: none.
    """

    name: str = DEFAULT_TENANT
    rpm: int = 60
    tpm: int = 200_000
    concurrency: int = 2
    weight: float = 1.0
    max_tokens: int = 32_768
    thinking_default: bool | None = None
    thinking_allowed: bool = True
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    deadline_s: float = 0.0


@dataclass(frozen=True)
class Settings:
    """The whole gateway configuration. Build with `load_settings` or `parse_settings`."""

    server: ServerSettings = field(default_factory=ServerSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    thinking: ThinkingSettings = field(default_factory=ThinkingSettings)
    responses: ResponsesSettings = field(default_factory=ResponsesSettings)
    retries: RetriesSettings = field(default_factory=RetriesSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    ratelimit: RatelimitSettings = field(default_factory=RatelimitSettings)
    ledger: LedgerSettings = field(default_factory=LedgerSettings)
    quarantine: QuarantineSettings = field(default_factory=QuarantineSettings)
    fleet: FleetSettings = field(default_factory=FleetSettings)
    deadline: DeadlineSettings = field(default_factory=DeadlineSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    tenants: Mapping[str, TenantSettings] = field(
        default_factory=lambda: MappingProxyType({DEFAULT_TENANT: TenantSettings()})
    )
    source: str | None = None
    engines: tuple[EngineSpec, ...] = ()

    @property
    def engine_specs(self) -> tuple[EngineSpec, ...]:
        """The engines behind the gateway, in the config's order: the ``[[engines]]`` tables,
        or one engine named ``default`` from ``[engine]`` when there are none."""
        if self.engines:
            return self.engines
        engine = self.engine
        return (
            EngineSpec(
                name=DEFAULT_ENGINE,
                socket=engine.socket,
                max_concurrency=engine.max_concurrency,
                ready_file=engine.ready_file,
                launcher_status_file=engine.launcher_status_file,
            ),
        )

    @property
    def total_slots(self) -> int:
        """Requests in flight at all engines together (the sum of their ``max_concurrency``)."""
        return sum(spec.max_concurrency for spec in self.engine_specs)

    def tenant(self, name: str) -> TenantSettings:
        """The settings for tenant ``name``: its own table, else ``default``'s under its own name."""
        found = self.tenants.get(name)
        if found is not None:
            return found
        return dataclasses.replace(self.tenants[DEFAULT_TENANT], name=name)

    def tenant_label(self, name: str | None) -> str:
        """Metrics label for a tenant: configured names as is, others ``default``, none ``unknown``.

        Keeps label cardinality bounded by the config file (Prometheus naming guide, "Labels").
        """
        if name is None:
            return UNKNOWN_TENANT
        return name if name in self.tenants else DEFAULT_TENANT

    def tenant_labels(self) -> tuple[str, ...]:
        """Every tenant label value that can appear in metrics."""
        return (*self.tenants.keys(), UNKNOWN_TENANT)


_SECTIONS: dict[str, type] = {
    "server": ServerSettings,
    "metrics": MetricsSettings,
    "engine": EngineSettings,
    "model": ModelSettings,
    "thinking": ThinkingSettings,
    "responses": ResponsesSettings,
    "retries": RetriesSettings,
    "auth": AuthSettings,
    "ratelimit": RatelimitSettings,
    "ledger": LedgerSettings,
    "quarantine": QuarantineSettings,
    "fleet": FleetSettings,
    "deadline": DeadlineSettings,
    "logging": LoggingSettings,
}


def parse_settings(data: Mapping[str, Any], source: str | None = None) -> Settings:
    """Build `Settings` from a parsed TOML document.

    Raises:
        ConfigError: unknown section or key, wrong type, out-of-range value, bad tenant name.
    """
    sections: dict[str, Any] = {}
    for name, table in data.items():
        if name in ("tenants", "engines"):
            continue
        cls = _SECTIONS.get(name)
        if cls is None:
            known = ", ".join([*sorted(_SECTIONS), "engines", "tenants"])
            raise ConfigError(f"unknown section [{name}] (known: {known})")
        sections[name] = build_table(cls, table, name)

    raw_tenants = data.get("tenants", {})
    if not isinstance(raw_tenants, dict):
        raise ConfigError(f"tenants: expected tables [tenants.NAME], got {raw_tenants!r}")
    default = build_table(TenantSettings, raw_tenants.get(DEFAULT_TENANT, {}), "tenants.default")
    tenants: dict[str, TenantSettings] = {DEFAULT_TENANT: default}
    for tname, table in raw_tenants.items():
        if not valid_tenant_name(tname) or tname == UNKNOWN_TENANT:
            raise ConfigError(
                f"tenants.{tname}: invalid tenant name ({TENANT_NAME_RULE}; not {UNKNOWN_TENANT!r})"
            )
        if tname == DEFAULT_TENANT:
            continue
        base = dataclasses.replace(default, name=tname)
        tenants[tname] = build_table(TenantSettings, table, f"tenants.{tname}", base=base)

    engines = parse_engines(data.get("engines"), data.get("engine", {}))
    settings = Settings(
        **sections, tenants=MappingProxyType(tenants), source=source, engines=engines
    )
    server, metrics = settings.server, settings.metrics
    if (
        metrics.enabled
        and metrics.port == server.port
        and (metrics.host == server.host or "0.0.0.0" in (metrics.host, server.host))
    ):
        raise ConfigError(
            f"metrics.port = {metrics.port}: must differ from server.port (the metrics listener "
            "is never on the public port)"
        )
    if settings.ledger.enabled and not settings.ledger.path:
        raise ConfigError("ledger.path must not be empty while ledger.enabled = true")
    if settings.engine.model == "" or settings.model.alias == "":
        raise ConfigError("engine.model and model.alias must not be empty")
    for name, section in (("server", settings.server), ("metrics", settings.metrics)):
        if bool(section.tls_cert_file) != bool(section.tls_key_file):
            raise ConfigError(f"{name}.tls_cert_file and {name}.tls_key_file must be set together")
    return settings


def parse_engines(raw: Any, engine_table: Any) -> tuple[EngineSpec, ...]:
    """The ``[[engines]]`` tables, checked as a topology (empty when there are none).

    Raises:
        ConfigError: not an array of tables; a bad or repeated name; neither or both of
            ``socket`` and ``url``; a socket or URL listed twice; a URL that is not ``https``
            off a loopback address, or has a path, query or credentials; a per-engine key
            (`PER_ENGINE_KEYS`) also set in ``[engine]``.
    """
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw or not all(isinstance(t, dict) for t in raw):
        raise ConfigError(f"engines: expected one or more [[engines]] tables, got {raw!r}")
    if isinstance(engine_table, dict):
        for key in PER_ENGINE_KEYS:
            if key in engine_table:
                raise ConfigError(
                    f"engine.{key} is set while [[engines]] tables are listed: set {key} in "
                    "each [[engines]] table instead"
                )
    specs: list[EngineSpec] = []
    names: dict[str, int] = {}
    addresses: dict[str, str] = {}
    for index, table in enumerate(raw):
        where = f"engines[{index}]"
        name = table.get("name")
        if not isinstance(name, str) or not ENGINE_NAME_RE.match(name):
            raise ConfigError(
                f"{where}.name = {name!r}: each [[engines]] table needs a name of lower-case "
                "letters, digits, '_' and '-' (at most 32, starting with a letter or digit)"
            )
        if name in names:
            raise ConfigError(
                f"{where}.name = {name!r}: engine listed twice (also engines[{names[name]}])"
            )
        names[name] = index
        rest = {k: v for k, v in table.items() if k != "name"}
        spec: EngineSpec = build_table(EngineSpec, rest, f"engines.{name}")
        spec = dataclasses.replace(spec, name=name)
        if bool(spec.socket) == bool(spec.url):
            raise ConfigError(
                f"engines.{name}: set exactly one of socket (an engine on this host) and url "
                "(an engine on another host, over TLS)"
            )
        address = _check_engine_url(name, spec.url) if spec.url else os.path.normpath(spec.socket)
        if address in addresses:
            key = "url" if spec.url else "socket"
            raise ConfigError(
                f"engines.{name}.{key} = {spec.address!r}: the same engine as "
                f"engines.{addresses[address]} (an engine listed twice)"
            )
        addresses[address] = name
        specs.append(spec)
    return tuple(specs)


def _check_engine_url(name: str, url: str) -> str:
    """The canonical ``scheme://host:port`` of an engine URL; raises `ConfigError` if unfit."""
    from urllib.parse import urlsplit

    key = f"engines.{name}.url = {url!r}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{key}: not a URL ({exc})") from None
    host = parts.hostname or ""
    if parts.scheme not in ("https", "http") or not host:
        raise ConfigError(f"{key}: expected https://host:port")
    if parts.username or parts.password:
        raise ConfigError(f"{key}: no credentials in the URL")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{key}: no path or query (the gateway chooses the engine's paths)")
    if parts.scheme == "http" and not is_loopback(host):
        raise ConfigError(
            f"{key}: an engine on another host is reached over TLS only (https://); plain http "
            "is accepted on a loopback address"
        )
    default = 443 if parts.scheme == "https" else 80
    return f"{parts.scheme}://{host.lower()}:{port or default}"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listener_problem(settings: Settings) -> str | None:
    """Why the public listener may not serve these settings, or None (checked by ``serve`` and
    ``check``, not by the other commands that read the config).

    Plain HTTP is served on a loopback address, or elsewhere with ``server.plain_http = true``
    (a TLS proxy in front); otherwise TLS files are required.
    """
    server = settings.server
    if not server.tls_cert_file and not server.plain_http and not is_loopback(server.host):
        return (
            f"server.host = {server.host!r} without TLS: clients would send their keys in clear. "
            "Set server.tls_cert_file and server.tls_key_file, or server.plain_http = true when "
            "a TLS proxy in front terminates TLS"
        )
    return None


def load_settings(path: str | os.PathLike[str] | None = None, *, named: bool = False) -> Settings:
    """Read and validate the TOML config.

    Args:
        path: file to read; None means ``$QWEN38_GATEWAY_CONFIG`` or ``/etc/qwen38/gateway.toml``.
            A file that does not exist means all defaults, unless ``named``.
        named: ``path`` was named on a command line (``--config``): a file that does not exist
            is an error (a typo would otherwise run, check or write keys with the defaults).

    Raises:
        ConfigError: the file is not valid TOML or fails `parse_settings`; a ``named`` file
            does not exist.
    """
    chosen = Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)
    if named and path is not None and not chosen.exists():
        raise ConfigError(f"{chosen}: no such file")
    return load_toml(chosen, parse_settings, Settings, ConfigError)
