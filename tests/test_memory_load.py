"""Memory bounds under the load that fills them, held in the gateway process's real memory
(``VmRSS``/``VmHWM`` of ``/proc/<pid>/status``): per-stream buffers of many slow readers of large
events, the request bodies held before and at the engine, the ledger's buffer while its file
cannot be written. A real gateway process in front of the engine simulator."""

from __future__ import annotations

import contextlib
import json
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.ledger import RECORD_BYTES
from tests.conftest import ALIAS, KEY_A, KEY_B, Gateway, wait_until

pytestmark = pytest.mark.slow(50)

MIB = 1024 * 1024
# What a gateway's RSS moves by without any held data: allocator arenas, a request's own
# working memory, the interpreter's caches (measured 2-6 MiB over these runs).
BASELINE_SLACK_KIB = 12 * 1024


def status_kib(pid: int, field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of ``/proc/<pid>/status`` in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} line")


class PeakWatch:
    """The largest growth of a process's RSS over its value at the start, sampled every 20 ms
    in a thread, and the growth of its ``VmHWM`` (the kernel's own peak) at the end."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = status_kib(pid, "VmRSS")
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, status_kib(self.pid, "VmRSS") - self.before)
            time.sleep(0.02)

    def __enter__(self) -> PeakWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, status_kib(self.pid, "VmHWM") - self.before)


def raw_post(gw: Gateway, path: str, body: dict[str, Any], rcvbuf: int = 4096) -> socket.socket:
    """Send one request on a socket with a small receive buffer; the caller reads (or not)."""
    raw = json.dumps(body).encode()
    host, port = gw.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {KEY_A}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    )
    sock.sendall(head.encode() + raw)
    return sock


def health_ms(gw: Gateway) -> float:
    """Milliseconds one ``GET /health`` took (it must answer 200)."""
    started = time.monotonic()
    r = httpx.get(gw.url("/health"), timeout=10)
    assert r.status_code == 200
    return (time.monotonic() - started) * 1000


STREAMS = 12
EVENT_CAP = 1 * MIB
# One stream holds the event being assembled (at most engine.max_event_bytes, and its copy
# while a read is appended to it) and the event written but not yet read by its client, plus
# its socket buffers (aiohttp's 64 KiB client read limit, asyncio's 256 KiB reads).
PER_STREAM_BOUND = 3 * EVENT_CAP + 320 * 1024


def test_c30_slow_readers_of_large_events_hold_at_most_their_per_stream_bound(
    sim_factory, gateway_factory
) -> None:
    """12 streams of 128 KiB events, each read slowly (one ``recv`` of at most 16 KiB every
    20 ms on a 4 KiB receive buffer): the gateway's RSS grows by at most twice
    12 x (3 x max_event_bytes + 320 KiB), every stream ends (whole, or cut at the event cap),
    and /health answers.

    The readers' pace is the kernel's: with so small a buffer a ``recv`` returns 2-4 KiB, so a
    whole stream (about 6 MB) takes 30-62 s. A reader gives up only after 80 s, or after 10 s
    without a byte (a stalled stream)."""
    sim = sim_factory()
    gw = gateway_factory(
        sim, {"engine": {"max_event_bytes": EVENT_CAP, "max_concurrency": STREAMS}}
    )
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Write a long answer."}],
        "stream": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "sim": {"completion_tokens": 48, "token_bytes": 128 * 1024, "tokens_per_second": 5},
    }
    received = [0] * STREAMS
    tails = [b""] * STREAMS

    def read_slowly(index: int, sock: socket.socket) -> None:
        deadline = time.monotonic() + 80
        with sock:
            sock.settimeout(10)
            while time.monotonic() < deadline:
                try:
                    data = sock.recv(16 * 1024)
                except OSError:
                    return
                received[index] += len(data)
                tails[index] = (tails[index] + data)[-4096:]
                if not data or data.endswith(b"0\r\n\r\n"):
                    return
                time.sleep(0.02)

    with PeakWatch(gw.proc.pid) as watch:
        socks = [raw_post(gw, "/v1/chat/completions", body) for _ in range(STREAMS)]
        readers = [threading.Thread(target=read_slowly, args=(i, s)) for i, s in enumerate(socks)]
        for reader in readers:
            reader.start()
        time.sleep(1.0)
        probe = health_ms(gw)
        for reader in readers:
            reader.join(95)
    total = sum(received)
    done = sum(b"[DONE]" in tail for tail in tails)
    cut = sum(b"upstream_error" in tail for tail in tails)
    print(
        f"RSS growth peak {watch.peak} KiB, {total} bytes relayed, {done} streams whole, "
        f"{cut} cut at max_event_bytes, /health {probe:.0f} ms"
    )
    assert done + cut == STREAMS
    assert total > STREAMS * 2 * MIB, f"only {total} bytes reached the readers"
    bound_kib = 2 * STREAMS * PER_STREAM_BOUND // 1024 + BASELINE_SLACK_KIB
    assert watch.peak < bound_kib, f"gateway RSS grew {watch.peak} KiB (bound {bound_kib})"
    health_ms(gw)


BODIES_BOUND = 32 * MIB
FLOOD = 30
# One body of about 3.7 MB: 20,000 messages of 150 characters, an agent's long history (its
# parsed form takes some 2.5 times its bytes, 4 times while it is parsed).
LONG_CONTEXT = 16_000_000  # the flood's prompts fit the engine's context
FLOOD_BODY = {
    "model": ALIAS,
    "messages": [{"role": "user", "content": f"{i:06d} " + "x" * 143} for i in range(20_000)],
    "max_tokens": 2,
    "sim": {"completion_tokens": 2},
}


def engine_held(gw: Gateway) -> tuple[socket.socket, threading.Thread]:
    """A stream that holds the engine's one slot, read by a thread until its socket closes."""
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Hold the engine."}],
        "stream": True,
        "sim": {"completion_tokens": 100_000, "tokens_per_second": 20},
    }
    sock = raw_post(gw, "/v1/chat/completions", body, rcvbuf=65536)

    def drain() -> None:
        try:
            while sock.recv(65536):
                pass
        except OSError:
            pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    return sock, reader


