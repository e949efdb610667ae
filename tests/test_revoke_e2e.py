"""Revoked keys counted as ``revoked``: a real gateway, its keys file changed by the key CLI."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import httpx
import jwt

from tests.conftest import ALIAS, KEY_A, KEY_B, REPO, Gateway, wait_until

BODY = {"model": ALIAS, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _status(gw: Gateway, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(
        gw.url("/v1/chat/completions"), json=BODY, headers=headers, timeout=30
    ).status_code


def _failures(gw: Gateway, reason: str) -> float:
    return gw.metric("gateway_auth_failures_total", reason=reason) or 0.0


def test_revoked_key_is_counted_as_revoked(sim_factory: Any, gateway_factory: Any) -> None:
    """A key removed by `keys revoke` gets 401 counted as revoked; a never-known key as unknown."""
    gw = gateway_factory(sim_factory())
    assert _status(gw, KEY_B) == 200
    revoke = subprocess.run(
        [sys.executable, "-m", "gateway", "keys", "revoke", "KEY_B", "--keys-file", str(gw.keys_file)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert revoke.returncode == 0, revoke.stderr
    assert wait_until(lambda: _status(gw, KEY_B) == 401, 10)
    assert _failures(gw, "revoked") >= 1 and _failures(gw, "unknown") == 0
    assert _status(gw, "sk-q38-neverissuedneverissuedneverissued") == 401
    assert _failures(gw, "unknown") == 1
    assert _status(gw, KEY_A) == 200
    assert KEY_B not in gw.log_path.read_text() and KEY_B not in httpx.get(gw.metrics_url).text


def test_removed_signing_key_is_counted_as_revoked(sim_factory: Any, gateway_factory: Any) -> None:
    """A token whose signing key `keys revoke JWT_<kid> --wait` removed gets 401 counted as
    revoked; a token naming a kid this gateway never loaded stays unknown_kid."""
    gw = gateway_factory(sim_factory())
    files = ["--keys-file", str(gw.keys_file), "--config", str(gw.config_path)]
    issued = subprocess.run(
        [sys.executable, "-m", "gateway", "token", "issue", "--tenant", "acme", *files, "--wait"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert issued.returncode == 0, issued.stderr
    token = issued.stdout.strip().splitlines()[-1]
    assert _status(gw, token) == 200
    (name,) = [
        line.partition("=")[0]
        for line in gw.keys_file.read_text().splitlines()
        if line.startswith("JWT_")
    ]
    revoke = subprocess.run(
        [sys.executable, "-m", "gateway", "keys", "revoke", name, *files, "--wait"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert revoke.returncode == 0, revoke.stderr
    assert _status(gw, token) == 401
    assert _failures(gw, "revoked") == 1 and _failures(gw, "unknown_kid") == 0
    now = int(time.time())
    stranger = jwt.encode(
        {"sub": "acme", "iat": now, "exp": now + 300},
        b"a-key-this-gateway-never-loaded-0123456789",
        algorithm="HS256",
        headers={"kid": "neverloaded"},
    )
    assert _status(gw, stranger) == 401
    assert _failures(gw, "unknown_kid") == 1 and _failures(gw, "revoked") == 1
    assert _status(gw, KEY_A) == 200
    assert token not in gw.log_path.read_text()
