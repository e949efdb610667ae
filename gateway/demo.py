"""``qwen38-gateway demo``: the engine simulator and the gateway in front of it, no config needed."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from engine.command import build_launch
from engine.config import EngineConfig
from gateway.config import Settings, load_settings


def demo_config(workdir: Path, host: str, port: int, metrics_port: int, engines: int = 1) -> str:
    """The demo's gateway.toml: a private socket, keys file, ledger and quarantine state under
    ``workdir`` (nothing of the demo outlives it or touches a deployment's ``/var/lib/qwen38``),
    generous limits. Written to ``workdir/gateway.toml`` so that the commands the demo prints
    (``keys add --wait``, ``usage report``) find this gateway, its keys file and its ledger with
    ``--config`` alone.

    ``engines`` > 1: that many simulators as ``[[engines]]`` ``sim0``, ``sim1``, ... (sockets
    ``sim0.sock``, ...), one slot each.
    """
    if engines > 1:
        engine = "\n".join(
            f'[[engines]]\nname = "sim{i}"\nsocket = {json.dumps(str(workdir / f"sim{i}.sock"))}\n'
            for i in range(engines)
        )
    else:
        engine = f"socket = {json.dumps(str(workdir / 'engine.sock'))}\n"
    single = engine if engines == 1 else ""
    several = engine if engines > 1 else ""
    return f"""# qwen38-gateway demo (removed on exit)
[server]
host = {json.dumps(host)}
port = {port}
shutdown_grace_s = 2.0
plain_http = true

[metrics]
host = "127.0.0.1"
port = {metrics_port}

[engine]
health_interval_s = 0.5
{single}
[auth]
keys_file = {json.dumps(str(workdir / "api-keys.env"))}

[ledger]
path = {json.dumps(str(workdir / "usage.sqlite3"))}

[quarantine]
state_file = {json.dumps(str(workdir / "quarantine.json"))}

[tenants.default]
rpm = 600
tpm = 2000000
concurrency = 8

[tenants.demo]

{several}"""


def demo_settings(
    workdir: Path, host: str, port: int, metrics_port: int, engines: int = 1
) -> Settings:
    """`demo_config` written to ``workdir/gateway.toml`` and loaded from there."""
    path = workdir / "gateway.toml"
    path.write_text(demo_config(workdir, host, port, metrics_port, engines))
    return load_settings(str(path))


# A simulator that exits this many times within RESTART_WINDOW_S is not started again: the demo
# stops (exit 1) instead of looping on one that cannot start.
RESTART_LIMIT = 10
RESTART_WINDOW_S = 30.0
# How often the demo looks for a simulator that exited (seconds).
SUPERVISE_INTERVAL_S = 0.2


def _wait_for_socket(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (in use, not allowed), or None when it can.

    Binds a throw-away TCP socket with ``SO_REUSEADDR``, as the gateway's listener does, so a
    port only in TIME_WAIT is not reported.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host}: {exc.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use"
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None


def simulator_argv(
    settings: Settings, tokens_per_second: float, socket_path: str = "", faults: bool = False
) -> list[str]:
    """The simulator's command line: the vLLM flags the launcher gives the real engine
    (`engine.command.build_launch`, so tools, reasoning parser and one sequence at a time
    behave as in production), then the simulator's pace; on ``socket_path`` (default: the
    first engine's socket).

    ``faults`` False (the default): ``--request-control off``, so a request body's ``"sim"``
    object is ignored and no client can crash or hold the demo's engine; True: honoured.
    """
    engine = EngineConfig(
        program=(sys.executable, "-m", "engine.sim"),
        model_path="/models/Qwen3.8-27B-demo",
        served_model=settings.engine.model,
        socket=socket_path or settings.engine_specs[0].socket,
        max_model_len=settings.engine.max_model_len,
    )
    launch = build_launch(engine)
    control = "on" if faults else "off"
    return [
        *launch.argv,
        "--tokens-per-second",
        str(tokens_per_second),
        "--request-control",
        control,
    ]


def exit_description(status: int) -> str:
    """A process's exit as words: ``status 70``, or ``killed by SIGKILL`` for a negative
    `subprocess.Popen.returncode`."""
    if status >= 0:
        return f"status {status}"
    try:
        return f"killed by {signal.Signals(-status).name}"
    except ValueError:
        return f"killed by signal {-status}"


def _last_line(path: Path) -> str:
    """The last line of a log file, or "" when it is empty or unreadable."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


@dataclass
class DemoEngine:
    """One simulator of the demo: its engine name, socket, command line and log file."""

    name: str
    socket: Path
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    exits: deque[float] = field(default_factory=deque)

    def start(self) -> subprocess.Popen[bytes]:
        """Start the simulator (stderr appended to `log`), after removing a socket file a
        crashed one left; the new process is also kept in `proc`. Its own session: a Ctrl-C
        at the terminal reaches the demo alone, which stops its simulators after the
        gateway's drain.

        Raises OSError when the log cannot be opened or the program cannot be run.
        """
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
            )
        return self.proc


