"""Reading one TOML settings file: missing means defaults, every failure names the file.

TOML 1.0 is parsed by the standard library's `tomllib` (Python 3.11+, PEP 680) or by `tomli`,
the package it was taken from, on Python 3.10.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_T = TypeVar("_T")


def read_regular_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of ``path``, refused at once unless it is a regular file.

    Opened with ``O_NONBLOCK`` and checked with ``fstat`` before reading, so a FIFO, socket or
    device at the path raises instead of blocking the reader (open(2)).

    Raises:
        FileNotFoundError: no such file.
        OSError: unreadable, or not a regular file (``strerror`` "not a regular file").
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a Unix socket
            raise OSError(errno.EINVAL, "not a regular file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read()
    finally:
        os.close(fd)


def load_toml(
    path: Path,
    parse: Callable[[dict[str, Any], str], _T],
    missing: Callable[[], _T],
    error: type[ValueError],
) -> _T:
    """Read the TOML file ``path`` and build settings from it with ``parse(data, source)``.

    A file that does not exist gives ``missing()`` (all defaults).

    Raises:
        error: the file cannot be read, is not UTF-8 or not valid TOML, or ``parse`` raised
            ``error``; the message starts with the file name.
    """
    try:
        raw = read_regular_file(path)
    except FileNotFoundError:
        return missing()
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not valid TOML: {exc}") from exc
    try:
        return parse(data, str(path))
    except error as exc:
        raise error(f"{path}: {exc}") from exc
