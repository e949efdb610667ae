"""Shared fixtures: the engine simulator and the gateway as real processes on short temp paths."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
ALIAS = "qwen3.8-27b"
KEY_A = "sk-q38-testAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
KEY_B = "sk-q38-testBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
KEY_C = "sk-q38-testCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"

# The `engine` fixture (real vLLM and the simulator, started by the launcher) and its markers;
# the layers (`fast`, `slow`) and the grouping of files under pytest-xdist.
# pytester runs pytest in-process on generated files (tests/test_layers.py); the live deployment
# tests' session fixtures (Docker, root filesystems, the image: tests/deploylive_fixtures.py).
pytest_plugins = (
    "tests.layers",
    "tests.realengine.fixtures",
    "pytester",
    "tests.deploylive_fixtures",
)


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that this process has not handed out.

    The kernel may give the same ephemeral port to two probes in a row once the first is closed,
    so two calls for one gateway (server and metrics) could collide; a port is never handed out
    twice (the memory is dropped after 10,000 ports, a third of Linux's ephemeral range).
    """
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port not in _HANDED_OUT:
            break
    if len(_HANDED_OUT) >= 10_000:
        _HANDED_OUT.clear()
    _HANDED_OUT.add(port)
    return port


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """Serialise nested dicts of scalars and lists as TOML tables (enough for our configs)."""
    scalars, tables, arrays = [], [], []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            arrays.append((key, value))
        else:
            scalars.append(f"{key} = {json.dumps(value)}")
    out = []
    if prefix and (scalars or not tables):
        out.append(f"[{prefix}]")
    out.extend(scalars)
    out.append("")
    for key, value in tables:
        out.append(to_toml(value, f"{prefix}.{key}" if prefix else key))
    for key, items in arrays:  # [[key]] arrays of tables of scalars (``engines``)
        for item in items:
            out.append(f"[[{key}]]")
            out.extend(f"{k} = {json.dumps(v)}" for k, v in item.items())
            out.append("")
    return "\n".join(out)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def _stop(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@dataclass
class Sim:
    """A running engine simulator process."""

    socket: str
    record: Path
    proc: subprocess.Popen[bytes]
    args: list[str]

    def records(self) -> list[dict[str, Any]]:
        """Requests the simulator received so far (its ``--record`` lines)."""
        if not self.record.exists():
            return []
        lines = self.record.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def model_records(self) -> list[dict[str, Any]]:
        """Recorded requests other than health probes, metrics scrapes and prompt counts."""
        return [
            r for r in self.records() if r.get("path") not in ("/health", "/metrics", "/tokenize")
        ]

    def stop(self) -> None:
        _stop(self.proc)

    def restart(self) -> None:
        """Start the simulator again with the same arguments (after `stop` or a crash)."""
        _stop(self.proc)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        self.proc = subprocess.Popen(self.args, cwd=REPO)
        assert wait_until(lambda: os.path.exists(self.socket), 15), "simulator did not restart"


@dataclass
class Gateway:
    """A running gateway process and how to reach it."""

    base_url: str
    metrics_url: str
    config_path: Path
    keys_file: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    sim: Sim | None
    extra: dict[str, Any] = field(default_factory=dict)

    def logs(self) -> list[dict[str, Any]]:
        """Every JSON log line the gateway wrote to stdout so far, parsed."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            line = line.strip()
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def access_logs(self) -> list[dict[str, Any]]:
        """The access lines (event ``request``)."""
        return [entry for entry in self.logs() if entry.get("event") == "request"]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.metrics_url, timeout=5).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    total += sample.value
        return total

    def url(self, path: str) -> str:
        return self.base_url + path

    def read_through(self, key: str, body: dict[str, Any], timeout: float) -> int:
        """POST ``body`` to chat completions with ``key`` and read the answer to its end, as a
        client holding the engine would; returns the status."""
        with httpx.stream(
            "POST",
            self.url("/v1/chat/completions"),
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout,
        ) as r:
            for _ in r.iter_bytes():
                pass
            return r.status_code


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short private temp directory (Unix socket paths must stay under ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="q38-", dir="/tmp"))
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_sim(workdir: Path, *extra: str, name: str = "engine") -> Sim:
    """Start ``python -m engine.sim`` on ``workdir/<name>.sock`` with ``--record``."""
    sock = str(workdir / f"{name}.sock")
    record = workdir / f"{name}-record.jsonl"
    args = [
        sys.executable, "-m", "engine.sim",
        "--socket", sock,
        "--served-model-name", ALIAS,
        "--record", str(record),
        "--tokens-per-second", "0",
        *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(args, cwd=REPO)
    if not wait_until(lambda: os.path.exists(sock), 15):
        _stop(proc)
        raise RuntimeError("simulator did not start")
    return Sim(socket=sock, record=record, proc=proc, args=args)


DEFAULT_KEYS = {"KEY_A": ("acme", KEY_A), "KEY_B": ("beta", KEY_B), "KEY_C": ("carol", KEY_C)}


def write_keys(path: Path, keys: dict[str, tuple[str, str]], extra: str = "") -> None:
    """Write a 0600 keys file with plaintext ``ID=tenant:secret`` lines."""
    lines = ["# test keys"] + [f"{kid}={tenant}:{secret}" for kid, (tenant, secret) in keys.items()]
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("\n".join(lines) + "\n" + extra)
    os.replace(tmp, path)


# Starts of a gateway whose ports `free_port` picked: another process may bind one between the
# pick and the gateway's own bind (many servers start side by side under pytest-xdist).
PORT_ATTEMPTS = 3


def start_gateway(
    workdir: Path,
    sim: Sim | None,
    config: dict[str, Any] | None = None,
    keys: dict[str, tuple[str, str]] | None = None,
    *,
    wait_ready: bool = True,
    name: str = "gw",
    env: dict[str, str] | None = None,
) -> Gateway:
    """Start ``python -m gateway serve`` with a generated config merged over test defaults.

    The ports a test does not fix are picked by `free_port`; a gateway that cannot listen
    because one of them was taken meanwhile is started again on new ones (`PORT_ATTEMPTS`).

    Raises:
        RuntimeError: the gateway exited or did not become ready in 20 s (its log's end).
    """
    keys_file = workdir / f"{name}-keys.env"
    if not keys_file.exists():
        write_keys(keys_file, DEFAULT_KEYS if keys is None else keys)
    fixed = any("port" in (config or {}).get(section, {}) for section in ("server", "metrics"))
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _launch_gateway(workdir, sim, config, keys_file, wait_ready, name, env)
        except RuntimeError as exc:
            taken = "cannot listen" in str(exc) and "address already in use" in str(exc)
            if fixed or not taken:
                raise
    return _launch_gateway(workdir, sim, config, keys_file, wait_ready, name, env)


def _launch_gateway(
    workdir: Path,
    sim: Sim | None,
    config: dict[str, Any] | None,
    keys_file: Path,
    wait_ready: bool,
    name: str,
    env: dict[str, str] | None,
) -> Gateway:
    """One start of `start_gateway` on newly picked ports."""
    port, metrics_port = free_port(), free_port()
    base: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 5.0},
        "metrics": {"host": "127.0.0.1", "port": metrics_port, "engine_scrape_cache_s": 0.0},
        "engine": {
            "socket": sim.socket if sim else str(workdir / "absent.sock"),
            "health_interval_s": 0.2,
        },
        "auth": {"keys_file": str(keys_file), "reload_poll_s": 0.2},
        "ledger": {"path": str(workdir / f"{name}-usage.sqlite3"), "flush_interval_s": 0.2},
        "quarantine": {"state_file": str(workdir / f"{name}-quarantine.json"), "poll_s": 0.2},
        "logging": {"level": "debug"},
        "tenants": {
            "default": {"rpm": 10_000, "tpm": 100_000_000, "concurrency": 64},
            "acme": {},
            "beta": {},
        },
    }
    for section, values in (config or {}).items():
        if section == "engines":  # several engines: their sockets are in their own tables
            base["engines"] = values
            del base["engine"]["socket"]
        elif section == "tenants":
            for tenant, table in values.items():
                base["tenants"].setdefault(tenant, {}).update(table)
        else:
            base.setdefault(section, {}).update(values)
    port, metrics_port = base["server"]["port"], base["metrics"]["port"]  # a test may fix them
    config_path = workdir / f"{name}.toml"
    config_path.write_text(to_toml(base))
    log_path = workdir / f"{name}.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config_path)],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    log_file.close()
    scheme = "https" if base["server"].get("tls_cert_file") else "http"
    gw = Gateway(
        base_url=f"{scheme}://127.0.0.1:{port}",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        config_path=config_path,
        keys_file=keys_file,
        log_path=log_path,
        proc=proc,
        sim=sim,
    )

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {log_path.read_text()[-2000:]}")
        try:
            r = httpx.get(gw.url("/ready" if wait_ready else "/health"), timeout=1, verify=False)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    if not wait_until(up, 20):
        _stop(proc)
        raise RuntimeError(f"gateway did not become ready: {log_path.read_text()[-2000:]}")
    return gw


@pytest.fixture
def sim_factory(workdir: Path) -> Iterator[Callable[..., Sim]]:
    """Start simulators for one test; all are stopped after it."""
    started: list[Sim] = []

    def factory(*extra: str, name: str = "engine") -> Sim:
        sim = start_sim(workdir, *extra, name=name)
        started.append(sim)
        return sim

    yield factory
    for sim in started:
        sim.stop()


@pytest.fixture
def gateway_factory(workdir: Path) -> Iterator[Callable[..., Gateway]]:
    """Start gateways for one test; all are stopped after it."""
    started: list[Gateway] = []

    def factory(sim: Sim | None, config: dict[str, Any] | None = None, **kwargs: Any) -> Gateway:
        gw = start_gateway(workdir, sim, config, **kwargs)
        started.append(gw)
        return gw

    yield factory
    for gw in started:
        _stop(gw.proc)


@contextlib.contextmanager
def running_stack(
    config: dict[str, Any] | None = None,
    keys: dict[str, tuple[str, str]] | None = None,
    keys_extra: str = "",
) -> Iterator[Gateway]:
    """A simulator and a gateway in a private temp dir, stopped and removed on exit."""
    path = Path(tempfile.mkdtemp(prefix="q38m-", dir="/tmp"))
    os.chmod(path, 0o700)
    if keys is not None or keys_extra:
        write_keys(path / "gw-keys.env", DEFAULT_KEYS if keys is None else keys, keys_extra)
    sim = start_sim(path)
    try:
        gw = start_gateway(path, sim, config)
        try:
            yield gw
        finally:
            _stop(gw.proc)
    finally:
        sim.stop()
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def stack() -> Iterator[Gateway]:
    """One simulator and one gateway shared by a test module (tenants acme, beta, carol)."""
    with running_stack() as gw:
        yield gw
