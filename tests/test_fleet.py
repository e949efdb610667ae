"""Several gateways as one service, with real processes: engine leases in a real redis-server,
the shared quarantine and revocations, the SQLite outbox shipped to a real PostgreSQL, the drain
HAProxy sees, and the shipped haproxy.cfg checked by ``haproxy -c``."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.conftest import (
    ALIAS,
    DEFAULT_KEYS,
    KEY_A,
    KEY_B,
    REPO,
    Gateway,
    wait_until,
    write_keys,
)
from tests.fleet_services import HAPROXY, HAPROXY_CFG, PG_BIN, Postgres, haproxy_config
from tests.test_quarantine import Restarter
from tests.test_ratelimit_redis import REDIS_SERVER, RedisServer

# Minutes, mostly waiting for processes (tests/README.md, "Layers").
pytestmark = pytest.mark.slow(48)

SALT = "QWEN38_CACHE_SALT_SECRET=fleet-test-salt-secret-0123456789abcdef\n"


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A fresh redis-server for one test (skipped without redis-server)."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed (.ci/run installs it)")
    workdir = Path(tempfile.mkdtemp(prefix="q38r-", dir="/tmp"))
    server = RedisServer(workdir)
    server.start()
    yield server.url
    server.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    """One PostgreSQL cluster for the module (skipped without PostgreSQL's binaries)."""
    if PG_BIN is None:
        pytest.skip("PostgreSQL binaries not found (.ci/run installs postgresql)")
    workdir = Path(tempfile.mkdtemp(prefix="q38pg-", dir="/tmp"))
    pg = Postgres(workdir)
    pg.init()
    pg.start()
    yield pg
    pg.stop("immediate")
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def pg(postgres: Postgres) -> Postgres:
    """The module's PostgreSQL, started, with an empty ``usage`` table."""
    if not wait_until(lambda: _pg_up(postgres), 1):
        postgres.start()
    postgres.query("DROP TABLE IF EXISTS usage")
    return postgres


def _pg_up(pg: Postgres) -> bool:
    try:
        pg.query("SELECT 1")
    except Exception:
        return False
    return True


def fleet(redis_url: str, gateway_id: str, **extra: Any) -> dict[str, Any]:
    return {"redis_url": redis_url, "gateway_id": gateway_id, "sync_interval_s": 0.2, **extra}


def chat(gw_url: str, key: str = KEY_A, content: str = "hi", **extra: Any) -> httpx.Response:
    body = {"model": ALIAS, "messages": [{"role": "user", "content": content}], "max_tokens": 5}
    return httpx.post(
        gw_url + "/v1/chat/completions",
        json={**body, **extra},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def kill9(gw: Gateway) -> None:
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(10)


# ----------------------------------------------------------------------------- HAProxy


@pytest.mark.skipif(HAPROXY is None, reason="haproxy not installed (.ci/run installs it)")
def test_shipped_haproxy_config_is_valid(workdir: Path) -> None:
    """deploy/haproxy/haproxy.cfg and its rewrite for the end-to-end suite pass haproxy -c."""
    assert HAPROXY is not None
    rendered = workdir / "rendered.cfg"
    rendered.write_text(haproxy_config(18080, [18001, 18002]))
    for path in (HAPROXY_CFG, rendered):
        done = subprocess.run(
            [HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stdout + done.stderr
    text = HAPROXY_CFG.read_text()
    for needle in (
        "option httpchk GET /ready",
        "hash-type consistent",
        "hash-balance-factor 150",
        "req.hdr(X-Claude-Code-Session-Id)",
        "req.hdr(X-Session-Id)",
        "balance hdr(X-Qwen38-Affinity)",
    ):
        assert needle in text


def test_ready_says_503_while_the_drain_is_announced(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """SIGTERM with server.drain_delay_s: /ready answers 503 (draining) while model requests are
    still served, then the gateway stops."""
    gw = gateway_factory(sim_factory(), {"server": {"drain_delay_s": 2.0}})
    gw.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: httpx.get(gw.url("/ready"), timeout=2).status_code == 503, 1.5)
    assert httpx.get(gw.url("/ready"), timeout=2).json()["draining"] is True
    assert chat(gw.base_url).status_code == 200
    assert gw.proc.wait(15) == 0


# ----------------------------------------------------------------------------- leases


def test_engine_owned_by_another_gateway_refuses_start_until_released(
    redis_url: str, sim_factory: Any, gateway_factory: Any
) -> None:
    """A second gateway configured with an engine another owns exits with an error naming the
    engine, the setting and the owner; it starts once the owner stopped (lease released)."""
    sim = sim_factory()
    gw1 = gateway_factory(sim, {"fleet": fleet(redis_url, "host-a:1")}, name="gw1")
    client = redis.Redis.from_url(redis_url)
    lease = f"qwen38:engine-lease:{socket.gethostname()}:{sim.socket}"
    assert client.get(lease).startswith(b"host-a:1 ")
    assert gw1.metric("gateway_engine_lease_held", engine="default") == 1
    with pytest.raises(RuntimeError) as refused:
        gateway_factory(sim, {"fleet": fleet(redis_url, "host-b:1")}, name="gw2")
    message = str(refused.value)
    assert "engine.socket = 'default'" in message and "'host-a:1'" in message
    assert lease in message
    gw1.proc.send_signal(signal.SIGTERM)
    assert gw1.proc.wait(15) == 0
    assert client.get(lease) is None, "released at stop"
    gw2 = gateway_factory(sim, {"fleet": fleet(redis_url, "host-b:1")}, name="gw2b")
    assert client.get(lease).startswith(b"host-b:1 ")
    assert chat(gw2.base_url).status_code == 200


def test_lease_of_a_killed_gateway_expires_and_is_taken_over(
    redis_url: str, sim_factory: Any, gateway_factory: Any
) -> None:
    """kill -9 leaves the lease until it expires (fleet.lease_ttl_s), then another gateway
    takes the engine; the same gateway restarted takes its own lease over at once."""
    sim = sim_factory()
    cfg = {"fleet": fleet(redis_url, "host-a:1", lease_ttl_s=3)}
    gw1 = gateway_factory(sim, cfg, name="gw1")
    kill9(gw1)
    again = gateway_factory(sim, cfg, name="gw1again")  # same gateway_id: no wait
    kill9(again)
    client = redis.Redis.from_url(redis_url)
    left_ms = client.pttl(f"qwen38:engine-lease:{socket.gethostname()}:{sim.socket}")
    assert 0 < left_ms <= 3000
    started = time.monotonic()
    while True:
        try:
            gw2 = gateway_factory(sim, {"fleet": fleet(redis_url, "host-b:1")}, name="gw2")
            break
        except RuntimeError as exc:
            assert "owned by gateway 'host-a:1'" in str(exc)
            assert time.monotonic() - started < 10
    assert time.monotonic() - started >= left_ms / 1000 - 0.5
    assert chat(gw2.base_url).status_code == 200


def test_a_running_gateway_renews_its_lease_past_its_ttl(
    redis_url: str, sim_factory: Any, gateway_factory: Any
) -> None:
    """A live owner keeps its lease however long it runs: three times the TTL later the lease
    is still its own, freshly renewed, and a second gateway is still refused."""
    sim = sim_factory()
    gw1 = gateway_factory(sim, {"fleet": fleet(redis_url, "host-a:1", lease_ttl_s=1.5)}, name="gw1")
    client = redis.Redis.from_url(redis_url)
    lease = f"qwen38:engine-lease:{socket.gethostname()}:{sim.socket}"
    time.sleep(4.5)
    assert client.get(lease).startswith(b"host-a:1 ")
    assert client.pttl(lease) > 500  # renewed every third of the TTL
    with pytest.raises(RuntimeError) as refused:
        gateway_factory(sim, {"fleet": fleet(redis_url, "host-b:1")}, name="gw2")
    assert "'host-a:1'" in str(refused.value)
    assert chat(gw1.base_url).status_code == 200


def test_unreachable_redis_or_postgres_at_start_is_a_clear_error(
    workdir: Path, sim_factory: Any, gateway_factory: Any
) -> None:
    """An unreachable fleet Redis or PostgreSQL DSN stops the start with an error naming the
    setting, and `check` fails on both; the DSN's password never shows."""
    sim = sim_factory()
    closed = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(RuntimeError) as no_redis:
        gateway_factory(sim, {"fleet": fleet(f"redis://{closed}/0", "a")}, name="r")
    assert "fleet.redis_url" in str(no_redis.value)
    dsn = f"postgresql://qwen38:S3cretPassw0rdXYZ@{closed}/postgres"
    with pytest.raises(RuntimeError) as no_pg:
        gateway_factory(sim, {"ledger": {"postgres_dsn": dsn}}, name="p")
    assert "ledger.postgres_dsn" in str(no_pg.value)
    assert "S3cretPassw0rdXYZ" not in str(no_pg.value)
    assert "S3cretPassw0rdXYZ" not in (workdir / "p.log").read_text()
    config = workdir / "p.toml"
    config.write_text(
        config.read_text().replace(
            "[ledger]", f'[fleet]\nredis_url = "redis://{closed}/0"\n\n[ledger]', 1
        )
    )
    checked = subprocess.run(
        [sys.executable, "-m", "gateway", "check", "--config", str(config)],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False,
    )  # fmt: skip
    assert checked.returncode == 1
    assert "FAIL fleet: fleet.redis_url" in checked.stdout
    assert "FAIL ledger: ledger.postgres_dsn" in checked.stdout
    assert "S3cretPassw0rdXYZ" not in checked.stdout + checked.stderr


def _closed_port() -> int:
    from tests.conftest import free_port

    return free_port()


def test_rpm_limit_is_exact_across_two_gateways(
    redis_url: str, sim_factory: Any, gateway_factory: Any
) -> None:
    """A tenant's rpm of 5 shared through Redis: 12 requests alternating between two gateways
    get exactly 5 answers and 7 429s."""
    gws = []
    for name in ("la", "lb"):
        cfg = {
            "fleet": fleet(redis_url, name),
            "ratelimit": {"backend": "redis", "redis_url": redis_url},
            "tenants": {"acme": {"rpm": 5}},
        }
        gws.append(gateway_factory(sim_factory(name=f"engine-{name}"), cfg, name=name))
    statuses = [chat(gws[i % 2].base_url, KEY_A, f"r{i}").status_code for i in range(12)]
    assert statuses.count(200) == 5 and statuses.count(429) == 7, statuses


# ----------------------------------------------------------------------------- revocation


def test_key_revoked_on_one_host_is_refused_by_every_gateway_within_2s(
    redis_url: str, sim_factory: Any, gateway_factory: Any, workdir: Path
) -> None:
    """A key removed from one gateway's keys file is refused by both gateways within 2 s, while
    the other's file still lists it; adding it back there lets it in again."""
    gws = []
    for name in ("ka", "kb"):
        sim = sim_factory(name=f"engine-{name}")
        write_keys(workdir / f"{name}-keys.env", DEFAULT_KEYS)
        cfg = {"fleet": fleet(redis_url, name), "auth": {"reload_poll_s": 1.0}}
        gws.append(gateway_factory(sim, cfg, name=name))
    for gw in gws:
        assert chat(gw.base_url, KEY_B).status_code == 200
    remaining = {k: v for k, v in DEFAULT_KEYS.items() if v[1] != KEY_B}
    write_keys(gws[0].keys_file, remaining)
    started = time.monotonic()
    refused: dict[int, float] = {}
    while len(refused) < 2 and time.monotonic() - started < 5:
        for i, gw in enumerate(gws):
            if i not in refused and chat(gw.base_url, KEY_B).status_code == 401:
                refused[i] = time.monotonic() - started
        time.sleep(0.05)
    assert set(refused) == {0, 1} and max(refused.values()) < 2.0, refused
    assert chat(gws[1].base_url, KEY_A).status_code == 200
    write_keys(gws[0].keys_file, DEFAULT_KEYS)  # added back
    assert wait_until(lambda: chat(gws[1].base_url, KEY_B).status_code == 200, 5)


# ----------------------------------------------------------------------------- quarantine


def test_poison_request_reaches_two_deaths_across_hosts(
    redis_url: str, sim_factory: Any, gateway_factory: Any, workdir: Path
) -> None:
    """A request that killed host A's engine once and host B's engine once is refused with 422
    by both gateways; the CLI lists and clears it in Redis."""
    poison = {"sim": {"headers_delay_s": 0.5, "exit_after": 0}}
    gws, restarters = [], []
    for name in ("qa", "qb"):
        sim = sim_factory("--tokens-per-second", "200", name=f"engine-{name}")
        write_keys(workdir / f"{name}-keys.env", DEFAULT_KEYS, SALT)
        cfg = {
            "fleet": fleet(redis_url, name),
            # No retry after the death: each death here is on another host.
            "engine": {"queue_timeout_s": 0.1, "health_interval_s": 0.1},
        }
        gws.append(gateway_factory(sim, cfg, name=name))
        restarters.append(Restarter(sim))
    try:
        first = chat(gws[0].base_url, KEY_A, "poison", **poison)
        assert first.status_code in (502, 503), first.text
        assert wait_until(lambda: restarters[0].crashes == 1, 5)
        assert wait_until(lambda: _ready(gws[1]), 10)
        second = chat(gws[1].base_url, KEY_A, "poison", **poison)
        assert second.status_code in (502, 503, 422), second.text
        assert wait_until(lambda: restarters[1].crashes == 1, 5)
        for gw in gws:
            assert wait_until(lambda gw=gw: _ready(gw), 15)
            # Each gateway takes the shared view every sync_interval_s (the second death may
            # reach Redis a health poll after the engine died): sent before, the request
            # would go to host A's engine again, as it should.
            shared = lambda gw=gw: gw.metric("gateway_quarantine_entries") >= 1  # noqa: E731
            assert wait_until(shared, 10)
            got = _until_status(lambda gw=gw: chat(gw.base_url, KEY_B, "poison", **poison), 422)
            assert got.json()["error"]["code"] == "request_quarantined"
        time.sleep(0.5)
        assert [r.crashes for r in restarters] == [1, 1], "never sent to an engine again"
        listed = _cli(gws[1], "quarantine", "list")
        assert listed.returncode == 0, listed.stderr
        fp = got.json()["error"]["message"].split("fingerprint ")[1][:32]
        assert fp in listed.stdout
        assert _cli(gws[0], "quarantine", "clear", fp).returncode == 0
        for gw in gws:
            assert wait_until(lambda gw=gw: gw.metric("gateway_quarantine_entries") == 0, 5)
    finally:
        for restarter in restarters:
            restarter.stop()


def _ready(gw: Gateway) -> bool:
    try:
        return httpx.get(gw.url("/ready"), timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _until_status(send: Callable[[], httpx.Response], status: int) -> httpx.Response:
    deadline = time.monotonic() + 10
    while True:
        got = send()
        if got.status_code == status or time.monotonic() > deadline:
            assert got.status_code == status, got.text
            return got
        time.sleep(0.2)


def _cli(
    gw: Gateway, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args, "--config", str(gw.config_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


# ----------------------------------------------------------------------------- ledger


def test_ledger_shipped_to_postgres_exactly_once_through_an_outage_and_kill9(
    pg: Postgres, sim_factory: Any, gateway_factory: Any, workdir: Path
) -> None:
    """Records reach PostgreSQL once each; with PostgreSQL stopped requests go on and are caught
    up after; a kill -9 and restart ship no duplicate; usage report and /v1/usage read it."""
    sim = sim_factory()
    cfg = {"ledger": {"ship_interval_s": 0.1}}
    env = {"QWEN38_LEDGER_POSTGRES_DSN": pg.dsn}
    gw = gateway_factory(sim, cfg, name="l1", env=env)
    for i in range(5):
        assert chat(gw.base_url, content=f"before {i}").status_code == 200
    assert wait_until(lambda: _pg_count(pg) == 5, 10)

    pg.stop()
    for i in range(4):
        assert chat(gw.base_url, content=f"during {i}").status_code == 200
    assert wait_until(lambda: gw.metric("gateway_ledger_unshipped_records") == 4, 10)
    assert any(e.get("event") == "ledger_postgres_down" for e in gw.logs())
    pg.start()
    assert wait_until(lambda: _pg_count(pg) == 9, 15)

    assert chat(gw.base_url, content="last").status_code == 200
    time.sleep(0.4)  # committed to SQLite (flush 0.2 s) and maybe shipped
    kill9(gw)
    gw2 = gateway_factory(sim, cfg, name="l1", env=env)  # the same SQLite outbox
    assert wait_until(lambda: _pg_count(pg) == 10, 10)
    assert chat(gw2.base_url, KEY_B, content="after restart").status_code == 200
    assert wait_until(lambda: _pg_count(pg) == 11, 10)
    rows = pg.query("SELECT COUNT(*), COUNT(DISTINCT record_id), SUM(completion_tokens) FROM usage")
    assert rows[0][0] == rows[0][1] == 11
    served = [r for r in sim.model_records() if r["outcome"] == "finished"]
    assert rows[0][2] == sum(r["tokens_sent"] for r in served)
    assert pg.dsn not in (workdir / "l1.log").read_text()

    report = _cli(gw2, "usage", "report", "--format", "json", env=env)
    assert report.returncode == 0, report.stderr
    assert '"requests": 11' in report.stdout
    usage = httpx.get(
        gw2.url("/v1/usage"), headers={"Authorization": f"Bearer {KEY_B}"}, timeout=10
    ).json()
    assert usage["total"]["requests"] == 1


def _pg_count(pg: Postgres) -> int:
    try:
        return int(pg.query("SELECT COUNT(*) FROM usage")[0][0])
    except Exception:
        return -1


def test_usage_is_the_same_on_every_gateway(
    pg: Postgres, redis_url: str, sim_factory: Any, gateway_factory: Any
) -> None:
    """Two gateways shipping to one PostgreSQL answer GET /v1/usage identically (within the
    shipping delay), with both gateways' records."""
    env = {"QWEN38_LEDGER_POSTGRES_DSN": pg.dsn}
    gws = [
        gateway_factory(
            sim_factory(name=f"engine-{n}"), {"fleet": fleet(redis_url, n)}, name=n, env=env
        )
        for n in ("ua", "ub")
    ]
    for i, gw in enumerate(gws):
        for _ in range(i + 2):
            assert chat(gw.base_url).status_code == 200

    def answers() -> list[dict[str, Any]]:
        return [
            httpx.get(
                gw.url("/v1/usage"), headers={"Authorization": f"Bearer {KEY_A}"}, timeout=10
            ).json()
            for gw in gws
        ]

    # Each gateway ships its own records within flush_interval_s + ship_interval_s.
    assert wait_until(lambda: (a := answers())[0]["total"]["requests"] == 5 and a[0] == a[1], 10)