def test_c27_flood_of_large_bodies_stays_within_bodies_max_bytes(
    sim_factory, gateway_factory
) -> None:
    """30 requests of 3.7 MB bodies arrive at once while the engine's one slot is held: the
    gateway queues what fits server.bodies_max_bytes = 32 MiB and refuses the rest
    (503, or 429 ``memory`` for a tenant past its share) in OpenAI's shape, its RSS grows by at
    most twice the bound, /health answers, and every queued request is served afterwards."""
    sim = sim_factory("--max-model-len", str(LONG_CONTEXT))
    gw = gateway_factory(
        sim,
        {
            "server": {"bodies_max_bytes": BODIES_BOUND},
            "engine": {"max_model_len": LONG_CONTEXT},
        },
    )
    raw = json.dumps(FLOOD_BODY).encode()
    holder, reader = engine_held(gw)
    assert wait_until(lambda: gw.metric("gateway_engine_in_flight") >= 1, 10)
    results: list[httpx.Response | None] = [None] * FLOOD

    def send(index: int) -> None:
        key = KEY_A if index % 2 else KEY_B
        results[index] = httpx.post(
            gw.url("/v1/chat/completions"),
            content=raw,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            timeout=120,
        )

    with PeakWatch(gw.proc.pid) as watch:
        senders = [threading.Thread(target=send, args=(i,)) for i in range(FLOOD)]
        for sender in senders:
            sender.start()
        # Every request is either refused or waiting in the queue.
        settled = wait_until(
            lambda: sum(r is not None for r in results) + gw.metric("gateway_queue_depth") >= FLOOD,
            60,
        )
        probe = health_ms(gw)
        queued = gw.metric("gateway_queue_depth")
        held = gw.metric("gateway_body_memory_bytes")
        holder.close()  # the engine's slot frees: the queue drains
        for sender in senders:
            sender.join(120)
    reader.join(10)
    statuses = [r.status_code if r is not None else 0 for r in results]
    print(
        f"RSS growth peak {watch.peak} KiB; queued {queued:.0f}, body memory {held:.0f} bytes, "
        f"statuses {sorted(statuses)}, /health {probe:.0f} ms"
    )
    assert settled
    refused = [r for r in results if r is not None and r.status_code in (429, 503)]
    served = [r for r in results if r is not None and r.status_code == 200]
    assert len(refused) + len(served) == FLOOD, statuses
    assert refused and served and len(served) == queued
    for r in refused:
        error = r.json()["error"]
        assert "memory bound" in error["message"] and r.headers["Retry-After"].isdigit()
        if r.status_code == 429:
            assert error["type"] == "memory"
    assert held <= BODIES_BOUND
    # Beside the bound: each uploading connection's socket buffers (asyncio's reads of up to
    # 256 KiB, aiohttp's 128 KiB of payload before it pauses reading)
    # and the one body being parsed (its bytes and text, `gateway.body_memory`).
    bound_kib = (2 * BODIES_BOUND + 2 * len(raw)) // 1024 + FLOOD * 384 + BASELINE_SLACK_KIB
    assert watch.peak < bound_kib, f"gateway RSS grew {watch.peak} KiB (bound {bound_kib})"
    health_ms(gw)


