"""Running the simulator as a process: bind the Unix socket, serve, stop cleanly on a signal."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from engine.sim.app import build_app
from engine.sim.options import SimOptions, add_arguments

# Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are cancelled.
SHUTDOWN_GRACE_S = 3.0
BACKLOG = 1024


def _run_loop(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # uvloop is not built for every platform (setup.cfg)
        return asyncio.run(coro)
    return uvloop.run(coro)


async def serve(options: SimOptions) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit code (1 when the socket cannot be bound).

    Like vLLM (section 1.3) the socket is bound first and listens only once the "model" is
    loaded (`load_s`), so clients get ECONNREFUSED meanwhile; an existing path is an error.
    The socket file is removed on exit.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(
        build_app(options),
        handler_cancellation=True,
        keepalive_timeout=options.keep_alive_s,
        access_log=None,
        shutdown_timeout=SHUTDOWN_GRACE_S,
    )
    await runner.setup()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(options.socket)
    except OSError as exc:
        sock.close()
        await runner.cleanup()
        print(f"engine simulator: cannot bind {options.socket}: {exc}", file=sys.stderr)
        return 1
    try:
        if options.load_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), options.load_s)
        if not stop.is_set():
            # listen before anything else runs: once ready, the socket never refuses
            sock.listen(BACKLOG)
            await web.SockSite(runner, sock, backlog=BACKLOG).start()
            print(f"engine simulator: serving on unix:{options.socket}", file=sys.stderr)
            await stop.wait()
    finally:
        await runner.cleanup()
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(options.socket)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the simulator with options parsed by a parser given `add_arguments`; exit code."""
    return _run_loop(serve(SimOptions.from_args(args)))


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.sim`: parse `argv` (default sys.argv), warn about unknown flags, run."""
    parser = argparse.ArgumentParser(
        prog="python -m engine.sim",
        description="Engine simulator: speaks 1Cat-vLLM's OpenAI API on a Unix socket.",
    )
    add_arguments(parser)
    args, unknown = parser.parse_known_args(argv)
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
    if flags:
        print(f"engine simulator: ignoring unknown flags {' '.join(flags)}", file=sys.stderr)
    return run(args)
