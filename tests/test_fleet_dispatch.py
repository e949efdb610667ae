"""Several engines behind one gateway, in process: the topology, dispatch, affinity, failover."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission import AdmissionQueue, Ticket
from gateway.affinity import Affinity, session_key
from gateway.config import ConfigError, QuarantineSettings, parse_settings
from gateway.ledger import SCHEMA_VERSION, Ledger, UsageRecord, connect, utc_day
from gateway.metrics import Metrics
from gateway.quarantine import Quarantine
from tests.perf.busy import jain

pytestmark = pytest.mark.fast

ENGINES4 = [("e0", 1), ("e1", 1), ("e2", 1), ("e3", 1)]


def fleet_queue(engines: list[tuple[str, int]], factor: float = 1.5) -> AdmissionQueue:
    return AdmissionQueue(
        1,
        10_000,
        3600.0,
        Metrics(CollectorRegistry()),
        engines=engines,
        affinity_load_factor=factor,
    )


def check_slots(queue: AdmissionQueue) -> None:
    """No engine has more in flight than its slots, and the counts add up."""
    for engine in queue.engines.values():
        assert 0 <= engine.in_flight <= engine.slots, engine.name
    assert sum(e.in_flight for e in queue.engines.values()) == queue.in_flight


# --- topology ----------------------------------------------------------------------------------


def test_engines_tables_parse_in_order_with_their_own_settings() -> None:
    """[[engines]] tables give the engines, in order, with per-engine slots and files."""
    settings = parse_settings(
        {
            "engine": {"queue_size": 9},
            "engines": [
                {"name": "gpu0", "socket": "/run/q/gpu0.sock", "max_concurrency": 2},
                {"name": "gpu1", "socket": "/run/q/gpu1.sock", "ready_file": "/run/q/gpu1.ready"},
                {"name": "remote", "url": "https://gpu-host.example:8443"},
            ],
        }
    )
    specs = settings.engine_specs
    assert [s.name for s in specs] == ["gpu0", "gpu1", "remote"]
    assert [s.max_concurrency for s in specs] == [2, 1, 1]
    assert specs[1].ready_file == "/run/q/gpu1.ready"
    assert settings.total_slots == 4 and settings.engine.queue_size == 9


def test_a_lone_engine_socket_is_one_engine_named_default() -> None:
    """Without [[engines]], [engine] socket, slots and files are one engine named default."""
    settings = parse_settings(
        {"engine": {"socket": "/run/x.sock", "max_concurrency": 3, "ready_file": "/r"}}
    )
    (spec,) = settings.engine_specs
    assert (spec.name, spec.socket, spec.max_concurrency, spec.ready_file) == (
        "default",
        "/run/x.sock",
        3,
        "/r",
    )


@pytest.mark.parametrize(
    ("engines", "shared", "names"),
    [
        ([{"name": "a", "socket": "/s1"}, {"name": "a", "socket": "/s2"}], {}, "engines[1].name"),
        ([{"name": "a", "socket": "/s1"}, {"name": "b", "socket": "/x/../s1"}], {}, "socket"),
        (
            [{"name": "a", "url": "https://h:8443"}, {"name": "b", "url": "https://H:8443/"}],
            {},
            "engines.b.url",
        ),
        ([{"name": "a", "url": "http://10.0.0.2:8000"}], {}, "https"),
        ([{"name": "a", "url": "https://u:p@h:1"}], {}, "credentials"),
        ([{"name": "a", "socket": "/s", "url": "https://h"}], {}, "exactly one"),
        ([{"name": "a"}], {}, "exactly one"),
        ([{"socket": "/s"}], {}, "engines[0].name"),
        ([{"name": "GPU 0", "socket": "/s"}], {}, "engines[0].name"),
        ([{"name": "a", "socket": "/s", "max_concurrency": 0}], {}, "max_concurrency"),
        ([{"name": "a", "socket": "/s", "slots": 2}], {}, "unknown key engines.a.slots"),
        ([{"name": "a", "socket": "/s"}], {"socket": "/t"}, "engine.socket"),
        ([{"name": "a", "socket": "/s"}], {"max_concurrency": 2}, "engine.max_concurrency"),
        ({"name": "a"}, {}, "[[engines]]"),
    ],
)
def test_bad_topology_is_a_clear_error_naming_the_setting(
    engines: object, shared: dict[str, object], names: str
) -> None:
    """An engine listed twice, a plain-http remote, a missing address... fail at load, named."""
    with pytest.raises(ConfigError) as info:
        parse_settings({"engine": shared, "engines": engines})
    assert names in str(info.value)


def test_plain_http_is_accepted_on_loopback_only() -> None:
    """An http:// engine URL on a loopback address is accepted (TLS is for other hosts)."""
    settings = parse_settings({"engines": [{"name": "a", "url": "http://127.0.0.1:8001"}]})
    assert settings.engine_specs[0].url == "http://127.0.0.1:8001"


