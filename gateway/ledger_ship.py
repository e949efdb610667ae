"""The SQLite ledger as the outbox of a PostgreSQL ledger shared by every gateway.

With ``[ledger] postgres_dsn`` (or ``$QWEN38_LEDGER_POSTGRES_DSN``) a shipper thread copies the
records committed to the local SQLite file (`gateway.ledger`) to PostgreSQL's ``usage`` table
every ``ledger.ship_interval_s``, in batches of `BATCH` in rowid order, with
``INSERT ... ON CONFLICT (record_id) DO NOTHING``, and only after PostgreSQL committed moves its
cursor (the ``outbox`` row of the SQLite file) past them. A crash between the two commits ships
the batch again and PostgreSQL keeps the first copy: every record arrives exactly once. What the
SQLite file holds survives ``kill -9`` (it is fsynced every ``ledger.flush_interval_s``), so
nothing older than that interval is lost; records the cursor has not passed are never pruned.

While PostgreSQL is down or refuses writes, requests go on (they only ever touch the SQLite
file), the outage is logged once (``ledger_postgres_down``, never the DSN),
``gateway_ledger_unshipped_records`` grows and the shipper retries with a doubling wait of at most
`RETRY_MAX_S`; once PostgreSQL answers it catches up. At start PostgreSQL must answer: an
unreachable DSN stops the gateway with an error naming ``ledger.postgres_dsn``.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import psycopg
import structlog

from gateway.config import ConfigError
from gateway.ledger import COLUMNS, OUTBOX_NAME, UsageRecord, connect
from gateway.metrics import Metrics
from gateway.usage_report import GROUPS, SUMS, ReportError, Span

log = structlog.get_logger("gateway.ledger")

BATCH = 1000
"""Records per PostgreSQL transaction."""
RETRY_MAX_S = 5.0
"""Longest wait between two attempts while PostgreSQL is down (seconds)."""
CONNECT_TIMEOUT_S = 5
"""libpq ``connect_timeout`` (whole seconds)."""

_PG_TYPES = {str: "TEXT", int: "BIGINT", float: "DOUBLE PRECISION"}


def _column_sql() -> list[tuple[str, str]]:
    """``(name, SQL type and constraint)`` of each `UsageRecord` field, in order."""
    hints = typing.get_type_hints(UsageRecord)
    out = []
    for f in fields(UsageRecord):
        hint = hints[f.name]
        args = typing.get_args(hint)
        nullable = type(None) in args or (isinstance(hint, types.UnionType) and type(None) in args)
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        sql = _PG_TYPES[base]
        if f.name == "record_id":
            sql += " PRIMARY KEY"
        elif not nullable:
            sql += " NOT NULL"
        out.append((f.name, sql))
    return out


def pg_schema() -> list[str]:
    """The statements that create (or complete) PostgreSQL's ``usage`` table: the columns of
    `UsageRecord`, ``record_id`` the primary key; columns a newer gateway added are added."""
    cols = _column_sql()
    create = ", ".join(f"{name} {sql}" for name, sql in cols)
    out = [f"CREATE TABLE IF NOT EXISTS usage ({create})"]
    for name, sql in cols:
        if name != "record_id":
            out.append(f"ALTER TABLE usage ADD COLUMN IF NOT EXISTS {name} {sql.split(' NOT')[0]}")
    out.append("CREATE INDEX IF NOT EXISTS usage_ts ON usage (ts)")
    out.append("CREATE INDEX IF NOT EXISTS usage_tenant_day ON usage (tenant, day)")
    return out


_INSERT = (
    f"INSERT INTO usage ({', '.join(COLUMNS)}) VALUES ({', '.join(['%s'] * len(COLUMNS))}) "
    "ON CONFLICT (record_id) DO NOTHING"
)


def redacted(exc: BaseException, dsn: str) -> str:
    """``Type: message`` of a driver error with the DSN's password cut out, if it shows."""
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    try:
        password = psycopg.conninfo.conninfo_to_dict(dsn).get("password")
    except psycopg.Error:
        password = None
    if password:
        text = text.replace(str(password), "<redacted>")
    return text


