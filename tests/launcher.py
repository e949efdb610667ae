"""Test helpers: `qwen38-engine serve` as a real process, with the simulator as its engine."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.procgroup import ProcessGroup
from tests.conftest import REPO, to_toml, wait_until

# Short timings so hangs and stops resolve in seconds (DESIGN section 8 keys).
FAST = {
    "start_timeout_s": 30,
    "health_interval_s": 0.2,
    "probe_timeout_s": 0.5,
    "unhealthy_after_s": 2,
    "stop_grace_s": 2,
    "warmup_max_tokens": 4,
}
MARGIN_S = 4.0  # scheduling slack on a busy 2-core machine


class NotifyListener:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET; a thread keeps every message
    (systemd reads continuously too, so the launcher never meets a full socket queue)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.1)
        self.messages: list[list[str]] = []
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, OSError):
                continue
            self.messages.append(data.decode().split("\n"))

    def wait_for(self, assignment: str, timeout: float, count: int = 1) -> list[str]:
        """Wait until ``count`` messages contain ``assignment``; return the last of them."""
        found: list[list[str]] = []

        def enough() -> bool:
            found[:] = [m for m in list(self.messages) if assignment in m]
            return len(found) >= count

        if not wait_until(enough, timeout):
            raise AssertionError(f"no {assignment!r} within {timeout} s: {self.messages}")
        return found[count - 1]

    def drain(self) -> None:
        """Give the reader a moment to take what is queued."""
        time.sleep(0.2)

    def close(self) -> None:
        self._closed.set()
        self._reader.join(5)
        self.sock.close()


@dataclass
class Launcher:
    """A running `python -m engine serve` and what it told us."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    notify: NotifyListener
    socket: str

    def logs(self) -> list[dict[str, Any]]:
        """The launcher's JSON log lines (component ``launcher``), parsed."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                if entry.get("component") == "launcher":
                    out.append(entry)
        return out

    def events(self) -> list[str]:
        return [entry["event"] for entry in self.logs()]

    def event(self, name: str, timeout: float = 30.0) -> dict[str, Any]:
        """The first log entry with event ``name``, waiting up to ``timeout`` seconds."""
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [e for e in self.logs() if e["event"] == name]
            return bool(found) or self.proc.poll() is not None

        wait_until(seen, timeout)
        assert found, f"no {name!r} event; log: {self.log_path.read_text()[-3000:]}"
        return found[0]

    def engine_pid(self) -> int:
        return int(self.event("spawn")["pid"])

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


def alive(pid: int) -> bool:
    """True while ``pid`` exists (a reaped child no longer does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Launchers:
    """Starts ``python -m engine serve`` processes running the simulator as their engine, all
    in one work directory; `close` kills every launcher and engine process group they made."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[Launcher] = []

    def start(
        self,
        supervise: dict[str, Any] | None = None,
        engine: dict[str, Any] | None = None,
        notify_address: str | None = None,
    ) -> Launcher:
        """One launcher with `FAST` timings overlaid by ``supervise`` and ``engine`` keys."""
        workdir = self.workdir
        started = self.started
        sock = str(workdir / "e.sock")
        config = {
            "engine": {
                "program": [sys.executable, "-m", "engine", "sim"],
                "socket": sock,
                "model_path": str(workdir),
                **(engine or {}),
            },
            "supervise": {**FAST, **(supervise or {})},
        }
        path = workdir / "engine.toml"
        path.write_text(to_toml(config))
        listener = NotifyListener(notify_address or str(workdir / f"notify-{len(started)}.sock"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN38_", "NOTIFY_"))}
        env["NOTIFY_SOCKET"] = listener.address
        log_path = workdir / f"launcher-{len(started)}.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "engine",
                    "serve",
                    "--config",
                    str(path),
                    "--skip-preflight",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env,
            )
        launcher = Launcher(proc, log_path, listener, sock)
        started.append(launcher)
        return launcher

    def close(self) -> None:
        """Stop every launcher (TERM, then KILL) and kill every engine process group."""
        for launcher in self.started:
            if launcher.proc.poll() is None:
                launcher.proc.terminate()
                try:
                    launcher.proc.wait(10)
                except subprocess.TimeoutExpired:
                    launcher.proc.kill()
                    launcher.proc.wait(10)
            # Only groups still led by the engine the launcher spawned (or by nobody): a pid
            # reused since by another test's process group is left alone (engine/procgroup.py).
            for group in engine_groups(launcher.logs()):
                group.signal(signal.SIGKILL)
            launcher.notify.close()


def engine_groups(logs: list[dict[str, Any]]) -> list[ProcessGroup]:
    """The engine process groups a launcher's ``spawn`` events name, with their start times."""
    return [
        ProcessGroup(int(e["pid"]), e.get("start_ticks")) for e in logs if e.get("event") == "spawn"
    ]


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file's object (the launcher's status file)."""
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    return data