# --- dispatch ----------------------------------------------------------------------------------


async def test_requests_fill_every_engines_slots_and_no_more() -> None:
    """Free slots of any engine are granted; beyond the sum of slots requests wait."""
    queue = fleet_queue([("a", 2), ("b", 1)])
    tickets = [queue.enqueue("t", 1.0, 10) for _ in range(5)]
    assert [t.granted for t in tickets] == [True, True, True, False, False]
    assert sorted(t.engine or "" for t in tickets[:3]) == ["a", "a", "b"]
    check_slots(queue)
    freed = next(t for t in tickets if t.engine == "b")
    freed.release()
    assert tickets[3].granted and tickets[3].engine == "b"
    check_slots(queue)


async def test_random_traffic_never_exceeds_any_engines_slots() -> None:
    """Under random arrivals, releases, homes, failures and recoveries, in-flight <= slots."""
    rng = random.Random(7)
    queue = fleet_queue([("a", 2), ("b", 1), ("c", 3)])
    live: list[Ticket] = []
    for _ in range(3000):
        action = rng.random()
        if action < 0.45:
            home = rng.choice([None, "a", "b", "c"])
            live.append(queue.enqueue(rng.choice("wxyz"), 1.0, rng.randint(1, 500), home=home))
        elif action < 0.85 and live:
            live.pop(rng.randrange(len(live))).release(rng.randint(0, 500))
        elif action < 0.9:
            granted = [t for t in live if t.granted]
            if granted:
                rng.choice(granted).requeue(avoid=rng.choice("abc"))
        else:
            queue.set_ready(rng.choice("abc"), rng.random() < 0.7)
        check_slots(queue)
    for ticket in live:
        ticket.release()
    assert queue.in_flight == 0 and queue.depth == 0


def _serve(queue: AdmissionQueue, tickets: list[Ticket], sizes: dict[str, int]) -> dict[str, int]:
    """Run granted tickets to their end in order of finishing time (one engine time per token)
    while every tenant keeps a backlog; return the tokens each tenant was served."""
    served = dict.fromkeys(sizes, 0)
    now = 0.0
    ends: dict[int, float] = {}
    for _ in range(4000):
        for ticket in tickets:
            if ticket.granted and id(ticket) not in ends:
                ends[id(ticket)] = now + ticket.cost
        running = [t for t in tickets if t.granted]
        first = min(running, key=lambda t: ends[id(t)])
        now = ends.pop(id(first))
        served[first.tenant] += first.cost
        tickets.remove(first)
        first.release(first.cost)
        tickets.append(queue.enqueue(first.tenant, 1.0, sizes[first.tenant]))
        check_slots(queue)
    return served


async def test_tenant_fairness_is_global_across_engines() -> None:
    """Four tenants of very different request sizes share four engines: Jain >= 0.95 by tokens."""
    queue = fleet_queue(ENGINES4)
    sizes = {"t1": 30, "t2": 120, "t3": 500, "t4": 2000}
    tickets = [queue.enqueue(t, 1.0, n) for t, n in sizes.items() for _ in range(4)]
    served = _serve(queue, tickets, sizes)
    assert jain(list(served.values())) >= 0.95, served


# --- affinity ----------------------------------------------------------------------------------