def pg_connect(dsn: str) -> psycopg.Connection[Any]:
    """A PostgreSQL connection (``connect_timeout`` `CONNECT_TIMEOUT_S`, autocommit off).

    Raises:
        psycopg.Error: it does not answer or refuses the login.
    """
    return psycopg.connect(dsn, connect_timeout=CONNECT_TIMEOUT_S)


def check_dsn(dsn: str) -> None:
    """Connect once and create the table, for the start of the gateway.

    Raises:
        ConfigError: PostgreSQL does not answer, refuses the login or the DDL; names
            ``ledger.postgres_dsn``, never its password.
    """
    try:
        with pg_connect(dsn) as conn:
            for statement in pg_schema():
                conn.execute(statement)
    except (psycopg.Error, OSError) as exc:
        raise ConfigError(
            f"ledger.postgres_dsn: PostgreSQL cannot be used ({redacted(exc, dsn)}); fix the DSN "
            "(or $QWEN38_LEDGER_POSTGRES_DSN) or leave it empty for the SQLite ledger alone"
        ) from None


class Shipper:
    """The thread that ships the SQLite outbox to PostgreSQL (see the module docstring).

    Args:
        path: the SQLite ledger file (the outbox).
        dsn: the PostgreSQL DSN (a secret: never logged).
        metrics: ``ledger_shipped(count)`` and ``ledger_unshipped(count)`` (`gateway.metrics`).
        interval_s: ``ledger.ship_interval_s``.
    """

    def __init__(self, path: str | Path, dsn: str, metrics: Metrics, interval_s: float) -> None:
        self.path = Path(path)
        self._dsn = dsn
        self._metrics = metrics
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pg: psycopg.Connection[Any] | None = None
        self._sqlite: sqlite3.Connection | None = None
        self._failing = False
        self.shipped = 0

    def start(self) -> None:
        """Check PostgreSQL (`check_dsn`) and start shipping.

        Raises:
            ConfigError: PostgreSQL cannot be used (see `check_dsn`).
        """
        check_dsn(self._dsn)
        self._thread = threading.Thread(target=self._run, name="ledger-shipper", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop after one last attempt to ship everything; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._lock:
            for conn in (self._pg, self._sqlite):
                if conn is not None:
                    conn.close()
            self._pg = self._sqlite = None

    def _run(self) -> None:
        wait = self._interval_s
        while not self._stop.wait(wait):
            ok = self.ship()
            wait = self._interval_s if ok else min(RETRY_MAX_S, max(wait * 2, self._interval_s))
        self.ship()

    @property
    def healthy(self) -> bool:
        """False from a failed shipment until the next one succeeds (PostgreSQL is down)."""
        return not self._failing

    def ship(self, wait: bool = True) -> bool:
        """Ship what the outbox holds now; True when nothing is left (never raises).

        ``wait=False`` returns False at once when a shipment is already running (a reader that
        must not wait on a PostgreSQL that does not answer).
        """
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            while self._ship_batch():
                pass
        except (psycopg.Error, OSError) as exc:
            self._down(exc)
            return False
        except sqlite3.Error as exc:
            log.error("ledger_outbox_unreadable", path=str(self.path), error=str(exc))
            return False
        finally:
            self._lock.release()
        if self._failing:
            self._failing = False
            log.info("ledger_postgres_up", shipped=self.shipped)
        return True

    def _ship_batch(self) -> bool:
        """Ship one batch; True when a full batch went (more may wait)."""
        if self._sqlite is None:
            self._sqlite = connect(self.path)
        db = self._sqlite
        row = db.execute("SELECT last_rowid FROM outbox WHERE name = ?", (OUTBOX_NAME,)).fetchone()
        cursor = int(row[0]) if row else 0
        rows = db.execute(
            f"SELECT rowid, {', '.join(COLUMNS)} FROM usage WHERE rowid > ? ORDER BY rowid LIMIT ?",
            (cursor, BATCH),
        ).fetchall()
        if not rows:
            top = db.execute("SELECT COALESCE(MAX(rowid), 0) FROM usage").fetchone()[0]
            if int(top) < cursor:  # the table was emptied and rowids started again
                with db:
                    db.execute("UPDATE outbox SET last_rowid = 0 WHERE name = ?", (OUTBOX_NAME,))
            self._metrics.ledger_unshipped.set(0)
            return False
        if self._pg is None or self._pg.closed:
            self._pg = pg_connect(self._dsn)
        with self._pg.transaction(), self._pg.cursor() as cur:
            cur.executemany(_INSERT, [tuple(r[1:]) for r in rows])
        last = int(rows[-1][0])
        with db:
            db.execute(
                "INSERT INTO outbox (name, last_rowid) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET last_rowid = excluded.last_rowid",
                (OUTBOX_NAME, last),
            )
        self.shipped += len(rows)
        self._metrics.ledger_shipped.inc(len(rows))
        left = db.execute("SELECT COUNT(*) FROM usage WHERE rowid > ?", (last,)).fetchone()[0]
        self._metrics.ledger_unshipped.set(int(left))
        return len(rows) == BATCH

    def _down(self, exc: BaseException) -> None:
        if self._pg is not None:
            with contextlib.suppress(psycopg.Error):
                self._pg.close()
            self._pg = None
        if not self._failing:
            self._failing = True
            log.error("ledger_postgres_down", error=redacted(exc, self._dsn))
        if self._sqlite is not None:
            try:
                left = self._sqlite.execute(
                    "SELECT COUNT(*) FROM usage WHERE rowid > COALESCE("
                    "(SELECT last_rowid FROM outbox WHERE name = ?), 0)",
                    (OUTBOX_NAME,),
                ).fetchone()[0]
            except sqlite3.Error:
                return
            self._metrics.ledger_unshipped.set(int(left))


_PG_SUMS = (
    "COUNT(*), SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END), SUM(prompt_tokens), "
    "SUM(completion_tokens), SUM(COALESCE(reasoning_tokens, 0))"
)


def summarise_pg(
    dsn: str, span: Span, by: str, *, tenant: str | None = None
) -> list[dict[str, Any]]:
    """`gateway.usage_report.summarise` over PostgreSQL's ``usage`` table: the same rows.

    Raises:
        ReportError: PostgreSQL does not answer or the table cannot be read (names
            ``ledger.postgres_dsn``, never its password).
    """
    cols = GROUPS[by]
    sql = f"SELECT {', '.join(cols)}, {_PG_SUMS} FROM usage WHERE ts >= %s AND ts < %s"
    args: list[Any] = [span.start_ts, span.end_ts]
    if tenant is not None:
        sql += " AND tenant = %s"
        args.append(tenant)
    sql += f" GROUP BY {', '.join(cols)}"
    try:
        with pg_connect(dsn) as conn:
            rows = conn.execute(sql, args).fetchall()
    except (psycopg.Error, OSError) as exc:
        raise ReportError(
            f"ledger.postgres_dsn: cannot read PostgreSQL ({redacted(exc, dsn)})"
        ) from None
    out = []
    for row in sorted(
        rows, key=lambda r: tuple("" if v is None else str(v) for v in r[: len(cols)])
    ):
        item: dict[str, Any] = dict(zip(cols, row[: len(cols)], strict=True))
        item.update(zip(SUMS, (int(v or 0) for v in row[len(cols) :]), strict=True))
        item["total_tokens"] = item["prompt_tokens"] + item["completion_tokens"]
        out.append(item)
    return out
