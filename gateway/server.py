"""Running the gateway: startup, serve until a signal, graceful shutdown (uvicorn's phases).

SIGTERM or SIGINT: drain (`serve`); a second signal exits at once. SIGHUP: reload config, keys
and TLS certificates.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
import time
from typing import Any

import structlog
from aiohttp import web

from gateway.app import create_app
from gateway.config import ConfigError, Settings, listener_problem
from gateway.drain import Drain
from gateway.exposition import create_metrics_app
from gateway.http_errors import GatewayRunner
from gateway.retries import FLIGHTS
from gateway.state import ADMISSION, DRAIN, LIVE, METRICS, RELOADER
from gateway.tls import TlsFiles

log = structlog.get_logger("gateway")


def install_uvloop() -> None:
    """Use uvloop's event loop when installed (cheaper socket I/O for the relay)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def serve(settings: Settings, config_path: str | None) -> int:
    """Run the public and metrics listeners until SIGTERM/SIGINT; returns the exit code.

    The drain on SIGTERM/SIGINT (`gateway.drain`): ``/ready`` answers 503 at once and, after
    ``server.drain_delay_s`` of normal service (time for a load balancer to notice), the listeners close and idle keep-alive
    connections with them; queued requests get 503 with ``Retry-After`` at once and new ones the
    same; requests at the engine get ``server.shutdown_grace_s`` to finish, then streams end with
    an SSE error event; the process is gone within the grace plus about 2 s. A second signal
    exits at once.

    Raises:
        gateway.credentials.KeysFileError: the keys file cannot be used (raised before listening).
        gateway.config.ConfigError: plain HTTP on a non-loopback address without
            ``server.plain_http``.
        gateway.tls.TlsError: a configured certificate or key does not load.
        OSError: a listen address is taken.
    """
    problem = listener_problem(settings)
    if problem is not None:
        raise ConfigError(problem)
    server_tls = _tls_files(settings.server.tls_cert_file, settings.server.tls_key_file, "server")
    metrics_tls = _tls_files(
        settings.metrics.tls_cert_file, settings.metrics.tls_key_file, "metrics"
    )
    app = create_app(settings, config_path=config_path)
    drain = app[DRAIN]
    # Thousands of open streams make each full collection of the default thresholds pause the
    # loop ~100 ms (measured with 2,000 slow streams: 112-144 ms stalls); rarer young-generation
    # collections keep every stall under 20 ms and save 4-8% CPU (tests/perf, section slow).
    gc.set_threshold(20_000, 50, 100)
    grace = settings.server.shutdown_grace_s
    runner = GatewayRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=_CLEANUP_S,
        keepalive_timeout=settings.server.keepalive_timeout_s,
    )
    # The handlers are in place before startup (engine leases, Redis) and before the first
    # listener opens: a SIGTERM that arrives as soon as /ready can answer (a supervisor's, a
    # test's) drains and releases instead of killing the process.
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await runner.setup()
    runners: list[web.AppRunner] = [runner]
    watchers: set[asyncio.Task[Any]] = set()
    try:
        await web.TCPSite(
            runner,
            settings.server.host,
            settings.server.port,
            ssl_context=server_tls.context if server_tls else None,
        ).start()
        if settings.metrics.enabled:
            # The same connection handler as the public port: its error pages echo nothing.
            metrics_runner = GatewayRunner(
                create_metrics_app(app), access_log=None, shutdown_timeout=_CLEANUP_S
            )
            await metrics_runner.setup()
            runners.append(metrics_runner)
            await web.TCPSite(
                metrics_runner,
                settings.metrics.host,
                settings.metrics.port,
                ssl_context=metrics_tls.context if metrics_tls else None,
            ).start()
        log.info(
            "gateway_started",
            host=settings.server.host,
            port=settings.server.port,
            tls=server_tls is not None,
            metrics=f"{settings.metrics.host}:{settings.metrics.port}"
            if settings.metrics.enabled
            else None,
            engine_socket=settings.engine.socket,
            config=settings.source,
        )
        tls_files = [t for t in (server_tls, metrics_tls) if t is not None]
        for tls in tls_files:
            watchers.add(loop.create_task(tls.watch(settings.auth.reload_poll_s, app[METRICS])))

        def on_sighup() -> None:
            app[RELOADER].trigger()
            for tls in tls_files:
                task = loop.create_task(tls.reload("signal", app[METRICS]))
                watchers.add(task)
                task.add_done_callback(watchers.discard)

        loop.add_signal_handler(signal.SIGHUP, on_sighup)
        await stop.wait()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _force_exit, drain)
        drain.announce()
        delay = app[LIVE].current.settings.server.drain_delay_s  # a reload may have changed it
        if delay > 0:
            # /ready says 503 while everything is still served: the load balancer's health
            # checks take this gateway out before its listener closes.
            log.info("gateway_drain_announced", delay_s=delay)
            await asyncio.sleep(delay)
        await _drain(app, runners, drain, grace)
    finally:
        for watcher in list(watchers):
            watcher.cancel()
        for r in reversed(runners):
            await r.cleanup()
    log.info("gateway_stopped")
    return 0


# After the grace: time for ended streams to write their error event, then for aiohttp to close
# what is left (each of its two shutdown phases waits up to this long).
_CLEANUP_S = 0.5


def _tls_files(cert_file: str, key_file: str, name: str) -> TlsFiles | None:
    return TlsFiles(cert_file, key_file, name) if cert_file else None


async def _drain(
    app: web.Application, runners: list[web.AppRunner], drain: Drain, grace: float
) -> None:
    """Stop accepting, refuse the queue and newcomers, end the generations no client reads
    (kept for a retry that can no longer come: `Flights.end_orphans`), wait up to ``grace``
    for the rest, end what remains."""
    admission = app[ADMISSION]
    log.info(
        "gateway_draining",
        grace_s=grace,
        in_flight=admission.in_flight,
        queued=admission.depth,
    )
    for r in runners:
        for site in list(r.sites):
            await site.stop()  # the listening sockets close: new connections are refused
        if r.server is not None:
            r.server.pre_shutdown()  # idle keep-alive connections close; busy ones after
    drain.begin()
    refused = admission.close(Drain.error)
    uploads = drain.end_uploads()  # bodies that can no longer arrive
    orphans = app[FLIGHTS].end_orphans()  # no connection can attach to them any more
    deadline = time.monotonic() + grace
    while (admission.in_flight or drain.busy) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    cut = 0
    if admission.in_flight or drain.busy:
        cut = drain.expire()
        end = time.monotonic() + _CLEANUP_S
        while drain.busy and time.monotonic() < end:
            await asyncio.sleep(0.02)
    log.info(
        "gateway_drained",
        queued_refused=refused,
        uploads_refused=uploads,
        orphans_ended=orphans,
        cut_by_shutdown=cut,
    )


def _force_exit(drain: Drain) -> None:
    """The second SIGTERM/SIGINT: exit at once; the requests still open are cut (`Drain.force`)."""
    log.warning("gateway_forced_exit", open_requests=drain.open_requests)
    drain.force()
    sys.exit(1)
