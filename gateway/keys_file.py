"""The keys file on disk: mode checks, loading, and locked atomic updates (mode 0600).

Writes go through `update_keys_file`: locked, validated, temp file in the same directory,
fsync, rename, mode 0600. The content's grammar is `gateway.credentials`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
from collections.abc import Callable, Iterator

from gateway.credentials import MAX_FILE_BYTES, KeySet, KeysFileError, parse_keys, split_lines


def mode_problem(mode: int, path: str) -> str | None:
    """A message when ``mode`` lets group or others read, write or run the file, else None."""
    if mode & 0o077:
        return (
            f"{path}: mode {stat.S_IMODE(mode):04o} gives group/others access; "
            f"run: chmod 600 {path}"
        )
    return None


def read_keys_bytes(path: str, *, check_mode: bool = True) -> bytes:
    """The raw bytes of the keys file after the mode and file-type checks.

    The file is opened with ``O_NONBLOCK`` and its type checked on the open descriptor before any
    read, so a FIFO, socket or device at the path is refused at once instead of blocking the
    reader (open(2): a FIFO opened non-blocking for reading returns at once; a socket fails with
    ``ENXIO``). A file on a hung mount can still block in ``open`` itself; callers that must not
    block (the reloader) run this in a thread with a time limit.

    Raises:
        KeysFileError: missing, unreadable, not a regular file, or (``check_mode``) group/other bits.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise KeysFileError([f"{path}: no such file"]) from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise KeysFileError([f"{path}: not a regular file"]) from None
        raise KeysFileError([f"{path}: cannot read ({exc.strerror})"]) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeysFileError([f"{path}: not a regular file"])
        if check_mode and (problem := mode_problem(info.st_mode, path)) is not None:
            raise KeysFileError([problem])
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise KeysFileError([f"{path}: cannot read ({exc.strerror})"]) from None
    finally:
        os.close(fd)


def load_keys_file(path: str | os.PathLike[str], *, check_mode: bool = True) -> KeySet:
    """Read, check and parse the keys file.

    Args:
        path: the file (``auth.keys_file``).
        check_mode: refuse a file with any group/other permission bit (the file must be 0600).

    Raises:
        KeysFileError: missing or unreadable file, bad mode, or parse problems (each with its line).
    """
    source = os.fspath(path)
    return parse_keys(read_keys_bytes(source, check_mode=check_mode), source)


def empty_keys_problem(keys: KeySet, path: str, *, allow_empty: bool) -> str | None:
    """Why ``keys`` must not be loaded for holding no key, or None when it may be.

    The rule of a reload (`gateway.reload.Reloader`) and of ``check``: a key set with no API key
    and no signing key is refused unless ``allow_empty`` (``auth.allow_empty_keys``). An empty or
    truncated file (``cat > file`` caught midway) would otherwise lock every tenant out.

    Returns:
        ``"<path>: no API key and no signing key (an empty or truncated file?)"``, or None.
    """
    if keys.api_keys or keys.signing_keys or allow_empty:
        return None
    return f"{path}: no API key and no signing key (an empty or truncated file?)"


def check_keys_file(path: str | os.PathLike[str], *, allow_empty: bool = False) -> list[str]:
    """Every problem `load_keys_file` would raise (mode included), or the file's
    `empty_keys_problem` (judged with ``allow_empty``); empty when the file is fine."""
    try:
        keys = load_keys_file(path)
    except KeysFileError as exc:
        return exc.problems
    problem = empty_keys_problem(keys, os.fspath(path), allow_empty=allow_empty)
    if problem is None:
        return []
    return [
        f"{problem}; serve would refuse every request (401) with /ready at 503, and a reload to "
        "it is refused. Set auth.allow_empty_keys = true to run with none"
    ]


@contextlib.contextmanager
def _locked(path: str, create: bool) -> Iterator[None]:
    """Hold an exclusive flock on the current file at ``path`` (serialises CLI writers).

    The lock is on the inode, so after another writer renamed a new file in, we re-open.
    A missing file is created empty with mode 0600 when ``create``.
    """
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise KeysFileError([f"{path}: no such file"]) from None
            with contextlib.suppress(FileExistsError):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(path)
            except FileNotFoundError:
                continue
            held = os.fstat(fd)
            if (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino):
                yield
                return
        finally:
            os.close(fd)


def write_atomically(path: str, data: bytes, *, owner_of: os.stat_result | None = None) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename, fsync dir.

    The new file has mode 0600 and, when running as root, the previous file's owner and group,
    so the gateway (a non-root user) can still read what an operator wrote with sudo.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o600)
            if owner_of is not None and os.geteuid() == 0:
                os.fchown(handle.fileno(), owner_of.st_uid, owner_of.st_gid)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def update_keys_file(
    path: str | os.PathLike[str],
    change: Callable[[bytes, KeySet], bytes],
    *,
    create: bool = False,
) -> KeySet:
    """Apply ``change(raw, keyset) -> new_raw`` to the keys file, atomically and under a lock.

    The current file must be mode 0600 (or tighter) and valid; the result is validated before
    it replaces the file, so a write never leaves a file the gateway would refuse.

    Returns:
        The `KeySet` of the new file.

    Raises:
        KeysFileError: missing file (unless ``create``), bad mode, invalid current or new content.
    """
    target = os.fspath(path)
    with _locked(target, create):
        raw = read_keys_bytes(target)
        new_raw = change(raw, parse_keys(raw, target))
        updated = parse_keys(new_raw, target)
        write_atomically(target, new_raw, owner_of=os.stat(target))
    return updated


def append_line(raw: bytes, line: str) -> bytes:
    """``raw`` with ``line`` added at the end (a newline is added first if the file lacks one)."""
    if raw and not raw.endswith(b"\n"):
        raw += b"\n"
    return raw + line.encode() + b"\n"


def remove_line(raw: bytes, number: int) -> bytes:
    """``raw`` without its 1-based line ``number``; every other byte unchanged."""
    lines = split_lines(raw)
    del lines[number - 1]
    return b"\n".join(lines)
