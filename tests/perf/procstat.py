"""CPU time and memory of a process from ``/proc`` (Linux ``proc(5)``): what a row charges a proxy."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by the threads of ``pid``, to the nanosecond where possible.

    Sums the first field of ``/proc/<pid>/task/<tid>/schedstat`` (time on CPU, ns; needs
    ``CONFIG_SCHED_INFO``); without it, ``utime + stime`` from ``/proc/<pid>/stat`` (fields 14
    and 15, in clock ticks of usually 10 ms: too coarse for a row of a few hundred chunks).
    Threads that ended are not in the schedstat sum: compare readings of long-lived threads only.

    Raises:
        FileNotFoundError: the process is gone.
    """
    total_ns = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                total_ns += int((task / "schedstat").read_text().split()[0])
    except (FileNotFoundError, PermissionError, ValueError, IndexError):
        total_ns = -1
    if total_ns > 0:
        return total_ns / 1e9
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def run_delay_seconds(pid: int) -> float:
    """Seconds the threads of ``pid`` spent runnable but waiting for a CPU so far: the second
    field of ``/proc/<pid>/task/<tid>/schedstat`` (ns), summed; 0.0 where it cannot be read.

    On a shared machine this is the share of a latency that is the machine's, not the code's.
    """
    total_ns = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                total_ns += int((task / "schedstat").read_text().split()[1])
    return total_ns / 1e9


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` (resident now) and ``VmHWM`` (peak resident) of ``pid`` in KiB."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0])
    return out


def reset_peak(pid: int) -> bool:
    """Reset ``VmHWM`` to the current RSS (``echo 5 > /proc/<pid>/clear_refs``, Linux >= 4.0).

    Returns False when not permitted (another user's process); the peak then covers the whole
    life of the process.
    """
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    return False


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (``/proc/<pid>/task/*/children``, Linux >= 3.5)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found.extend(int(p) for p in (task / "children").read_text().split())
    return found
