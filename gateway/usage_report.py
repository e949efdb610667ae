"""Usage reports from one or several ledgers: the ``usage report`` command and per-tenant days.

Ledgers are opened read-only (`gateway.ledger.open_readonly`), so a report runs against the live
file of a running gateway. Several ledgers (one per replica) are merged by summing; the same
file named twice counts once.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import json
import os
import sqlite3
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.errors import quotable
from gateway.ledger import open_readonly

GROUPS: dict[str, tuple[str, ...]] = {
    "tenant": ("tenant",),
    "key": ("tenant", "key_id", "subject"),
    "day": ("day",),
    "endpoint": ("endpoint",),
}
"""``--by`` choices and the ledger columns each groups by."""
SUMS = ("requests", "errors", "prompt_tokens", "completion_tokens", "reasoning_tokens")
"""Summed columns; ``total_tokens`` (prompt plus completion) is derived."""
_SELECT_SUMS = (
    "COUNT(*), SUM(status >= 400), SUM(prompt_tokens), SUM(completion_tokens), "
    "SUM(COALESCE(reasoning_tokens, 0))"
)


class ReportError(ValueError):
    """A bad date, a missing ledger or an unreadable file; the message says which."""


@dataclass(frozen=True)
class Span:
    """A range of whole UTC days, ``since`` to ``until`` inclusive."""

    since: dt.date
    until: dt.date

    @property
    def start_ts(self) -> float:
        """First second of ``since`` (Unix seconds)."""
        return _midnight(self.since)

    @property
    def end_ts(self) -> float:
        """First second after ``until`` (Unix seconds)."""
        return _midnight(self.until + dt.timedelta(days=1))


def _midnight(day: dt.date) -> float:
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.timezone.utc).timestamp()


def parse_day(text: str, what: str) -> dt.date:
    """A ``YYYY-MM-DD`` date; `ReportError` naming ``what`` otherwise."""
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise ReportError(f"{what} must be a date as YYYY-MM-DD, not '{quotable(text)}'") from None


def make_span(since: str | None, until: str | None, today: dt.date) -> Span:
    """The span of ``--since``/``--until`` (default: the first of this month to today).

    Raises:
        ReportError: a date is malformed or ``since`` is after ``until``.
    """
    end = parse_day(until, "until") if until else today
    start = parse_day(since, "since") if since else end.replace(day=1)
    if start > end:
        raise ReportError(f"since ({start}) is after until ({end})")
    return Span(start, end)


def _unique(paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Paths with the same file named twice (by device and inode) kept once.

    Raises:
        ReportError: a path does not exist.
    """
    seen: set[tuple[int, int]] = set()
    out: list[str] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ReportError(f"{path}: cannot open ledger ({exc.strerror})") from None
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append(str(path))
    return out


def summarise(
    paths: Sequence[str | os.PathLike[str]],
    span: Span,
    by: str,
    *,
    tenant: str | None = None,
) -> list[dict[str, Any]]:
    """Usage grouped by ``by`` over ``span``, merged over ``paths``, sorted by group.

    Each row has the group's columns (`GROUPS`), the `SUMS` and ``total_tokens``. ``tenant``
    restricts to one tenant.

    Raises:
        ReportError: a ledger is missing or unreadable.
    """
    cols = GROUPS[by]
    sql = f"SELECT {', '.join(cols)}, {_SELECT_SUMS} FROM usage WHERE ts >= ? AND ts < ?"
    args: list[Any] = [span.start_ts, span.end_ts]
    if tenant is not None:
        sql += " AND tenant = ?"
        args.append(tenant)
    sql += f" GROUP BY {', '.join(cols)}"
    merged: dict[tuple[Any, ...], list[int]] = {}
    for path in _unique(paths):
        try:
            conn = open_readonly(path)
        except (OSError, sqlite3.Error) as exc:
            raise ReportError(f"{path}: not a readable usage ledger ({exc})") from None
        try:
            rows = conn.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise ReportError(f"{path}: cannot read ({exc})") from None
        finally:
            conn.close()
        for row in rows:
            key = tuple(row[: len(cols)])
            sums = merged.setdefault(key, [0] * len(SUMS))
            for i, value in enumerate(row[len(cols) :]):
                sums[i] += int(value or 0)
    out = []
    for key in sorted(merged, key=lambda k: tuple("" if v is None else str(v) for v in k)):
        row = dict(zip(cols, key, strict=True))
        row.update(zip(SUMS, merged[key], strict=True))
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
        out.append(row)
    return out


