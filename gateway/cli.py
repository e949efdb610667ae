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
    listener_problem,
    load_settings,
)


def _serve(args: argparse.Namespace) -> int:
    from gateway.credentials import KeysFileError
    from gateway.logs import configure_logging
    from gateway.server import install_uvloop, serve
    from gateway.tls import TlsError

    try:
        settings = load_settings(args.config)
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
    from gateway.keys_file import check_keys_file
    from gateway.tls import TlsError, server_context

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"FAIL config: {exc}")
        return 1
    print(f"OK   config: {settings.source or 'defaults (no file)'}")
    failed = False
    listener = listener_problem(settings)
    if listener is not None:
        print(f"FAIL listener: {listener}")
        failed = True
    for name, section in (("server", settings.server), ("metrics", settings.metrics)):
        if section.tls_cert_file:
            try:
                server_context(section.tls_cert_file, section.tls_key_file)
            except TlsError as exc:
                print(f"FAIL {name} tls: {exc}")
                failed = True
            else:
                print(f"OK   {name} tls: {section.tls_cert_file}")
    keys_file = args.keys_file or settings.auth.keys_file
    problems = check_keys_file(keys_file)
    for problem in problems:
        print(f"FAIL keys: {problem}")
    if not problems:
        print(f"OK   keys: {keys_file}")
    return 1 if problems or failed else 0


def _demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    return run_demo(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        tokens_per_second=args.tokens_per_second,
        engines=args.engines,
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
    p.set_defaults(func=_demo)

    p = sub.add_parser("check", help="validate the config and keys file; exit 1 on problems")
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
