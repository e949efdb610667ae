"""The usage ledger: one SQLite record per finished model request, written off the request path.

The request path calls `Ledger.record`, which appends to an in-memory queue and returns; a writer
thread commits the queue every ``flush_interval_s`` in one transaction, fsynced (SQLite WAL mode
with ``synchronous = FULL``, see sqlite.org "Write-Ahead Logging" and "PRAGMA synchronous"). A
``kill -9`` or a crash therefore loses at most the records that finished during the last
``flush_interval_s`` plus the time of one commit. A file that cannot be written (full disk,
read-only path, missing permissions) is logged once per outage, counted in
``gateway_ledger_write_errors_total`` and retried. Records wait in memory up to ``max_pending``
in all (queued, being written, kept for a retry), whether the file fails or a write hangs (a
stalled disk): beyond it the oldest queued record is dropped as the new one arrives, counted in
``gateway_ledger_dropped_records_total`` and logged by the writer as ``ledger_records_dropped``
with the tokens they held per tenant, so no charge is lost unseen. A record takes about 510
bytes (`RECORD_BYTES`). A request never fails because of the ledger.

Readers (`open_readonly`) open the file read-only through a ``file:`` URI, so reports run against
a live ledger without blocking its writer (WAL readers never block the writer).
"""

from __future__ import annotations

import collections
import datetime as dt
import operator
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

SCHEMA_VERSION = 4
"""1: the first table; 2: ``record_id`` (the outbox's key); 3: ``engine``; 4: ``attaches``.
Older files are completed in place at the first open (`connect`)."""
_BUSY_TIMEOUT_MS = 5000
_PRUNE_BATCH = 10_000
_RETRY_MAX_S = 5.0
RECORD_BYTES = 600
"""Memory of one waiting record, rounded up: a `UsageRecord` with a 128-character request id
and its queue slot measured 510 bytes (tracemalloc, CPython 3.11, 64-bit)."""
OUTBOX_NAME = "postgres"
"""The outbox cursor's row: records with a rowid up to its ``last_rowid`` are in PostgreSQL."""
_SHIPPED = " AND rowid <= COALESCE((SELECT last_rowid FROM outbox WHERE name = 'postgres'), 0)"

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    ts REAL NOT NULL,
    day TEXT NOT NULL,
    tenant TEXT NOT NULL,
    key_id TEXT NOT NULL,
    subject TEXT,
    endpoint TEXT NOT NULL,
    status INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER,
    queue_s REAL,
    ttft_s REAL,
    duration_s REAL NOT NULL,
    request_id TEXT NOT NULL,
    record_id TEXT,
    engine TEXT,
    attaches INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS usage_ts ON usage (ts);
CREATE INDEX IF NOT EXISTS usage_tenant_day ON usage (tenant, day);
CREATE TABLE IF NOT EXISTS outbox (name TEXT PRIMARY KEY, last_rowid INTEGER NOT NULL);
"""
# Version 1 files have no record_id: added, and filled with fresh ids, at the first open.
_MIGRATE = (
    "ALTER TABLE usage ADD COLUMN record_id TEXT",
    "UPDATE usage SET record_id = lower(hex(randomblob(16))) WHERE record_id IS NULL",
)
_RECORD_ID_INDEX = "CREATE UNIQUE INDEX IF NOT EXISTS usage_record_id ON usage (record_id)"


def new_record_id() -> str:
    """32 random hex digits (128 bits): a record's id, unique across gateways and restarts."""
    return os.urandom(16).hex()  # `secrets.token_hex(16)` without its three calls


def utc_day(ts: float) -> str:
    """The UTC calendar date of ``ts`` (seconds since the Unix epoch) as ``YYYY-MM-DD``.

    The last day is kept (its first second and its name): records of one day ask alike.
    """
    global _last_day
    start, name = _last_day
    if start <= ts < start + 86_400:
        return name
    moment = dt.datetime.fromtimestamp(ts, dt.timezone.utc)
    day0 = dt.datetime(moment.year, moment.month, moment.day, tzinfo=dt.timezone.utc)
    _last_day = (day0.timestamp(), day0.strftime("%Y-%m-%d"))
    return _last_day[1]


