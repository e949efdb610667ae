"""Hot reload: file changes and SIGHUP swap config and keys whole, or keep the old ones."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from gateway.config import Settings, load_settings
from gateway.credentials import KeySet
from gateway.keys_file import load_keys_file
from gateway.metrics import Metrics
from gateway.reload import Reloader

pytestmark = pytest.mark.fast

SECRET_A = "sk-q38-AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
SECRET_B = "sk-q38-BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
SECRET_C = "sk-q38-CCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"
CONFIG = '[server]\nport = 8000\n[tenants.acme]\nrpm = 10\n[auth]\nkeys_file = "{keys}"\n'


@dataclass
class Harness:
    """A running `Reloader` over files in a temporary directory, recording what it applies."""

    directory: Path
    config: Path
    keys: Path
    metrics: Metrics
    reloader: Reloader
    applied: list[tuple[Settings, KeySet]] = field(default_factory=list)

    def count(self, result: str) -> float:
        """``gateway_config_reloads_total{result}``."""
        value = self.metrics.registry.get_sample_value(
            "gateway_config_reloads_total", {"result": result}
        )
        return value or 0.0

    def replace_keys(self, text: str, mode: int = 0o600) -> None:
        """Write a new keys file beside the old one and rename it over (as editors do)."""
        temp = self.directory / "keys.env.new"
        temp.write_text(text)
        temp.chmod(mode)
        os.replace(temp, self.keys)


async def wait_for(predicate: Callable[[], Any], timeout: float = 5.0) -> float:
    """Seconds until ``predicate()`` is truthy; fails the test after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail("condition not met in time")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def make_harness(tmp: Path, poll_s: float) -> Harness:
    """Files and a reloader (not started) with poll interval ``poll_s``."""
    keys = tmp / "keys.env"
    keys.write_text(f"# team keys\na=acme:{SECRET_A}\n")
    keys.chmod(0o600)
    config = tmp / "gateway.toml"
    config.write_text(CONFIG.format(keys=keys))
    metrics = Metrics(CollectorRegistry())
    settings = load_settings(config)
    applied: list[tuple[Settings, KeySet]] = []
    reloader = Reloader(
        str(config),
        str(keys),
        poll_s,
        lambda s, k: applied.append((s, k)),
        metrics,
        settings=settings,
    )
    load_keys_file(keys)
    return Harness(tmp, config, keys, metrics, reloader, applied)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    """A started reloader polling every 0.2 s."""
    made = make_harness(tmp_path, 0.2)
    await made.reloader.start()
    yield made
    await made.reloader.stop()


def key_ids(keys: KeySet) -> list[str]:
    """Key ids of a key set, in file order."""
    return [key.key_id for key in keys.api_keys]


async def test_rename_replace_is_applied_within_two_seconds(harness: Harness) -> None:
    """A new file renamed over the keys file is applied within 2 s, with metrics and a log."""
    with capture_logs() as logs:
        harness.replace_keys(f"a=acme:{SECRET_A}\nb=beta:{SECRET_B}\n")
        elapsed = await wait_for(lambda: harness.applied)
    assert elapsed < 2.0
    assert key_ids(harness.applied[-1][1]) == ["a", "b"]
    assert harness.count("ok") == 1 and harness.count("error") == 0
    assert harness.metrics.registry.get_sample_value("gateway_keys_loaded") == 2
    ok = [entry for entry in logs if entry["event"] == "reload_ok"]
    assert ok and ok[0]["trigger"] == "change" and ok[0]["keys"] == 2


async def test_in_place_edit_is_applied(harness: Harness) -> None:
    """Appending to the same inode (no rename) is detected too."""
    inode = harness.keys.stat().st_ino
    with open(harness.keys, "a") as handle:
        handle.write(f"c=acme:{SECRET_C}\n")
    elapsed = await wait_for(lambda: harness.applied)
    assert harness.keys.stat().st_ino == inode
    assert elapsed < 2.0
    assert key_ids(harness.applied[-1][1]) == ["a", "c"]


async def test_sighup_triggers_a_reload(tmp_path: Path) -> None:
    """SIGHUP (via trigger from the signal handler) reloads at once, even with slow polling."""
    made = make_harness(tmp_path, 60.0)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, made.reloader.trigger)
    await made.reloader.start()
    try:
        with capture_logs() as logs:
            os.kill(os.getpid(), signal.SIGHUP)
            await wait_for(lambda: made.applied, timeout=2.0)
        assert [e["trigger"] for e in logs if e["event"] == "reload_ok"] == ["signal"]
        assert key_ids(made.applied[0][1]) == ["a"]
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        await made.reloader.stop()