async def test_a_session_goes_to_its_home_engine_when_it_has_a_free_slot() -> None:
    """A request whose session lives on an engine goes there, even if others are idle."""
    queue = fleet_queue(ENGINES4)
    ticket = queue.enqueue("t", 1.0, 10, home="e2")
    assert ticket.engine == "e2"


async def test_a_session_waits_briefly_for_its_busy_home_then_moves_when_overloaded() -> None:
    """With two slots per engine a session waits for its home while the home's load stays
    within the factor of an idle engine's, and moves once the home's backlog exceeds it."""
    queue = fleet_queue([("a", 2), ("b", 2)])
    running = [queue.enqueue("t", 1.0, 10, home="a") for _ in range(2)]
    assert all(t.engine == "a" for t in running)
    # Home a: 2 in flight + this waiter = 1.5 per slot; b idle: 0.5 with it; 1.5 > 1.5 x 0.5.
    mover = queue.enqueue("t", 1.0, 10, home="a")
    assert mover.engine == "b"
    queue = fleet_queue([("a", 2), ("b", 2)], factor=4.0)
    running = [queue.enqueue("t", 1.0, 10, home="a") for _ in range(2)]
    waiter = queue.enqueue("t", 1.0, 10, home="a")
    assert not waiter.granted  # 1.5 <= 4 x 0.5: it waits for its own engine
    running[0].release()
    assert waiter.engine == "a"


async def test_with_one_slot_per_engine_no_engine_idles_while_a_request_waits() -> None:
    """One slot each: an idle engine always takes a waiter whose home is busy (2 > 1.5 x 1)."""
    queue = fleet_queue([("a", 1), ("b", 1)])
    first = queue.enqueue("t", 1.0, 10, home="a")
    second = queue.enqueue("u", 1.0, 10, home="a")
    assert (first.engine, second.engine) == ("a", "b")


async def test_a_later_waiter_for_a_free_engine_passes_one_waiting_for_its_busy_home() -> None:
    """A tenant's head waiting for its busy home does not hold a free engine idle for others."""
    queue = fleet_queue([("a", 2), ("b", 2)], factor=4.0)
    busy = [queue.enqueue("x", 1.0, 10, home="a") for _ in range(2)]
    b_busy = [queue.enqueue("x", 1.0, 10, home="b") for _ in range(2)]
    waits_for_a = queue.enqueue("t", 1.0, 10, home="a")
    for_b = queue.enqueue("t", 1.0, 10, home="b")
    b_busy[0].release()
    assert for_b.engine == "b" and not waits_for_a.granted
    busy[0].release()
    assert waits_for_a.engine == "a"


def test_session_keys_come_from_each_client_in_order() -> None:
    """prompt_cache_key, then Claude Code's header or user_id session, user_id, X-Session-Id."""
    cc_user = '{"device_id":"d1","account_uuid":"","session_id":"5f1c-aa"}'
    assert session_key({}, {"prompt_cache_key": "conv-1"}) == "pck:conv-1"
    assert session_key({"X-Claude-Code-Session-Id": "s-9"}, {}) == "cc:s-9"
    assert session_key({}, {"metadata": {"user_id": cc_user}}) == "cc:5f1c-aa"
    legacy = "user_ab12_account__session_0d6f6a1e-1234-4bcd-9f00-1234567890ab"
    assert session_key({}, {"metadata": {"user_id": legacy}}) == (
        "cc:0d6f6a1e-1234-4bcd-9f00-1234567890ab"
    )
    assert session_key({}, {"metadata": {"user_id": "alice"}}) == "user:alice"
    assert session_key({"X-Session-Id": "z"}, {}) == "sid:z"
    assert session_key({"X-Session-Id": "z"}, {"prompt_cache_key": "p"}) == "pck:p"
    assert session_key({}, {"messages": []}) is None
    assert session_key({}, ["not", "an", "object"]) is None


