"""Several simulator engines behind one real gateway: dispatch, affinity, failover, rejoin."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ALIAS, KEY_A, KEY_B, Gateway, Sim, wait_until

AUTH = {"Authorization": f"Bearer {KEY_A}"}


def chat(
    gw: Gateway,
    *,
    key: str = KEY_A,
    sim: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
    **extra: Any,
) -> httpx.Response:
    payload: dict[str, Any] = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]}
    if sim:
        payload["sim"] = sim
    payload.update(extra)
    return httpx.post(
        gw.url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
        json=payload,
        timeout=timeout,
    )


def fleet(
    sim_factory: Callable[..., Sim],
    gateway_factory: Callable[..., Gateway],
    count: int = 2,
    slots: int = 1,
    engine: dict[str, Any] | None = None,
    sim_args: tuple[str, ...] = (),
) -> tuple[list[Sim], Gateway]:
    """``count`` simulators (e0, e1, ...) behind one gateway, ``slots`` each."""
    sims = [sim_factory(*sim_args, name=f"e{i}") for i in range(count)]
    engines = [
        {"name": f"e{i}", "socket": sim.socket, "max_concurrency": slots}
        for i, sim in enumerate(sims)
    ]
    config = {"engines": engines, "engine": {"health_interval_s": 0.2, **(engine or {})}}
    gw = gateway_factory(None, config)
    assert wait_until(lambda: all(s == "ready" for s in engine_states(gw).values()), 15)
    return sims, gw


def engine_states(gw: Gateway) -> dict[str, str]:
    detail = httpx.get(gw.url("/ready"), timeout=5).json()["engines"]
    return {name: str(d["status"]) for name, d in detail.items()}


def streaming_engines(gw: Gateway, count: int = 2) -> list[int]:
    """The indexes of engines e0..e<count-1> with a request in flight (from ``/ready``)."""
    detail = httpx.get(gw.url("/ready"), timeout=5).json()["engines"]
    return [i for i in range(count) if detail[f"e{i}"]["in_flight"] == 1]


def served_by(sims: list[Sim]) -> list[int]:
    return [len(s.model_records()) for s in sims]


def test_requests_use_every_engine_and_ready_and_metrics_name_them(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway], workdir: Path
) -> None:
    """Concurrent requests spread over both engines; /ready, metrics and ledger name them."""
    sims, gw = fleet(sim_factory, gateway_factory, sim_args=("--tokens-per-second", "50"))
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: chat(gw, max_tokens=20), range(8)))
    assert [a.status_code for a in answers] == [200] * 8
    assert all(n >= 2 for n in served_by(sims)), served_by(sims)
    ready = httpx.get(gw.url("/ready"), timeout=5).json()
    assert ready["ready"] is True and set(ready["engines"]) == {"e0", "e1"}
    assert ready["engines"]["e0"]["slots"] == 1
    assert gw.metric("gateway_engine_status", engine="e1") == 1
    assert gw.metric("gateway_engine_slots") == 2
    sent = [gw.metric("gateway_engine_requests_total", engine=e) for e in ("e0", "e1")]
    assert sum(sent) == 8 and min(sent) >= 2
    ledger = workdir / "gw-usage.sqlite3"
    assert wait_until(
        lambda: (
            ledger.exists()
            and sqlite3.connect(ledger).execute("SELECT COUNT(*) FROM usage").fetchone()[0] == 8
        ),
        10,
    )
    rows = sqlite3.connect(ledger).execute("SELECT engine, COUNT(*) FROM usage GROUP BY engine")
    by_engine = dict(rows.fetchall())
    assert set(by_engine) == {"e0", "e1"} and sum(by_engine.values()) == 8


def test_a_session_stays_on_its_engine(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway]
) -> None:
    """Turns of one session (X-Session-Id, prompt_cache_key) go to the engine of its first turn."""
    sims, gw = fleet(sim_factory, gateway_factory)
    for _ in range(4):
        assert chat(gw, headers={"X-Session-Id": "s-one"}, max_tokens=2).status_code == 200
        assert chat(gw, prompt_cache_key="conv-two", max_tokens=2).status_code == 200
        assert chat(gw, key=KEY_B, prompt_cache_key="conv-two", max_tokens=2).status_code == 200
    homes = [
        {r.get("body", {}).get("prompt_cache_key") or "sid" for r in s.model_records()}
        for s in sims
    ]
    # Each session's four turns on one engine: the per-engine record counts are multiples of 4.
    assert all(n % 4 == 0 for n in served_by(sims)), (served_by(sims), homes)
    assert sum(served_by(sims)) == 12


def test_a_killed_engine_leaves_rotation_fast_and_rejoins_by_itself(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway]
) -> None:
    """Kill one engine: the next requests are served by the other at once (none fails); it
    is out of rotation within 1.2 s, and back in rotation after its restart."""
    sims, gw = fleet(sim_factory, gateway_factory)
    sims[0].stop()
    killed = time.monotonic()
    first = chat(gw, max_tokens=2)
    first_served = time.monotonic() - killed
    assert first.status_code == 200 and first_served < 1.2
    assert wait_until(lambda: engine_states(gw)["e0"] == "down", 1.2 - (time.monotonic() - killed))
    answers = [chat(gw, max_tokens=2) for _ in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    before = served_by(sims)[0]
    sims[0].restart()
    assert wait_until(lambda: engine_states(gw)["e0"] == "ready", 10)
    with ThreadPoolExecutor(4) as pool:
        later = list(pool.map(lambda _: chat(gw, max_tokens=20), range(6)))
    assert [a.status_code for a in later] == [200] * 6
    assert served_by(sims)[0] > before  # the restarted engine takes requests again


def test_a_request_that_got_no_byte_is_retried_once_elsewhere(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway]
) -> None:
    """An engine that dies under a non-streamed request: the request is answered by the
    other engine; one that kills that engine too is not sent a third time."""
    sims, gw = fleet(sim_factory, gateway_factory)
    answer = chat(gw, sim={"exit_after": 3}, max_tokens=8, n=1, seed=1)
    # The first engine crashed under it; the retry went to the other, which crashed too.
    assert answer.status_code in (502, 503, 422)
    assert gw.metric("gateway_engine_retries_total") == 1
    assert wait_until(lambda: set(engine_states(gw).values()) == {"down"}, 5)
    assert [s.proc.poll() for s in sims] == [70, 70]  # each died once under it
    for sim in sims:
        sim.restart()
    assert wait_until(lambda: all(s == "ready" for s in engine_states(gw).values()), 10)
    fine = chat(gw, max_tokens=4)
    assert fine.status_code == 200
    # Two deaths (one per engine) quarantine it fleet-wide.
    again = chat(gw, sim={"exit_after": 3}, max_tokens=8, n=1, seed=1)
    assert again.status_code == 422 and again.json()["error"]["code"] == "request_quarantined"


def test_a_retry_on_a_healthy_engine_answers_the_client(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway]
) -> None:
    """A non-streamed request whose engine died before any byte is answered by another one."""
    sims, gw = fleet(sim_factory, gateway_factory)
    # e0 comes back as an engine that dies under every request after two tokens.
    sims[0].stop()
    crash = sim_factory("--exit-after", "2", name="e0")
    assert crash.socket == sims[0].socket
    assert wait_until(lambda: engine_states(gw)["e0"] == "ready", 10)
    answers = [chat(gw, max_tokens=6) for _ in range(3)]
    assert [a.status_code for a in answers] == [200] * 3
    assert (
        gw.metric("gateway_engine_retries_total") + gw.metric("gateway_engine_failovers_total") >= 1
    )


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_stream_in_flight_on_a_killed_engine_ends_with_an_error_event(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway], route: str
) -> None:
    """A stream that already had bytes when its engine was killed ends with its dialect's
    error event, while the other engine keeps serving."""
    sims, gw = fleet(sim_factory, gateway_factory, sim_args=("--tokens-per-second", "20"))
    body: dict[str, Any] = {"model": ALIAS, "stream": True}
    if route == "/v1/responses":
        body.update(input="hi", max_output_tokens=200)
    else:
        body.update(messages=[{"role": "user", "content": "hi"}], max_tokens=200)
    headers = {**AUTH, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", gw.url(route), headers=headers, json=body, timeout=30) as r:
        assert r.status_code == 200
        chunks = r.iter_text()
        text = next(chunks)
        busy = streaming_engines(gw)
        assert len(busy) == 1
        sims[busy[0]].proc.kill()  # SIGKILL: a crash, no graceful end of the stream
        text += "".join(chunks)
    if route == "/v1/messages":
        assert "event: error" in text and "message_stop" not in text
    elif route == "/v1/responses":
        assert "response.failed" in text and "response.completed" not in text
    else:
        assert '"error"' in text and "[DONE]" not in text
    assert chat(gw, max_tokens=2).status_code == 200


def test_demo_with_several_engines_serves_from_each(tmp_path: Path) -> None:
    """``qwen38-gateway demo --engines 3`` starts three simulators behind one gateway and uses
    each of them."""
    import os
    import re
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO, free_port

    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "demo", "--engines", "3", "--port", str(port),
         "--metrics-port", str(metrics_port), "--tokens-per-second", "40"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        key = None
        deadline = time.monotonic() + 30
        while key is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            found = re.search(r"(sk-q38-demo-\S+)", line)
            key = found.group(1) if found else None
        assert key, "the demo printed no key"
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                detail = httpx.get(base + "/ready", timeout=2).json()["engines"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return sorted(detail) == ["sim0", "sim1", "sim2"] and all(
                d["status"] == "ready" for d in detail.values()
            )

        assert wait_until(ready, 30)

        def ask(_: int) -> int:
            return httpx.post(
                base + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": ALIAS, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 20},
                timeout=30,
            ).status_code  # fmt: skip

        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(ask, range(6))) == [200] * 6
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        used = re.findall(r'gateway_engine_requests_total\{engine="(sim\d)"\} ([1-9])', text)
        assert {name for name, _ in used} == {"sim0", "sim1", "sim2"}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()
