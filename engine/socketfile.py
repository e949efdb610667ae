"""The engine's socket path: one launcher per path (a lock file), and no stale socket left over."""

from __future__ import annotations

import fcntl
import os
import socket
import stat


class SupervisorError(RuntimeError):
    """The engine cannot be started: socket path busy or not a socket, lock held, spawn failed."""


def acquire_lock(socket_path: str) -> int:
    """Take an exclusive lock on ``<socket>.lock`` and return its descriptor (held until closed).

    Two launchers on one socket would delete each other's socket while the engine loads (the
    engine binds early but accepts late, so a loading engine looks like a stale socket).

    Raises:
        SupervisorError: another process holds the lock, or the directory is not usable.
    """
    path = socket_path + ".lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SupervisorError(f"cannot open {path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SupervisorError(f"another launcher holds {path}") from None
    return fd


def remove_stale_socket(path: str) -> bool:
    """Remove ``path`` if it is a socket nobody accepts on; True if something was removed.

    vLLM does not unlink its socket on exit and then fails to bind with "address in use"
    (vllm-protocol.md section 1.3).

    Raises:
        SupervisorError: ``path`` is not a socket, or a process accepts connections on it.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(info.st_mode):
        raise SupervisorError(f"{path} exists and is not a socket; refusing to remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise SupervisorError(f"cannot probe {path}: {exc.strerror or exc}") from exc
    finally:
        probe.close()
    raise SupervisorError(f"a process accepts connections on {path}: another engine is running")
