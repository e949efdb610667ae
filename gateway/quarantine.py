"""Poison-request quarantine: requests that were at the engine each time it died are refused.

The engine runs about one sequence at a time, so the request running when it dies is the prime
suspect: engines crash on particular inputs, and a client (or a queue) that replays such a
request crashes it again, costing every tenant a restart of minutes each time. The gateway keeps
no request content: a request is known by its fingerprint, an HMAC-SHA256 (RFC 2104) under a
server secret of its canonical engine body (sorted keys, compact JSON) without the per-request
``request_id`` and the per-tenant ``cache_salt``. Without the secret the fingerprint says
nothing about the content.

A death counts for a request only when both hold: its own engine connection failed (dropped
mid-request, reset, or dropped before the answer's headers; a client leaving, a time limit or a
clean end is not a failure) and the engine proved down (`gateway.engine_watch.poll_health`: a
refused or missing socket, a non-200 ``/health``, or probes failing for
``engine.unhealthy_after_s``). The order does not matter: a request whose connection failed up
to `DROP_GRACE_S` plus two health intervals plus ``engine.unhealthy_after_s`` before the engine
went from ready (or warming) to down gets the death then; one at the engine when it went down
gets it if its connection fails before the engine is ready again. A request whose connection
stays alive and keeps answering never gets a death, however slow ``/health`` is. Each request
gets at most one death per outage. A fingerprint
with ``quarantine.deaths`` deaths within ``quarantine.window_s`` is quarantined for
``quarantine.duration_s``: refused with 422 ``request_quarantined`` (`RequestQuarantined`)
before it reaches the engine. Requests waiting in the admission queue are never suspects.

State lives in ``quarantine.state_file`` (JSON, 0600, written whole and renamed into place under
an exclusive ``flock`` of ``<file>.lock``), so it survives a restart of the gateway (with the
same ``QWEN38_CACHE_SALT_SECRET``; without it fingerprints change with every process) and the
``qwen38-gateway quarantine list|clear`` command edits it under the same lock. The gateway
re-reads the file when its modification time changes (every ``quarantine.poll_s``), so a clear
takes effect within that time; its own changes re-read the file under the lock first, so it
never writes back an entry an operator cleared.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gateway.config import QuarantineSettings
from gateway.errors import RequestQuarantined
from gateway.metrics import Metrics

log = structlog.get_logger("gateway.quarantine")

EXCLUDED_FIELDS = ("request_id", "cache_salt")
"""Engine body fields that differ between two sends of the same request (the gateway's id, the
tenant's prefix-cache salt) and so are not part of the fingerprint."""
DROP_GRACE_S = 2.0
"""Seconds (beyond two health intervals) a dropped request stays a suspect: the health poller
may notice the death only after the request saw its connection drop."""
MAX_ENTRIES = 10_000
"""Fingerprints kept (quarantined plus suspects); the oldest go first beyond it."""
_KEY_LABEL = b"qwen38-gateway quarantine fingerprint v1"


def fingerprint_key(secret: bytes) -> bytes:
    """The HMAC key of fingerprints, derived from the server secret (a label of its own, so the
    fingerprint is unrelated to the cache salt made from the same secret)."""
    return hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()


def fingerprint(key: bytes, body: bytes) -> str:
    """32 hex digits: HMAC-SHA256 of the canonical engine body without `EXCLUDED_FIELDS`.

    Canonical: ``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)``; a
    body that is not a JSON object is hashed as sent.
    """
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        kept = {k: v for k, v in obj.items() if k not in EXCLUDED_FIELDS}
        body = json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()[:32]


class RequestPrint:
    """A request's fingerprint (`fingerprint` of its engine body), computed when first read
    (``str``): most requests never need it, since nothing is quarantined and no engine dies
    under them, and canonicalising a body costs a JSON decode and encode.

    Args:
        key: `fingerprint_key` of the server secret.
        body: the engine body (held until the fingerprint is computed).
    """

    __slots__ = ("_body", "_key", "_value")

    def __init__(self, key: bytes, body: bytes) -> None:
        self._key = key
        self._body = body
        self._value: str | None = None

    def __str__(self) -> str:
        if self._value is None:
            self._value = fingerprint(self._key, self._body)
            self._body = b""
        return self._value


@dataclass
class Record:
    """One fingerprint's history: its deaths (Unix seconds) and quarantine end (0: none)."""

    deaths: list[float] = field(default_factory=list)
    until: float = 0.0
    since: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"deaths": self.deaths, "until": self.until, "since": self.since}


