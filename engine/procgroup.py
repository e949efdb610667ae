"""A process group signalled only while its id still names the group that was started.

A process group's id is its leader's pid. Once the leader has been reaped and no member is left,
the kernel may give that pid to a new process (``/proc/sys/kernel/pid_max`` is 32,768 on many
hosts: a busy one wraps it within minutes); a ``killpg`` with the old id then signals whatever
group the new process leads (any program started with ``setsid``). `ProcessGroup` records the
leader's start time at spawn (field 22 of ``/proc/<pid>/stat``, clock ticks since boot, proc(5))
and signals the group only when

- the leader is still the process that was started (same start time: running or a zombie), or
- no process has that pid: the id is then held by the group's remaining members, if any (the
  kernel does not reuse a pid while a process group or session is known by it), and ``killpg``
  reaches exactly them, or fails with ESRCH.

A pid reused by a thread or a process started later has another start time: not signalled.
Without ``/proc`` (not Linux) start times are unknown and the group is signalled as before.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


def start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks after boot (``/proc/<pid>/stat`` field 22,
    proc(5)); None when no process has that pid (or there is no ``/proc``)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # Field 2 (the command name) is in parentheses and may contain spaces and ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[19])  # fields[0] is field 3


@dataclass(frozen=True)
class ProcessGroup:
    """The process group led by ``pgid`` whose leader started at ``started`` (clock ticks after
    boot; None when unknown: no ``/proc``, or the leader was gone before it was read)."""

    pgid: int
    started: int | None

    @classmethod
    def of(cls, pid: int) -> ProcessGroup:
        """The group of a leader just spawned (call it before the child can have been reaped)."""
        return cls(pid, start_ticks(pid))

    def ours(self) -> bool:
        """True while ``pgid`` can only name this group (see the module's docstring)."""
        if not PROC.is_dir():
            return True
        now = start_ticks(self.pgid)
        return now is None or now == self.started

    def signal(self, signum: int) -> bool:
        """Send ``signum`` to the group if it is still this one; True when sent."""
        if not self.ours():
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)
            return True
        return False
