"""One TOML table checked and built into its settings dataclass: keys, types, ranges, choices.

`gateway.config` calls `build_table` for each section and tenant; a problem is a `ConfigError`
naming the dotted key and the offending value, so a bad file fails at load and never
half-applies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast


class ConfigError(ValueError):
    """A configuration problem; the message names the file, key and offending value."""


# key -> (minimum, maximum) inclusive; checked after types.
RANGES: dict[str, tuple[float, float]] = {
    "server.port": (1, 65535),
    "server.max_body_bytes": (1024, 1 << 31),
    "server.bodies_max_bytes": (1 << 20, 1 << 42),
    "server.shutdown_grace_s": (0, 3600),
    "server.drain_delay_s": (0, 600),
    "server.keepalive_timeout_s": (1, 3600),
    "server.body_timeout_s": (0.1, 3600),
    "server.plan_timeout_s": (0.1, 3600),
    "server.client_write_timeout_s": (0.1, 3600),
    "server.sse_keepalive_s": (0, 3600),
    "server.sse_progress_event_s": (0, 3600),
    "metrics.port": (1, 65535),
    "metrics.engine_scrape_timeout_s": (0.05, 60),
    "metrics.engine_scrape_cache_s": (0, 60),
    "engine.max_model_len": (1, 1 << 24),
    "engine.max_concurrency": (1, 4096),
    "engine.queue_size": (0, 1_000_000),
    "engine.queue_timeout_s": (0, 86_400),
    "engine.connect_timeout_s": (0.01, 600),
    "engine.read_timeout_s": (0.01, 86_400),
    "engine.request_timeout_s": (0, 604_800),
    "engine.min_tokens_per_s": (0, 100_000),
    "engine.pool_idle_s": (0.1, 4.9),
    "engine.health_interval_s": (0.05, 600),
    "engine.rotation_timeout_s": (0.01, 600),
    "engine.unhealthy_after_s": (0, 3600),
    "engine.queued_comment_after_s": (0, 3600),
    "engine.drift_check_interval_s": (0.1, 86_400),
    "engine.max_answer_bytes": (65_536, 1 << 34),
    "engine.max_event_bytes": (65_536, 1 << 32),
    "engine.affinity_load_factor": (1, 1000),
    "engines.max_concurrency": (1, 4096),
    "responses.store_max_items": (1, 10_000_000),
    "responses.store_max_bytes": (1024, 1 << 40),
    "responses.store_ttl_s": (1, 31_536_000),
    "retries.idempotency_ttl_s": (1, 604_800),
    "retries.retry_window_s": (0, 86_400),
    "retries.orphan_grace_s": (0, 600),
    "retries.buffer_bytes": (65_536, 1 << 32),
    "retries.max_bytes": (1 << 20, 1 << 40),
    "auth.jwt_leeway_s": (0, 3600),
    "auth.jwt_max_ttl_s": (1, 31_536_000),
    "auth.reload_poll_s": (0.05, 60),
    "ratelimit.redis_timeout_s": (0.01, 60),
    "ledger.flush_interval_s": (0.01, 1.0),
    "ledger.retention_days": (0, 36_500),
    "ledger.prune_interval_s": (1, 86_400),
    "ledger.max_pending": (1000, 10_000_000),
    "ledger.ship_interval_s": (0.05, 60),
    "fleet.lease_ttl_s": (1, 3600),
    "fleet.sync_interval_s": (0.05, 60),
    "fleet.redis_timeout_s": (0.01, 60),
    "quarantine.deaths": (1, 100),
    "quarantine.window_s": (1, 30 * 86_400),
    "quarantine.duration_s": (1, 365 * 86_400),
    "quarantine.poll_s": (0.05, 3600),
    "tenant.rpm": (0, 10**9),
    "tenant.tpm": (0, 10**12),
    "tenant.concurrency": (0, 100_000),
    "tenant.weight": (0.001, 1_000_000),
    "tenant.max_tokens": (1, 1 << 24),
    "tenant.tokens_per_day": (0, 10**15),
    "tenant.tokens_per_month": (0, 10**15),
    "tenant.deadline_s": (0, 86_400),
    "deadline.decode_tokens_per_s": (0.1, 100_000),
    "deadline.prefill_tokens_per_s": (1, 10_000_000),
    "deadline.expected_output_tokens": (1, 1 << 24),
}

CHOICES: dict[str, tuple[str, ...]] = {
    "ratelimit.backend": ("memory", "redis"),
    "logging.level": ("debug", "info", "warning", "error"),
}


def _expected(tp: Any) -> tuple[type, ...]:
    """Python types a TOML value may have for a dataclass field annotation (a string here)."""
    text = str(tp)
    if text.startswith("tuple"):
        return (list,)
    if text.startswith("bool"):
        return (bool, type(None)) if "None" in text else (bool,)
    if text.startswith("int"):
        return (int,)
    if text.startswith("float"):
        return (int, float)
    return (str,)


def build_table(cls: type, table: Any, where: str, base: Any = None) -> Any:
    """Instantiate dataclass ``cls`` from TOML ``table``, checking keys, types, ranges and choices.

    Args:
        cls: the section's dataclass (its field ``name``, if any, is not a key).
        table: the parsed TOML table.
        where: the dotted name of the table (``engine``, ``tenants.acme``) for messages; a
            ``tenants.*`` table is checked against the ``tenant.*`` ranges.
        base: an instance the table's values override (a tenant inherits ``default``).

    Raises:
        ConfigError: not a table, an unknown key, a wrong type, a value out of range or not
            one of the choices, a non-finite number.
    """
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {table!r}")
    known = {f.name: f for f in dataclasses.fields(cls) if f.name != "name"}
    values: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{where}.{key}"
        f = known.get(key)
        if f is None:
            raise ConfigError(f"unknown key {dotted} (known: {', '.join(sorted(known))})")
        kinds = _expected(f.type)
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"{dotted} = {value!r}: expected {kinds[0].__name__}")
        if not isinstance(value, kinds):
            raise ConfigError(f"{dotted} = {value!r}: expected {kinds[0].__name__}")
        if isinstance(value, list):
            if not all(isinstance(item, str) and item for item in value):
                raise ConfigError(f"{dotted} = {value!r}: expected a list of non-empty strings")
            value = tuple(value)
        if float in kinds:
            value = float(cast(float, value))
            if not math.isfinite(value):
                raise ConfigError(f"{dotted} = {value!r}: must be finite")
        range_key = dotted
        if where.startswith("tenants."):
            range_key = f"tenant.{key}"
        elif where.startswith("engines."):
            range_key = f"engines.{key}"
        bounds = RANGES.get(range_key)
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            raise ConfigError(f"{dotted} = {value!r}: must be between {bounds[0]} and {bounds[1]}")
        choices = CHOICES.get(dotted)
        if choices is not None and value not in choices:
            raise ConfigError(f"{dotted} = {value!r}: must be one of {', '.join(choices)}")
        values[key] = value
    if base is not None:
        return dataclasses.replace(base, **values)
    return cls(**values)