def test_affinity_is_scoped_by_tenant_bounded_and_forgets_a_dead_engine() -> None:
    """Two tenants' equal session ids are two sessions; the map keeps its bound; a restarted
    engine's sessions are forgotten (its prefix cache is empty)."""
    affinity = Affinity(max_sessions=3)
    a, b = Affinity.digest("acme", "s"), Affinity.digest("beta", "s")
    assert a != b
    affinity.served(a, "e0")
    affinity.served(b, "e1")
    assert (affinity.home(a), affinity.home(b)) == ("e0", "e1")
    for n in range(5):
        affinity.served(Affinity.digest("acme", f"x{n}"), "e0")
    assert len(affinity) == 3 and affinity.home(a) is None
    affinity.forget_engine("e0")
    assert len(affinity) == 0


# --- health and failover -----------------------------------------------------------------------


async def test_an_engine_out_of_rotation_gets_nothing_and_takes_waiters_when_back() -> None:
    """Only ready engines take requests; one coming back is handed the waiters at once."""
    queue = fleet_queue([("a", 1), ("b", 1)])
    queue.set_ready("b", False)
    first = queue.enqueue("t", 1.0, 10, home="b")
    second = queue.enqueue("t", 1.0, 10)
    assert first.engine == "a" and not second.granted
    queue.set_ready("b", True)
    assert second.engine == "b"


async def test_a_requeued_request_goes_elsewhere_first_in_line_and_charged_once() -> None:
    """A request its engine failed goes to another engine before its tenant's later ones,
    and its tenant's virtual time is not charged twice."""
    queue = fleet_queue([("a", 1), ("b", 1)])
    failed = queue.enqueue("t", 1.0, 100)
    other = queue.enqueue("u", 1.0, 100)
    later = queue.enqueue("t", 1.0, 100)
    assert (failed.engine, other.engine, later.granted) == ("a", "b", False)
    queue.set_ready("a", False)
    failed.requeue(avoid="a")
    assert not failed.granted and queue.depth == 2
    other.release(100)
    assert failed.engine == "b" and not later.granted
    check_slots(queue)


async def test_deaths_count_per_engine_so_a_poison_request_is_caught_fleet_wide(
    tmp_path: Path,
) -> None:
    """A request that kills engine a and then, retried, engine b has two deaths: quarantined."""
    quarantine = Quarantine(
        QuarantineSettings(state_file=str(tmp_path / "q.json")),
        b"k" * 32,
        Metrics(CollectorRegistry()),
    )
    fp = quarantine.fingerprint(b'{"messages":[]}')
    token = quarantine.started(fp, "r1", "a")
    quarantine.engine_died("a")
    quarantine.finished(token, dropped=True)
    token = quarantine.started(fp, "r1", "b")
    quarantine.finished(token, dropped=True)
    assert quarantine.engine_died("b") == [str(fp)]


def test_the_ledger_records_the_engine_and_migrates_an_old_file(tmp_path: Path) -> None:
    """A version-1 ledger gains the engine column in place; new records carry the engine."""
    path = tmp_path / "usage.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE usage (ts REAL NOT NULL, day TEXT NOT NULL, tenant TEXT NOT NULL, "
        "key_id TEXT NOT NULL, subject TEXT, endpoint TEXT NOT NULL, status INTEGER NOT NULL, "
        "prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
        "reasoning_tokens INTEGER, queue_s REAL, ttft_s REAL, duration_s REAL NOT NULL, "
        "request_id TEXT NOT NULL);"
        "INSERT INTO usage VALUES (1.0, '1970-01-01', 'acme', 'k', NULL, '/v1/x', 200, 1, 2, "
        "NULL, NULL, NULL, 0.1, 'old');"
        "PRAGMA user_version = 1;"
    )
    old.commit()
    old.close()
    connect(path).close()
    ledger = Ledger(path, Metrics(CollectorRegistry()))
    ts = 2.0
    fields = ("acme", "k", None, "/v1/x", 200, 3, 4, None, None, None, 0.2, "new")
    ledger.record(UsageRecord(ts, utc_day(ts), *fields, engine="gpu1"))
    ledger.flush()
    ledger.close()
    rows = sqlite3.connect(path).execute("SELECT request_id, engine FROM usage ORDER BY ts")
    assert rows.fetchall() == [("old", None), ("new", "gpu1")]
    version = sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0]
    assert version == SCHEMA_VERSION == 4
