"""In-process stack: the simulator's app on a short Unix socket and the gateway app, one loop.

The gateway is the app of `gateway.app.create_app`, driven through pytest-aiohttp's client; the
engine is the simulator's app (`engine.sim.app.build_app`) served by an `AppRunner` on a Unix
socket in the same event loop. Nothing is stubbed: the gateway's aiohttp client talks to the
simulator over a real socket, so every branch of the model path runs as in production, in
milliseconds instead of the seconds a process takes to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from engine.sim.app import build_app
from engine.sim.options import Behaviour, SimOptions
from gateway.app import create_app
from gateway.config import Settings, load_settings
from gateway.keys_file import load_keys_file
from gateway.state import ENGINE_STATE
from tests.clock import FakeClock
from tests.conftest import ALIAS, DEFAULT_KEYS, KEY_A, to_toml, write_keys

ENGINE_MODEL = "qwen3.8-27b-engine"
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}


@contextlib.contextmanager
def short_tempdir(prefix: str = "q38i-") -> Iterator[Path]:
    """A private temp directory under /tmp (Unix socket paths must stay under ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class SimServer:
    """The simulator's app served on ``socket`` in this event loop."""

    socket: str
    app: web.Application
    runner: web.AppRunner
    record: Path

    def model_records(self) -> list[dict[str, Any]]:
        """Model requests the simulator received (``--record`` lines; probes, counts excluded)."""
        if not self.record.exists():
            return []
        lines = [json.loads(line) for line in self.record.read_text().splitlines() if line]
        return [r for r in lines if r.get("path") not in ("/health", "/metrics", "/tokenize")]

    async def stop(self) -> None:
        """Stop serving; the socket path is removed (the engine is gone)."""
        await self.runner.cleanup()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)


async def start_sim(directory: Path, **behaviour: Any) -> SimServer:
    """Serve the simulator (served name `ENGINE_MODEL`, no pacing unless ``behaviour`` sets it)."""
    socket = str(directory / "e.sock")
    record = directory / "sim.jsonl"
    options = SimOptions(
        socket=socket,
        model=ENGINE_MODEL,
        served_model_names=(ENGINE_MODEL,),
        record=str(record),
        behaviour=Behaviour(**{"tokens_per_second": 0.0, **behaviour}),
    )
    app = build_app(options)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.UnixSite(runner, socket).start()
    return SimServer(socket=socket, app=app, runner=runner, record=record)


def write_config(directory: Path, overrides: dict[str, Any] | None = None) -> Path:
    """Write the gateway's TOML (tenants acme and beta) over ``directory``'s engine socket."""
    base: dict[str, Any] = {
        "engine": {
            "socket": str(directory / "e.sock"),
            "model": ENGINE_MODEL,
            "health_interval_s": 0.05,
        },
        "model": {"alias": ALIAS},
        "auth": {"keys_file": str(directory / "keys.env"), "reload_poll_s": 60.0},
        "metrics": {"enabled": False},
        "ledger": {"path": str(directory / "usage.sqlite3")},
        "quarantine": {"state_file": str(directory / "quarantine.json")},
        "tenants": {
            "default": {"rpm": 10_000, "tpm": 100_000_000, "concurrency": 64},
            "acme": {},
            "beta": {},
        },
    }
    for section, values in (overrides or {}).items():
        if section == "tenants":
            for tenant, table in values.items():
                base["tenants"].setdefault(tenant, {}).update(table)
        else:
            base.setdefault(section, {}).update(values)
    path = directory / "gw.toml"
    path.write_text(to_toml(base))
    return path


ClientFactory = Callable[..., Any]


@dataclass
class Stack:
    """A gateway client over an in-process simulator, and what the tests inspect."""

    client: TestClient[Any, Any]
    sim: SimServer | None
    directory: Path
    config_path: Path
    clock: FakeClock | None

    @property
    def app(self) -> web.Application:
        """The gateway application."""
        return self.client.server.app  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def open_stack(
    aiohttp_client: ClientFactory,
    config: dict[str, Any] | None = None,
    *,
    sim: bool = True,
    clock: FakeClock | None = None,
    handler_cancellation: bool = False,
    **behaviour: Any,
) -> AsyncIterator[Stack]:
    """The simulator (unless ``sim`` is False) and a gateway client, the engine ready;
    ``handler_cancellation``: a client closing its connection cancels the gateway's handler, as
    under `gateway.server` (pytest-aiohttp's server does not by default)."""
    with short_tempdir() as directory:
        write_keys(directory / "keys.env", DEFAULT_KEYS)
        config_path = write_config(directory, config)
        server = await start_sim(directory, **behaviour) if sim else None
        try:
            settings: Settings = load_settings(config_path)
            extra: dict[str, Any] = {} if clock is None else {"clock": clock}
            app = create_app(
                settings,
                keys=load_keys_file(settings.auth.keys_file),
                config_path=str(config_path),
                **extra,
            )
            server_kwargs = {"handler_cancellation": True} if handler_cancellation else {}
            client = await aiohttp_client(app, server_kwargs=server_kwargs)
            if server is not None:
                await wait_ready(app)
            yield Stack(client, server, directory, config_path, clock)
        finally:
            if server is not None:
                await server.stop()


async def wait_ready(app: web.Application, timeout: float = 5.0) -> None:
    """Wait until the gateway's health poller saw the engine ready."""
    state = app[ENGINE_STATE]
    assert await state.wait_ready(timeout), f"engine not ready: {state.status}"


def sse_data(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    events = raw.decode().replace("\r\n", "\n").split("\n\n")
    return [line[6:] for event in events for line in event.split("\n") if line.startswith("data: ")]


def chat_body(**fields: Any) -> dict[str, Any]:
    """A small chat request; ``fields`` override or add (``sim`` steers the simulator)."""
    return {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], **fields}


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` every 10 ms until true or ``timeout`` seconds passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True