async def test_broken_file_keeps_old_keys_and_counts_error(harness: Harness) -> None:
    """A file with a bad line is not applied; the error is counted and logged with its line."""
    with capture_logs() as logs:
        harness.replace_keys(f"a=acme:{SECRET_A}\nb=beta {SECRET_B}\n")
        await wait_for(lambda: harness.count("error") == 1)
        await asyncio.sleep(0.5)
    assert harness.applied == []
    assert harness.count("error") == 1, "a broken file is reported once, not on every poll"
    failed = [entry for entry in logs if entry["event"] == "reload_failed"]
    assert failed[0]["log_level"] == "error"
    assert failed[0]["problems"] == [
        f"{harness.keys}:2: b: expected tenant:secret or tenant:sha256:<hex>"
    ]
    harness.replace_keys(f"a=acme:{SECRET_A}\nb=beta:{SECRET_B}\n")
    await wait_for(lambda: harness.applied)
    assert key_ids(harness.applied[-1][1]) == ["a", "b"]


async def test_group_readable_file_is_refused(harness: Harness) -> None:
    """chmod g+r on the keys file fails the reload; the previous keys stay."""
    harness.keys.chmod(0o640)
    await wait_for(lambda: harness.count("error") == 1)
    assert harness.applied == []
    harness.keys.chmod(0o600)
    await wait_for(lambda: harness.applied)
    assert harness.count("ok") == 1


async def test_deleted_file_keeps_old_keys(harness: Harness) -> None:
    """Deleting the keys file is an error that keeps the old keys; recreating it applies."""
    with capture_logs() as logs:
        harness.keys.unlink()
        await wait_for(lambda: harness.count("error") == 1)
    assert harness.applied == []
    assert logs[-1]["problems"] == [f"{harness.keys}: no such file"]
    harness.replace_keys(f"b=beta:{SECRET_B}\n")
    await wait_for(lambda: harness.applied)
    assert key_ids(harness.applied[-1][1]) == ["b"]


async def test_config_change_applies_limits_and_warns_on_listen_address(harness: Harness) -> None:
    """New tenant limits are applied; a new port is logged as needing a restart."""
    with capture_logs() as logs:
        new = CONFIG.format(keys=harness.keys).replace("rpm = 10", "rpm = 99")
        harness.config.write_text(new.replace("port = 8000", "port = 8001"))
        await wait_for(lambda: harness.applied)
    settings, keys = harness.applied[-1]
    assert settings.tenant("acme").rpm == 99
    assert settings.server.port == 8001
    assert key_ids(keys) == ["a"]
    warnings = [entry for entry in logs if entry["event"] == "reload_needs_restart"]
    assert [(w["key"], w["log_level"]) for w in warnings] == [("server.port", "warning")]


async def test_broken_config_keeps_everything(harness: Harness) -> None:
    """An invalid TOML config fails the reload; a keys change in the same reload is not applied."""
    harness.config.write_text("[server]\nport = 'eighty'\n")
    harness.replace_keys(f"b=beta:{SECRET_B}\n")
    await wait_for(lambda: harness.count("error") >= 1)
    assert harness.applied == []
    harness.config.write_text(CONFIG.format(keys=harness.keys))
    await wait_for(lambda: harness.applied)
    assert key_ids(harness.applied[-1][1]) == ["b"]


async def test_deleted_config_keeps_settings(harness: Harness) -> None:
    """Removing a config file that existed does not silently fall back to defaults."""
    harness.config.unlink()
    await wait_for(lambda: harness.count("error") == 1)
    assert harness.applied == []


async def test_failing_apply_counts_as_error(tmp_path: Path) -> None:
    """If on_reload raises, the reload is reported failed."""
    made = make_harness(tmp_path, 60.0)

    def explode(_settings: Settings, _keys: KeySet) -> None:
        raise RuntimeError("boom")

    reloader = Reloader(str(made.config), str(made.keys), 60.0, explode, made.metrics)
    assert await reloader.reload() is False
    assert made.count("error") == 1


async def test_no_config_file_keeps_given_settings(tmp_path: Path) -> None:
    """With config_path None only the keys file is read; the given settings are passed on."""
    made = make_harness(tmp_path, 60.0)
    settings = Settings()
    applied: list[tuple[Settings, KeySet]] = []
    reloader = Reloader(
        None,
        str(made.keys),
        60.0,
        lambda s, k: applied.append((s, k)),
        made.metrics,
        settings=settings,
    )
    assert await reloader.reload() is True
    assert applied[0][0] is settings


async def test_logs_never_contain_secrets(harness: Harness) -> None:
    """Neither good nor broken reloads log a secret, even one pasted in the wrong place."""
    with capture_logs() as logs:
        harness.replace_keys(f"{SECRET_B}\n{SECRET_C}=acme:x\nk=acme:{SECRET_A}:expires=never\n")
        await wait_for(lambda: harness.count("error") == 1)
        harness.replace_keys(f"a=acme:{SECRET_A}\nb=acme:{SECRET_B}\n")
        await wait_for(lambda: harness.applied)
    text = repr(logs)
    assert len(logs) >= 2
    for secret in (SECRET_A, SECRET_B, SECRET_C):
        assert secret not in text and secret[7:19] not in text
