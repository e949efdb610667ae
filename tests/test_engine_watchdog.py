"""The progress watchdog: a running request with frozen counters is a hang, whatever /health says."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.progress import Progress, StallWatch, parse_progress
from engine.status import RESTART_REASONS, StatusFile, read_status
from tests.conftest import ALIAS, KEY_A, REPO, wait_until
from tests.launcher import FAST, MARGIN_S, Launcher, Launchers, alive, read_json

VLLM_METRICS = REPO / "tests" / "fixtures" / "vllm-metrics"
STALL_S = 2.0
AUTH = {"Authorization": f"Bearer {KEY_A}"}
# The simulator's stall fault: three tokens stream, then the request stays running with every
# counter frozen while /health answers 200 (the client has seen bytes, so the gateway never
# retries it).
STALL = {"stall_after": 3}


@pytest.fixture
def launch(workdir: Path) -> Iterator[Callable[..., Launcher]]:
    """Launchers with the simulator as engine, a status file and a short stall_after_s."""
    launchers = Launchers(workdir)

    def start(supervise: dict[str, Any] | None = None, **kwargs: Any) -> Launcher:
        settings = {"stall_after_s": STALL_S, "status_file": str(workdir / "status.json")}
        return launchers.start({**settings, **(supervise or {})}, **kwargs)

    yield start
    launchers.close()


def open_request(path: str, sim: dict[str, Any], max_tokens: int = 64) -> socket.socket:
    """Send a streaming chat completion straight to the engine socket; the caller closes it."""
    body = json.dumps(
        {
            "model": "qwen3.8-27b",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": max_tokens,
            "sim": sim,
        }
    ).encode()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return client


def status(workdir: Path) -> dict[str, Any]:
    return read_json(workdir / "status.json")


# -- reading the counters ----------------------------------------------------------------------


def test_progress_is_read_from_real_vllm_metrics() -> None:
    """The running gauge and the three counters are summed from a recorded vLLM /metrics page."""
    idle = parse_progress((VLLM_METRICS / "idle.txt").read_text())
    busy = parse_progress((VLLM_METRICS / "running.txt").read_text())
    assert idle is not None and busy is not None
    assert idle.running == 0 and busy.running == 1
    assert busy.generation_tokens > idle.generation_tokens
    assert idle.finished >= 1 and idle.prompt_tokens > 0


def test_progress_needs_the_running_gauge() -> None:
    """Without vllm:num_requests_running (or with garbage) there is no reading at all."""
    assert parse_progress("vllm:generation_tokens_total 5\n") is None
    assert parse_progress("not { prometheus\n") is None
    assert parse_progress("") is None
    text = 'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n'
    assert parse_progress(text) == Progress(3, 0, 0, 0)


def test_stall_is_running_with_frozen_counters_for_stall_after_s() -> None:
    """Hung only after stall_after_s of a running request whose counters do not move."""
    watch = StallWatch(10)
    frozen = Progress(1, 100, 50, 3)
    assert watch.observe(0, frozen).stalled_s == 0
    assert not watch.observe(9.9, frozen).hung
    verdict = watch.observe(10, frozen)
    assert verdict.hung and verdict.stalled_s == 10
    assert "1 request(s) running and no progress for 10.0 s" in watch.describe(verdict)


@pytest.mark.parametrize(
    "moved",
    [Progress(1, 101, 50, 3), Progress(1, 100, 51, 3), Progress(1, 100, 50, 4)],
    ids=["generation", "prompt", "finished"],
)
def test_any_counter_moving_restarts_the_clock(moved: Progress) -> None:
    """A decoded token, a finished prefill or a finished request each count as progress."""
    watch = StallWatch(10)
    watch.observe(0, Progress(1, 100, 50, 3))
    assert watch.observe(8, moved).stalled_s == 0
    assert not watch.observe(17, moved).hung
    assert watch.observe(18, moved).hung


def test_idle_engine_and_failed_reads_never_hang() -> None:
    """Nothing running is never a stall; an unreadable /metrics neither resets nor convicts."""
    watch = StallWatch(10)
    for now in range(0, 100, 5):
        assert watch.observe(now, Progress(0, 7, 7, 1)).stalled_s == 0
    watch.observe(100, Progress(1, 7, 7, 1))
    unread = watch.observe(200, None)
    assert not unread.hung and unread.stalled_s == 0 and unread.progress is None
    assert watch.observe(201, Progress(1, 7, 7, 1)).hung


def test_zero_turns_the_verdict_off() -> None:
    """stall_after_s = 0 reports the stall but never calls it a hang."""
    watch = StallWatch(0)
    watch.observe(0, Progress(1, 1, 1, 1))
    verdict = watch.observe(10_000, Progress(1, 1, 1, 1))
    assert verdict.stalled_s == 10_000 and not verdict.hung


def test_status_counters_survive_a_new_launcher(workdir: Path) -> None:
    """A new StatusFile continues the previous file's counters; a foreign file is ignored."""
    path = str(workdir / "status.json")
    first = StatusFile(path, 30, clock=lambda: 1000.0)
    first.update(state="ready", detail="up")
    first.record_restart("hang", "hung: frozen")
    second = StatusFile(path, 30)
    second.record_restart("exited", "engine exited on signal SIGKILL")
    data = read_status(path)
    assert data is not None
    assert data["hangs_total"] == 1
    assert data["restarts_total"] == {r: int(r in ("hang", "exited")) for r in RESTART_REASONS}
    assert data["last_restart"]["reason"] == "exited"
    assert not [p for p in os.listdir(workdir) if p.endswith(".tmp")]
    Path(path).write_text('{"format": 99, "hangs_total": 5}')
    assert StatusFile(path, 30).data["hangs_total"] == 0


