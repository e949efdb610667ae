"""The fleet's pieces in process: the PostgreSQL schema derived from the ledger record, the DSN's
password kept out of errors, engine lease names, fleet revocations in the authenticator, and the
new settings' checks."""

from __future__ import annotations

import socket
from dataclasses import fields

import pytest

from gateway.auth import Authenticator, RevokedSet
from gateway.config import ConfigError, parse_settings
from gateway.credentials import parse_keys, secret_digest
from gateway.errors import InvalidApiKey
from gateway.fleet import configured_engines
from gateway.ledger import COLUMNS, UsageRecord, new_record_id
from gateway.ledger_ship import pg_schema, redacted

pytestmark = pytest.mark.fast

KEY = "sk-q38-unitAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"


def test_postgres_table_mirrors_every_ledger_column() -> None:
    """CREATE TABLE has each UsageRecord field once, record_id the primary key, and every other
    column is added to an older table."""
    create = pg_schema()[0]
    for name in COLUMNS:
        assert f" {name} " in f" {create.split('(', 1)[1]}".replace(",", " ")
    assert "record_id TEXT PRIMARY KEY" in create
    alters = [s for s in pg_schema() if s.startswith("ALTER")]
    assert len(alters) == len(fields(UsageRecord)) - 1
    assert all("NOT NULL" not in s for s in alters)


def test_record_ids_are_fresh_128_bit_hex() -> None:
    """Two records never share an id: 32 hex digits from the system's random source."""
    ids = {new_record_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_dsn_password_never_shows_in_an_error() -> None:
    """A driver message quoting the password is printed with <redacted> in its place."""
    dsn = "postgresql://qwen38:Hunter2Secret@db.internal/qwen38"
    text = redacted(RuntimeError("login failed for Hunter2Secret"), dsn)
    assert "Hunter2Secret" not in text and "<redacted>" in text


def test_lease_names_say_where_the_engine_is() -> None:
    """A lone [engine] socket is engine 'default', leased as <hostname>:<socket>; [[engines]]
    by socket or URL, each named by its table."""
    host = socket.gethostname()
    settings = parse_settings({"engine": {"socket": "/run/q/e.sock"}})
    assert configured_engines(settings) == [("default", "engine.socket", f"{host}:/run/q/e.sock")]
    fleet = parse_settings(
        {
            "engines": [
                {"name": "gpu0", "socket": "/run/q/gpu0.sock"},
                {"name": "far", "url": "https://10.0.0.9:8443"},
            ]
        }
    )
    assert configured_engines(fleet) == [
        ("gpu0", "engines[0].name", f"{host}:/run/q/gpu0.sock"),
        ("far", "engines[1].name", "https://10.0.0.9:8443"),
    ]


def test_a_key_revoked_in_the_fleet_is_refused_while_the_file_lists_it() -> None:
    """The authenticator refuses a key whose digest another gateway published, reason revoked."""
    keys = parse_keys(f"K1=acme:{KEY}\n".encode())
    shared = RevokedSet()
    auth = Authenticator(keys, fleet_revoked=shared)
    assert auth.authenticate(f"Bearer {KEY}").tenant == "acme"
    shared.digests = frozenset({secret_digest(KEY)})
    with pytest.raises(InvalidApiKey) as refused:
        auth.authenticate(f"Bearer {KEY}")
    assert refused.value.reason == "revoked"


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ({"fleet": {"lease_ttl_s": 0.5}}, "fleet.lease_ttl_s"),
        ({"fleet": {"sync_interval_s": 0}}, "fleet.sync_interval_s"),
        ({"ledger": {"ship_interval_s": 0}}, "ledger.ship_interval_s"),
        ({"server": {"drain_delay_s": -1}}, "server.drain_delay_s"),
        ({"fleet": {"redis": "x"}}, "fleet.redis"),
    ],
)
def test_fleet_settings_out_of_range_name_the_key(table: dict[str, object], named: str) -> None:
    """A bad [fleet], ledger shipping or drain delay value is a ConfigError naming the key."""
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        parse_settings(table)
