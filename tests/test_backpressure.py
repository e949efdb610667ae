"""Back-pressure: a client that stops reading does not grow the gateway, whatever the engine does."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import ALIAS, KEY_A, Gateway, Sim

# 16,000 tokens padded to 1 KiB each: an answer of about 20 MB of SSE.
ANSWER_TOKENS = 16_000
TOKEN_BYTES = 1024
# The gateway may hold its socket buffers (aiohttp's 64 KiB read and write limits, asyncio's
# reads of up to 256 KiB in which a lagging engine's merged event arrives), the one event it is
# framing (at most `engine.max_event_bytes`, 8 MiB: a loaded machine lets the engine merge
# that much before the client's buffer fills) and some allocator slack; never the 20 MB answer.
MAX_RSS_GROWTH_KIB = 12 * 1024


def rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` in KiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS line")


def generated_tokens(sim: Sim) -> float:
    """``vllm:generation_tokens_total`` from the simulator's ``/metrics`` (over its socket)."""
    transport = httpx.HTTPTransport(uds=sim.socket)
    with httpx.Client(transport=transport, timeout=5) as client:
        text = client.get("http://engine/metrics").text
    for line in text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def stalled_client(gw: Gateway, body: dict[str, Any]) -> socket.socket:
    """Send one streamed request on a socket with a small receive buffer and never read it."""
    raw = json.dumps(body).encode()
    host, port = gw.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {KEY_A}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    )
    sock.sendall(head.encode() + raw)
    return sock


def test_client_that_does_not_read_leaves_the_gateway_flat(sim_factory, gateway_factory) -> None:
    """A stalled reader: the engine generates on, as vLLM does (its API server merges what it
    cannot send into one event), while the gateway holds back at its socket buffers and its
    RSS stays flat."""
    sim = sim_factory()
    gw = gateway_factory(sim)
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Write a long answer."}],
        "stream": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "sim": {"completion_tokens": ANSWER_TOKENS, "token_bytes": TOKEN_BYTES},
    }
    before = rss_kib(gw.proc.pid)
    sock = stalled_client(gw, body)
    try:
        deadline = time.monotonic() + 20
        last = 0.0
        while last < ANSWER_TOKENS and time.monotonic() < deadline:  # the engine runs on
            time.sleep(0.2)
            last = generated_tokens(sim)
        assert last == ANSWER_TOKENS, f"engine generated {last} of {ANSWER_TOKENS} tokens"
        growth = 0
        for _ in range(6):  # the engine's merged remainder waits at the gateway's door
            time.sleep(0.5)
            growth = max(growth, rss_kib(gw.proc.pid) - before)
        assert growth < MAX_RSS_GROWTH_KIB, f"gateway RSS grew {growth} KiB"
    finally:
        sock.close()