# -- the launcher with the simulator -----------------------------------------------------------


def test_stalled_engine_with_healthy_health_is_restarted(
    launch: Callable[..., Launcher], workdir: Path
) -> None:
    """A request stuck with /health 200: killed within stall_after_s + a probe, reason logged."""
    launcher = launch()
    launcher.notify.wait_for("READY=1", timeout=30)
    pid = launcher.engine_pid()
    client = open_request(launcher.socket, STALL)
    try:
        assert wait_until(lambda: status(workdir)["running"] == 1, 10)
        started = time.monotonic()
        code = launcher.wait(timeout=STALL_S + FAST["stop_grace_s"] + 30)
        elapsed = time.monotonic() - started
    finally:
        client.close()
    assert code == 1
    budget = STALL_S + FAST["health_interval_s"] + FAST["probe_timeout_s"] + FAST["stop_grace_s"]
    assert elapsed <= budget + MARGIN_S, elapsed
    hung = launcher.event("hung")
    assert "1 request(s) running and no progress" in hung["detail"]
    killed = launcher.event("killed")
    assert killed["cause"] == "hang" and killed["reason"].startswith("hung: ")
    assert "unhealthy" not in launcher.events()
    assert not alive(pid)
    launcher.notify.drain()
    assert any(
        m[0].startswith("STATUS=killing the engine: hung: ") for m in launcher.notify.messages
    )
    final = status(workdir)
    assert final["state"] == "exited" and final["hangs_total"] == 1
    assert final["restarts_total"]["hang"] == 1
    assert final["last_restart"]["reason"] == "hang"


def test_slow_progress_and_idle_time_are_not_hangs(
    launch: Callable[..., Launcher], workdir: Path
) -> None:
    """Tokens trickling slower than the probe rate, then idle time, never trip the watchdog."""
    launcher = launch()
    launcher.notify.wait_for("READY=1", timeout=30)
    client = open_request(launcher.socket, {"tokens_per_second": 2, "completion_tokens": 12})
    try:
        assert wait_until(lambda: status(workdir)["running"] == 1, 10)
        assert wait_until(lambda: status(workdir)["running"] == 0, 20)
    finally:
        client.close()
    time.sleep(STALL_S * 2)
    assert launcher.proc.poll() is None
    assert "hung" not in launcher.events()
    assert status(workdir)["state"] == "ready" and status(workdir)["stalled_s"] == 0


def test_restarts_are_counted_by_reason_across_launchers(
    launch: Callable[..., Launcher], workdir: Path
) -> None:
    """A hang then a crash, in two launcher runs, give hang 1 and exited 1 in one status file."""
    first = launch()
    first.notify.wait_for("READY=1", timeout=30)
    client = open_request(first.socket, STALL)
    try:
        assert first.wait(timeout=30) == 1
    finally:
        client.close()
    second = launch()
    second.notify.wait_for("READY=1", timeout=30)
    assert status(workdir)["state"] == "ready"
    os.kill(second.engine_pid(), 9)
    assert second.wait(timeout=10) == 1
    final = status(workdir)
    assert final["restarts_total"] == {r: int(r in ("hang", "exited")) for r in RESTART_REASONS}
    assert final["hangs_total"] == 1 and final["last_restart"]["reason"] == "exited"


