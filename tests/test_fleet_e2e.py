"""The fleet on one machine, started as an operator would: HAProxy (the shipped config) in front
of 2 gateways, each owning its simulator engine, one redis-server and one PostgreSQL. The tests
run in order on the one fleet and inject the faults of issue 22 section 3: an engine killed under
load, a gateway killed, Redis stopped and restarted, PostgreSQL stopped, a key revoked; the last
test proves that nothing a client was not told about is lost (the ledger in PostgreSQL against
what the engines served). About 2-3 minutes on 2 cores."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    KEY_C,
    REPO,
    Gateway,
    Sim,
    _stop,
    start_gateway,
    start_sim,
    wait_until,
    write_keys,
)
from tests.fleet_services import HAPROXY, PG_BIN, HAProxy, Postgres
from tests.test_quarantine import Restarter
from tests.test_ratelimit_redis import REDIS_SERVER, RedisServer

pytestmark = [
    pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed (.ci/run)"),
    pytest.mark.skipif(PG_BIN is None, reason="PostgreSQL binaries not found (.ci/run)"),
    pytest.mark.skipif(HAPROXY is None, reason="haproxy not installed (.ci/run)"),
    pytest.mark.timeout(300),
    pytest.mark.slow(43),
]

SALT = "QWEN38_CACHE_SALT_SECRET=fleet-e2e-salt-secret-0123456789abcdef\n"
NAMES = ("host-a", "host-b")


@dataclass
class Fleet:
    """The running fleet and what clients were told."""

    workdir: Path
    redis: RedisServer
    pg: Postgres
    sims: dict[str, Sim]
    restarters: dict[str, Restarter]
    gateways: dict[str, Gateway]
    haproxy: HAProxy | None = None
    answered: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start_gateway(self, name: str) -> Gateway:
        env = {"QWEN38_LEDGER_POSTGRES_DSN": self.pg.dsn}
        config: dict[str, Any] = {
            "server": {"drain_delay_s": 3.0},
            "engine": {"health_interval_s": 0.2, "queue_timeout_s": 20},
            "ratelimit": {"backend": "redis", "redis_url": self.redis.url},
            "fleet": {"redis_url": self.redis.url, "gateway_id": name, "sync_interval_s": 0.2},
            "ledger": {"ship_interval_s": 0.2},
            "responses": {"store": True},
        }
        previous = self.gateways.get(name)
        if previous is not None:  # restarted on its ports: HAProxy's server line names them
            config["server"]["port"] = int(previous.base_url.rsplit(":", 1)[1])
            config["metrics"] = {"port": int(previous.metrics_url.split(":")[2].split("/")[0])}
        gw = start_gateway(self.workdir, self.sims[name], config, name=name, env=env)
        self.gateways[name] = gw
        if self.haproxy is not None:
            assert wait_until(self.haproxy.all_up, 15), "HAProxy sees every gateway up"
        return gw

    def chat(
        self,
        base_url: str | None = None,
        key: str = KEY_A,
        session: str = "",
        extra: dict[str, Any] | None = None,
    ) -> httpx.Response:
        """One non-streamed chat request (through HAProxy by default); 200s are remembered."""
        assert self.haproxy is not None
        rid = uuid.uuid4().hex
        headers = {"Authorization": f"Bearer {key}", "x-request-id": rid}
        if session:
            headers["X-Session-Id"] = session
        body = {
            "model": ALIAS,
            "messages": [{"role": "user", "content": f"turn {rid}"}],
            "max_tokens": 6,
            **(extra or {}),
        }
        got = httpx.post(
            (base_url or self.haproxy.url) + "/v1/chat/completions",
            json=body,
            headers=headers,
            timeout=60,
        )
        if got.status_code == 200:
            with self.lock:
                self.answered.append(
                    {"rid": rid, "completion": got.json()["usage"]["completion_tokens"]}
                )
        return got

    def where(self, rid: str) -> str | None:
        """The gateway whose access log has the request ``rid``."""
        for name, gw in self.gateways.items():
            if any(str(e.get("request_id", "")).startswith(rid) for e in gw.access_logs()):
                return name
        return None


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    workdir = Path(tempfile.mkdtemp(prefix="q38f-", dir="/tmp"))
    workdir.chmod(0o755)  # PostgreSQL's user reaches its directory inside
    server = RedisServer(workdir)
    server.start()
    pg = Postgres(workdir)
    pg.init()
    pg.start()
    sims: dict[str, Sim] = {}
    restarters: dict[str, Restarter] = {}
    gateways: dict[str, Gateway] = {}
    haproxy: HAProxy | None = None
    try:
        for name in NAMES:
            write_keys(workdir / f"{name}-keys.env", DEFAULT_KEYS, SALT)
            sims[name] = start_sim(workdir, "--tokens-per-second", "300", name=f"engine-{name}")
            restarters[name] = Restarter(sims[name])
        made = Fleet(workdir, server, pg, sims, restarters, gateways)
        for name in NAMES:
            made.start_gateway(name)
        haproxy = HAProxy(workdir, [int(gateways[n].base_url.rsplit(":", 1)[1]) for n in NAMES])
        made.haproxy = haproxy
        haproxy.start()
        assert wait_until(haproxy.all_up, 15) and made.chat().status_code == 200
        yield made
    finally:
        if haproxy is not None:
            haproxy.stop()
        for restarter in restarters.values():
            restarter.stop()
        for gw in gateways.values():
            _stop(gw.proc)
        for sim in sims.values():
            sim.stop()
        server.stop()
        pg.stop("immediate")
        shutil.rmtree(workdir, ignore_errors=True)


def _load(fleet: Fleet, seconds: float, threads: int = 4) -> list[int]:
    """Requests through HAProxy from ``threads`` sessions for ``seconds``; their statuses."""
    statuses: list[int] = []
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        while time.monotonic() < stop:
            try:
                statuses.append(fleet.chat(session=f"load-{i}").status_code)
            except httpx.HTTPError:
                statuses.append(0)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(seconds + 90)
    return statuses


def test_sessions_stay_on_one_gateway_through_haproxy(fleet: Fleet) -> None:
    """Every turn of a session (X-Session-Id) reaches the same gateway; sessions use both."""
    placed: dict[str, set[str | None]] = {}
    for session in range(12):
        for _turn in range(3):
            got = fleet.chat(session=f"s{session}")
            assert got.status_code == 200, got.text
            placed.setdefault(f"s{session}", set()).add(
                fleet.where(got.headers["x-request-id"].split("-")[0])
            )
    assert all(len(gws) == 1 and None not in gws for gws in placed.values()), placed
    assert set().union(*placed.values()) == set(NAMES)


def test_sessions_named_in_the_body_stay_on_one_gateway_through_haproxy(fleet: Fleet) -> None:
    """Without a session header, the body's prompt_cache_key keeps a session's turns on one
    gateway; requests with no session at all still reach both."""
    placed: dict[str, set[str | None]] = {}
    for session in range(10):
        for _turn in range(3):
            got = fleet.chat(extra={"prompt_cache_key": f"cache-{session}"})
            assert got.status_code == 200, got.text
            placed.setdefault(f"cache-{session}", set()).add(
                fleet.where(got.headers["x-request-id"].split("-")[0])
            )
    assert all(len(gws) == 1 and None not in gws for gws in placed.values()), placed
    assert set().union(*placed.values()) == set(NAMES)
    unkeyed = {fleet.where(fleet.chat().headers["x-request-id"].split("-")[0]) for _ in range(8)}
    assert unkeyed == set(NAMES)


def test_an_engine_killed_under_load_costs_no_silent_loss(fleet: Fleet) -> None:
    """SIGKILL of one engine under load: every client gets an answer or an error status, the
    engine comes back (restarted like the launcher does) and serves again."""
    victim = fleet.sims["host-a"]
    killer = threading.Timer(1.5, lambda: victim.proc.send_signal(signal.SIGKILL))
    killer.start()
    statuses = _load(fleet, 5.0)
    killer.join()
    assert statuses and 0 not in statuses, "no client left without an answer"
    assert statuses.count(200) > len(statuses) // 2
    assert set(statuses) <= {200, 502, 503}, statuses  # 503: engine_unavailable, told
    assert fleet.restarters["host-a"].crashes == 1
    gw = fleet.gateways["host-a"]
    assert wait_until(lambda: httpx.get(gw.url("/ready"), timeout=2).status_code == 200, 20)
    assert fleet.chat(gw.base_url).status_code == 200


def test_a_killed_gateway_is_routed_around_and_takes_its_engine_back(fleet: Fleet) -> None:
    """kill -9 of a gateway: requests through HAProxy keep succeeding (retried on the other
    gateway at once, the dead one out after its checks); restarted, it takes its lease over."""
    time.sleep(1.0)  # its last records are committed to its SQLite outbox
    gw = fleet.gateways["host-a"]
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(10)
    killed = time.monotonic()
    statuses = [fleet.chat(session=f"after-kill-{i}").status_code for i in range(10)]
    assert statuses == [200] * 10, statuses
    assert time.monotonic() - killed < 10
    fleet.start_gateway("host-a")  # the same gateway_id: its lease at once
    lease = redis.Redis.from_url(fleet.redis.url).get(
        f"qwen38:engine-lease:{_host()}:{fleet.sims['host-a'].socket}"
    )
    assert lease is not None and lease.startswith(b"host-a ")
    assert wait_until(lambda: fleet.chat(fleet.gateways["host-a"].base_url).status_code == 200, 10)


def _host() -> str:
    import socket

    return socket.gethostname()


def test_a_gateway_stopped_gracefully_behind_haproxy_loses_no_request(fleet: Fleet) -> None:
    """SIGTERM of a gateway under load through HAProxy: /ready goes 503 for drain_delay_s while
    it still serves, HAProxy moves new requests to the other one, every request gets 200; the
    gateway released its lease and starts again."""
    gw = fleet.gateways["host-b"]
    stopper = threading.Timer(1.0, lambda: gw.proc.send_signal(signal.SIGTERM))
    stopper.start()
    statuses = _load(fleet, 7.0)  # past drain_delay_s (3 s, longer than 2 checks of 1 s)
    stopper.join()
    assert gw.proc.wait(60) == 0
    assert statuses and set(statuses) == {200}, statuses
    key = f"qwen38:engine-lease:{_host()}:{fleet.sims['host-b'].socket}"
    assert redis.Redis.from_url(fleet.redis.url).get(key) is None, "released at stop"
    fleet.start_gateway("host-b")
    assert wait_until(lambda: fleet.chat(fleet.gateways["host-b"].base_url).status_code == 200, 10)


def test_a_stored_response_chain_lands_where_it_is_stored(fleet: Fleet) -> None:
    """Through HAProxy, previous_response_id and GET /v1/responses/{id} find the stored response
    (pinned by credential); the other gateway does not have it."""
    assert fleet.haproxy is not None
    headers = {"Authorization": f"Bearer {KEY_B}"}
    url = fleet.haproxy.url + "/v1/responses"
    body = {"model": ALIAS, "input": "first turn", "max_output_tokens": 5, "store": True}
    previous = httpx.post(url, json=body, headers=headers, timeout=60).json()["id"]
    for turn in range(4):
        follow = {**body, "input": f"turn {turn}", "previous_response_id": previous}
        got = httpx.post(url, json=follow, headers=headers, timeout=60)
        assert got.status_code == 200, got.text
        assert httpx.get(f"{url}/{previous}", headers=headers, timeout=10).status_code == 200
        previous = got.json()["id"]
    found = [
        httpx.get(f"{gw.url('/v1/responses')}/{previous}", headers=headers, timeout=10).status_code
        for gw in fleet.gateways.values()
    ]
    assert sorted(found) == [200, 404], found


def test_redis_stopped_and_restarted_fails_open_then_recovers(fleet: Fleet) -> None:
    """Redis down: requests go on (local limits, the last shared view), gateway_fleet_redis_up
    drops to 0; Redis back: it returns to 1 and the leases are held again."""
    fleet.redis.stop()
    try:
        for gw in fleet.gateways.values():
            assert wait_until(lambda gw=gw: gw.metric("gateway_fleet_redis_up") == 0, 10)
        assert [fleet.chat(session=f"r{i}").status_code for i in range(6)] == [200] * 6
    finally:
        fleet.redis.start()
    client = redis.Redis.from_url(fleet.redis.url)
    for name, gw in fleet.gateways.items():
        assert wait_until(lambda gw=gw: gw.metric("gateway_fleet_redis_up") == 1, 15)
        key = f"qwen38:engine-lease:{_host()}:{fleet.sims[name].socket}"
        assert wait_until(lambda key=key: client.get(key) is not None, 15), "lease taken again"
    assert fleet.chat().status_code == 200


def test_postgres_stopped_requests_go_on_and_the_ledger_catches_up(fleet: Fleet) -> None:
    """PostgreSQL down: requests are served, the outbox grows; back: shipped, once each."""
    fleet.pg.stop()
    try:
        assert [fleet.chat(session=f"p{i}").status_code for i in range(6)] == [200] * 6
        unshipped = sum(
            gw.metric("gateway_ledger_unshipped_records") for gw in fleet.gateways.values()
        )
        assert wait_until(
            lambda: (
                sum(gw.metric("gateway_ledger_unshipped_records") for gw in fleet.gateways.values())
                >= 6
            ),
            10,
        ), unshipped
    finally:
        fleet.pg.start()
    assert wait_until(
        lambda: all(
            gw.metric("gateway_ledger_unshipped_records") == 0 for gw in fleet.gateways.values()
        ),
        20,
    )


def test_a_revoked_key_is_refused_by_both_gateways_within_2s(fleet: Fleet) -> None:
    """KEY_C removed from host-a's keys file only: both gateways, and HAProxy, refuse it within
    2 s."""
    for gw in fleet.gateways.values():
        assert fleet.chat(gw.base_url, KEY_C).status_code == 200
    remaining = {k: v for k, v in DEFAULT_KEYS.items() if v[1] != KEY_C}
    write_keys(fleet.workdir / "host-a-keys.env", remaining, SALT)
    started = time.monotonic()
    pending = dict(fleet.gateways)
    while pending and time.monotonic() - started < 5:
        for name, gw in list(pending.items()):
            if fleet.chat(gw.base_url, KEY_C).status_code == 401:
                del pending[name]
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    assert not pending and elapsed < 2.0, (list(pending), elapsed)
    assert fleet.chat(key=KEY_C).status_code == 401
    assert fleet.chat(key=KEY_B).status_code == 200


def test_nothing_a_client_was_not_told_about_is_lost(fleet: Fleet) -> None:
    """Σ ledger in PostgreSQL = Σ what the engines served = Σ what clients got, request by
    request, with no record twice; usage report agrees from either host."""
    assert wait_until(
        lambda: all(
            gw.metric("gateway_ledger_unshipped_records") == 0 for gw in fleet.gateways.values()
        ),
        20,
    )
    time.sleep(0.5)
    rows = fleet.pg.query(
        "SELECT request_id, completion_tokens FROM usage WHERE status = 200 "
        "AND endpoint = '/v1/chat/completions'"
    )
    total = fleet.pg.query("SELECT COUNT(*), COUNT(DISTINCT record_id) FROM usage")[0]
    assert total[0] == total[1], "no record twice"
    by_rid = {str(rid).split("-")[0]: int(tokens) for rid, tokens in rows}
    assert len(by_rid) == len(rows), "no request recorded twice"
    told = {a["rid"]: a["completion"] for a in fleet.answered}
    missing = set(told) - set(by_rid)
    assert not missing, f"{len(missing)} answered requests not in the ledger"
    assert sum(told[r] for r in told) == sum(by_rid[r] for r in told)
    served = [
        r
        for sim in fleet.sims.values()
        for r in sim.model_records()
        if r["outcome"] == "finished" and r["status"] == 200
    ]
    # Every answer the engines finished, whatever the route (Responses are sent as chat).
    all_ok = fleet.pg.query("SELECT COUNT(*), SUM(completion_tokens) FROM usage WHERE status = 200")
    assert len(served) == all_ok[0][0]
    assert sum(r["tokens_sent"] for r in served) == all_ok[0][1]
    reports = [
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway",
                "usage",
                "report",
                "--format",
                "json",
                "--config",
                str(gw.config_path),
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            check=False,
            env={"QWEN38_LEDGER_POSTGRES_DSN": fleet.pg.dsn, "PATH": "/usr/bin:/bin"},
        )
        for gw in fleet.gateways.values()
    ]
    assert reports[0].returncode == 0, reports[0].stderr
    assert reports[0].stdout == reports[1].stdout