STALLED = 17
STALLED_LENGTH = 33_000_000  # just under max_body_bytes (32 MiB)
UPLOADS_BOUND = 64 * MIB


def stalled_upload(gw: Gateway, key: str, first: bytes) -> socket.socket:
    """Headers promising ``STALLED_LENGTH`` bytes of body, then only ``first``."""
    host, port = gw.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {STALLED_LENGTH}\r\n\r\n"
    )
    sock.sendall(head.encode() + first)
    return sock


def test_c27_stalled_uploads_hold_what_arrived_and_leave_other_tenants_served(
    sim_factory, gateway_factory
) -> None:
    """17 uploads of tenant A send headers with ``Content-Length: 33000000`` and 12 bytes: they
    hold 408 bytes of the 64 MiB bound, and tenant B is served. Each then sends 3 MB and stalls:
    A's uploads stop at its half of the bound (429 ``memory`` for those past it); B is still
    served, B's real 20 MB body (40 MB counted) does not fit beside A's and is refused 503 with
    ``Retry-After`` 60 (the upload idle timeout: only uploads hold the bound); the gateway's RSS
    grows by less than the bound."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"server": {"bodies_max_bytes": UPLOADS_BOUND}})
    head = b'{"model": "q'
    small = {"model": ALIAS, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    auth_b = {"Authorization": f"Bearer {KEY_B}"}
    with PeakWatch(gw.proc.pid) as watch:
        socks = [stalled_upload(gw, KEY_A, head) for _ in range(STALLED)]
        assert wait_until(
            lambda: gw.metric("gateway_body_memory_bytes") == STALLED * 2 * len(head), 10
        ), gw.metric("gateway_body_memory_bytes")
        started = time.monotonic()
        first = httpx.post(gw.url("/v1/chat/completions"), json=small, headers=auth_b, timeout=30)
        first_ms = (time.monotonic() - started) * 1000
        assert first.status_code == 200, first.text

        def push(sock: socket.socket) -> None:
            sock.settimeout(15)
            with contextlib.suppress(OSError):
                sock.sendall(b" " * 3_000_000)

        pushers = [threading.Thread(target=push, args=(sock,)) for sock in socks]
        for pusher in pushers:
            pusher.start()
        for pusher in pushers:
            pusher.join(30)
        refused = gw.metric("gateway_rate_limited_total", limit="memory")
        held = gw.metric("gateway_body_memory_bytes")
        second = httpx.post(gw.url("/v1/chat/completions"), json=small, headers=auth_b, timeout=30)
        large = dict(small, messages=[{"role": "user", "content": "a" * 20_000_000}])
        third = httpx.post(gw.url("/v1/chat/completions"), json=large, headers=auth_b, timeout=60)
        for sock in socks:
            sock.close()
    print(
        f"RSS growth peak {watch.peak} KiB; B's first answer {first.status_code} in "
        f"{first_ms:.0f} ms; A's uploads of 3 MB: {refused:.0f} refused, {held:.0f} bytes held; "
        f"B's next {second.status_code}, B's 20 MB body {third.status_code} "
        f"Retry-After {third.headers.get('Retry-After')}"
    )
    assert refused > 0 and held <= UPLOADS_BOUND // 2
    assert second.status_code == 200, second.text
    assert third.status_code == 503 and "memory bound" in third.json()["error"]["message"]
    assert third.headers["Retry-After"] == "60"
    assert wait_until(lambda: gw.metric("gateway_body_memory_bytes") == 0, 10)
    bound_kib = UPLOADS_BOUND // 1024 + STALLED * 384 + BASELINE_SLACK_KIB
    assert watch.peak < bound_kib, f"gateway RSS grew {watch.peak} KiB (bound {bound_kib})"


LEDGER_PENDING = 2000
LEDGER_FLOOD = 6000


def test_c27_ledger_buffer_holds_max_pending_while_its_file_is_locked(sim_factory, gateway_factory):
    """With the ledger's file locked by another process (every write hangs 5 s, then fails),
    6,000 finished requests keep ledger.max_pending = 2,000 records: RSS grows by at most twice
    2,000 x RECORD_BYTES beside the baseline, the 4,000 dropped are counted and logged with
    their tokens, /health answers, and the 2,000 newest are committed once the lock goes."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"ledger": {"max_pending": LEDGER_PENDING}})
    path = Path(gw.config_path.parent / "gw-usage.sqlite3")
    # A refused body is still a model request with its record: the cheapest one to finish.
    bad = json.dumps({"model": ALIAS, "messages": [{"role": "user", "content": "Hi"}],
                      "temperature": -1}).encode()  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    with httpx.Client(timeout=30) as client:  # warm: one request's working memory is in RSS
        for _ in range(200):
            assert (
                client.post(
                    gw.url("/v1/chat/completions"), content=bad, headers=headers
                ).status_code
                == 400
            )
    assert wait_until(lambda: gw.metric("gateway_ledger_records_total") >= 200, 10)
    blocker = sqlite3.connect(path, isolation_level=None, timeout=10)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        done = [0]

        def flood(count: int) -> None:
            with httpx.Client(timeout=30) as client:
                for _ in range(count):
                    r = client.post(gw.url("/v1/chat/completions"), content=bad, headers=headers)
                    assert r.status_code == 400
                    done[0] += 1

        with PeakWatch(gw.proc.pid) as watch:
            workers = [threading.Thread(target=flood, args=(LEDGER_FLOOD // 4,)) for _ in range(4)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(120)
            probe = health_ms(gw)
        assert done[0] == LEDGER_FLOOD
        dropped = gw.metric("gateway_ledger_dropped_records_total")
        pending = gw.metric("gateway_ledger_pending_records")
        print(f"RSS growth peak {watch.peak} KiB, dropped {dropped:.0f}, pending {pending:.0f}, "
              f"/health {probe:.0f} ms")  # fmt: skip
        assert dropped == LEDGER_FLOOD - LEDGER_PENDING and pending == LEDGER_PENDING
        bound_kib = 2 * LEDGER_PENDING * RECORD_BYTES // 1024 + BASELINE_SLACK_KIB
        assert watch.peak < bound_kib, f"gateway RSS grew {watch.peak} KiB (bound {bound_kib})"
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert wait_until(lambda: gw.metric("gateway_ledger_records_total") >= 200 + LEDGER_PENDING, 30)

    def logged() -> list[dict[str, Any]]:
        return [e for e in gw.logs() if e.get("event") == "ledger_records_dropped"]

    assert wait_until(
        lambda: sum(e["records"] for e in logged()) >= LEDGER_FLOOD - LEDGER_PENDING, 10
    )
    assert sum(e["records"] for e in logged()) == LEDGER_FLOOD - LEDGER_PENDING
    assert all(set(e["tokens"]) == {"acme"} for e in logged())
