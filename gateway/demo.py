"""``qwen38-gateway demo``: the engine simulator and the gateway in front of it, no config needed."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    settings: Settings, tokens_per_second: float, socket_path: str = ""
) -> list[str]:
    """The simulator's command line: the vLLM flags the launcher gives the real engine
    (`engine.command.build_launch`, so tools, reasoning parser and one sequence at a time
    behave as in production), then the simulator's pace; on ``socket_path`` (default: the
    first engine's socket)."""
    engine = EngineConfig(
        program=(sys.executable, "-m", "engine.sim"),
        model_path="/models/Qwen3.8-27B-demo",
        served_model=settings.engine.model,
        socket=socket_path or settings.engine_specs[0].socket,
        max_model_len=settings.engine.max_model_len,
    )
    launch = build_launch(engine)
    return [*launch.argv, "--tokens-per-second", str(tokens_per_second)]


def run_demo(
    host: str, port: int, metrics_port: int, tokens_per_second: float, engines: int = 1
) -> int:
    """Start the simulator(s) and the gateway, print a demo key and examples, run until Ctrl-C.

    ``engines``: simulators behind the gateway (``--engines N``), each its own process, socket
    and slot, as one engine per GPU.

    Both ports are checked first: when one is taken, one line says which flag (``--port``,
    ``--metrics-port``) picks another, and nothing else is printed or started. Returns the
    exit code (0 after Ctrl-C, 1 when something could not start).
    """
    from gateway.logs import configure_logging
    from gateway.server import install_uvloop, serve

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

    sims: list[subprocess.Popen[bytes]] = []
    try:
        for spec in settings.engine_specs:
            sim_log = workdir / f"{spec.name}.log"
            with open(sim_log, "wb") as log:
                sim = subprocess.Popen(
                    simulator_argv(settings, tokens_per_second, spec.socket),
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            sims.append(sim)
            if not _wait_for_socket(Path(spec.socket), sim, 60.0):
                said = sim_log.read_text(errors="replace").strip().splitlines()[-1:]
                print(
                    "qwen38-gateway demo: the engine simulator did not start"
                    + (f": {said[0]}" if said else ""),
                    file=sys.stderr,
                )
                return 1
        base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        key_files = _write_key_files(workdir, secret)
        _print_examples(base, settings, secret, key_files, engines)
        configure_logging("info")
        install_uvloop()
        try:
            return asyncio.run(serve(settings, None))
        except KeyboardInterrupt:
            return 0
    finally:
        for sim in sims:
            sim.terminate()
        for sim in sims:
            try:
                sim.wait(5)
            except subprocess.TimeoutExpired:
                sim.kill()
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
    base: str, settings: Settings, secret: str, key_files: tuple[Path, Path], engines: int = 1
) -> None:
    what = "engine simulator" if engines == 1 else f"{engines} engine simulators"
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

Metrics: curl http://127.0.0.1:{settings.metrics.port}/metrics    Readiness: curl {base}/ready
Press Ctrl-C to stop.
""",
        flush=True,
    )
