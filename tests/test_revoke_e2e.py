"""Revoked keys counted as ``revoked``: a real gateway, its keys file changed by the key CLI."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx

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
