"""TLS for the listeners: one server `ssl.SSLContext` per listener, its certificate re-read in place.

The context comes from `ssl.create_default_context` (Python's secure defaults: no SSLv2/3, no
compression, OpenSSL's default cipher list) with TLS 1.2 as the lowest version (RFC 9325 section
3.1.1: TLS 1.2 or 1.3 only). A renewed certificate is loaded into the same context with
``load_cert_chain``: OpenSSL uses it for every handshake from then on, while open connections keep
the session they have, so a renewal needs no restart and cuts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import stat
import tempfile
from typing import Any

import structlog

from engine.tomlfile import read_regular_file
from gateway.reload import BlockingCalls, FileBlocked, Signature, file_signature

log = structlog.get_logger("gateway.tls")


class TlsError(ValueError):
    """A certificate or key that cannot be used; the message names the files, never their content."""


def _no_passphrase() -> bytes:
    raise TlsError("the private key is encrypted; give the gateway an unencrypted key (mode 0600)")


def _load_into(context: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    """``load_cert_chain`` after checking both paths are regular files (a FIFO would block it).

    Raises:
        TlsError: a path is missing, not a regular file, or the pair does not load.
    """
    for path in (cert_file, key_file):
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise TlsError(f"{path}: cannot read ({exc.strerror})") from None
        if not stat.S_ISREG(mode):
            raise TlsError(f"{path}: not a regular file")
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    except TlsError:
        raise
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or type(exc).__name__
        raise TlsError(
            f"{cert_file} / {key_file}: certificate and key do not load ({reason})"
        ) from None


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context for ``cert_file`` (PEM chain, leaf first) and ``key_file`` (PEM key).

    Raises:
        TlsError: the files are missing, not regular files, encrypted, or do not match.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_into(context, cert_file, key_file)
    return context


class TlsFiles:
    """A listener's certificate and key files and the live context built from them.

    Args:
        cert_file: PEM certificate chain.
        key_file: PEM private key (unencrypted).
        name: the listener (``server`` or ``metrics``), for logs.

    Raises:
        TlsError: the first load failed (the listener cannot start).
    """

    def __init__(self, cert_file: str, key_file: str, name: str = "server") -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.name = name
        self.context = server_context(cert_file, key_file)
        self._seen = self._signatures()
        self._calls = BlockingCalls()
        self._lock = asyncio.Lock()

    def _signatures(self) -> tuple[Signature | None, Signature | None]:
        return file_signature(self.cert_file), file_signature(self.key_file)

    def _load(self) -> None:
        """Snapshot both files, check the pair in a fresh context, then load the same bytes into
        the live one. A failed ``load_cert_chain`` can leave a context with the new certificate
        and the old key, and a renewal tool may be between its two writes, so the live context is
        only ever given a pair that just loaded."""
        with tempfile.TemporaryDirectory(prefix="qwen38-tls-") as private:
            cert_copy = os.path.join(private, "cert.pem")
            key_copy = os.path.join(private, "key.pem")
            for source, copy in ((self.cert_file, cert_copy), (self.key_file, key_copy)):
                data = read_regular_file(source)
                fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
            try:
                server_context(cert_copy, key_copy)
            except TlsError as exc:
                reason = str(exc).rpartition("(")[2].rstrip(")")
                raise TlsError(
                    f"{self.cert_file} / {self.key_file}: certificate and key do not load "
                    f"({reason})"
                ) from None
            _load_into(self.context, cert_copy, key_copy)

    async def reload(self, trigger: str = "signal", metrics: Any = None) -> bool:
        """Re-read both files into the live context; True when the new pair is in force.

        A pair that does not load (a renewal caught between writing the certificate and the
        key, a wrong key) leaves the old one in force and logs ``tls_reload_failed``; it is
        retried at the next change or SIGHUP.
        """
        async with self._lock:
            try:
                self._seen = await self._calls.run(self._signatures)
                await self._calls.run(self._load)
            except (TlsError, FileBlocked, OSError) as exc:
                log.error("tls_reload_failed", listener=self.name, trigger=trigger, error=str(exc))
                if metrics is not None:
                    metrics.config_reloads.labels("error").inc()
                return False
            log.info("tls_reloaded", listener=self.name, trigger=trigger, cert_file=self.cert_file)
            return True

    async def watch(self, poll_s: float, metrics: Any = None) -> None:
        """Reload whenever either file changes (checked every ``poll_s`` seconds); runs until
        cancelled. A change is read after the files stopped changing for one poll."""
        pending: tuple[Signature | None, Signature | None] | None = None
        while True:
            await asyncio.sleep(poll_s)
            with contextlib.suppress(FileBlocked):
                now = await self._calls.run(self._signatures)
                if now == self._seen:
                    pending = None
                elif now != pending:
                    pending = now  # still being written: wait one more poll
                else:
                    pending = None
                    await self.reload("change", metrics)
