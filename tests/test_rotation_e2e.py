"""Key rotation against the running gateway: add, revoke, tokens, broken files, SIGHUP, startup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import (
    ALIAS,
    DEFAULT_KEYS,
    KEY_A,
    KEY_B,
    REPO,
    Gateway,
    Sim,
    free_port,
    wait_until,
)

Factory = Callable[..., Any]


def cli(gw: Gateway, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m gateway <argv> --keys-file <the gateway's keys file>``."""
    return subprocess.run(
        [sys.executable, "-m", "gateway", *argv, "--keys-file", str(gw.keys_file)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    )


def status(gw: Gateway, credential: str) -> int:
    """Status of ``GET /v1/models`` with ``credential``."""
    headers = {"Authorization": f"Bearer {credential}"}
    return httpx.get(gw.url("/v1/models"), headers=headers, timeout=5).status_code


def seconds_until_status(gw: Gateway, credential: str, code: int, timeout: float = 5.0) -> float:
    """Seconds until ``credential`` gets ``code`` on /v1/models (inf when it never does)."""
    start = time.monotonic()
    if not wait_until(lambda: status(gw, credential) == code, timeout, interval=0.05):
        return float("inf")
    return time.monotonic() - start


def stream_chat(gw: Gateway, key: str, started: threading.Event) -> dict[str, Any]:
    """A streaming chat request; sets ``started`` at the first event; returns what it saw."""
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": True,
        "max_tokens": 90,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    seen: dict[str, Any] = {"events": 0, "done": False, "errors": [], "finish": None}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", gw.url("/v1/chat/completions"), json=body, headers=headers, timeout=60
    ) as response:
        seen["status"] = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            started.set()
            data = line[len("data: ") :]
            if data == "[DONE]":
                seen["done"] = True
                continue
            event = json.loads(data)
            if "error" in event:
                seen["errors"].append(event)
            for choice in event.get("choices", []):
                seen["finish"] = choice.get("finish_reason") or seen["finish"]
            seen["events"] += 1
    seen["ended_at"] = time.monotonic()
    return seen


