"""The ``qwen38-gateway`` command: serve, demo, check, keys and token, and usage reports."""

from __future__ import annotations

import argparse
import asyncio
import sys

from gateway import __version__
from gateway.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    ConfigError,
    Settings,
    listener_problem,
    load_settings,
)


def _serve(args: argparse.Namespace) -> int:
    from gateway.credentials import KeysFileError
    from gateway.logs import configure_logging
    from gateway.server import install_uvloop, serve
    from gateway.tls import TlsError

    try:
        settings = load_settings(args.config, named=args.config is not None)
    except ConfigError as exc:
        print(f"qwen38-gateway: invalid configuration: {exc}", file=sys.stderr)
        return 1
    configure_logging(settings.logging.level)
    install_uvloop()
    try:
        return asyncio.run(serve(settings, settings.source))
    except KeysFileError as exc:
        print(f"qwen38-gateway: cannot use the keys file:\n{exc}", file=sys.stderr)
        return 1
    except (ConfigError, TlsError) as exc:
        print(f"qwen38-gateway: invalid configuration: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"qwen38-gateway: cannot listen: {exc}", file=sys.stderr)
        return 1


def _check(args: argparse.Namespace) -> int:
    """``check``: what was asked to be checked fails the command; the rest only warns.

    ``--keys-file F`` alone checks that file: problems of the config it may read for nothing
    else (no file, a listener without TLS, certificates) are printed as ``WARN`` and the exit
    status is the keys file's (case C32). With ``--config`` (or neither option) the config, its
    listener, its certificates and the keys file are all checked and each problem fails.

    The keys file is judged as a reload judges it: one with no API key and no signing key fails
    unless ``auth.allow_empty_keys`` (`gateway.keys_file.empty_keys_problem`). A ledger path this
    user cannot create or write is only a ``WARN`` either way: ``serve`` starts with it.
    """
    from gateway.keys_file import check_keys_file
    from gateway.tls import TlsError, server_context

    keys_only = args.keys_file is not None and args.config is None
    other = "WARN" if keys_only else "FAIL"
    failed = False
    settings: Settings | None
    try:
        settings = load_settings(args.config, named=args.config is not None)
    except ConfigError as exc:
        print(f"{other} config: {exc}")
        if not keys_only:
            return 1
        settings = None
    if settings is not None:
        print(f"OK   config: {settings.source or 'defaults (no file)'}")
        listener = listener_problem(settings)
        if listener is not None:
            print(f"{other} listener: {listener}")
            failed = failed or not keys_only
        for name, section in (("server", settings.server), ("metrics", settings.metrics)):
            if section.tls_cert_file:
                try:
                    server_context(section.tls_cert_file, section.tls_key_file)
                except TlsError as exc:
                    print(f"{other} {name} tls: {exc}")
                    failed = failed or not keys_only
                else:
                    print(f"OK   {name} tls: {section.tls_cert_file}")
        if settings.ledger.enabled:
            _check_ledger_path(settings.ledger.path)
        if not keys_only:
            failed = _check_fleet(settings) or failed
    keys_file = args.keys_file or (settings.auth.keys_file if settings is not None else None)
    assert keys_file is not None, "a config loads whenever --keys-file is not given"
    allow_empty = settings.auth.allow_empty_keys if settings is not None else False
    problems = check_keys_file(keys_file, allow_empty=allow_empty)
    for problem in problems:
        print(f"FAIL keys: {problem}")
    if not problems:
        print(f"OK   keys: {keys_file}")
    return 1 if problems or failed else 0


def _check_ledger_path(path: str) -> None:
    """Print OK, or WARN when this user could not create or write the ledger at ``path``
    (`gateway.ledger.path_problem`). Only a warning: ``serve`` starts all the same and holds
    the records in memory (logging ``ledger_write_failed``) until the file can be written."""
    from gateway.ledger import path_problem

    problem = path_problem(path)
    if problem is None:
        print(f"OK   ledger: {path}")
    else:
        print(
            f"WARN ledger: {problem}; serve would keep usage records in memory only "
            "(ledger_write_failed)"
        )


def _check_fleet(settings: Settings) -> bool:
    """Print OK/FAIL for the fleet's Redis and the ledger's PostgreSQL when configured; True on
    a failure. Neither the DSN nor the Redis URL is printed (either may hold a password)."""
    failed = False
    if settings.fleet.redis_url:
        import redis

        client = redis.Redis.from_url(
            settings.fleet.redis_url, socket_timeout=5.0, socket_connect_timeout=5.0
        )
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            print(f"FAIL fleet: fleet.redis_url does not answer ({type(exc).__name__})")
            failed = True
        else:
            print("OK   fleet: fleet.redis_url answers")
        finally:
            client.close()
    dsn = settings.ledger.dsn() if settings.ledger.enabled else ""
    if dsn:
        from gateway.ledger_ship import check_dsn

        try:
            check_dsn(dsn)
        except ConfigError as exc:
            print(f"FAIL ledger: {exc}")
            failed = True
        else:
            print("OK   ledger: ledger.postgres_dsn answers (table usage ready)")
    return failed


def _demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    return run_demo(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        tokens_per_second=args.tokens_per_second,
        engines=args.engines,
        faults=args.faults,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from gateway.keys_cli import add_subcommands
    from gateway.quarantine_cli import add_subcommands as add_quarantine_subcommands
    from gateway.usage_report import add_subcommands as add_usage_subcommands

    parser = argparse.ArgumentParser(
        prog="qwen38-gateway",
        description="OpenAI-compatible gateway for Qwen3.8-27B on 1Cat-vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    config_help = f"TOML config (default ${CONFIG_ENV} or {DEFAULT_CONFIG_PATH})"

    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--config", help=config_help)
    p.set_defaults(func=_serve)

    p = sub.add_parser(
        "demo", help="run the engine simulator and the gateway with a demo key (no config)"
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="public port (default 8000)")
    p.add_argument("--metrics-port", type=int, default=9400, help="metrics port (default 9400)")
    p.add_argument(
        "--tokens-per-second",
        type=float,
        default=30.0,
        help="simulated decode speed (default 30, like one V100; 0 = as fast as possible)",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=1,
        choices=range(1, 17),
        metavar="N",
        help="engine simulators behind the gateway, one slot each, as one per GPU (default 1)",
    )
    p.add_argument(
        "--faults",
        action="store_true",
        help='let a request\'s "sim" object inject faults (crash, hang, ...; engine/sim/README.md); '
        "off by default, so no client can stop the demo's engine",
    )
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "check",
        help="validate the config and keys file; exit 1 on problems (with --keys-file alone: "
        "the keys file's problems; the config's are warnings)",
    )
    p.add_argument("--config", help=config_help)
    p.add_argument(
        "--keys-file", metavar="F", help="the keys file (default: auth.keys_file of the config)"
    )
    p.set_defaults(func=_check)

    add_subcommands(sub)
    add_usage_subcommands(sub)
    add_quarantine_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``qwen38-gateway`` and ``python -m gateway``; returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))
