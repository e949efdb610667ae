"""``qwen38-gateway quarantine list|clear [FINGERPRINT]``: the operator's view of poison requests.

Works on ``[quarantine] state_file`` under the same lock as the running gateway, which re-reads
the file within ``quarantine.poll_s`` (`gateway.quarantine`): run it as the gateway's user (the
file is 0600). Works as well while the gateway is stopped. With ``[fleet] redis_url`` it works on
the fleet's shared quarantine in Redis instead (`gateway.quarantine_redis`), which every gateway
re-reads within ``fleet.sync_interval_s``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from gateway.config import CONFIG_ENV, DEFAULT_CONFIG_PATH, ConfigError, Settings, load_settings
from gateway.quarantine import Record, StateFile, prune
from gateway.quarantine_redis import hash_key, parse_records


class RedisState:
    """The fleet's shared quarantine hash, with `StateFile`'s ``read`` and ``locked``.

    ``locked`` deletes the fingerprints the caller removed (``HDEL``); it never writes records.
    """

    def __init__(self, settings: Settings) -> None:
        cfg = settings.fleet
        self.path = Path(hash_key(cfg.key_prefix))
        self._key = hash_key(cfg.key_prefix)
        self._client = redis.Redis.from_url(
            cfg.redis_url, socket_timeout=5.0, socket_connect_timeout=5.0
        )

    def read(self) -> dict[str, Record]:
        """Every record of the hash."""
        return parse_records(self._client.hgetall(self._key))

    @contextmanager
    def locked(self) -> Iterator[dict[str, Record]]:
        """Yield the records; the ones the caller deleted are deleted in Redis."""
        records = self.read()
        before = set(records)
        yield records
        gone = before - set(records)
        if gone:
            self._client.hdel(self._key, *gone)


def _when(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )


def _state_file(args: argparse.Namespace) -> StateFile | RedisState | None:
    try:
        settings = load_settings(args.config, named=args.config is not None)
    except ConfigError as exc:
        print(f"qwen38-gateway: invalid configuration: {exc}", file=sys.stderr)
        return None
    if settings.fleet.redis_url:
        return RedisState(settings)
    path = settings.quarantine.state_file
    if not path:
        print(
            "qwen38-gateway: [quarantine] state_file is empty: the quarantine lives in the "
            "gateway's memory only (restart the gateway to clear it)",
            file=sys.stderr,
        )
        return None
    return StateFile(path)


def _list(args: argparse.Namespace) -> int:
    state = _state_file(args)
    if state is None:
        return 2
    now = time.time()
    try:
        records = state.read()
    except (redis.RedisError, OSError) as exc:
        print(f"qwen38-gateway: fleet.redis_url: Redis: {type(exc).__name__}", file=sys.stderr)
        return 2
    shown = [
        (fp, r) for fp, r in sorted(records.items()) if r.until > now or (args.all and r.deaths)
    ]
    if not shown:
        print("no quarantined requests" + ("" if args.all else " (--all shows suspects)"))
        return 0
    print(f"{'FINGERPRINT':32}  {'QUARANTINED UNTIL':20}  DEATHS  LAST DEATH")
    for fp, record in shown:
        until = _when(record.until) if record.until > now else "-"
        last = _when(max(record.deaths)) if record.deaths else "-"
        print(f"{fp:32}  {until:20}  {len(record.deaths):6}  {last}")
    return 0


def _clear(args: argparse.Namespace) -> int:
    state = _state_file(args)
    if state is None:
        return 2
    try:
        with state.locked() as records:
            if args.fingerprint is None:
                cleared = sorted(records)
            else:
                cleared = [args.fingerprint] if args.fingerprint in records else []
            for fp in cleared:
                del records[fp]
            prune(records, time.time(), float("inf"))
    except (redis.RedisError, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else type(exc).__name__
        print(f"qwen38-gateway: cannot write {state.path}: {reason}", file=sys.stderr)
        return 2
    if args.fingerprint is not None and not cleared:
        print(f"qwen38-gateway: {args.fingerprint} is not in the quarantine", file=sys.stderr)
        return 1
    for fp in cleared:
        print(f"cleared {fp}")
    if not cleared:
        print("nothing to clear")
    return 0


def add_subcommands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``quarantine list`` and ``quarantine clear`` to the ``qwen38-gateway`` parser."""
    config_help = f"TOML config (default ${CONFIG_ENV} or {DEFAULT_CONFIG_PATH})"
    parser = sub.add_parser("quarantine", help="list or clear quarantined (poison) requests")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("list", help="fingerprints refused now, until when, their deaths")
    p.add_argument("--config", help=config_help)
    p.add_argument("--all", action="store_true", help="also suspects with a death, not refused")
    p.set_defaults(func=_list)
    p = actions.add_parser(
        "clear", help="forget one fingerprint (refused or suspect), or every one without it"
    )
    p.add_argument("fingerprint", nargs="?", help="32 hex digits, as listed or in the 422")
    p.add_argument("--config", help=config_help)
    p.set_defaults(func=_clear)
