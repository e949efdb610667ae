"""Per-file time table of a test run, from pytest's JUnit XML (``--junitxml``).

Usage: ``python -m tests.timetable REPORT.xml [--markdown]``. Each row is one test file: the
seconds its tests took (setup, call and teardown, so a module fixture's start counts on the file
that starts it), and its test count; slowest first. tests/README.md's table is made with it.
Under pytest-xdist the seconds are per worker and add up to more than the run's wall time.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def file_of(classname: str) -> str:
    """``tests.test_x.Class`` -> ``tests/test_x.py`` (class parts start with a capital)."""
    parts = [part for part in classname.split(".") if part and not part[0].isupper()]
    return "/".join(parts) + ".py"


def table(report: Path) -> list[tuple[str, float, int]]:
    """(file, seconds, tests) for every file in ``report``, slowest first."""
    seconds: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        name = file_of(case.get("classname", ""))
        seconds[name] += float(case.get("time", "0") or 0)
        counts[name] += 1
    return sorted(((f, seconds[f], counts[f]) for f in seconds), key=lambda row: -row[1])


def main(argv: list[str] | None = None) -> int:
    """Print the table; ``--markdown`` prints it as the rows of a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    rows = table(args.report)
    total = sum(row[1] for row in rows)
    for name, secs, count in rows:
        if args.markdown:
            print(f"| `{name.removeprefix('tests/')}` | {count} | {secs:.0f} |")
        else:
            print(f"{secs:8.1f} s {count:5d} tests  {name}")
    if not args.markdown:
        print(f"{total:8.1f} s {sum(r[2] for r in rows):5d} tests  (sum over workers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
