"""``--wait`` of the key commands: poll the running gateway's ``/ready`` until it has loaded the
keys file as the command left it.

``/ready`` reports ``keys_version``, the first 16 hex digits of the SHA-256 of the keys file bytes
the gateway has in force (`gateway.credentials.KeySet.version`): a hash of the whole file, never a
secret or a part of one, so it can sit on the unauthenticated ``/ready``. The command hashes the
file it just wrote the same way and waits until the two agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from gateway.config import Settings

# Polling period of /ready while waiting (the gateway re-reads the file every auth.reload_poll_s).
POLL_S = 0.1


def file_version(raw: bytes) -> str:
    """The ``keys_version`` of a keys file's bytes: 16 hex digits of their SHA-256."""
    return hashlib.sha256(raw).hexdigest()[:16]


def gateway_url(settings: Settings) -> str:
    """The running gateway's base URL from its config: ``server.host`` (a wildcard address
    becomes loopback) and ``server.port``, HTTPS when ``server.tls_cert_file`` is set."""
    host = settings.server.host
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if settings.server.tls_cert_file else "http"
    return f"{scheme}://{host}:{settings.server.port}"


def _loaded_version(url: str, timeout_s: float) -> str | None:
    """``keys_version`` from ``url``/ready (any status: 503 while the engine warms still tells),
    or None when the gateway does not answer."""
    # /ready is public and nothing secret is sent: certificate checks are not needed to read it,
    # and a loopback address rarely matches the certificate's name.
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url + "/ready", timeout=timeout_s, context=context) as reply:
            body = reply.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    except (OSError, ValueError):
        return None
    try:
        version = json.loads(body).get("keys_version")
    except (ValueError, AttributeError):
        return None
    return version if isinstance(version, str) else None


def wait_for_version(url: str, expected: str, timeout_s: float) -> str | None:
    """Poll ``url``/ready until its ``keys_version`` is ``expected``.

    Returns:
        None once the gateway has it; else why not (for one line on stderr) after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    seen: str | None = None
    while True:
        seen = _loaded_version(url, min(2.0, timeout_s))
        if seen == expected:
            return None
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    if seen is None:
        return f"no gateway answered at {url}/ready within {timeout_s:g} s (--gateway-url?)"
    return (
        f"the gateway at {url} still has keys file version {seen}, not {expected}, after "
        f"{timeout_s:g} s: is it using this keys file? (its log says reload_failed if it "
        "refused the file)"
    )


def add_wait_options(parser: argparse.ArgumentParser) -> None:
    """``--wait``, ``--wait-timeout`` and ``--gateway-url`` for a command that changes the file."""
    parser.add_argument(
        "--wait",
        action="store_true",
        help="return only once the running gateway has loaded the changed keys file "
        "(polls its /ready keys_version)",
    )
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="longest --wait (default 10); then exit 1",
    )
    parser.add_argument(
        "--gateway-url",
        metavar="URL",
        help="the running gateway for --wait (default: server.host and server.port of the config)",
    )


def wait_if_asked(args: argparse.Namespace, path: str, settings: Callable[[], Settings]) -> int:
    """After a successful change of ``path``: 0 at once without ``--wait``; with it, 0 once the
    gateway has loaded the file as it is now, else 1 with one line on stderr."""
    if not getattr(args, "wait", False):
        return 0
    with open(path, "rb") as handle:
        expected = file_version(handle.read())
    url = (args.gateway_url or gateway_url(settings())).rstrip("/")
    problem = wait_for_version(url, expected, args.wait_timeout)
    if problem is not None:
        print(f"error: the keys file is changed, but {problem}", file=sys.stderr)
        return 1
    print(f"the gateway at {url} has loaded it", file=sys.stderr)
    return 0
