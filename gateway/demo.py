"""``qwen38-gateway demo``: the engine simulator and the gateway in front of it, no config needed."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway.config import Settings, parse_settings


def demo_settings(workdir: Path, host: str, port: int, metrics_port: int) -> Settings:
    """Settings for the demo: a private socket and keys file under ``workdir``, generous limits."""
    return parse_settings(
        {
            "server": {
                "host": host,
                "port": port,
                "shutdown_grace_s": 2.0,
                "plain_http": True,
            },
            "metrics": {"host": "127.0.0.1", "port": metrics_port},
            "engine": {"socket": str(workdir / "engine.sock"), "health_interval_s": 0.5},
            "auth": {"keys_file": str(workdir / "api-keys.env")},
            "ledger": {"path": str(workdir / "usage.sqlite3")},
            "tenants": {
                "default": {"rpm": 600, "tpm": 2_000_000, "concurrency": 8},
                "demo": {},
            },
        },
        source=None,
    )


def _wait_for_socket(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def run_demo(host: str, port: int, metrics_port: int, tokens_per_second: float) -> int:
    """Start the simulator and the gateway, print a demo key and examples, run until Ctrl-C.

    Returns the exit code (0 after Ctrl-C, 1 when something could not start).
    """
    from gateway.logs import configure_logging
    from gateway.server import install_uvloop, serve

    workdir = Path(tempfile.mkdtemp(prefix="q38demo-", dir="/tmp"))
    settings = demo_settings(workdir, host, port, metrics_port)
    secret = "sk-q38-demo-" + secrets.token_urlsafe(24)
    keys_file = workdir / "api-keys.env"
    fd = os.open(keys_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("# demo key, created by qwen38-gateway demo\n")
        handle.write(f"DEMO=demo:{secret}\n")

    sim = subprocess.Popen(
        [
            sys.executable, "-m", "engine.sim",
            "--socket", settings.engine.socket,
            "--served-model-name", settings.engine.model,
            "--max-model-len", str(settings.engine.max_model_len),
            "--tokens-per-second", str(tokens_per_second),
        ],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        if not _wait_for_socket(Path(settings.engine.socket), sim, 20.0):
            print("qwen38-gateway demo: the engine simulator did not start", file=sys.stderr)
            return 1
        base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        _print_examples(base, settings.model.alias, secret, metrics_port, keys_file)
        configure_logging("info")
        install_uvloop()
        try:
            return asyncio.run(serve(settings, None))
        except KeyboardInterrupt:
            return 0
    finally:
        sim.terminate()
        try:
            sim.wait(5)
        except subprocess.TimeoutExpired:
            sim.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def _print_examples(base: str, alias: str, secret: str, metrics_port: int, keys_file: Path) -> None:
    print(
        f"""
qwen38-gateway demo: engine simulator + gateway on {base}
API key (tenant "demo", 600 requests and 2,000,000 tokens a minute): {secret}
Keys file (removed on exit): {keys_file}
  try: qwen38-gateway keys add --tenant demo --keys-file {keys_file}

curl (streaming, thinking on by default):
  curl -N {base}/v1/chat/completions \\
    -H "Authorization: Bearer {secret}" -H "Content-Type: application/json" \\
    -d '{{"model": "{alias}", "stream": true, "messages": [{{"role": "user", "content": "Hello!"}}]}}'

Python (pip install openai):
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="{secret}")
  r = client.chat.completions.create(model="{alias}",
      messages=[{{"role": "user", "content": "Hello!"}}],
      extra_body={{"chat_template_kwargs": {{"enable_thinking": False}}}})
  print(r.choices[0].message.content)

Metrics: curl http://127.0.0.1:{metrics_port}/metrics    Readiness: curl {base}/ready
Press Ctrl-C to stop.
""",
        flush=True,
    )
