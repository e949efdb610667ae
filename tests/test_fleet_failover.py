"""A hung engine (SIGSTOP) behind one real gateway with two simulator engines: out of rotation
within 1.2 s while idle and under load, requests it never read served by the other, a request it
read retried once elsewhere when it is declared down, rejoining after SIGCONT."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx

from tests.conftest import ALIAS, Gateway, Sim, wait_until
from tests.test_fleet_engines import AUTH, chat, engine_states, fleet, streaming_engines

FAST_ROTATION = {"rotation_timeout_s": 0.3}


def in_rotation(gw: Gateway) -> dict[str, bool]:
    detail = httpx.get(gw.url("/ready"), timeout=5).json()["engines"]
    return {name: bool(d["in_rotation"]) for name, d in detail.items()}


def finished(sim: Sim) -> int:
    """Model requests the simulator answered to their end."""
    return sum(1 for r in sim.model_records() if r.get("outcome") == "finished")


@contextmanager
def stopped(sim: Sim) -> Iterator[float]:
    """SIGSTOP ``sim`` (its process hangs: the socket accepts, nothing is read); SIGCONT on exit.
    Yields the monotonic time of the stop."""
    os.kill(sim.proc.pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(sim.proc.pid, signal.SIGCONT)


def watch_rotation(gw: Gateway, engine: str, since: list[float]) -> threading.Thread:
    """Poll /ready every 20 ms until ``engine`` is out of rotation; append the moment."""

    def run() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if not in_rotation(gw)[engine]:
                    since.append(time.monotonic())
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_hung_idle_engine_is_out_within_1_2_s_and_its_requests_served_elsewhere(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway]
) -> None:
    """SIGSTOP one of two idle engines: out of rotation within 1.2 s while still up (not down);
    two requests sent at the stop (one placed on the hung engine) are both answered by the
    other within 1.2 s; after SIGCONT it is back in rotation and serves again."""
    sims, gw = fleet(
        sim_factory, gateway_factory, engine={**FAST_ROTATION, "unhealthy_after_s": 30}
    )
    out: list[float] = []
    with stopped(sims[0]) as at:
        watcher = watch_rotation(gw, "e0", out)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: (chat(gw, max_tokens=2), time.monotonic()), range(2)))
        watcher.join(10)
        served_s = max(done for _, done in answers) - at
        out_s = out[0] - at if out else float("inf")
        print(
            f"\nhung engine (idle): out of rotation {out_s:.3f} s, 2 requests served {served_s:.3f} s"
        )
        assert [a.status_code for a, _ in answers] == [200, 200]
        assert out_s < 1.2 and served_s < 1.2
        assert engine_states(gw)["e0"] == "ready"  # down keeps its slower rule
        assert finished(sims[1]) == 2
        assert gw.metric("gateway_engine_in_rotation", engine="e0") == 0
    assert wait_until(lambda: in_rotation(gw)["e0"], 5)
    before = finished(sims[0])
    with ThreadPoolExecutor(4) as pool:
        later = list(pool.map(lambda _: chat(gw, max_tokens=20), range(6)))
    assert [a.status_code for a in later] == [200] * 6
    assert finished(sims[0]) > before  # rejoined by itself


def test_a_hung_engine_under_load_hands_its_work_to_the_other(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway]
) -> None:
    """Under load, SIGSTOP one engine: requests started after the stop are served by the other
    from within 1.2 s; the request it had read and never answered is retried once elsewhere
    when it is declared down (engine.unhealthy_after_s); nothing fails; SIGCONT: it rejoins."""
    sims, gw = fleet(
        sim_factory,
        gateway_factory,
        engine={**FAST_ROTATION, "unhealthy_after_s": 2},
        sim_args=("--tokens-per-second", "100"),
    )
    results: list[tuple[float, float, int]] = []
    running = threading.Event()
    running.set()

    def client() -> None:
        while running.is_set():
            started = time.monotonic()
            answer = chat(gw, max_tokens=10)
            results.append((started, time.monotonic(), answer.status_code))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        assert wait_until(lambda: finished(sims[0]) >= 3 and finished(sims[1]) >= 3, 15)
        out: list[float] = []
        with stopped(sims[0]) as at:
            watcher = watch_rotation(gw, "e0", out)
            assert wait_until(lambda: engine_states(gw)["e0"] == "down", 10)
            time.sleep(0.5)
            watcher.join(10)
            after = [r for r in results if r[0] >= at]
            first_s = min(done for _, done, _ in after) - at
            out_s = out[0] - at if out else float("inf")
            print(
                f"\nhung engine (load): out of rotation {out_s:.3f} s, first request started "
                f"after the stop served {first_s:.3f} s, {len(after)} served meanwhile"
            )
            assert out_s < 1.2 and first_s < 1.2
    finally:
        running.clear()
        for thread in threads:
            thread.join(30)
    assert results and {status for _, _, status in results} == {200}
    assert gw.metric("gateway_engine_retries_total") <= 1
    assert wait_until(lambda: engine_states(gw)["e0"] == "ready" and in_rotation(gw)["e0"], 10)
    before = finished(sims[0])
    with ThreadPoolExecutor(4) as pool:
        later = list(pool.map(lambda _: chat(gw, max_tokens=20), range(6)))
    assert [a.status_code for a in later] == [200] * 6
    assert finished(sims[0]) > before


def test_a_stream_on_a_hung_engine_ends_with_an_error_event_when_it_is_down(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway]
) -> None:
    """A stream that had bytes when its engine hung ends with an error event once the engine
    is marked down (engine.unhealthy_after_s with nothing from it), long before
    engine.read_timeout_s; the other engine serves meanwhile."""
    sims, gw = fleet(
        sim_factory,
        gateway_factory,
        engine={**FAST_ROTATION, "read_timeout_s": 120, "unhealthy_after_s": 1},
        sim_args=("--tokens-per-second", "20"),
    )
    body: dict[str, Any] = {
        "model": ALIAS,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 200,
    }
    url = gw.url("/v1/chat/completions")
    with httpx.stream("POST", url, headers=AUTH, json=body, timeout=30) as r:
        assert r.status_code == 200
        chunks = r.iter_text()
        text = next(chunks)
        busy = streaming_engines(gw)
        assert len(busy) == 1
        with stopped(sims[busy[0]]) as at:
            assert chat(gw, max_tokens=2).status_code == 200
            text += "".join(chunks)
            ended_s = time.monotonic() - at
    print(
        f"\nhung engine: stream with bytes ended with its error event {ended_s:.3f} s after the stop"
    )
    assert '"error"' in text and "[DONE]" not in text
    assert ended_s < 10


def test_a_busy_engine_whose_health_lags_keeps_its_sessions(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway]
) -> None:
    """Engines whose /health answers 1.5 s late while they generate (as real vLLM on a busy
    host) leave rotation during each non-streamed request, yet come back with its answer: every
    turn of a session stays on its engine."""
    _, gw = fleet(
        sim_factory,
        gateway_factory,
        engine=FAST_ROTATION,
        sim_args=("--tokens-per-second", "40", "--health-delay-busy-s", "1.5"),
    )
    engines: dict[str, list[str]] = {"s0": [], "s1": []}
    for session, turns in engines.items():
        for _ in range(5):  # back to back: the next turn comes as the engine answers the last
            before = {e: gw.metric("gateway_engine_requests_total", engine=e) for e in ("e0", "e1")}
            answer = chat(gw, headers={"X-Session-Id": session}, max_tokens=40)
            assert answer.status_code == 200
            after = {e: gw.metric("gateway_engine_requests_total", engine=e) for e in before}
            turns += [e for e in before if after[e] > before[e]]
    assert all(len(set(turns)) == 1 for turns in engines.values()), engines
    stalls = [e for e in gw.logs() if e.get("event") == "engine_out_of_rotation"]
    assert stalls, "the lagging probes did take the busy engine out of rotation"