# -- the gateway in front ----------------------------------------------------------------------


def test_queued_request_waits_through_a_hang_restart(
    launch: Callable[..., Launcher], workdir: Path, gateway_factory: Any
) -> None:
    """Gateway + launcher: the hung stream (it had sent bytes, so it is not retried) ends with an
    error event, the queued request waits for the restarted engine and succeeds, and the
    gateway's scrape shows the hang and the restart by reason."""
    first = launch({"ready_file": str(workdir / "engine.ready")})
    first.notify.wait_for("READY=1", timeout=30)
    gw = gateway_factory(
        None,
        {
            "engine": {
                "socket": first.socket,
                "ready_file": str(workdir / "engine.ready"),
                "launcher_status_file": str(workdir / "status.json"),
                "max_concurrency": 1,
                "queue_timeout_s": 60,
            }
        },
    )
    results: dict[str, httpx.Response] = {}

    def send(name: str, sim: dict[str, Any] | None = None, **extra: Any) -> None:
        body: dict[str, Any] = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]}
        if sim:
            body["sim"] = sim
        results[name] = httpx.post(
            gw.url("/v1/chat/completions"), headers=AUTH, json={**body, **extra}, timeout=60
        )

    hung = threading.Thread(target=send, args=("hung", STALL), kwargs={"stream": True})
    hung.start()
    assert wait_until(lambda: httpx.get(gw.url("/ready")).json()["in_flight"] == 1, 5)
    queued = threading.Thread(target=send, args=("queued",), kwargs={"max_tokens": 4})
    queued.start()
    assert wait_until(lambda: httpx.get(gw.url("/ready")).json()["queue_depth"] == 1, 5)
    assert first.wait(timeout=30) == 1
    hung.join(15)
    assert results["hung"].status_code == 200  # the stream had begun: it ends with an error event
    events = [line for line in results["hung"].text.splitlines() if line.startswith("data: ")]
    assert events[0].startswith('data: {"id"') and '"error"' in events[-1], events
    time.sleep(1.0)
    assert "queued" not in results  # waiting for the engine, not refused
    second = launch({"ready_file": str(workdir / "engine.ready")})  # systemd's Restart=always
    second.notify.wait_for("READY=1", timeout=30)
    queued.join(30)
    assert results["queued"].status_code == 200
    assert gw.metric("qwen38_engine_hangs_total") == 1
    assert gw.metric("qwen38_engine_restarts_total", reason="hang") == 1
    assert gw.metric("qwen38_engine_restarts_total", reason="unhealthy") == 0
    assert gw.metric("qwen38_engine_launcher_state", state="ready") == 1
    assert gw.metric("qwen38_engine_stalled_seconds") == 0


def test_gateway_exports_the_status_file_with_the_contract_types(workdir: Path) -> None:
    """The gateway's collector turns a launcher status file into the families the rules read."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.launcher_status import LauncherStatusCollector
    from tests.test_prometheus_rules import CONTRACT_METRICS

    path = workdir / "status.json"
    writer = StatusFile(str(path), 1800)
    writer.update(state="ready", running=1.0, stalled_s=12.5)
    writer.record_restart("unhealthy", "no healthy /health answer")
    writer.update(state="ready")
    registry = CollectorRegistry()
    registry.register(LauncherStatusCollector(lambda: [("default", str(path))]))
    text = generate_latest(registry).decode()
    declared = dict(line.split(" ")[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    for family, (kind, _labels) in CONTRACT_METRICS.items():
        if family.startswith("qwen38_engine_"):
            assert declared[family] == kind, family
    progress = {s.name: s for f in registry.collect() for s in f.samples}
    assert progress["qwen38_engine_stalled_seconds"].value == 12.5
    assert progress["qwen38_engine_stalled_seconds"].labels == {"engine": "default"}
    assert 'qwen38_engine_restarts_total{engine="default",reason="unhealthy"} 1.0' in text
    assert 'qwen38_engine_launcher_state{engine="default",state="ready"} 1.0' in text
    path.write_text("{not json")
    assert "qwen38_engine" not in generate_latest(registry).decode()
