"""The ``qwen38-engine`` command: ``serve``, ``check``, ``command`` and ``sim`` (DESIGN section 2)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping, Sequence

from engine import preflight
from engine.command import Launch, build_launch
from engine.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    ConfigError,
    Settings,
    config_path,
    load_settings,
)
from engine.cpukv import read_cpu_flags, resolve_kv_cache_dtype
from engine.gpus import resolve_devices
from engine.probes import PreflightError, Probes, system_probes

EXIT_OK = 0
EXIT_FAILURE = 1  # preflight failed, engine exited or hung, start refused
EXIT_CONFIG = 2  # engine.toml invalid, or a PCI bus id that cannot be resolved


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help=f"engine.toml (default: ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH}; "
        "a missing file means all defaults)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand except ``sim`` (which `main` hands over)."""
    parser = argparse.ArgumentParser(
        prog="qwen38-engine",
        description="Preflight, launch and supervise the 1Cat-vLLM engine on its Unix socket.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="preflight, launch the engine and supervise it",
        description="Run preflight, start the engine on its Unix socket, wait for /health, warm "
        "it up, report READY=1 to systemd, watch it and exit non-zero if it dies or hangs.",
    )
    _add_config(serve)
    serve.add_argument(
        "--skip-preflight",
        action="store_true",
        help="do not run the host checks (for the simulator and emergencies)",
    )
    check = commands.add_parser(
        "check",
        help="run the host checks only",
        description="One line per check: PASS, WARN or FAIL, with the fix for each problem. "
        "Exit 1 if any check fails.",
    )
    _add_config(check)
    command = commands.add_parser(
        "command",
        help="print the engine's command line and environment",
        description="Print the exact argv and environment 'serve' would use, shell-quoted.",
    )
    _add_config(command)
    commands.add_parser(
        "sim",
        help="run the engine simulator (see 'qwen38-engine sim --help')",
        add_help=False,
    )
    return parser


def _run_sim(argv: Sequence[str]) -> int:
    # Imported here: the simulator pulls in aiohttp's server side, which the other commands
    # do not need.
    from engine import sim

    parser = argparse.ArgumentParser(
        prog="qwen38-engine sim",
        description="The engine simulator: the 1Cat-vLLM wire protocol on a Unix socket.",
    )
    sim.add_arguments(parser)
    # Like `python -m engine.sim`: vLLM flags it does not know are accepted, with a warning, so
    # any engine.toml runs against it.
    args, unknown = parser.parse_known_args(list(argv))
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
    if flags:
        print(f"qwen38-engine sim: ignoring unknown flags {' '.join(flags)}", file=sys.stderr)
    return int(sim.run(args))


def _load(path_arg: str | None, environ: Mapping[str, str]) -> tuple[Settings, str]:
    path = config_path(path_arg, environ)
    return load_settings(path), str(path)


def _launch(settings: Settings, probes: Probes, cpu_flags: frozenset[str] | None = None) -> Launch:
    """The launch for ``settings``; PCI bus ids among the GPUs are resolved to their UUIDs.

    ``cpu_flags``: this host's, for a ``kv_cache_dtype`` chosen by the CPU (`engine.cpukv`).

    Raises:
        PreflightError: a bus id cannot be resolved.
    """
    engine = settings.engine
    return build_launch(
        engine, visible_devices=resolve_devices(engine.devices, probes), cpu_flags=cpu_flags
    )


def _check(args: argparse.Namespace) -> int:
    probes = system_probes()
    try:
        settings, path = _load(args.config, probes.environ)
    except ConfigError as exc:
        print(f"FAIL config: {exc}", file=sys.stdout)
        return EXIT_CONFIG
    results = [preflight.config_check(path, settings)]
    results += preflight.run_checks(settings, probes)
    sys.stdout.write(preflight.report(results))
    return EXIT_FAILURE if preflight.failed(results) else EXIT_OK


def _command(args: argparse.Namespace) -> int:
    probes = system_probes()
    try:
        settings, _path = _load(args.config, probes.environ)
        launch = _launch(settings, probes)
    except ConfigError as exc:
        print(f"qwen38-engine: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except PreflightError as exc:
        print(f"qwen38-engine: {exc}; {exc.fix}", file=sys.stderr)
        return EXIT_CONFIG
    sys.stdout.write(launch.render())
    return EXIT_OK


def _serve(args: argparse.Namespace) -> int:
    from engine.logs import configure_logging, get_logger
    from engine.supervise import Supervisor
    from engine.systemd import SystemdNotifier

    configure_logging()
    log = get_logger()
    probes = system_probes()
    try:
        settings, path = _load(args.config, probes.environ)
    except ConfigError as exc:
        log.error("config_invalid", error=str(exc))
        return EXIT_CONFIG
    log.info("config", path=path, loaded=settings.source is not None)
    if args.skip_preflight:
        log.warning("preflight", skipped=True)
    else:
        results = preflight.run_checks(settings, probes)
        levels = {"PASS": log.info, "WARN": log.warning, "FAIL": log.error}
        for result in results:
            levels[result.status](
                "preflight",
                check=result.name,
                status=result.status,
                detail=result.detail,
                fix=result.fix or None,
            )
        if preflight.failed(results):
            log.error("preflight_failed", failed=[r.name for r in results if r.status == "FAIL"])
            return EXIT_FAILURE
    flags = read_cpu_flags()
    configured = settings.engine.kv_cache_dtype
    choice = resolve_kv_cache_dtype(configured, flags)
    if choice.reason:
        log.info("kv_cache_dtype", configured=configured, chosen=choice.dtype, reason=choice.reason)
    try:
        launch = _launch(settings, probes, flags)
    except PreflightError as exc:
        log.error("gpu_unresolved", error=str(exc), fix=exc.fix)
        return EXIT_CONFIG
    notifier = SystemdNotifier(os.environ.get("NOTIFY_SOCKET"))
    try:
        supervisor = Supervisor(settings, launch, environ=os.environ, notifier=notifier, log=log)
        return asyncio.run(supervisor.run())
    finally:
        notifier.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``qwen38-engine`` and ``python -m engine``; returns the exit status.

    0 success; 1 preflight failure or engine failure; 2 invalid configuration.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["sim"]:
        return _run_sim(args_list[1:])
    args = build_parser().parse_args(args_list)
    handlers = {"serve": _serve, "check": _check, "command": _command}
    return handlers[args.command](args)
