"""Two simulator engines behind one real gateway: every engine's ``vllm:*`` series and launcher
status file in the scrape, labelled with its engine; prompt counts asked of an engine in
rotation (the session's, or another while one hangs)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.status import StatusFile
from tests.conftest import ALIAS, KEY_A, Gateway, Sim, wait_until
from tests.test_fleet_engines import engine_states
from tests.test_fleet_failover import in_rotation

HEADERS = {"Authorization": f"Bearer {KEY_A}", "anthropic-version": "2023-06-01"}


def two_engines(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway], workdir: Path
) -> tuple[list[Sim], Gateway, dict[str, StatusFile]]:
    """e0 and e1, each with its own launcher status file."""
    sims = [sim_factory(name=f"e{i}") for i in range(2)]
    paths = {f"e{i}": str(workdir / f"e{i}.status.json") for i in range(2)}
    status = {name: StatusFile(path, 1800) for name, path in paths.items()}
    engines = [
        {"name": f"e{i}", "socket": sim.socket, "launcher_status_file": paths[f"e{i}"]}
        for i, sim in enumerate(sims)
    ]
    config = {"engines": engines, "engine": {"health_interval_s": 0.2, "rotation_timeout_s": 0.3}}
    gw = gateway_factory(None, config)
    assert wait_until(lambda: all(s == "ready" for s in engine_states(gw).values()), 15)
    return sims, gw, status


def samples(gw: Gateway, name: str) -> dict[str, float]:
    """The samples of ``name`` in one scrape, by their ``engine`` label."""
    text = httpx.get(gw.metrics_url, timeout=5).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[sample.labels["engine"]] = sample.value
    return found


def test_every_engines_series_and_status_file_are_in_the_scrape(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway], workdir: Path
) -> None:
    """Both engines' vllm:* series and launcher states are in one scrape, each labelled with its
    engine; a killed engine's series leave while the other's stay and scraping stays ok."""
    sims, gw, status = two_engines(sim_factory, gateway_factory, workdir)
    status["e0"].update(state="ready")
    status["e1"].update(state="warming")
    status["e1"].record_restart("exited", "code 1")
    for _ in range(4):
        payload = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        answer = httpx.post(gw.url("/v1/chat/completions"), headers=HEADERS, json=payload)
        assert answer.status_code == 200
    running = samples(gw, "vllm:num_requests_running")
    assert set(running) == {"e0", "e1"}
    generated = samples(gw, "vllm:generation_tokens_total")
    assert sum(generated.values()) == 12
    assert gw.metric("gateway_engine_scrape_ok") == 1
    states = {
        (e, s): gw.metric("qwen38_engine_launcher_state", engine=e, state=s)
        for e, s in (("e0", "ready"), ("e1", "warming"), ("e1", "ready"))
    }
    assert states == {("e0", "ready"): 1, ("e1", "warming"): 1, ("e1", "ready"): 0}
    assert gw.metric("qwen38_engine_restarts_total", engine="e1", reason="exited") == 1
    assert gw.metric("qwen38_engine_restarts_total", engine="e0", reason="exited") == 0
    sims[1].stop()
    assert wait_until(lambda: engine_states(gw)["e1"] == "down", 5)
    assert set(samples(gw, "vllm:num_requests_running")) == {"e0"}
    assert gw.metric("gateway_engine_scrape_ok") == 1


def test_prompt_counts_go_to_an_engine_in_rotation(
    sim_factory: Callable[..., Sim], gateway_factory: Callable[..., Gateway], workdir: Path
) -> None:
    """count_tokens asks the session's engine; with that engine hung (out of rotation) the
    other one counts, at once."""
    sims, gw, _ = two_engines(sim_factory, gateway_factory, workdir)
    body = {"model": ALIAS, "max_tokens": 8, "messages": [{"role": "user", "content": "hi there"}]}
    session = {**HEADERS, "X-Session-Id": "s-count"}
    served = httpx.post(gw.url("/v1/messages"), headers=session, json=body, timeout=30)
    assert served.status_code == 200
    home = next(i for i, sim in enumerate(sims) if sim.model_records())
    url = gw.url("/v1/messages/count_tokens")

    def tokenized(sim: Sim) -> int:
        return sum(1 for r in sim.records() if r.get("path") == "/tokenize")

    counted = httpx.post(url, headers=session, json=body, timeout=10)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    assert tokenized(sims[home]) == 1 and tokenized(sims[1 - home]) == 0
    os.kill(sims[home].proc.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: not in_rotation(gw)[f"e{home}"], 5)
        again = httpx.post(url, headers=session, json=body, timeout=10)
        assert again.status_code == 200
        assert again.json()["input_tokens"] == counted.json()["input_tokens"]
        assert tokenized(sims[1 - home]) == 1
    finally:
        os.kill(sims[home].proc.pid, signal.SIGCONT)