class Supervisor:
    """Starts the demo's simulators again when they exit, until the demo stops.

    A thread polls each simulator every `SUPERVISE_INTERVAL_S`. An exit is reaped (no zombie),
    reported in one line on stderr (engine name, exit status) and followed by a new start on
    the same socket; the gateway's health checks see the engine come back. The
    `RESTART_LIMIT`-th exit within `RESTART_WINDOW_S` is not: one line says so and
    the ``on_give_up`` given to `watch` is called (from the thread) to stop the demo.
    """

    def __init__(self, engines: list[DemoEngine]) -> None:
        self.engines = engines
        self.gave_up = False
        self._on_give_up: Callable[[], object] = lambda: None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="demo-supervisor", daemon=True)

    def watch(self, on_give_up: Callable[[], object]) -> None:
        """Start watching the simulators (all started already); ``on_give_up`` is called from
        the watching thread when one exits too often."""
        self._on_give_up = on_give_up
        self._thread.start()

    def stop(self) -> None:
        """Stop watching, then stop every simulator: SIGTERM, SIGKILL after 5 s, reaped."""
        with self._lock:
            self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        procs = [engine.proc for engine in self.engines if engine.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _run(self) -> None:
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            for engine in self.engines:
                proc = engine.proc
                if proc is None or proc.poll() is None:
                    continue
                with self._lock:
                    if self._stopping.is_set():
                        return
                    if not self._restart(engine, proc.pid, proc.returncode):
                        self.gave_up = True
                        self._stopping.set()
                        break
        if self.gave_up:
            self._on_give_up()

    def _restart(self, engine: DemoEngine, pid: int, status: int) -> bool:
        """Report the exit and start ``engine`` again; False (nothing started) at the limit."""
        now = time.monotonic()
        engine.exits.append(now)
        while engine.exits and engine.exits[0] < now - RESTART_WINDOW_S:
            engine.exits.popleft()
        said = _last_line(engine.log)
        said = "" if said.startswith("engine simulator: serving on") else said
        if len(engine.exits) >= RESTART_LIMIT:
            print(
                f'qwen38-gateway demo: engine simulator "{engine.name}" exited '
                f"{len(engine.exits)} times within {RESTART_WINDOW_S:g} s "
                f"(last: {exit_description(status)}); stopping the demo"
                + (f"; it said: {said}" if said else ""),
                file=sys.stderr,
                flush=True,
            )
            return False
        print(
            f'qwen38-gateway demo: engine simulator "{engine.name}" (pid {pid}) '
            f"exited ({exit_description(status)}); starting it again on {engine.socket}",
            file=sys.stderr,
            flush=True,
        )
        try:
            engine.start()
        except OSError as exc:
            print(
                f'qwen38-gateway demo: engine simulator "{engine.name}" cannot be started '
                f"again ({exc}); stopping the demo",
                file=sys.stderr,
                flush=True,
            )
            return False
        return True


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


async def _serve_supervised(settings: Settings, supervisor: Supervisor) -> int:
    """The gateway (`gateway.server.serve`) until it stops (its exit code) or the supervisor
    gives up (the gateway is cancelled; 1)."""
    from gateway.server import serve

    loop = asyncio.get_running_loop()
    serving = asyncio.ensure_future(serve(settings, None))
    given_up = loop.create_future()

    def give_up() -> None:
        if not given_up.done():
            given_up.set_result(None)

    supervisor.watch(lambda: loop.call_soon_threadsafe(give_up))
    await asyncio.wait((serving, given_up), return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        given_up.cancel()
        return serving.result()
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    return 1


def run_demo(
    host: str,
    port: int,
    metrics_port: int,
    tokens_per_second: float,
    engines: int = 1,
    faults: bool = False,
) -> int:
    """Start the simulator(s) and the gateway, print a demo key and examples, run until Ctrl-C.

    ``engines``: simulators behind the gateway (``--engines N``), each its own process, socket
    and slot, as one engine per GPU. ``faults`` (``--faults``): the simulators honour a
    request body's ``"sim"`` object (fault injection); without it they ignore it, so no client
    can crash or hold the demo's engines. A simulator that exits is started again
    (`Supervisor`); one that exits `RESTART_LIMIT` times within `RESTART_WINDOW_S` stops the
    demo.

    Both ports are checked first: when one is taken, one line says which flag (``--port``,
    ``--metrics-port``) picks another, and nothing else is printed or started. Returns the
    exit code (0 after Ctrl-C or SIGTERM, 1 when something could not start or a simulator kept
    exiting).
    """
    from gateway.logs import configure_logging
    from gateway.server import install_uvloop

    for flag, where, number in (
        ("--port", host, port),
        ("--metrics-port", "127.0.0.1", metrics_port),
    ):
        problem = port_problem(where, number)
        if problem is not None:
            print(f"qwen38-gateway demo: {problem}; pass {flag} N to use another", file=sys.stderr)
            return 1
    if port == metrics_port:
        print("qwen38-gateway demo: --port and --metrics-port must differ", file=sys.stderr)
        return 1

    workdir = Path(tempfile.mkdtemp(prefix="q38demo-", dir="/tmp"))
    settings = demo_settings(workdir, host, port, metrics_port, engines)
    secret = "sk-q38-demo-" + secrets.token_urlsafe(24)
    keys_file = workdir / "api-keys.env"
    fd = os.open(keys_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("# demo key, created by qwen38-gateway demo\n")
        handle.write(f"DEMO=demo:{secret}\n")

    supervisor = Supervisor(
        [
            DemoEngine(
                name=spec.name,
                socket=Path(spec.socket),
                argv=simulator_argv(settings, tokens_per_second, spec.socket, faults),
                log=workdir / f"{spec.name}.log",
            )
            for spec in settings.engine_specs
        ]
    )
    # The simulators run in their own sessions: until the gateway's handlers are in place, a
    # SIGTERM stops the demo through the `finally` below, which stops them too.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for engine in supervisor.engines:
            sim = engine.start()
            if not _wait_for_socket(engine.socket, sim, 60.0):
                said = _last_line(engine.log)
                print(
                    "qwen38-gateway demo: the engine simulator did not start"
                    + (f": {said}" if said else ""),
                    file=sys.stderr,
                )
                return 1
        base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        key_files = _write_key_files(workdir, secret)
        _print_examples(base, settings, secret, key_files, engines, faults)
        configure_logging("info")
        install_uvloop()
        try:
            return asyncio.run(_serve_supervised(settings, supervisor))
        except KeyboardInterrupt:
            return 1 if supervisor.gave_up else 0
    except KeyboardInterrupt:
        return 0
    finally:
        supervisor.stop()
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(workdir, ignore_errors=True)


def _write_key_files(workdir: Path, secret: str) -> tuple[Path, Path]:
    """The demo key in two 0600 files: the key alone, and curl's ``-H @file`` header line, so
    the printed commands never carry it on a command line (``ps``, shell history)."""
    paths = (workdir / "api-key", workdir / "auth-header")
    for path, text in zip(paths, (secret, f"Authorization: Bearer {secret}"), strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text + "\n")
    return paths


def _print_examples(
    base: str,
    settings: Settings,
    secret: str,
    key_files: tuple[Path, Path],
    engines: int = 1,
    faults: bool = False,
) -> None:
    what = "engine simulator" if engines == 1 else f"{engines} engine simulators"
    if faults:
        control = (
            'Fault injection: on (--faults): a request\'s "sim" object sets its behaviour, e.g.\n'
            '  "sim": {"exit_after": 3} crashes the engine (the demo starts it again), '
            '"sim": {"hang": true}\n  holds it (engine/sim/README.md, Behaviour).'
        )
    else:
        control = (
            'Fault injection: off: a request\'s "sim" object is ignored (--faults turns it on).'
        )
    alias = settings.model.alias
    config = shlex.quote(str(settings.source))
    key_file, header_file = (shlex.quote(str(path)) for path in key_files)
    bash_prompt = shlex.quote("Run `ls` with the Bash tool")
    print(
        f"""
qwen38-gateway demo: {what} + gateway on {base}
API key (tenant "demo", 600 requests and 2,000,000 tokens a minute): {secret}
Config (removed on exit, with everything below): {settings.source}
  keys file: {settings.auth.keys_file}
  ledger:    {settings.ledger.path}
  key:       {key_files[0]} (the key alone), {key_files[1]} (curl's header line)

Commands against this demo (--config names its port, keys file and ledger):
  qwen38-gateway keys add --tenant demo --config {config} --wait
  qwen38-gateway usage report --config {config}

curl (streaming, thinking on by default; the key read from a file, not on the command line):
  curl -N {base}/v1/chat/completions -H @{header_file} -H "Content-Type: application/json" \\
    -d '{{"model": "{alias}", "stream": true, "messages": [{{"role": "user", "content": "Hello!"}}]}}'

Python (pip install openai):
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key=open({str(key_files[0])!r}).read().strip())
  r = client.chat.completions.create(model="{alias}",
      messages=[{{"role": "user", "content": "Hello!"}}],
      extra_body={{"chat_template_kwargs": {{"enable_thinking": False}}}})
  print(r.choices[0].message.content)

Claude Code (README, Clients): the simulated model calls the tool the prompt names, a shell
tool (Bash) otherwise, with the `quoted` text as its command:
  ANTHROPIC_BASE_URL={base} ANTHROPIC_AUTH_TOKEN=$(cat {key_file}) ANTHROPIC_MODEL={alias} \\
    claude -p {bash_prompt} --allowedTools Bash --output-format json

Tool calling works as in production (the simulator runs with the launcher's vLLM flags): give
`tools` and the simulated model calls one (named in the prompt, else a shell tool, else the
first; or the one `tool_choice` names) with arguments that fit its parameters, then answers in
text once it gets the tool result.

{control}
A simulator that exits is started again (one line on stderr).

Metrics: curl http://127.0.0.1:{settings.metrics.port}/metrics    Readiness: curl {base}/ready
Press Ctrl-C to stop.
""",
        flush=True,
    )
