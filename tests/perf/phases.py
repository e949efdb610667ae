"""Where a request's time goes before its first byte: the gateway's stages timed one by one.

``python -m tests.perf.phases [REQUESTS [TOKENS]]``: one simulator (0 ms per token, 256 tokens unless
TOKENS says) and one gateway with
production's ``engine.max_concurrency = 1``; a client sends streamed chat requests one at a time
(c=1) and the gateway, started through this module's ``serve`` wrapper, times its stages per
request with ``time.perf_counter`` around the functions that do them:

- ``auth``: `gateway.auth.Authenticator.authenticate`;
- ``rewrite``: `gateway.proxy.plan_call` (read and parse the body, validate, rewrite);
- ``limits``: the quota and rate-limit reservations (`gateway.budget.reserve_budgets`);
- ``queue``: the admission ticket's wait (`gateway.admission.Ticket.wait`);
- ``baseline``: `gateway.settling.take_baseline` (the engine-counter baseline of one slot);
- ``connect``: `gateway.upstream.Upstream.post` (the POST until the engine's headers);
- ``first byte``: from the engine's headers to the first client write of an event;
- ``to first byte``: from the request's context (`context_middleware`) to that write;
- ``arrival``: from the client's send (its ``perf_counter``, the same clock in every process)
  to the request's context: the server's own request path and any work still under way;
- ``after the end``: from the last write of the stream to the handler's return (settling,
  ledger, access log), work the next request of a back-to-back client may wait behind.

Medians and p90 in microseconds over the measured requests, plus the client's TTFT. The timers
cost about 1 µs each. Nothing here is used by the gateway itself.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

PHASES = (
    "auth",
    "rewrite",
    "limits",
    "queue",
    "baseline",
    "connect",
    "first byte",
    "to first byte",
    "arrival",
    "after the end",
)
_current: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "phases", default=None
)
_done: list[dict[str, float]] = []


def _timed_async(name: str, func: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await func(*args, **kwargs)
        finally:
            record = _current.get()
            if record is not None:
                record[name] = record.get(name, 0.0) + time.perf_counter() - started
                if name == "connect":
                    record["_headers"] = time.perf_counter()

    return wrapper


def _timed(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            record = _current.get()
            if record is not None:
                record[name] = record.get(name, 0.0) + time.perf_counter() - started

    return wrapper


def install() -> None:
    """Wrap the stages (see the module doc); the records are written at exit to $PHASES_OUT."""
    import gateway.admission
    import gateway.app
    import gateway.auth
    import gateway.proxy
    import gateway.relay
    import gateway.upstream

    original_context = gateway.app.context_middleware

    async def context_middleware(request: Any, handler: Any) -> Any:
        record: dict[str, float] = {"_start": time.perf_counter()}
        sent = request.headers.get("X-Phases-Sent")
        if sent is not None:
            record["_sent"] = float(sent)
        token = _current.set(record)
        try:
            return await original_context(request, handler)
        finally:
            _current.reset(token)
            record["_return"] = time.perf_counter()
            if "_first" in record and request.path.startswith("/v1/"):
                _done.append(record)

    context_middleware.__middleware_version__ = 1  # type: ignore[attr-defined]
    gateway.app.context_middleware = context_middleware  # type: ignore[assignment]
    auth = gateway.auth.Authenticator
    auth.authenticate = _timed("auth", auth.authenticate)  # type: ignore[method-assign]
    gateway.proxy.plan_call = _timed_async("rewrite", gateway.proxy.plan_call)
    gateway.proxy.reserve_budgets = _timed_async("limits", gateway.proxy.reserve_budgets)
    ticket = gateway.admission.Ticket
    ticket.wait = _timed_async("queue", ticket.wait)  # type: ignore[method-assign]
    if hasattr(gateway.proxy, "take_baseline"):
        gateway.proxy.take_baseline = _timed_async("baseline", gateway.proxy.take_baseline)
    upstream = gateway.upstream.Upstream
    upstream.post = _timed_async("connect", upstream.post)  # type: ignore[method-assign]
    stream = gateway.relay.ClientStream
    original_send = stream.send

    async def send(self: Any, data: bytes) -> None:
        record = _current.get()
        if record is not None and "_first" not in record and data.startswith(b"data:"):
            record["_first"] = time.perf_counter()
        await original_send(self, data)

    stream.send = send  # type: ignore[method-assign]
    original_end = stream.end

    async def end(self: Any, tail: bytes, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original_end(self, tail, *args, **kwargs)
        finally:
            record = _current.get()
            if record is not None:
                record["_end"] = time.perf_counter()

    stream.end = end  # type: ignore[method-assign]

    def dump() -> None:
        out = os.environ.get("PHASES_OUT")
        if out:
            Path(out).write_text(json.dumps(_done))

    atexit.register(dump)


def serve() -> int:
    """``qwen38-gateway serve`` with the stages timed (arguments as ``serve``'s)."""
    install()
    from gateway.cli import main

    return main(["serve", *sys.argv[2:]])


def summarise(records: list[dict[str, float]], skip: int) -> dict[str, tuple[float, float]]:
    """Median and p90 (µs) of every phase over ``records`` after the first ``skip`` (warm-up)."""
    rows = records[skip:]
    out: dict[str, tuple[float, float]] = {}
    for name in PHASES:
        if name == "first byte":
            values = [r["_first"] - r["_headers"] for r in rows if "_headers" in r]
        elif name == "to first byte":
            values = [r["_first"] - r["_start"] for r in rows]
        elif name == "arrival":
            values = [r["_start"] - r["_sent"] for r in rows if "_sent" in r]
        elif name == "after the end":
            values = [r["_return"] - r["_end"] for r in rows if "_end" in r]
        else:
            values = [r.get(name, 0.0) for r in rows]
        if values:
            values.sort()
            out[name] = (
                statistics.median(values) * 1e6,
                values[min(len(values) - 1, int(len(values) * 0.9))] * 1e6,
            )
    return out


async def _drive(url: str, key: str, body: dict[str, Any], count: int) -> list[float]:
    import aiohttp

    ttfts = []
    # A request the timed gateway never ends (its wrappers out of step with the code) fails in
    # 30 s, not aiohttp's 5 minutes.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for _ in range(count):
            started = time.perf_counter()
            headers = {"Authorization": f"Bearer {key}", "X-Phases-Sent": repr(started)}
            async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                first = None
                async for line in r.content:
                    if first is None and line.startswith(b"data:"):
                        first = time.perf_counter() - started
                ttfts.append(first or 0.0)
    return ttfts


def main() -> int:
    """Run the c=1 measurement and print the phase table (µs) of the code in this tree."""
    import signal

    from tests.conftest import KEY_A, start_gateway, start_sim
    from tests.perf.stacks import BENCH_CONFIG, request_body

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    tokens = sys.argv[2] if len(sys.argv) > 2 else "256"
    workdir = Path(tempfile.mkdtemp(prefix="q38ph-", dir="/tmp"))
    try:
        out = workdir / "phases.json"
        sim = start_sim(workdir, "--tokens-per-second", "0", "--completion-tokens", tokens)
        config = {**BENCH_CONFIG, "engine": {**BENCH_CONFIG["engine"], "max_concurrency": 1}}
        os.environ["PHASES_OUT"] = str(out)
        gw = start_gateway(workdir, sim, config)
        # start_gateway runs ``-m gateway serve``; run this wrapper instead, same config.
        gw.proc.send_signal(signal.SIGTERM)
        gw.proc.wait(15)
        import subprocess

        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.perf.phases", "serve", "--config", str(gw.config_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PHASES_OUT": str(out)},
        )
        try:
            import httpx

            from tests.conftest import wait_until

            def ready() -> bool:
                if proc.poll() is not None:
                    raise RuntimeError("the timed gateway exited")
                try:
                    return httpx.get(gw.url("/ready"), timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            assert wait_until(ready, 30), "the timed gateway did not become ready"
            ttfts = asyncio.run(_drive(gw.base_url, KEY_A, request_body(int(tokens)), count))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            sim.stop()
        records = json.loads(out.read_text())
        skip = min(20, len(records) // 10)
        table = summarise(records, skip)
        load = os.getloadavg()
        print(f"# phases at c=1, {len(records) - skip} requests, load {load[0]:.1f}")
        print("| phase | median µs | p90 µs |")
        print("| --- | --- | --- |")
        for name, (p50, p90) in table.items():
            print(f"| {name} | {p50:.0f} | {p90:.0f} |")
        ttfts.sort()
        print(f"| client TTFT | {statistics.median(ttfts[skip:]) * 1e6:.0f} | - |")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # its logs, ledger, keys and records
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.exit(serve())
    sys.exit(main())
