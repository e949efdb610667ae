"""The gateway rides out engine outages: 503 + Retry-After at once, recovery by itself, no leaks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import ALIAS, KEY_A, REPO, Gateway, to_toml, wait_until

AUTH = {"Authorization": f"Bearer {KEY_A}"}


def chat(gw: Gateway, sim: dict[str, Any] | None = None, **extra: Any) -> httpx.Response:
    payload: dict[str, Any] = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]}
    if sim:
        payload["sim"] = sim
    payload.update(extra)
    return httpx.post(gw.url("/v1/chat/completions"), headers=AUTH, json=payload, timeout=30)


def ready_state(gw: Gateway) -> str:
    return str(httpx.get(gw.url("/ready"), timeout=2).json()["engine"])


def test_engine_absent_gives_503_with_retry_after(gateway_factory: Any) -> None:
    """No engine yet: /ready is 503 'starting' and model routes answer 503 + Retry-After at once."""
    gw = gateway_factory(None, wait_ready=False)
    ready = httpx.get(gw.url("/ready"))
    assert ready.status_code == 503 and ready.json()["engine"] == "starting"
    started = time.monotonic()
    r = chat(gw)
    assert time.monotonic() - started < 1.0
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "engine_unavailable"
    assert gw.metric("gateway_engine_up") == 0


def test_gateway_recovers_across_engine_restart(sim_factory: Any, gateway_factory: Any) -> None:
    """Engine crash: streams end with an error event, 503 while down, recovery alone, nothing leaks."""
    sim = sim_factory()
    gw = gateway_factory(sim)
    assert chat(gw).status_code == 200

    payload = {
        "model": ALIAS,
        "stream": True,
        "messages": [{"role": "user", "content": "long"}],
        "sim": {"tokens_per_second": 20, "completion_tokens": 2000},
    }
    events: list[bytes] = []
    with httpx.stream(
        "POST", gw.url("/v1/chat/completions"), headers=AUTH, json=payload, timeout=30
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:].encode())
                if len(events) == 5:
                    sim.proc.send_signal(signal.SIGKILL)
    assert b"[DONE]" not in events
    assert "error" in json.loads(events[-1])

    assert wait_until(lambda: ready_state(gw) == "down", 5)
    r = chat(gw)
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert gw.metric("gateway_engine_up") == 0
    assert gw.metric("gateway_upstream_errors_total", kind="disconnect") >= 1

    sim.restart()
    assert wait_until(lambda: ready_state(gw) == "ready", 5)
    assert chat(gw).status_code == 200
    assert gw.metric("gateway_engine_up") == 1
    assert gw.metric("gateway_requests_in_flight", tenant="acme") == 0
    assert httpx.get(gw.url("/ready")).json()["in_flight"] == 0


def test_queued_request_waits_for_engine_return(sim_factory: Any, gateway_factory: Any) -> None:
    """A request queued behind the engine's one slot waits through an outage and then succeeds;
    the one at the engine, answered no byte before it died, is sent once more after it."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"engine": {"max_concurrency": 1, "queue_timeout_s": 20}})
    results: dict[str, httpx.Response] = {}

    def long_request() -> None:
        results["first"] = chat(
            gw, {"tokens_per_second": 10, "completion_tokens": 1000}, max_tokens=20
        )

    def queued_request() -> None:
        results["second"] = chat(gw, max_tokens=4)

    first = threading.Thread(target=long_request)
    first.start()
    assert wait_until(lambda: httpx.get(gw.url("/ready")).json()["in_flight"] == 1, 5)
    second = threading.Thread(target=queued_request)
    second.start()
    assert wait_until(lambda: httpx.get(gw.url("/ready")).json()["queue_depth"] == 1, 5)
    sim.proc.send_signal(signal.SIGKILL)
    time.sleep(1.0)
    assert "first" not in results  # waiting to be sent again (non-streaming: no byte came back)
    assert "second" not in results  # still waiting for the engine, not refused
    sim.restart()
    first.join(15)
    second.join(15)
    assert results["first"].status_code == 200
    assert results["second"].status_code == 200
    assert gw.metric("gateway_engine_retries_total") == 1


def _running(gw: Gateway, results: dict[str, httpx.Response]) -> threading.Thread:
    """A long request (100 s of tokens) at the engine, its answer to go in ``results["first"]``."""
    first = threading.Thread(
        target=lambda: results.setdefault(
            "first", chat(gw, {"tokens_per_second": 10, "completion_tokens": 1000})
        )
    )
    first.start()
    assert wait_until(lambda: httpx.get(gw.url("/ready")).json()["in_flight"] == 1, 5)
    return first


