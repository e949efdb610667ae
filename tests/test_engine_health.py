"""The engine is marked down only when proved down: a slow /health during a healthy stream is
ridden out, a dead engine is seen at once, and a slow probe never counts a quarantine death."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx

from tests.conftest import ALIAS, KEY_A, KEY_B, Gateway, wait_until

# A stream of a few seconds, long enough for several probes to time out behind it.
LONG = {"tokens_per_second": 150, "completion_tokens": 600}
# /health answers 1.5 s late while a request generates; the probe gives up after 1 s.
SLOW_HEALTH = ("--health-delay-busy-s", "1.5")


def stream(gw: Gateway, sim: dict[str, Any], key: str = KEY_A) -> tuple[int, list[str]]:
    """Stream one chat completion; the status and its data lines."""
    payload = {
        "model": ALIAS,
        "stream": True,
        "messages": [{"role": "user", "content": "a long healthy answer"}],
        "sim": sim,
    }
    with httpx.stream(
        "POST",
        gw.url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {key}"},
        json=payload,
        timeout=60,
    ) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    return resp.status_code, lines


def chat(gw: Gateway, key: str = KEY_B) -> httpx.Response:
    payload = {"model": ALIAS, "messages": [{"role": "user", "content": "short"}], "max_tokens": 4}
    return httpx.post(
        gw.url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {key}"},
        json=payload,
        timeout=60,
    )


def ready_state(gw: Gateway) -> str:
    return str(httpx.get(gw.url("/ready"), timeout=5).json()["engine"])


def events(gw: Gateway, name: str) -> list[dict[str, Any]]:
    return [e for e in gw.logs() if e.get("event") == name]


def test_slow_health_during_a_long_stream_keeps_the_engine_up(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """Probe timeouts during a healthy stream give no 503, no engine_down and no death; the same
    request sent three times is never quarantined."""
    sim = sim_factory(*SLOW_HEALTH)
    gw = gateway_factory(sim, {"engine": {"health_interval_s": 0.2, "unhealthy_after_s": 60}})
    queued: dict[str, httpx.Response] = {}

    def later() -> None:
        time.sleep(1.5)
        queued["r"] = chat(gw)  # waits in the queue behind the stream, never 503

    for attempt in range(3):
        thread = threading.Thread(target=later)
        thread.start()
        status, lines = stream(gw, LONG)
        thread.join(60)
        assert status == 200 and lines[-1] == "[DONE]", attempt
        assert queued["r"].status_code == 200, queued["r"].text
    assert len(events(gw, "engine_probe_failed")) >= 2, "the probes did time out"
    assert not events(gw, "engine_down")
    assert not events(gw, "engine_death_suspect")
    assert gw.metric("gateway_engine_up") == 1
    assert gw.metric("gateway_quarantine_entries") == 0


def test_engine_marked_down_by_slow_probes_counts_no_death_for_a_live_stream(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """Probes failing past engine.unhealthy_after_s mark the engine down (503 + Retry-After to
    new requests), but the stream whose connection stays alive gets no death: sent three times,
    it is never quarantined."""
    sim = sim_factory(*SLOW_HEALTH)
    gw = gateway_factory(sim, {"engine": {"health_interval_s": 0.2, "unhealthy_after_s": 0.5}})
    refused: list[httpx.Response] = []

    def probe_while_down() -> None:
        if wait_until(lambda: ready_state(gw) == "down", 10):
            refused.append(chat(gw))

    for attempt in range(3):
        assert wait_until(lambda: ready_state(gw) == "ready", 10)
        thread = threading.Thread(target=probe_while_down)
        thread.start()
        status, lines = stream(gw, LONG)
        thread.join(30)
        assert status == 200 and lines[-1] == "[DONE]", attempt
    assert len(events(gw, "engine_down")) >= 2, "the threshold marked the engine down"
    assert refused and all(r.status_code == 503 for r in refused)
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
    assert not events(gw, "engine_death_suspect")
    assert gw.metric("gateway_quarantine_entries") == 0
    assert wait_until(lambda: ready_state(gw) == "ready", 10)


def test_dead_engine_is_marked_down_at_once(sim_factory: Any, gateway_factory: Any) -> None:
    """A killed engine (refused, socket gone) is down within a probe, whatever
    engine.unhealthy_after_s says, and new requests get 503 + Retry-After."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"engine": {"health_interval_s": 0.2, "unhealthy_after_s": 60}})
    sim.proc.send_signal(signal.SIGKILL)
    sim.proc.wait(10)
    killed = time.monotonic()
    assert wait_until(lambda: ready_state(gw) == "down", 5)
    assert time.monotonic() - killed < 3.0
    r = chat(gw)
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert json.loads(r.text)["error"]["code"] == "engine_unavailable"
    sim.restart()
    assert wait_until(lambda: ready_state(gw) == "ready", 10)
    assert chat(gw).status_code == 200
