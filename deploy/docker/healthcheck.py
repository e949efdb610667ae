#!/opt/qwen38/venv/bin/python3
"""Container HEALTHCHECK: GET /health of the gateway or the engine, by the role the entry point recorded."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import sys
from collections.abc import Mapping

ROLE_FILE_ENV = "QWEN38_ROLE_FILE"
DEFAULT_ROLE_FILE = "/tmp/qwen38-role"
# Docker's HEALTHCHECK --timeout is 10 s; answer well inside it.
PROBE_TIMEOUT_S = 5.0
# Wildcard listen addresses and the loopback address that reaches them.
_WILDCARD = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a Unix stream socket (the engine listens only on ``--uds``)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        """Open the Unix socket instead of a TCP connection."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def read_role(environ: Mapping[str, str]) -> str | None:
    """``"engine"``, ``"gateway"``, or None when the container runs neither (a CLI command)."""
    path = environ.get(ROLE_FILE_ENV) or DEFAULT_ROLE_FILE
    try:
        with open(path, encoding="utf-8") as handle:
            role = handle.read().strip()
    except FileNotFoundError:
        return None
    return role or None


def gateway_connection(environ: Mapping[str, str]) -> http.client.HTTPConnection:
    """A connection to the gateway's public listener, from gateway.toml ``[server]``.

    The config is found as ``qwen38-gateway serve`` finds it (``$QWEN38_GATEWAY_CONFIG`` or
    ``/etc/qwen38/gateway.toml``, DESIGN section 2); a wildcard host is probed on loopback, over
    TLS when ``server.tls_cert_file`` is set.

    Raises:
        gateway.config.ConfigError: the config does not load.
    """
    from gateway.config import load_settings

    settings = load_settings(environ.get("QWEN38_GATEWAY_CONFIG") or None)
    host = _WILDCARD.get(settings.server.host, settings.server.host)
    if settings.server.tls_cert_file:
        # The gateway's own listener over loopback: the certificate names the public host, not
        # this address, and proving who answers is not the liveness probe's job.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return http.client.HTTPSConnection(
            host, settings.server.port, timeout=PROBE_TIMEOUT_S, context=context
        )
    return http.client.HTTPConnection(host, settings.server.port, timeout=PROBE_TIMEOUT_S)


def engine_connection(environ: Mapping[str, str]) -> http.client.HTTPConnection:
    """A connection to the engine's Unix socket, from engine.toml ``[engine] socket``.

    Raises:
        engine.config.ConfigError: the config does not load.
    """
    from engine.config import config_path, load_settings

    settings = load_settings(config_path(None, environ))
    return UnixHTTPConnection(settings.engine.socket, timeout=PROBE_TIMEOUT_S)


def probe(connection: http.client.HTTPConnection) -> str | None:
    """GET /health; None when it answered 200, else why not (one line, no body echoed)."""
    try:
        connection.request("GET", "/health", headers={"User-Agent": "qwen38-healthcheck"})
        response = connection.getresponse()
        response.read()
    except (OSError, http.client.HTTPException) as exc:
        return f"/health unreachable: {exc.__class__.__name__}: {exc}"
    finally:
        connection.close()
    if response.status != 200:
        return f"/health answered {response.status}"
    return None


def main(environ: Mapping[str, str] = os.environ) -> int:
    """Exit status for Docker: 0 healthy (or no server role), 1 unhealthy."""
    role = read_role(environ)
    if role is None:
        return 0
    try:
        if role == "gateway":
            connection = gateway_connection(environ)
        elif role == "engine":
            connection = engine_connection(environ)
        else:
            print(f"unknown role {role!r}", file=sys.stderr)
            return 1
    except ValueError as exc:
        print(f"{role}: config: {exc}", file=sys.stderr)
        return 1
    problem = probe(connection)
    if problem is not None:
        print(f"{role}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
