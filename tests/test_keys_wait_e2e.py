"""`--wait` on the key commands and `check --keys-file`: the CLI and a running gateway."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import ALIAS, REPO, Gateway, free_port

BODY = {"model": ALIAS, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
SLOW_RELOAD = {"auth": {"reload_poll_s": 1.0}}  # the production default: a real race window


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m gateway ARGS`` from the repository, bounded in time."""
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def status(gw: Gateway, credential: str) -> int:
    headers = {"Authorization": f"Bearer {credential}"}
    return httpx.post(
        gw.url("/v1/chat/completions"), json=BODY, headers=headers, timeout=30
    ).status_code


def files(gw: Gateway) -> list[str]:
    return ["--keys-file", str(gw.keys_file), "--config", str(gw.config_path)]


def test_token_issued_with_wait_works_on_the_next_request(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """`token issue --wait` creates the signing key and returns once the gateway has it."""
    gw = gateway_factory(sim_factory(), SLOW_RELOAD)
    for tenant in ("acme", "beta", "acme"):
        issued = cli("token", "issue", "--tenant", tenant, *files(gw), "--wait")
        assert issued.returncode == 0, issued.stderr
        assert status(gw, issued.stdout.strip().splitlines()[-1]) == 200


def test_keys_add_and_revoke_with_wait_take_effect_at_once(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """`keys add --wait`: the new secret works at once; `keys revoke --wait`: refused at once."""
    gw = gateway_factory(sim_factory(), SLOW_RELOAD)
    added = cli("keys", "add", "--tenant", "acme", "--id", "fresh", *files(gw), "--wait")
    assert added.returncode == 0, added.stderr
    assert status(gw, added.stdout.strip().splitlines()[-1]) == 200
    revoked = cli("keys", "revoke", "fresh", *files(gw), "--wait")
    assert revoked.returncode == 0, revoked.stderr
    assert status(gw, added.stdout.strip().splitlines()[-1]) == 401


def test_ready_reports_the_keys_file_version_not_a_secret(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """/ready's keys_version is 16 hex digits of the file's SHA-256; no key appears in it."""
    gw = gateway_factory(sim_factory())
    raw = Path(gw.keys_file).read_bytes()
    body = httpx.get(gw.url("/ready"), timeout=5).json()
    assert body["keys_version"] == hashlib.sha256(raw).hexdigest()[:16]
    assert "sk-" not in str(body)


def test_wait_without_a_gateway_fails_with_one_clear_line(tmp_path: Path) -> None:
    """--wait with no gateway answering: exit 1 after the timeout, naming the URL tried."""
    keys = tmp_path / "keys.env"
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    args = ["--keys-file", str(keys), "--wait", "--wait-timeout", "0.5", "--gateway-url", url]
    done = cli("keys", "add", "--tenant", "acme", *args)
    assert done.returncode == 1 and time.monotonic() - started < 30
    assert f"no gateway answered at {url}/ready within 0.5 s" in done.stderr
    assert "the keys file is changed" in done.stderr


def test_check_takes_keys_file(tmp_path: Path) -> None:
    """`check --keys-file F` checks F instead of the config's keys file."""
    config = tmp_path / "gateway.toml"
    config.write_text('[server]\nhost = "127.0.0.1"\n[auth]\nkeys_file = "/nonexistent/keys.env"\n')
    keys = tmp_path / "keys.env"
    assert cli("keys", "add", "--tenant", "acme", "--keys-file", str(keys)).returncode == 0
    ok = cli("check", "--config", str(config), "--keys-file", str(keys))
    assert ok.returncode == 0 and f"OK   keys: {keys}" in ok.stdout, ok.stdout
    keys.chmod(0o644)
    bad = cli("check", "--config", str(config), "--keys-file", str(keys))
    assert bad.returncode == 1 and "FAIL keys" in bad.stdout
