"""Per-request overhead of the rate limiter (memory and Redis) and of the admission queue.

Run: ``python -m tests.perf.bench_limits [--requests N] [--redis-url URL]``. Without
``--redis-url`` a throwaway ``redis-server`` is started on a free loopback port when the binary
is installed; otherwise the Redis rows are skipped. Prints one row per measurement: microseconds
per request (wall time / requests) and requests per second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry

from gateway.admission import AdmissionQueue
from gateway.config import RatelimitSettings, Settings, TenantSettings
from gateway.limiter import create_rate_limiter
from gateway.metrics import Metrics
from gateway.ratelimit import RateLimiter

# Limits no benchmark request reaches: the cost measured is the check, never a refusal.
TENANT = TenantSettings(name="bench", rpm=10**9, tpm=10**12, concurrency=100_000)


@contextlib.contextmanager
def redis_server() -> Iterator[str | None]:
    """A throwaway redis-server's URL, or None when the binary is not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="q38b-", dir="/tmp")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)


async def timed(requests: int, concurrency: int, one: Callable[[], Awaitable[None]]) -> float:
    """Seconds to run ``one`` ``requests`` times, ``concurrency`` at a time."""

    async def worker(count: int) -> None:
        for _ in range(count):
            await one()

    share, extra = divmod(requests, concurrency)
    start = time.perf_counter()
    await asyncio.gather(*(worker(share + (i < extra)) for i in range(concurrency)))
    return time.perf_counter() - start


def limiter_round(limiter: RateLimiter) -> Callable[[], Awaitable[None]]:
    """One request's limiter work: reserve, then settle to a different token count."""

    async def one() -> None:
        reservation = await limiter.reserve(TENANT, 1200)
        await limiter.settle(reservation, 900)

    return one


def queue_round(queue: AdmissionQueue, tenants: int) -> Callable[[], Awaitable[None]]:
    """One request's admission work: enqueue, wait for the slot, yield once (the call), release."""
    counter = iter(range(1 << 62))

    async def one() -> None:
        ticket = queue.enqueue(f"t{next(counter) % tenants}", 1.0, 1200)
        try:
            await ticket.wait()
            await asyncio.sleep(0)
        finally:
            ticket.release()

    return one


async def bench(requests: int, redis_url: str | None) -> list[tuple[str, str, int, float]]:
    rows: list[tuple[str, str, int, float]] = []
    backends = [("memory", Settings())]
    if redis_url is not None:
        redis_settings = RatelimitSettings(backend="redis", redis_url=redis_url)
        backends.append(("redis", Settings(ratelimit=redis_settings)))
    for name, settings in backends:
        limiter = create_rate_limiter(settings, Metrics(CollectorRegistry()))
        await limiter.start()
        count = requests if name == "memory" else max(1, requests // 10)
        try:
            await timed(min(count, 200), 1, limiter_round(limiter))  # warm up
            for concurrency in (1, 32):
                elapsed = await timed(count, concurrency, limiter_round(limiter))
                rows.append((name, f"reserve+settle, {concurrency} at once", count, elapsed))
        finally:
            await limiter.close()
    for max_concurrency, concurrency, label in (
        (64, 1, "enqueue+wait+release, granted at once"),
        (1, 32, "enqueue+wait+release, 32 waiting for 1 slot"),
    ):
        queue = AdmissionQueue(max_concurrency, 1024, 60.0, Metrics(CollectorRegistry()))
        elapsed = await timed(requests, concurrency, queue_round(queue, tenants=8))
        rows.append(("queue", label, requests, elapsed))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000, help="requests per measurement")
    parser.add_argument("--redis-url", help="an existing Redis (default: start a throwaway one)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(redis_server())
        rows = asyncio.run(bench(args.requests, url))
    print(f"{'backend':<8} {'operation':<46} {'requests':>9} {'us/request':>11} {'requests/s':>11}")
    for backend, label, count, elapsed in rows:
        per = elapsed / count
        print(f"{backend:<8} {label:<46} {count:>9} {per * 1e6:>11.1f} {1 / per:>11.0f}")
    if url is None:
        print("redis    skipped: redis-server not installed and no --redis-url given")


if __name__ == "__main__":
    main()
