"""`qwen38-engine serve` supervising the engine simulator: ready, watchdog, hang, crash, stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.socketfile import remove_stale_socket
from engine.supervise import describe_exit
from tests.launcher import FAST, MARGIN_S, Launcher, Launchers, alive


@pytest.fixture
def launch(workdir: Path) -> Iterator[Callable[..., Launcher]]:
    """Start launchers running the simulator as their engine; everything is killed afterwards."""
    launchers = Launchers(workdir)
    yield launchers.start
    launchers.close()


def test_ready_status_and_watchdog_reach_the_notify_socket(launch: Callable[..., Launcher]) -> None:
    """After /health and the warm-up: READY=1 with STATUS, then WATCHDOG=1 on each healthy probe."""
    launcher = launch()
    ready = launcher.notify.wait_for("READY=1", timeout=30)
    assert f"STATUS=ready: qwen3.8-27b on {launcher.socket} (warm)" in ready
    launcher.notify.wait_for("WATCHDOG=1", timeout=5, count=3)
    first = launcher.notify.messages[0]
    assert first[0].startswith("STATUS=loading the model (engine pid ")
    assert first[1] == "EXTEND_TIMEOUT_USEC=" + str((30 + 2 + 10) * 1_000_000)
    warming = [f"STATUS=warming up (engine pid {launcher.engine_pid()})"]
    assert warming in launcher.notify.messages
    events = launcher.events()
    order = [events.index(name) for name in ("spawn", "healthy", "warmup", "ready")]
    assert order == sorted(order)
    warmup = launcher.event("warmup")
    assert warmup["ok"] is True and warmup["status"] == 200 and warmup["completion_tokens"] == 4
    spawn = launcher.event("spawn")
    assert spawn["argv"][:4] == [sys.executable, "-m", "engine", "sim"]
    assert "--uds" in spawn["argv"] and "--api-key" not in spawn["argv"]
    assert launcher.event("ready")["warmup_failures"] == 0


def test_abstract_notify_socket_is_supported(
    workdir: Path, launch: Callable[..., Launcher]
) -> None:
    """NOTIFY_SOCKET=@name (Linux abstract namespace) receives READY=1 like a path does."""
    launcher = launch(notify_address=f"@q38-test-{uuid.uuid4().hex}")
    launcher.notify.wait_for("READY=1", timeout=30)


def test_hung_engine_is_killed_and_launcher_exits_nonzero(launch: Callable[..., Launcher]) -> None:
    """A stopped (SIGSTOP) engine is killed within unhealthy_after_s plus grace, exit status 1."""
    launcher = launch()
    launcher.notify.wait_for("READY=1", timeout=30)
    pid = launcher.engine_pid()
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    code = launcher.wait(timeout=FAST["unhealthy_after_s"] + FAST["stop_grace_s"] + 30)
    elapsed = time.monotonic() - stopped_at
    assert code == 1
    assert elapsed <= FAST["unhealthy_after_s"] + FAST["stop_grace_s"] + MARGIN_S, elapsed
    unhealthy = launcher.event("unhealthy")
    assert unhealthy["state"] == "timeout" and unhealthy["pid"] == pid
    killed = launcher.event("killed")
    assert "unhealthy_after_s 2" in killed["reason"]
    assert killed["signals"][0] == "SIGTERM"
    assert not alive(pid)
    launcher.notify.drain()
    assert any(m[0].startswith("STATUS=unhealthy: timeout") for m in launcher.notify.messages)


def test_engine_crash_exits_nonzero_naming_the_signal(launch: Callable[..., Launcher]) -> None:
    """An engine killed by SIGKILL makes the launcher exit 1, naming the signal."""
    launcher = launch()
    launcher.notify.wait_for("READY=1", timeout=30)
    pid = launcher.engine_pid()
    os.kill(pid, signal.SIGKILL)
    assert launcher.wait(timeout=10) == 1
    exited = launcher.event("exited")
    assert exited["level"] == "error"
    assert (exited["returncode"], exited["signal"]) == (-9, "SIGKILL")
    assert exited["reason"] == "engine exited on signal SIGKILL"
    launcher.notify.drain()
    assert ["STATUS=engine exited on signal SIGKILL"] in launcher.notify.messages


def test_sigterm_is_passed_on_and_the_launcher_exits_cleanly(
    launch: Callable[..., Launcher],
) -> None:
    """SIGTERM: STOPPING=1 to systemd, SIGTERM to the engine, exit 0 once it has stopped."""
    launcher = launch()
    launcher.notify.wait_for("READY=1", timeout=30)
    pid = launcher.engine_pid()
    launcher.proc.send_signal(signal.SIGTERM)
    stopping = launcher.notify.wait_for("STOPPING=1", timeout=10)
    assert "STATUS=stopping (SIGTERM)" in stopping
    assert launcher.wait(timeout=FAST["stop_grace_s"] + 10) == 0
    exited = launcher.event("exited")
    assert exited["signals"] == ["SIGTERM"] and exited["returncode"] == 0
    assert launcher.events().index("stopping") < launcher.events().index("exited")
    assert not alive(pid)
    assert not os.path.exists(launcher.socket)


def test_second_signal_kills_at_once(launch: Callable[..., Launcher]) -> None:
    """While the engine drains an in-flight request, a second SIGTERM makes it SIGKILL now."""
    launcher = launch(supervise={"stop_grace_s": 30})
    launcher.notify.wait_for("READY=1", timeout=30)
    pid = launcher.engine_pid()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(launcher.socket)
    body = json.dumps(
        {
            "model": "qwen3.8-27b",
            "messages": [{"role": "user", "content": "hi"}],
            "sim": {"hang": True},
        }
    ).encode()
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        time.sleep(0.5)
        launcher.proc.send_signal(signal.SIGTERM)
        launcher.notify.wait_for("STOPPING=1", timeout=10)
        time.sleep(0.3)
        assert alive(pid), "the engine should still be draining its hung request"
        second = time.monotonic()
        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=10) == 1
        assert time.monotonic() - second < 3
    finally:
        client.close()
    exited = launcher.event("exited")
    assert exited["signals"] == ["SIGTERM", "SIGKILL"]
    assert not alive(pid)


def test_stale_socket_is_removed_before_start(
    launch: Callable[..., Launcher], workdir: Path
) -> None:
    """A socket file left by a dead engine is removed, then the engine starts on the same path."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(workdir / "e.sock"))
    stale.close()
    assert os.path.exists(workdir / "e.sock")
    launcher = launch()
    launcher.notify.wait_for("READY=1", timeout=30)
    removed = launcher.event("stale_socket_removed")
    assert removed["socket"] == launcher.socket
    assert launcher.events().index("stale_socket_removed") < launcher.events().index("spawn")


