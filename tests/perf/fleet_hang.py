"""The ``fleet`` section's hang: an engine stopped (SIGSTOP) under a session's next turn.

A stopped engine accepts connections and reads nothing, as a hung process or a stuck GPU does;
the gateway takes it out of rotation at its first unanswered probe (``rotation_timeout_s``) and
moves the turn it never read to another engine (`gateway.failover`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import aiohttp
import httpx

from tests.conftest import Gateway, Sim
from tests.perf.fleet import _KEYS, CHAT_PATH, _home_of, _records, _Session


def _in_rotation(gw: Gateway, name: str) -> bool:
    return bool(httpx.get(gw.url("/ready"), timeout=2).json()["engines"][name]["in_rotation"])


async def hang(
    gw: Gateway, sims: list[Sim], sessions: list[_Session], skip: str
) -> tuple[float, str, str, float, float]:
    """Stop (SIGSTOP) the live engine of a session other than ``skip``'s and send that
    session's next turn at once; (seconds to its first byte, stopped engine, serving engine,
    seconds to out of rotation, seconds from SIGCONT to back in rotation)."""
    homes = _home_of(_records(sims))
    alive = {f"e{i}" for i, sim in enumerate(sims) if sim.proc.poll() is None}
    session = next(s for s in sessions if s.key != skip and homes.get(s.key, (0, ""))[1] in alive)
    victim = int(homes[session.key][1][1:])
    name = f"e{victim}"
    headers = {
        "Authorization": f"Bearer {_KEYS[session.tenant]}",
        "X-Request-Id": f"{session.key}.{session.turn}",
    }
    out: list[float] = []

    def watch() -> None:
        while time.monotonic() - stopped < 10 and _in_rotation(gw, name):
            time.sleep(0.01)
        out.append(time.monotonic() - stopped)

    async with aiohttp.ClientSession() as http:
        os.kill(sims[victim].proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            async with http.post(gw.url(CHAT_PATH), json=session.body(), headers=headers) as resp:
                await resp.content.readany()
                first_byte = time.monotonic() - stopped
                await resp.read()
            watcher.join(10)
        finally:
            os.kill(sims[victim].proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    while time.monotonic() - resumed < 10 and not _in_rotation(gw, name):
        time.sleep(0.01)
    back = time.monotonic() - resumed
    for _ in range(50):
        homes = _home_of(_records(sims))
        if homes.get(session.key, (-1, ""))[0] == session.turn:
            break
        await asyncio.sleep(0.1)
    by = homes.get(session.key, (0, "?"))[1]
    return first_byte, name, by, out[0] if out else float("inf"), back
