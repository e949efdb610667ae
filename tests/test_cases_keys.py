"""Cases C17 and C18: a keys file that is empty for a moment, or a path that blocks, on a live gateway."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.keys_file import check_keys_file, empty_keys_problem, load_keys_file
from gateway.reload import BlockingCalls, FileBlocked
from tests.conftest import KEY_A, KEY_B, REPO, Gateway, wait_until, write_keys
from tests.test_reload import SECRET_A, Harness, key_ids, make_harness, wait_for

METRICS_TOKEN = "metrics-token-0123456789abcdef"
KEYS = {"KEY_A": ("acme", KEY_A)}
EXTRA = f"QWEN38_METRICS_TOKEN={METRICS_TOKEN}\n"


def models_status(gw: Gateway, key: str) -> int:
    """Status of ``GET /v1/models`` with ``key``."""
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.get(gw.url("/v1/models"), headers=headers, timeout=5).status_code


def reload_errors(gw: Gateway) -> float:
    """``gateway_config_reloads_total{result="error"}``, scraped with the metrics token."""
    text = httpx.get(
        gw.metrics_url, headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=5
    ).text
    for line in text.splitlines():
        if line.startswith('gateway_config_reloads_total{result="error"}'):
            return float(line.split()[-1])
    return 0.0


def start_with_token(
    gateway_factory: Any, sim_factory: Any, workdir: Path, **config: Any
) -> Gateway:
    """A gateway whose keys file holds KEY_A and a metrics token."""
    write_keys(workdir / "gw-keys.env", KEYS, EXTRA)
    return gateway_factory(sim_factory(), config or None)


@pytest.mark.parametrize("rewrite", ["truncate", "comments_only", "blank_lines"])
def test_c17_empty_keys_file_never_loaded(
    gateway_factory: Any, sim_factory: Any, workdir: Path, rewrite: str
) -> None:
    """C17: an empty or comments-only keys file keeps the old keys, /ready, and the metrics token; it is an error."""
    gw = start_with_token(gateway_factory, sim_factory, workdir)
    assert models_status(gw, KEY_A) == 200
    content = {"truncate": "", "comments_only": "# keys\n# none yet\n", "blank_lines": "\n\n"}
    with open(gw.keys_file, "w") as handle:  # in place, as `cat > file` does
        handle.write(content[rewrite])
    assert wait_until(lambda: reload_errors(gw) >= 1, 5)
    assert models_status(gw, KEY_A) == 200
    assert httpx.get(gw.url("/ready"), timeout=5).status_code == 200
    assert httpx.get(gw.metrics_url, timeout=5).status_code == 401, "metrics opened"
    failed = [e for e in gw.logs() if e.get("event") == "reload_failed"]
    assert failed and "no API key" in " ".join(failed[-1]["problems"])
    # The writer finishes: the new file applies.
    write_keys(gw.keys_file, {"KEY_B": ("beta", KEY_B)}, EXTRA)
    assert wait_until(lambda: models_status(gw, KEY_B) == 200, 5)
    assert models_status(gw, KEY_A) == 401


def test_c17_metrics_token_never_dropped_by_a_keys_reload(
    gateway_factory: Any, sim_factory: Any, workdir: Path
) -> None:
    """C17: a keys file that lost QWEN38_METRICS_TOKEN (truncated after the keys) is refused: /metrics stays closed."""
    gw = start_with_token(gateway_factory, sim_factory, workdir)
    write_keys(gw.keys_file, {"KEY_A": ("acme", KEY_A), "KEY_B": ("beta", KEY_B)})
    assert wait_until(lambda: reload_errors(gw) >= 1, 5)
    assert httpx.get(gw.metrics_url, timeout=5).status_code == 401
    assert models_status(gw, KEY_B) == 401, "a refused reload applies nothing"
    failed = [e for e in gw.logs() if e.get("event") == "reload_failed"]
    assert "QWEN38_METRICS_TOKEN is no longer set" in " ".join(failed[-1]["problems"])
    assert METRICS_TOKEN not in gw.log_path.read_text()


def test_c17_zero_keys_by_explicit_opt_in(
    gateway_factory: Any, sim_factory: Any, workdir: Path
) -> None:
    """C17: with auth.allow_empty_keys = true an empty key set is loaded on purpose and /ready says so."""
    write_keys(workdir / "gw-keys.env", KEYS)
    gw = gateway_factory(sim_factory(), {"auth": {"allow_empty_keys": True}})
    with open(gw.keys_file, "w") as handle:
        handle.write("# no keys on purpose\n")
    assert wait_until(lambda: models_status(gw, KEY_A) == 401, 5)
    ready = httpx.get(gw.url("/ready"), timeout=5)
    assert ready.status_code == 503 and ready.json()["keys_loaded"] == 0


async def test_c17_reloader_refuses_empty_set_unit(tmp_path: Path) -> None:
    """C17: the reloader itself refuses an empty key set and counts it, unless the config allows it."""
    made = make_harness(tmp_path, 60.0)
    await made.reloader.start()
    try:
        made.keys.write_text("")
        assert await made.reloader.reload() is False
        assert made.applied == [] and made.count("error") == 1
        made.config.write_text(made.config.read_text() + "allow_empty_keys = true\n")
        assert await made.reloader.reload() is True
        assert key_ids(made.applied[-1][1]) == []
    finally:
        await made.reloader.stop()


def _make_fifo(path: Path) -> None:
    os.mkfifo(path, 0o600)


def _make_dir(path: Path) -> None:
    path.mkdir(mode=0o700)


def _make_socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()


BLOCKERS = {"fifo": _make_fifo, "directory": _make_dir, "socket": _make_socket}


@pytest.mark.parametrize("kind", sorted(BLOCKERS))
def test_c18_blocking_keys_path_is_refused(
    gateway_factory: Any, sim_factory: Any, workdir: Path, kind: str
) -> None:
    """C18: a FIFO, directory or socket at the keys path is refused at once; SIGHUP, later changes and SIGTERM still work."""
    gw = start_with_token(gateway_factory, sim_factory, workdir, server={"shutdown_grace_s": 3.0})
    saved = gw.keys_file.read_bytes()
    gw.keys_file.unlink()
    BLOCKERS[kind](gw.keys_file)
    assert wait_until(lambda: reload_errors(gw) >= 1, 5)
    failed = [e for e in gw.logs() if e.get("event") == "reload_failed"]
    assert "not a regular file" in " ".join(failed[-1]["problems"])
    assert models_status(gw, KEY_A) == 200
    before = reload_errors(gw)
    gw.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: reload_errors(gw) > before, 5), "SIGHUP no longer handled"
    # The operator puts a regular file back, with one more key: it applies.
    if kind == "directory":
        gw.keys_file.rmdir()
    else:
        gw.keys_file.unlink()
    write_keys(gw.keys_file, {"KEY_A": ("acme", KEY_A), "KEY_B": ("beta", KEY_B)}, EXTRA)
    assert saved
    assert wait_until(lambda: models_status(gw, KEY_B) == 200, 5)
    started = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)
    gw.proc.wait(30)
    assert time.monotonic() - started < 3.0 + 2.0 + 3.0


def test_c18_fifo_with_a_blocked_writer_never_stalls(
    gateway_factory: Any, sim_factory: Any, workdir: Path
) -> None:
    """C18: a FIFO the reload could have waited on forever: the gateway keeps answering and exits on SIGTERM."""
    gw = start_with_token(gateway_factory, sim_factory, workdir, server={"shutdown_grace_s": 2.0})
    gw.keys_file.unlink()
    os.mkfifo(gw.keys_file, 0o600)
    gw.proc.send_signal(signal.SIGHUP)
    for _ in range(5):
        assert models_status(gw, KEY_A) == 200
        time.sleep(0.2)
    started = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)
    gw.proc.wait(30)
    # grace 2 s + 2 s, plus room for a loaded CI machine flushing the usage ledger at exit
    assert time.monotonic() - started < 2.0 + 2.0 + 3.0


async def test_c18_hung_file_call_times_out_and_is_not_repeated(tmp_path: Path) -> None:
    """C18: a file call that really blocks (open of a FIFO without writer) times out; no second call starts until it returns."""
    fifo = tmp_path / "hung"
    os.mkfifo(fifo, 0o600)
    calls = BlockingCalls(timeout_s=0.3)

    def blocking_read() -> bytes:
        with open(fifo, "rb") as handle:  # blocks until a writer opens the FIFO
            return handle.read()

    started = time.monotonic()
    with pytest.raises(FileBlocked):
        await calls.run(blocking_read)
    assert time.monotonic() - started < 1.0
    assert calls.blocked
    with pytest.raises(FileBlocked):
        await calls.run(os.getpid)  # refused at once: the hung call has not returned
    # A writer unblocks the hung thread; calls work again.
    fd = os.open(fifo, os.O_WRONLY)
    os.close(fd)
    await wait_for(lambda: not calls.blocked, timeout=2.0)
    assert await calls.run(os.getpid) == os.getpid()


async def test_c18_reloader_survives_a_hung_keys_read(tmp_path: Path) -> None:
    """C18: a keys read that hangs is one counted error; the watcher keeps running and applies the next good file."""
    made: Harness = make_harness(tmp_path, 0.1)
    made.reloader._calls.timeout_s = 0.3
    await made.reloader.start()
    try:
        made.keys.unlink()
        os.mkfifo(made.keys, 0o600)
        await wait_for(lambda: made.count("error") >= 1)
        assert made.applied == []
        made.keys.unlink()
        made.replace_keys(f"a=acme:{SECRET_A}\n")
        await wait_for(lambda: made.applied, timeout=3.0)
        await asyncio.sleep(0)
    finally:
        await made.reloader.stop()


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    """``qwen38-gateway check ARGS`` as a process, bounded in time."""
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_c17_check_fails_a_keys_file_a_reload_would_refuse(workdir: Path) -> None:
    """C17: `check` judges a keys file with no API key and no signing key as a reload does: FAIL
    (exit 1) with the reload's words, unless auth.allow_empty_keys; one signing key is enough."""
    keys = workdir / "keys.env"
    write_keys(keys, {})  # a comment line only
    config = workdir / "s1.toml"
    config.write_text(f'[server]\nhost = "127.0.0.1"\n[auth]\nkeys_file = "{keys}"\n')
    for args in (("--config", str(config)), ("--keys-file", str(keys))):
        done = run_check(*args)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert f"FAIL keys: {keys}: no API key and no signing key" in done.stdout, done.stdout
        assert "allow_empty_keys" in done.stdout and "OK   keys" not in done.stdout
    keys.write_text("")  # `: > file`
    assert run_check("--config", str(config)).returncode == 1
    config.write_text(config.read_text() + "allow_empty_keys = true\n")
    allowed = run_check("--config", str(config))
    assert allowed.returncode == 0 and f"OK   keys: {keys}" in allowed.stdout, allowed.stdout
    write_keys(keys, {}, extra=f"JWT_only=hs256:{'A' * 43}\n")
    signing_only = run_check("--keys-file", str(keys))
    assert signing_only.returncode == 0 and f"OK   keys: {keys}" in signing_only.stdout


async def test_c17_check_and_reload_share_the_empty_keys_rule(tmp_path: Path) -> None:
    """C17: the reload's refusal and `check`'s FAIL are one rule (`empty_keys_problem`)."""
    made = make_harness(tmp_path, 60.0)
    await made.reloader.start()
    try:
        made.keys.write_text("# no keys\n")
        assert await made.reloader.reload() is False
        (problem,) = check_keys_file(made.keys)
        rule = empty_keys_problem(load_keys_file(made.keys), str(made.keys), allow_empty=False)
        assert rule is not None and problem.startswith(rule)
        assert check_keys_file(made.keys, allow_empty=True) == []
    finally:
        await made.reloader.stop()