def test_live_socket_or_other_file_blocks_start(
    launch: Callable[..., Launcher], workdir: Path
) -> None:
    """A socket someone accepts on, or a non-socket file, is left alone and the start refused."""
    path = workdir / "e.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(1)
    try:
        launcher = launch()
        assert launcher.wait(timeout=20) == 1
        refused = launcher.event("start_refused")
        assert "another engine is running" in refused["error"]
        assert "spawn" not in launcher.events()
    finally:
        live.close()
    path.unlink()
    path.write_text("not a socket")
    launcher = launch()
    assert launcher.wait(timeout=20) == 1
    assert "is not a socket" in launcher.event("start_refused")["error"]
    assert path.read_text() == "not a socket"


def test_engine_never_healthy_is_killed_at_start_timeout(launch: Callable[..., Launcher]) -> None:
    """An engine still loading at start_timeout_s is killed; no READY=1; exit status 1."""
    launcher = launch(supervise={"start_timeout_s": 3}, engine={"extra_args": ["--load-s", "60"]})
    started = time.monotonic()
    assert launcher.wait(timeout=30) == 1
    assert time.monotonic() - started <= 3 + FAST["stop_grace_s"] + MARGIN_S + 2
    killed = launcher.event("killed")
    assert "start_timeout_s (3 s)" in killed["reason"]
    assert launcher.event("waiting")["state"] == "refused"
    launcher.notify.drain()
    assert not any("READY=1" in m for m in launcher.notify.messages)


def test_engine_exiting_during_start_is_reported_with_its_code(
    launch: Callable[..., Launcher],
) -> None:
    """An engine that exits at once (bad flag value) makes the launcher exit 1 naming code 2."""
    launcher = launch(engine={"extra_args": ["--max-num-batched-tokens", "many"]})
    assert launcher.wait(timeout=30) == 1
    exited = launcher.event("exited")
    assert (exited["returncode"], exited["signal"]) == (2, None)
    assert exited["reason"] == "engine exited with code 2"


def test_failed_warmup_is_logged_and_does_not_block_ready(launch: Callable[..., Launcher]) -> None:
    """A warm-up the engine rejects (prompt longer than max_model_len) is logged; READY=1 follows."""
    launcher = launch(engine={"max_model_len": 8})
    ready = launcher.notify.wait_for("READY=1", timeout=30)
    assert any(item.endswith("(warm-up failed)") for item in ready)
    warmup = launcher.event("warmup")
    assert warmup["ok"] is False and warmup["status"] == 400
    assert warmup["level"] == "warning"
    assert launcher.event("ready")["warmup_failures"] == 1


def test_stale_socket_helper_only_removes_dead_sockets(workdir: Path) -> None:
    """remove_stale_socket: an absent path is left alone, a socket nobody accepts on is removed."""
    path = str(workdir / "s.sock")
    assert remove_stale_socket(path) is False
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()
    assert remove_stale_socket(path) is True
    assert not os.path.exists(path)


def test_exit_descriptions_name_code_or_signal() -> None:
    """Exit statuses read as 'code N' or 'signal NAME' (asyncio reports signals as negatives)."""
    assert describe_exit(3) == ("engine exited with code 3", None)
    assert describe_exit(-15) == ("engine exited on signal SIGTERM", "SIGTERM")