def _parse(text: str) -> dict[str, Record]:
    try:
        raw = json.loads(text) if text.strip() else {}
    except ValueError:
        log.error("quarantine_state_unreadable")
        return {}
    records = raw.get("fingerprints") if isinstance(raw, dict) else None
    out: dict[str, Record] = {}
    for fp, value in (records or {}).items():
        if isinstance(value, dict):
            deaths = [float(t) for t in value.get("deaths", []) if isinstance(t, (int, float))]
            out[str(fp)] = Record(
                deaths, float(value.get("until") or 0), float(value.get("since") or 0)
            )
    return out


class StateFile:
    """The quarantine's JSON file, read and replaced under an exclusive lock (gateway and CLI).

    ``{"fingerprints": {FP: {"deaths": [unix s], "until": unix s or 0, "since": unix s}}}``.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def read(self) -> dict[str, Record]:
        """The records; empty when the file does not exist or cannot be parsed (logged)."""
        try:
            return _parse(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}

    def mtime(self) -> float:
        """Modification time in ns, 0 when absent."""
        try:
            return float(self.path.stat().st_mtime_ns)
        except FileNotFoundError:
            return 0.0

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Record]]:
        """Read the records under the lock, let the caller change them, write them back."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            records = self.read()
            yield records
            self._write(records)
        finally:
            os.close(fd)  # closing releases the lock

    def _write(self, records: dict[str, Record]) -> None:
        data = {"fingerprints": {fp: r.to_json() for fp, r in records.items()}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".quarantine-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(data, handle, separators=(",", ":"))
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def prune(records: dict[str, Record], now: float, window_s: float) -> None:
    """Drop deaths older than ``window_s`` and records with neither deaths nor a quarantine;
    keep at most `MAX_ENTRIES` (the least recent go first)."""
    for fp in list(records):
        record = records[fp]
        record.deaths = [t for t in record.deaths if now - t <= window_s]
        if record.until <= now:
            record.until = 0.0
        if not record.deaths and not record.until:
            del records[fp]
    if len(records) > MAX_ENTRIES:
        ordered = sorted(records, key=lambda f: max([records[f].until, *records[f].deaths]))
        for fp in ordered[: len(records) - MAX_ENTRIES]:
            del records[fp]


class _Outage:
    """One engine's death bookkeeping: down (between its death and its return), requests whose
    connection to it failed (time, fingerprint, request id), fingerprints counted this outage."""

    __slots__ = ("counted", "down", "dropped")

    def __init__(self) -> None:
        self.down = False
        self.dropped: list[tuple[float, str, str]] = []
        self.counted: set[str] = set()


class Quarantine:
    """The gateway's view of the quarantine: suspects at the engine, deaths, refusals.

    Args:
        settings: ``[quarantine]``.
        key: `fingerprint_key` of the server secret.
        metrics: ``gateway_quarantined_requests_total``, ``gateway_quarantine_entries``.
        clock: Unix seconds (persisted times).
    """

    def __init__(
        self,
        settings: QuarantineSettings,
        key: bytes,
        metrics: Metrics,
        *,
        health_interval_s: Callable[[], float] = lambda: 2.0,
        unhealthy_after_s: Callable[[], float] = lambda: 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.key = key
        self._metrics = metrics
        self._clock = clock
        self._health_interval_s = health_interval_s
        self._unhealthy_after_s = unhealthy_after_s
        # Per engine: between its engine_died and engine_ready, its dropped suspects, and the
        # fingerprints already given a death in its current outage.
        self._outages: dict[str, _Outage] = {}
        self._file = StateFile(settings.state_file) if settings.state_file else None
        self._records: dict[str, Record] = {}
        self._mtime = -1.0
        self._running: dict[int, tuple[str | RequestPrint, str, str]] = {}
        self._tokens = iter(range(1 << 62))
        # Set by `gateway.fleet_sync` when the fleet shares the quarantine in Redis: deaths go
        # there (this view is updated at once and replaced by the shared one on each sync).
        self.shared_push: Callable[[list[str], float], None] | None = None
        self.refresh()

    def _outage(self, engine: str) -> _Outage:
        found = self._outages.get(engine)
        if found is None:
            found = self._outages[engine] = _Outage()
        return found

    @property
    def enabled(self) -> bool:
        """False when ``quarantine.enabled`` is off: nothing is fingerprinted or refused."""
        return self.settings.enabled

    def fingerprint(self, body: bytes) -> RequestPrint:
        """The fingerprint of an engine body (`fingerprint`), computed when first read."""
        return RequestPrint(self.key, body)

    def entries(self) -> dict[str, Record]:
        """Quarantined fingerprints now (a copy)."""
        now = self._clock()
        return {fp: r for fp, r in self._records.items() if r.until > now}

    def check(self, fp: str | RequestPrint, tenant_label: str) -> None:
        """Refuse a quarantined fingerprint (computed only when something is quarantined).

        Raises:
            RequestQuarantined: 422; counted and logged once.
        """
        if not self._records:
            return
        fp = str(fp)
        record = self._records.get(fp)
        now = self._clock()
        if record is None or record.until <= now:
            return
        self._metrics.quarantined.labels(tenant_label).inc()
        log.warning("request_quarantined", fingerprint=fp, until=round(record.until))
        raise RequestQuarantined(fp, record.until - now, self.settings.deaths)

    def started(self, fp: str | RequestPrint, request_id: str, engine: str = "default") -> int:
        """The request ``request_id`` with ``fp`` is being sent to ``engine``; returns its token.

        Deaths are per engine (each engine's outage counts once per request), and fleet-wide in
        effect: the records are shared, so a request that kills one engine and then, retried,
        another has its two deaths."""
        token = next(self._tokens)
        self._running[token] = (fp, request_id, engine)
        return token

    def finished(self, token: int, *, dropped: bool) -> None:
        """The request of ``token`` left the engine; ``dropped``: its engine connection failed
        (the engine may have died under it). A failure while the engine is down is a death at
        once; one while it is up stays a suspect for the grace time (`engine_died`)."""
        entry = self._running.pop(token, None)
        if entry is None or not dropped:
            return
        fp = str(entry[0])
        request_id, engine = entry[1], entry[2]
        outage = self._outage(engine)
        if fp in outage.counted:
            return
        if outage.down:
            self._count({fp: request_id}, self._clock(), outage)
        else:
            outage.dropped.append((self._clock(), fp, request_id))

    def engine_died(self, engine: str = "default") -> list[str]:
        """The engine proved down: every request whose engine connection failed within the
        grace time before gets a death (those still at it get theirs in `finished` if their
        connection fails before `engine_ready`).

        Returns the fingerprints quarantined by this death.
        """
        now = self._clock()
        grace = DROP_GRACE_S + 2 * self._health_interval_s() + self._unhealthy_after_s()
        outage = self._outage(engine)
        suspects = {fp: rid for at, fp, rid in outage.dropped if now - at <= grace}
        outage.dropped.clear()
        outage.counted = set()
        outage.down = True
        return self._count(suspects, now, outage)

    def _count(self, suspects: dict[str, str], now: float, outage: _Outage) -> list[str]:
        """Give each fingerprint of ``suspects`` (fingerprint: request id) one death."""
        outage.counted.update(suspects)
        if not suspects or not self.enabled:
            return []
        if self.shared_push is not None:
            added = self._add_deaths(self._records, set(suspects), now)
            self.shared_push(list(suspects), now)
            self._metrics.quarantine_entries.set(len(self.entries()))
        else:
            added = self._update(lambda records: self._add_deaths(records, set(suspects), now))
        for fp, request_id in suspects.items():
            log.warning(
                "engine_death_suspect",
                fingerprint=fp,
                suspect_request_id=request_id,
                quarantined=fp in added,
            )
        return added

    def engine_ready(self, engine: str = "default") -> None:
        """The engine is back: the next death is a new one."""
        outage = self._outage(engine)
        outage.down = False
        outage.counted = set()
        outage.dropped.clear()

    def _add_deaths(self, records: dict[str, Record], suspects: set[str], now: float) -> list[str]:
        settings = self.settings
        prune(records, now, settings.window_s)
        added = []
        for fp in suspects:
            record = records.setdefault(fp, Record())
            record.deaths.append(now)
            if len(record.deaths) >= settings.deaths and record.until <= now:
                record.until, record.since = now + settings.duration_s, now
                added.append(fp)
        return added

    def _update(self, change: Callable[[dict[str, Record]], list[str]]) -> list[str]:
        if self._file is None:
            result = change(self._records)
        else:
            try:
                with self._file.locked() as records:
                    result = change(records)
                self._records = records
                self._mtime = self._file.mtime()
            except OSError as exc:
                log.error("quarantine_state_write_failed", error=type(exc).__name__)
                result = change(self._records)
        self._metrics.quarantine_entries.set(len(self.entries()))
        return result

    def replace(self, records: dict[str, Record]) -> None:
        """Take the fleet's shared records (`gateway.fleet_sync`) as this gateway's view."""
        self._records = records
        self._metrics.quarantine_entries.set(len(self.entries()))

    def refresh(self) -> None:
        """Re-read the state file if it changed (an operator's clear) and update the gauge; an
        unreadable file is logged and the last state kept. With a shared quarantine the state
        file is not used."""
        if self._file is not None and self.shared_push is None:
            try:
                mtime = self._file.mtime()
                if mtime != self._mtime:
                    self._records = self._file.read()
                    self._mtime = mtime
            except OSError as exc:
                log.error("quarantine_state_unreadable", error=type(exc).__name__)
        self._metrics.quarantine_entries.set(len(self.entries()))
