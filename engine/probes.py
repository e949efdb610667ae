"""What preflight asks the system, behind one replaceable `Probes` value, and its result type.

Tests feed `Probes` with recorded outputs of real hosts; the checks only decide.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

Status = Literal["PASS", "WARN", "FAIL"]


@dataclass(frozen=True)
class CheckResult:
    """One preflight line.

    Attributes:
        status: ``PASS``, ``WARN`` (works, but not as intended) or ``FAIL`` (the engine will not
            start or not work; ``serve`` refuses to start and ``check`` exits 1).
        name: short check name, stable for scripts (``gpu``, ``glibc`` ...).
        detail: what was found.
        fix: one sentence, for WARN and FAIL.
    """

    status: Status
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        """``STATUS name: detail`` and, for WARN/FAIL, an indented ``fix:`` line."""
        text = f"{self.status} {self.name}: {self.detail}"
        if self.status != "PASS" and self.fix:
            text += f"\n    fix: {self.fix}"
        return text


@dataclass(frozen=True)
class Output:
    """What a probed command printed; ``returncode`` 124 means it timed out."""

    returncode: int
    stdout: str
    stderr: str


class Runner(Protocol):
    """Runs a command and returns its `Output`, or None when the program does not exist."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> Output | None: ...


@dataclass(frozen=True)
class Probes:
    """Everything preflight asks the system, as replaceable callables.

    Attributes:
        run: runs a command (`Runner`).
        which: ``(name, PATH) -> path or None``, like `shutil.which`.
        glibc: ``os.confstr("CS_GNU_LIBC_VERSION")``, e.g. ``"glibc 2.39"``; ``""`` if not glibc.
        disk_usage: ``path -> (total, free)`` in bytes (free as seen by unprivileged users);
            raises OSError when the path does not exist.
        environ: the launcher's environment (the engine inherits it).
    """

    run: Runner
    which: Callable[[str, str | None], str | None]
    glibc: Callable[[], str]
    disk_usage: Callable[[str], tuple[int, int]]
    environ: Mapping[str, str] = field(default_factory=dict)


def _run(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 30.0
) -> Output | None:
    try:
        done = subprocess.run(
            list(argv),
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        return Output(126, "", str(exc))
    except subprocess.TimeoutExpired:
        return Output(124, "", f"timed out after {timeout_s:g} s")
    return Output(done.returncode, done.stdout, done.stderr)


def _glibc() -> str:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return ""


def _disk_usage(path: str) -> tuple[int, int]:
    usage = shutil.disk_usage(path)
    return usage.total, usage.free


def system_probes(environ: Mapping[str, str] | None = None) -> Probes:
    """`Probes` of this machine (``environ`` defaults to `os.environ`)."""
    return Probes(
        run=_run,
        which=lambda name, path: shutil.which(name, path=path),
        glibc=_glibc,
        disk_usage=_disk_usage,
        environ=dict(os.environ if environ is None else environ),
    )


class PreflightError(RuntimeError):
    """A probe needed outside `run_checks` (GPU lookup for a PCI bus id) failed; ``fix`` says how."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def first_line(text: str) -> str:
    """The first non-blank line of ``text``, stripped; "" if none."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def last_line(text: str) -> str:
    """The last non-blank line of ``text``, stripped; "" if none."""
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return ""


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """Leading numeric components of a version (``"1.3.0rc1+g12"`` -> ``(1, 3, 0)``)."""
    if not text:
        return None
    match = re.match(r"^\s*(\d+(?:\.\d+)*)", text)
    if match is None:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def dotted(version: Sequence[int]) -> str:
    """``(12, 8)`` -> ``"12.8"``."""
    return ".".join(str(part) for part in version)