_last_day: tuple[float, str] = (float("inf"), "")


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One finished model request, as stored (the table's columns, in order).

    Attributes:
        ts: when the request finished, seconds since the Unix epoch (UTC).
        day: ``utc_day(ts)``, stored for grouping.
        tenant: the tenant name (not the metric label: an unconfigured tenant keeps its name).
        key_id: the API key id, or ``jwt:<kid>`` for a JWT.
        subject: the JWT ``sub`` (bounded, see ``gateway.auth.bounded_subject``), else None.
        endpoint: the route, e.g. ``/v1/chat/completions``.
        status: the HTTP status answered (499: the client went away; a stream cut by the engine
            keeps its 200 status line but is recorded with the error's status).
        prompt_tokens: as the engine reported them, else the gateway's estimate of the prompt.
        completion_tokens: as the engine reported them, else the tokens streamed before the cut.
        reasoning_tokens: the part of ``completion_tokens`` spent thinking, when known, else None.
        queue_s: seconds waited for an engine slot, None if never queued.
        ttft_s: seconds from request received to the first token sent, None if none was sent.
        duration_s: seconds from request received to the end.
        request_id: the ``x-request-id`` answered to the client.
        record_id: the record's own id (`new_record_id`), the key that ships it to PostgreSQL
            exactly once (a client may send the same ``x-request-id`` twice).
        engine: the name of the engine the request was sent to (``[[engines]]`` ``name``, or
            ``default``), None when it never reached one.
        attaches: retries answered from this request's generation while it ran
            (`gateway.retries`); they have no record of their own and are not charged.
    """

    ts: float
    day: str
    tenant: str
    key_id: str
    subject: str | None
    endpoint: str
    status: int
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int | None
    queue_s: float | None
    ttft_s: float | None
    duration_s: float
    request_id: str
    record_id: str = field(default_factory=new_record_id)
    engine: str | None = None
    attaches: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens: what quotas and ``tpm`` charge."""
        return self.prompt_tokens + self.completion_tokens


COLUMNS = tuple(f.name for f in fields(UsageRecord))
_INSERT = f"INSERT INTO usage ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
_ROW = operator.attrgetter(*COLUMNS)
"""A record's values in `COLUMNS` order: a plain tuple (``dataclasses.astuple`` deep-copies
every field: 28 µs a record against 0.6, while the writer thread holds the interpreter)."""


class LedgerMetrics(Protocol):
    """The metrics the writer updates (`gateway.metrics.Metrics` provides them)."""

    def ledger_written(self, count: int) -> None:
        """``count`` records were committed."""

    def ledger_write_error(self) -> None:
        """A commit (or opening the file) failed."""

    def ledger_dropped_records(self, count: int) -> None:
        """``count`` records were dropped because ``max_pending`` was exceeded."""

    def ledger_pending_records(self, count: int) -> None:
        """``count`` records wait in memory."""


def connect(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """Open (creating if needed) the ledger for writing: WAL mode, fsync on each commit.

    Raises:
        sqlite3.Error, OSError: the directory or file cannot be created or written.
    """
    target = Path(path)
    target.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    conn = sqlite3.connect(target, timeout=_BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.executescript(SCHEMA)
        have = {str(row[1]) for row in conn.execute("PRAGMA table_info(usage)")}
        if "record_id" not in have:
            for statement in _MIGRATE:
                conn.execute(statement)
        conn.execute(_RECORD_ID_INDEX)
        if "engine" not in have:  # an older file: its records name no engine
            conn.execute("ALTER TABLE usage ADD COLUMN engine TEXT")
        if "attaches" not in have:  # an older file: no request of it was attached to
            conn.execute("ALTER TABLE usage ADD COLUMN attaches INTEGER NOT NULL DEFAULT 0")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.commit()
    except BaseException:
        conn.close()
        raise
    return conn


def path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why `connect`, run by this user, could not create or write the ledger at ``path``; None
    when it could.

    Tried for real, leaving nothing behind: a temporary file in the file's directory (removed
    at once), or, when that directory does not exist yet, a temporary directory in its nearest
    existing parent, where `connect` would create it (removed at once); an existing ledger is
    opened for appending and closed, unchanged, and must start as an SQLite database does. For
    ``check``: ``serve`` starts all the same,
    logs ``ledger_write_failed`` and holds the records in memory (up to ``max_pending``).

    Returns:
        ``"<path>: ..."`` naming the directory at fault and the OS error, or None.
    """
    target = Path(path)
    if os.path.isdir(target):
        return f"{target}: a directory, not a file"
    directory = target.parent
    nearest = directory
    while not os.path.exists(nearest) and nearest != nearest.parent:
        nearest = nearest.parent
    if not os.path.isdir(nearest):
        return f"{target}: {nearest} is not a directory"
    try:
        if nearest == directory:
            where = f"directory {directory} is not writable"
            fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.check-")
            os.close(fd)
            os.unlink(temp)
            if os.path.exists(target):
                where = "the file cannot be written"
                os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC))
        else:
            where = f"directory {directory} does not exist and cannot be created in {nearest}"
            os.rmdir(tempfile.mkdtemp(dir=nearest, prefix=".qwen38-check-"))
    except OSError as exc:
        return f"{target}: {where} ({exc.strerror or type(exc).__name__})"
    if os.path.isfile(target) and os.path.getsize(target) > 0:
        with open(target, "rb") as file:
            if file.read(len(_SQLITE_HEADER)) != _SQLITE_HEADER:
                return f"{target}: not an SQLite database (file is not a database)"
    return None


_SQLITE_HEADER = b"SQLite format 3\x00"
"""The first 16 bytes of every SQLite database file (sqlite.org, "Database File Format" 1.3)."""


def open_readonly(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """Open an existing ledger read-only (``mode=ro``), safe against a live writer.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        sqlite3.Error: the file is not a ledger (no ``usage`` table) or cannot be read.
    """
    target = Path(path).resolve()
    if not target.is_file():
        raise FileNotFoundError(f"{path}: no such ledger")
    conn = sqlite3.connect(f"{target.as_uri()}?mode=ro", uri=True, timeout=_BUSY_TIMEOUT_MS / 1000)
    try:
        conn.execute("SELECT 1 FROM usage LIMIT 1").fetchall()
    except BaseException:
        conn.close()
        raise
    return conn


def tokens_by_tenant(
    conn: sqlite3.Connection, since_ts: float, until_ts: float | None = None
) -> dict[str, int]:
    """Prompt plus completion tokens per tenant of the records with ``since_ts <= ts < until_ts``."""
    sql = "SELECT tenant, SUM(prompt_tokens + completion_tokens) FROM usage WHERE ts >= ?"
    args: list[float] = [since_ts]
    if until_ts is not None:
        sql += " AND ts < ?"
        args.append(until_ts)
    rows = conn.execute(sql + " GROUP BY tenant", args).fetchall()
    return {str(tenant): int(total or 0) for tenant, total in rows}


class Ledger:
    """The writer of one ledger file; `start` it once, `record` from any thread, `close` at exit.

    Args:
        path: the SQLite file.
        metrics: where write counts and errors go.
        flush_interval_s: longest time a record waits in memory before its commit (seconds).
        retention_days: records older than this are deleted (0 keeps everything).
        prune_interval_s: how often old records are deleted (seconds).
        max_pending: records held in memory in all (queued, being written, kept for a retry);
            beyond it the oldest queued are dropped, counted and logged.
        clock: wall-clock seconds since the epoch (retention cut-off).
        outbox: the file is the outbox of a PostgreSQL ledger (`gateway.ledger_ship`): records
            not shipped yet are never pruned.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        metrics: LedgerMetrics,
        *,
        flush_interval_s: float = 0.5,
        retention_days: int = 400,
        prune_interval_s: float = 3600.0,
        max_pending: int = 100_000,
        clock: Callable[[], float] = time.time,
        outbox: bool = False,
    ) -> None:
        self.path = Path(path)
        self._outbox = outbox
        self._metrics = metrics
        self._flush_s = flush_interval_s
        self._retention_s = retention_days * 86_400.0
        self._prune_s = prune_interval_s
        self._max_pending = max_pending
        self._clock = clock
        # deque.append and popleft are atomic: the request path appends, the writer drains.
        self._queue: collections.deque[UsageRecord] = collections.deque()
        # Records the writer holds outside the queue: its batch while it writes (a batch that
        # failed goes back to the head of the queue, oldest first, for the next try).
        self._unwritten = 0
        # Dropped since the writer last logged it: records, and their tokens per tenant.
        self._drop_lock = threading.Lock()
        self._dropped = 0
        self._dropped_tokens: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None
        self._failing = False
        self._next_prune = 0.0
        self._lock = threading.Lock()  # one flush at a time (writer thread, `flush`, `close`)
        self._metrics_each = False
        self.written = 0

    def record(self, rec: UsageRecord) -> None:
        """Queue one record for the next commit; O(1), never blocks, never raises.

        With ``max_pending`` records already held (the file failing, or a write hanging), the
        oldest queued record is dropped for it (counted; logged by the writer).
        """
        queue = self._queue
        queue.append(rec)
        over = len(queue) + self._unwritten - self._max_pending
        if over > 0:
            self._drop(queue, over)
        if self._metrics_each:
            self._metrics.ledger_pending_records(len(queue) + self._unwritten)

    def _drop(self, queue: collections.deque[UsageRecord], count: int) -> None:
        """Drop up to ``count`` of the oldest queued records (the writer may take them first)."""
        dropped: list[UsageRecord] = []
        for _ in range(count):
            try:
                dropped.append(queue.popleft())
            except IndexError:
                break
        if dropped:
            self._count_dropped(dropped)

    def _count_dropped(self, dropped: list[UsageRecord]) -> None:
        self._metrics.ledger_dropped_records(len(dropped))
        self._metrics_each = True  # the pending gauge follows every record while over
        with self._drop_lock:
            self._dropped += len(dropped)
            for rec in dropped:
                tokens = self._dropped_tokens
                tokens[rec.tenant] = tokens.get(rec.tenant, 0) + rec.total_tokens

    def _log_dropped(self) -> None:
        """Log what was dropped since the last call (writer thread), once per flush."""
        with self._drop_lock:
            count, tokens = self._dropped, self._dropped_tokens
            self._dropped, self._dropped_tokens = 0, {}
        if count:
            log.error("ledger_records_dropped", path=str(self.path), records=count, tokens=tokens)

    def start(self) -> None:
        """Open the file (failures are logged and retried by the writer) and start the writer."""
        if self._thread is not None:
            return
        self._open()
        self._thread = threading.Thread(target=self._run, name="usage-ledger", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the writer after a last commit of everything queued; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        else:
            self._flush()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def flush(self) -> None:
        """Commit everything queued now, in the caller's thread (for tests and tools)."""
        self._flush()

    def totals_since(self, since_ts: float) -> dict[str, int]:
        """Tokens per tenant recorded since ``since_ts``, committed or still queued here.

        Raises:
            sqlite3.Error: the file cannot be read (the caller decides what that means).
        """
        totals: dict[str, int] = {}
        if self.path.exists():
            conn = open_readonly(self.path)
            try:
                totals = tokens_by_tenant(conn, since_ts)
            finally:
                conn.close()
        for rec in list(self._queue):
            if rec.ts >= since_ts:
                totals[rec.tenant] = totals.get(rec.tenant, 0) + rec.total_tokens
        return totals

    # ----------------------------------------------------------------------- writer thread

    def _run(self) -> None:
        wait = self._flush_s
        while not self._stop.wait(wait):
            ok = self._flush()
            # While failing, back off (doubling, at most _RETRY_MAX_S) instead of spinning.
            wait = self._flush_s if ok else min(_RETRY_MAX_S, max(wait * 2, self._flush_s))
            if ok and self._clock() >= self._next_prune:
                self._prune()
        self._flush()

    def _open(self) -> bool:
        if self._conn is not None:
            return True
        try:
            self._conn = connect(self.path)
        except (sqlite3.Error, OSError) as exc:
            self._fail("open", exc)
            return False
        return True

    def _flush(self) -> bool:
        """Commit queued records in one transaction; True when nothing is left to write."""
        with self._lock:
            return self._flush_locked()

    def _flush_locked(self) -> bool:
        self._log_dropped()
        batch: list[UsageRecord] = []
        queue = self._queue
        for _ in range(len(queue)):
            try:
                batch.append(queue.popleft())
            except IndexError:  # `record` dropped the oldest meanwhile
                break
        self._unwritten = len(batch)
        if not batch:
            return True
        if not self._open():
            self._keep(batch)
            return False
        assert self._conn is not None
        try:
            with self._conn:
                self._conn.executemany(_INSERT, map(_ROW, batch))
        except (sqlite3.Error, OSError) as exc:
            self._fail("write", exc)
            self._keep(batch)
            return False
        self.written += len(batch)
        self._unwritten = 0
        self._log_dropped()  # what arrived past the bound while this write hung
        self._metrics_each = False
        self._metrics.ledger_written(len(batch))
        self._metrics.ledger_pending_records(len(self._queue))
        if self._failing:
            self._failing = False
            log.info("ledger_write_recovered", path=str(self.path), records=len(batch))
        return True

    def _keep(self, batch: list[UsageRecord]) -> None:
        """Put a failed batch back at the head of the queue for the next try, dropping the
        oldest beyond ``max_pending``."""
        excess = len(batch) + len(self._queue) - self._max_pending
        if excess > 0:
            self._count_dropped(batch[:excess])
            del batch[:excess]
            self._log_dropped()
        self._queue.extendleft(reversed(batch))
        self._unwritten = 0
        self._metrics.ledger_pending_records(len(self._queue))

    def _fail(self, action: str, exc: BaseException) -> None:
        self._metrics.ledger_write_error()
        if self._conn is not None and action == "open":
            self._conn = None
        if not self._failing:
            self._failing = True
            log.error(
                "ledger_write_failed",
                path=str(self.path),
                action=action,
                error=f"{type(exc).__name__}: {exc}",
            )

    def _prune(self) -> None:
        """Delete records older than the retention, in batches (short write transactions)."""
        self._next_prune = self._clock() + self._prune_s
        if self._retention_s <= 0 or self._conn is None:
            return
        cutoff = self._clock() - self._retention_s
        deleted = 0
        try:
            while not self._stop.is_set():
                with self._lock, self._conn:
                    cur = self._conn.execute(
                        "DELETE FROM usage WHERE rowid IN "
                        f"(SELECT rowid FROM usage WHERE ts < ?{_SHIPPED if self._outbox else ''} "
                        "LIMIT ?)",
                        (cutoff, _PRUNE_BATCH),
                    )
                deleted += cur.rowcount
                if cur.rowcount < _PRUNE_BATCH:
                    break
                self._flush()
        except (sqlite3.Error, OSError) as exc:
            self._fail("prune", exc)
            return
        if deleted:
            log.info("ledger_pruned", path=str(self.path), records=deleted, before=utc_day(cutoff))
