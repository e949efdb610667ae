"""The progress watchdog on real vLLM (CPU build): a stopped worker leaves /health at 200."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.progress import parse_progress
from tests.conftest import to_toml
from tests.launcher import read_json
from tests.realengine.fixtures import real_engine_skipped
from tests.realengine.launcher import (
    PYTHON_ENV,
    SKIP_ENV,
    EngineUnavailable,
    LaunchedEngine,
    build_model,
    check_engine_python,
    engine_python,
    engine_toml,
)

STALL_S = 5.0
HEALTH_INTERVAL_S = 0.5
STOP_GRACE_S = 10.0

pytestmark = pytest.mark.real_engine


@pytest.fixture
def watched_engine() -> Iterator[LaunchedEngine]:
    """Real vLLM under the launcher with a 5 s stall_after_s and a status file (its own copy:
    the test ends it)."""
    if real_engine_skipped():
        pytest.skip(f"real engine not run: {SKIP_ENV} is set")
    python = engine_python()
    try:
        check_engine_python(python)
    except EngineUnavailable as exc:
        pytest.fail(f"real engine unavailable ({PYTHON_ENV}): {exc}", pytrace=False)
    workdir = Path(tempfile.mkdtemp(prefix="q38rw-", dir="/tmp"))
    os.chmod(workdir, 0o700)
    model = workdir / "model"
    build_model(python, model)
    config = engine_toml("real", workdir, python, model)
    config["supervise"].update(
        stall_after_s=STALL_S,
        health_interval_s=HEALTH_INTERVAL_S,
        stop_grace_s=STOP_GRACE_S,
        status_file=str(workdir / "status.json"),
    )
    config_path = workdir / "engine-real.toml"
    config_path.write_text(to_toml(config))
    engine = LaunchedEngine(
        kind="real",
        workdir=workdir,
        config_path=config_path,
        socket=config["engine"]["socket"],
        ready_file=config["supervise"]["ready_file"],
        log_path=workdir / "engine-real.log",
        start_timeout_s=float(config["supervise"]["start_timeout_s"]),
    )
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def group_processes(pgid: int) -> dict[int, str]:
    """pid -> command line of every process in process group ``pgid`` (from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:
            found[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def start_stream(engine: LaunchedEngine) -> socket.socket:
    """Open a long streaming completion (max_tokens near the context) on the engine socket."""
    body = json.dumps(
        {
            "model": "qwen3.8-27b",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8000,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(30)
    client.connect(engine.socket)
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return client


def running(engine: LaunchedEngine) -> float:
    """vllm:num_requests_running as the engine's /metrics reports it."""
    progress = parse_progress(engine.metrics_text())
    assert progress is not None
    return progress.running


@pytest.mark.timeout(400)
def test_stopped_worker_mid_stream_is_found_and_the_engine_restarted(
    watched_engine: LaunchedEngine,
) -> None:
    """SIGSTOP on vLLM's Worker mid-stream: /health stays 200 and the launcher ends the engine as
    hung within stall_after_s plus a probe, counting it in its status file."""
    engine = watched_engine
    pgid = engine.engine_pid()
    assert pgid is not None
    workers = [pid for pid, cmd in group_processes(pgid).items() if cmd.startswith("VLLM::Worker")]
    assert len(workers) == 1, group_processes(pgid)
    clients = []
    try:
        # The tiny model decodes thousands of tokens a second: stop the worker as soon as the
        # engine reports the request running, and try again if it finished first.
        for _attempt in range(5):
            clients.append(start_stream(engine))
            deadline = time.monotonic() + 20
            while running(engine) == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(workers[0], signal.SIGSTOP)
            stopped = time.monotonic()
            if running(engine) == 1:
                break
            os.kill(workers[0], signal.SIGCONT)
        else:
            pytest.fail("the request always finished before the worker could be stopped")
        assert engine.get("/health", timeout=5).status_code == 200
        assert engine.launcher is not None
        code = engine.launcher.wait(STALL_S + STOP_GRACE_S + 60)
        elapsed = time.monotonic() - stopped
    finally:
        for client in clients:
            client.close()
    assert code == 1
    assert elapsed <= STALL_S + HEALTH_INTERVAL_S + 5 + STOP_GRACE_S + 5, elapsed
    status = read_json(engine.workdir / "status.json")
    assert status["hangs_total"] == 1 and status["restarts_total"]["hang"] == 1
    assert status["running"] == 1 and status["state"] == "exited"
    events = [
        json.loads(line)
        for line in engine.log_path.read_text(errors="replace").splitlines()
        if line.startswith('{"component": "launcher"')
    ]
    hung = next(e for e in events if e["event"] == "hung")
    assert "1 request(s) running and no progress" in hung["detail"]
    assert next(e for e in events if e["event"] == "killed")["cause"] == "hang"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
            probe.connect(engine.socket)  # nothing serves the socket any more
    finally:
        probe.close()
