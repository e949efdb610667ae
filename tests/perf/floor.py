"""The least an aiohttp relay costs: the ``aiohttp-floor`` row of the relay benchmark.

A streaming proxy on aiohttp and uvloop, as the gateway runs them, doing nothing else: read the
client's body, POST it unchanged to the engine over the gateway's own engine link
(`gateway.engine_http.EnginePool`, the Unix socket), and relay each engine read as one client
write. No authentication, parsing, limits, queue, rewrites, usage, metrics or access log. Beside
the nginx and gateway rows it splits the gateway's added TTFT and CPU into what aiohttp and the
event loop cost by themselves and what the gateway's own work costs (`tests/perf/README.md`).

Run: ``python -m tests.perf.floor --config FILE`` (a gateway config: ``server.host``,
``server.port`` and ``engine.socket`` are read); ``GET /ready`` answers 200 once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import tomllib
import uvloop
from aiohttp import web

from gateway.engine_http import EnginePool

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
POOL = web.AppKey("pool", EnginePool)


async def relay(request: web.Request) -> web.StreamResponse:
    """POST the body to the engine's ``/v1/chat/completions``; relay its answer read by read."""
    pool = request.app[POOL]
    body = await request.read()
    connection = await pool.acquire()
    head = pool.head(
        "POST", "/v1/chat/completions", {"Content-Type": "application/json"}, len(body)
    )
    connection.send(head, body)
    try:
        await connection.read_head(60.0)
        response = web.StreamResponse(status=connection.status, headers=SSE_HEADERS)
        await response.prepare(request)
        while data := await connection.read(60.0):
            await response.write(data)
    except BaseException:
        connection.abort()
        raise
    finally:
        pool.release(connection)
    await response.write_eof()
    return response


async def ready(request: web.Request) -> web.Response:
    """200: listening."""
    return web.json_response({"ready": True})


async def serve(host: str, port: int, socket: str) -> None:
    """Listen on ``host:port`` until cancelled."""
    app = web.Application()
    app[POOL] = EnginePool(socket, "", idle_s=4.0, connect_timeout_s=5.0)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/ready", ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    await asyncio.Event().wait()


def main() -> None:
    """Read the config's address and engine socket; serve."""
    parser = argparse.ArgumentParser(prog="python -m tests.perf.floor", description=__doc__)
    parser.add_argument("--config", required=True, type=Path)
    config = tomllib.loads(parser.parse_args().config.read_text())
    server = config["server"]
    uvloop.run(serve(server["host"], server["port"], config["engine"]["socket"]))


if __name__ == "__main__":
    main()