def assert_no_secrets(gw: Gateway, *secrets: str) -> None:
    """None of ``secrets`` (nor a 12-character piece of one) is in the gateway's log."""
    text = gw.log_path.read_text(errors="replace")
    for secret in secrets:
        assert secret not in text
        assert secret[len(secret) // 2 : len(secret) // 2 + 12] not in text


def test_revoked_key_stream_finishes_and_next_request_gets_401(
    sim_factory: Factory, gateway_factory: Factory
) -> None:
    """Revoking a key mid-stream: the stream completes, new requests get 401 within 2 s."""
    sim: Sim = sim_factory("--tokens-per-second", "15")
    gw: Gateway = gateway_factory(sim)
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running: Future[dict[str, Any]] = pool.submit(stream_chat, gw, KEY_A, started)
        assert started.wait(15), "stream did not start"
        cli(gw, "keys", "revoke", "KEY_A")
        revoked_at = time.monotonic()
        assert seconds_until_status(gw, KEY_A, 401) < 2.0
        refused_at = time.monotonic()
        assert not running.done(), "the stream should still be running when the 401 arrives"
        seen = running.result(timeout=60)
    assert seen["status"] == 200
    assert seen["done"] and not seen["errors"] and seen["finish"] in ("length", "stop")
    assert seen["ended_at"] > refused_at > revoked_at
    assert status(gw, KEY_B) == 200
    assert gw.metric("gateway_keys_loaded") == len(DEFAULT_KEYS) - 1
    assert_no_secrets(gw, KEY_A, KEY_B)


def test_key_added_with_the_cli_works_within_2s(
    sim_factory: Factory, gateway_factory: Factory
) -> None:
    """keys add on a running gateway: the new secret is accepted within 2 s."""
    gw: Gateway = gateway_factory(sim_factory())
    added = cli(gw, "keys", "add", "--tenant", "beta")
    secret = added.stdout.splitlines()[-1]
    assert seconds_until_status(gw, secret, 200) < 2.0
    assert gw.metric("gateway_keys_loaded") == len(DEFAULT_KEYS) + 1
    ok = [e for e in gw.logs() if e.get("event") == "reload_ok"]
    assert ok and ok[-1]["keys"] == len(DEFAULT_KEYS) + 1
    assert_no_secrets(gw, secret)


def test_issued_token_works_and_dies_with_its_signing_key(
    sim_factory: Factory, gateway_factory: Factory
) -> None:
    """token issue creates a signing key the gateway accepts within 2 s; revoking it ends tokens."""
    gw: Gateway = gateway_factory(sim_factory())
    issued = cli(gw, "token", "issue", "--tenant", "acme", "--ttl", "300")
    token = issued.stdout.splitlines()[-1]
    assert seconds_until_status(gw, token, 200) < 2.0
    signing = [line.split("=")[0] for line in gw.keys_file.read_text().splitlines()]
    (name,) = [n for n in signing if n.startswith("JWT_")]
    cli(gw, "keys", "revoke", name)
    assert seconds_until_status(gw, token, 401) < 2.0
    assert gw.metric("gateway_auth_failures_total", reason="revoked") >= 1
    assert_no_secrets(gw, token)


def test_broken_keys_file_keeps_the_old_keys(
    sim_factory: Factory, gateway_factory: Factory
) -> None:
    """A keys file that fails to parse is not applied; the error is logged with its line."""
    gw: Gateway = gateway_factory(sim_factory())
    errors_before = gw.metric("gateway_config_reloads_total", result="error")
    original = gw.keys_file.read_text()
    broken = gw.keys_file.with_name("broken.tmp")
    fd = os.open(broken, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(f"KEY_B=beta:{KEY_B}\nthis line is wrong\n")
    os.replace(broken, gw.keys_file)
    assert wait_until(
        lambda: gw.metric("gateway_config_reloads_total", result="error") > errors_before, 3
    )
    assert status(gw, KEY_A) == 200, "the previous keys stay in force"
    failed = [e for e in gw.logs() if e.get("event") == "reload_failed"]
    assert failed[-1]["problems"] == [f"{gw.keys_file}:2: expected NAME=VALUE"]
    gw.keys_file.write_text(original)
    assert seconds_until_status(gw, KEY_A, 200) < 2.0
    assert_no_secrets(gw, KEY_A, KEY_B)


def test_group_readable_keys_file_is_refused_on_reload(
    sim_factory: Factory, gateway_factory: Factory
) -> None:
    """chmod 640 on the running gateway's keys file fails the reload and keeps the keys."""
    gw: Gateway = gateway_factory(sim_factory())
    gw.keys_file.chmod(0o640)
    assert wait_until(lambda: gw.metric("gateway_config_reloads_total", result="error") >= 1, 3)
    assert status(gw, KEY_A) == 200
    failed = [e for e in gw.logs() if e.get("event") == "reload_failed"]
    assert "chmod 600" in failed[-1]["problems"][0]


def test_sighup_reloads_without_polling(sim_factory: Factory, gateway_factory: Factory) -> None:
    """With polling slowed to a minute, SIGHUP alone applies a revocation at once."""
    gw: Gateway = gateway_factory(sim_factory(), {"auth": {"reload_poll_s": 60}})
    cli(gw, "keys", "revoke", "KEY_B")
    time.sleep(0.5)
    assert status(gw, KEY_B) == 200, "no reload yet: polling is slow"
    gw.proc.send_signal(signal.SIGHUP)
    assert seconds_until_status(gw, KEY_B, 401) < 2.0
    assert status(gw, KEY_A) == 200


def test_startup_refuses_a_group_readable_keys_file(workdir: Path) -> None:
    """serve exits 1 with a chmod hint when the keys file is readable by group or others."""
    keys = workdir / "keys.env"
    keys.write_text(f"KEY_A=acme:{KEY_A}\n")
    keys.chmod(0o644)
    config = workdir / "gw.toml"
    config.write_text(
        f'[auth]\nkeys_file = "{keys}"\n'
        f'[server]\nhost = "127.0.0.1"\nport = {free_port()}\n'
        f"[metrics]\nport = {free_port()}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert f"chmod 600 {keys}" in done.stderr
    assert KEY_A not in done.stderr + done.stdout