def totals(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    """The `SUMS` and ``total_tokens`` over ``rows``."""
    out = dict.fromkeys((*SUMS, "total_tokens"), 0)
    for row in rows:
        for name in out:
            out[name] += int(row[name])
    return out


def render(rows: list[dict[str, Any]], by: str, fmt: str, span: Span) -> str:
    """``rows`` as ``table`` (aligned, with a total line), ``csv`` or ``json``."""
    columns = [*GROUPS[by], *SUMS, "total_tokens"]
    if fmt == "json":
        doc = {
            "object": "usage.report",
            "since": span.since.isoformat(),
            "until": span.until.isoformat(),
            "by": by,
            "data": rows,
            "total": totals(rows),
        }
        return json.dumps(doc, indent=2) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()
    total = {**dict.fromkeys(GROUPS[by], ""), **totals(rows)}
    total[GROUPS[by][0]] = "TOTAL"
    cells = [columns] + [["" if r[c] is None else str(r[c]) for c in columns] for r in rows]
    cells.append([str(total[c]) for c in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    numeric = {*SUMS, "total_tokens"}
    lines = []
    for line in cells:
        parts = [
            v.rjust(w) if c in numeric else v.ljust(w)
            for c, v, w in zip(columns, line, widths, strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
    header = f"usage {span.since} .. {span.until} (UTC), by {by}"
    return header + "\n" + "\n".join(lines) + "\n"


def _report(args: argparse.Namespace) -> int:
    from gateway.config import ConfigError, load_settings

    paths = list(args.ledger or [])
    dsn = ""
    if not paths:
        try:
            settings = load_settings(args.config)
        except ConfigError as exc:
            print(f"qwen38-gateway: invalid configuration: {exc}", file=sys.stderr)
            return 1
        ledger = settings.ledger
        if settings.source is None:
            # No config file at all: the built-in default path may be another installation's
            # ledger (or none); never report from it silently.
            print(
                "qwen38-gateway usage report: no --ledger and no config file "
                f"({args.config or 'the default config'} does not exist): name the ledger with "
                "--ledger PATH or the gateway's config with --config PATH (the demo prints "
                f"both); the built-in default would be {ledger.path}",
                file=sys.stderr,
            )
            return 1
        paths, dsn = [ledger.path], ledger.dsn()
        where = "PostgreSQL ([ledger] postgres_dsn)" if dsn else f"ledger {ledger.path}"
        print(f"usage report: {where}, from {settings.source}", file=sys.stderr)
    else:
        print(f"usage report: ledger {', '.join(paths)}", file=sys.stderr)
    try:
        span = make_span(args.since, args.until, dt.datetime.now(dt.timezone.utc).date())
        if dsn:
            from gateway.ledger_ship import summarise_pg

            rows = summarise_pg(dsn, span, args.by)
        else:
            rows = summarise(paths, span, args.by)
    except ReportError as exc:
        print(f"qwen38-gateway usage report: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(render(rows, args.by, args.format, span))
    return 0


def add_subcommands(sub: Any) -> None:
    """Register ``usage report`` on the top-level subparsers."""
    usage = sub.add_parser("usage", help="usage reports from the usage ledger")
    usage_sub = usage.add_subparsers(dest="usage_command", required=True, metavar="COMMAND")
    p = usage_sub.add_parser(
        "report",
        help="tokens and requests by tenant, key, day or endpoint",
        description=(
            "Sum the usage ledger over whole UTC days. Ledgers are opened read-only, so this "
            "runs against a live gateway's file; several --ledger files (one per replica) are "
            "merged. Without --ledger, a config with [ledger] postgres_dsn (or "
            "$QWEN38_LEDGER_POSTGRES_DSN) is read from PostgreSQL: the whole fleet's usage."
        ),
    )
    p.add_argument("--since", help="first UTC day, YYYY-MM-DD (default: the 1st of this month)")
    p.add_argument("--until", help="last UTC day, inclusive, YYYY-MM-DD (default: today)")
    p.add_argument("--by", choices=tuple(GROUPS), default="tenant", help="group (default tenant)")
    p.add_argument(
        "--format", choices=("table", "csv", "json"), default="table", help="default table"
    )
    p.add_argument(
        "--ledger",
        action="append",
        metavar="PATH",
        help="a ledger file; repeat for several (default: PostgreSQL when [ledger] postgres_dsn "
        "is set, else [ledger] path of the config)",
    )
    p.add_argument("--config", help="TOML config whose [ledger] path is read without --ledger")
    p.set_defaults(func=_report)
