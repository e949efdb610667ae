"""An engine on another host: ``[[engines]] url = "https://..."`` reached over verified TLS.

The engine host is stood in for by a TLS terminator on 127.0.0.1 (a certificate of a throw-away
CA) in front of a simulator's Unix socket, as a reverse proxy beside vLLM would be on a GPU host.
The gateway trusts that CA through ``SSL_CERT_FILE`` (OpenSSL's default verify paths, which
aiohttp's default TLS context loads), as an operator's private CA would be installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ALIAS, KEY_A, Gateway, Sim, wait_until
from tests.test_fleet_engines import engine_states
from tests.tls_certs import make_ca


class TlsForwarder:
    """``https://127.0.0.1:port`` forwarding each connection's bytes to a Unix socket, in a
    thread of its own (its own event loop)."""

    def __init__(self, cert: Path, key: Path, socket: str) -> None:
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(cert, key)
        self._socket = socket
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0
        self.connections = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._context)
        )
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_unix_connection(self._socket)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def __enter__(self) -> TlsForwarder:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def remote(sim_factory: Callable[..., Sim], workdir: Path) -> Iterator[tuple[TlsForwarder, Path]]:
    """A simulator behind a TLS terminator; the CA bundle that verifies it."""
    sim = sim_factory("--completion-tokens", "12", name="far")
    ca = make_ca(workdir)
    cert, key = workdir / "engine.pem", workdir / "engine.key"
    ca.issue(cert, key, common_name="gpu-host")
    with TlsForwarder(cert, key, sim.socket) as forwarder:
        yield forwarder, ca.bundle


def test_an_engine_on_another_host_is_served_over_verified_tls(
    remote: tuple[TlsForwarder, Path], gateway_factory: Callable[..., Gateway]
) -> None:
    """Health, streamed and whole answers, the engine's name in /ready, metrics and the ledger,
    all through ``https://``; the connections are kept alive and reused."""
    forwarder, bundle = remote
    url = f"https://127.0.0.1:{forwarder.port}"
    gw = gateway_factory(
        None,
        {"engines": [{"name": "far", "url": url}]},
        env={"SSL_CERT_FILE": str(bundle)},
    )
    assert engine_states(gw) == {"far": "ready"}
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0)
    messages = [{"role": "user", "content": "hello from afar"}]
    stream = client.chat.completions.create(
        model=ALIAS, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    whole = client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=5)
    assert whole.choices[0].finish_reason == "length" and whole.usage is not None
    assert gw.metric("gateway_engine_requests_total", engine="far") >= 2
    assert wait_until(lambda: gw.metric("gateway_ledger_records_total") >= 2, 5)
    # Health probes and both requests went over a few kept-alive TLS connections.
    assert 1 <= forwarder.connections < 10
    client.close()


def test_an_engine_whose_certificate_is_not_trusted_is_never_used(
    remote: tuple[TlsForwarder, Path], gateway_factory: Callable[..., Gateway]
) -> None:
    """Without the CA the engine's certificate fails verification: the engine is not ready
    and a request gets 503, not an answer from an unverified host."""
    forwarder, _ = remote
    url = f"https://127.0.0.1:{forwarder.port}"
    gw = gateway_factory(None, {"engines": [{"name": "far", "url": url}]}, wait_ready=False)
    assert not wait_until(lambda: engine_states(gw).get("far") == "ready", 2)
    answer = httpx.post(
        gw.url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {KEY_A}"},
        json={"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert answer.status_code == 503, answer.text
    assert "hello" not in answer.text