def test_queued_request_gets_503_when_engine_stays_down(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """A queued request whose engine stays down past the queue timeout gets 503 + Retry-After."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"engine": {"max_concurrency": 1, "queue_timeout_s": 2}})
    results: dict[str, httpx.Response] = {}
    first = _running(gw, results)
    second = threading.Thread(target=lambda: results.setdefault("second", chat(gw, max_tokens=4)))
    second.start()
    assert wait_until(lambda: httpx.get(gw.url("/ready")).json()["queue_depth"] == 1, 5)
    sim.proc.send_signal(signal.SIGKILL)
    first.join(10)
    second.join(10)
    r = results["second"]
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert wait_until(lambda: gw.metric("gateway_requests_in_flight", tenant="acme") == 0, 3)


def test_a_tenants_queued_requests_get_503_not_429_when_the_engine_stays_down(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """Three of one tenant's requests queued behind its running one when the engine dies and
    stays down: each gets 503 `engine_unavailable` at the queue timeout, none the 429 `queue`
    that blames the tenant's backlog (that 429 is for a waiting tenant while the engine
    serves); streamed or not."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"engine": {"max_concurrency": 1, "queue_timeout_s": 3}})
    results: dict[str, httpx.Response] = {}
    first = _running(gw, results)
    queued = [
        threading.Thread(
            target=lambda i=i: results.setdefault(f"q{i}", chat(gw, max_tokens=4, stream=i == 0))
        )
        for i in range(3)
    ]
    for thread in queued:
        thread.start()
    assert wait_until(lambda: httpx.get(gw.url("/ready")).json()["queue_depth"] == 3, 5)
    sim.proc.send_signal(signal.SIGKILL)
    for thread in [first, *queued]:
        thread.join(15)
    for name in ("q0", "q1", "q2"):
        r = results[name]
        assert r.status_code == 503, (name, r.status_code, r.text[:300])
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert int(r.headers["Retry-After"]) >= 1
    assert gw.metric("gateway_rate_limited_total", tenant="acme", limit="queue") == 0
    assert wait_until(lambda: gw.metric("gateway_requests_in_flight", tenant="acme") == 0, 3)


def test_engine_refusing_connections_never_leaks_slots(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """An engine that answers 503 or drops connections: errors in OpenAI shape and no leaked slot."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"tenants": {"acme": {"concurrency": 1}}})
    for fault in ("503", "close"):
        for _ in range(5):
            r = chat(gw, {"refuse": fault})
            assert r.status_code in (502, 503), r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert chat(gw).status_code == 200
    assert gw.metric("gateway_requests_in_flight", tenant="acme") == 0


def test_gateway_follows_the_launcher_from_warming_to_ready(
    workdir: Path, gateway_factory: Any
) -> None:
    """Launcher + simulator: the gateway shows 'warming' until the warm-up ends, then serves."""
    sock = str(workdir / "e.sock")
    ready_file = str(workdir / "engine.ready")
    config = {
        "engine": {
            "program": [sys.executable, "-m", "engine", "sim", "--prefill-ms", "1500"],
            "socket": sock,
            "model_path": str(workdir),
        },
        "supervise": {"health_interval_s": 0.2, "ready_file": ready_file, "stop_grace_s": 5},
    }
    (workdir / "engine.toml").write_text(to_toml(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN38_", "NOTIFY_"))}
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "serve",
            "--config",
            str(workdir / "engine.toml"),
            "--skip-preflight",
        ],
        stdout=subprocess.DEVNULL,
        cwd=REPO,
        env=env,
    )
    try:
        gw = gateway_factory(
            None,
            {"engine": {"socket": sock, "ready_file": ready_file}},
            wait_ready=False,
        )
        states: set[str] = set()
        assert wait_until(lambda: states.add(ready_state(gw)) or "ready" in states, 30)
        assert "warming" in states
        assert os.path.exists(ready_file)
        assert chat(gw).status_code == 200
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(15) == 0
        assert not os.path.exists(ready_file)
        assert wait_until(lambda: ready_state(gw) != "ready", 5)
        assert chat(gw).status_code == 503
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(5)


def test_inflight_drift_is_logged(sim_factory: Any, gateway_factory: Any) -> None:
    """Requests running at the engine that the gateway did not admit are reported as drift."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"engine": {"drift_check_interval_s": 0.3}})
    transport = httpx.HTTPTransport(uds=sim.socket)
    payload = {
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "sim": {"tokens_per_second": 5, "completion_tokens": 20},
    }
    with (
        httpx.Client(transport=transport) as direct,
        direct.stream("POST", "http://engine/v1/chat/completions", json=payload, timeout=30) as r,
    ):
        for _ in r.iter_lines():
            if any(e.get("event") == "inflight_drift" for e in gw.logs()):
                break
    drift = [e for e in gw.logs() if e.get("event") == "inflight_drift"]
    assert drift and drift[0]["engine_running"] == 1 and drift[0]["gateway_in_flight"] == 0
