"""The services a fleet of gateways runs on, started as an operator would, for the fleet tests:
a real PostgreSQL (``initdb`` into a temp dir, ``pg_ctl``) and HAProxy (the shipped
``deploy/haproxy/haproxy.cfg`` with the test's addresses). redis-server comes from
`tests.test_ratelimit_redis.RedisServer`.

PostgreSQL refuses to run as root: when the tests run as root, its processes run as the
``postgres`` system user (Debian's package creates it), or ``nobody``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.conftest import free_port

REPO = Path(__file__).resolve().parent.parent
HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"


def _pg_bin() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "pg_ctl").exists():
            return candidate
    return None


PG_BIN = _pg_bin()
HAPROXY = shutil.which("haproxy") or (
    "/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None
)


def _pg_user() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root without a postgres or nobody user for PostgreSQL")


class Postgres:
    """A throwaway PostgreSQL cluster on a loopback port (trust authentication: loopback only)."""

    def __init__(self, workdir: Path) -> None:
        assert PG_BIN is not None
        self.dir = workdir / "pg"
        self.port = free_port()
        self.user = _pg_user()
        self.log = workdir / "pg.log"

    @property
    def dsn(self) -> str:
        """libpq URI of the ``postgres`` database as the ``qwen38`` role."""
        return f"postgresql://qwen38@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 60) -> None:
        subprocess.run(
            args, check=True, timeout=timeout, user=self.user, capture_output=True, cwd="/"
        )

    def init(self) -> None:
        """``initdb`` into the temp dir (the directory handed to the server's user)."""
        assert PG_BIN is not None
        self.dir.mkdir(mode=0o700)
        self.log.touch()
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            for path in (self.dir.parent, self.dir, self.log):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._run(
            str(PG_BIN / "initdb"), "-D", str(self.dir), "-U", "qwen38",
            "--auth=trust", "--no-sync", "-E", "UTF8",
        )  # fmt: skip
        with open(self.dir / "postgresql.conf", "a") as conf:
            conf.write(
                f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                f"unix_socket_directories = '{self.dir}'\nfsync = off\n"
                "max_connections = 50\nshared_buffers = 16MB\n"
            )

    def start(self) -> None:
        """``pg_ctl start`` and wait until it takes connections."""
        assert PG_BIN is not None
        self._run(
            str(PG_BIN / "pg_ctl"), "-D", str(self.dir), "-l", str(self.log), "-w", "-t", "60",
            "start",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m fast`` (or ``immediate``: a crash)."""
        assert PG_BIN is not None
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.dir), "-m", mode, "-w", "stop")

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        """Rows of one statement (none for a statement without rows), over a fresh connection."""
        import psycopg

        with psycopg.connect(self.dsn, connect_timeout=5) as conn:
            cur = conn.execute(sql)
            return list(cur.fetchall()) if cur.description is not None else []


def haproxy_config(listen_port: int, gateways: list[int], stats_port: int | None = None) -> str:
    """The shipped ``haproxy.cfg`` with the frontend on ``listen_port`` and one server line per
    gateway port, on 127.0.0.1; everything else as shipped."""
    text = HAPROXY_CFG.read_text()
    text = re.sub(r"(?m)^    bind 127\.0\.0\.1:8080$", f"    bind 127.0.0.1:{listen_port}", text)
    text = text.replace("    log stdout format raw local0 info\n", "")
    text = text.replace("    log global\n", "")
    # The test machine's file descriptor limit (HAProxy sizes it from maxconn).
    text = text.replace("    maxconn 20000\n", "    maxconn 1000\n")
    servers = "".join(
        f"    server gw{i + 1} 127.0.0.1:{port} check\n" for i, port in enumerate(gateways)
    )
    text = re.sub(r"(?m)(^    server gw\d+ \S+ check\n)+", servers, text)
    if stats_port is not None:
        text += (
            f"\nfrontend stats\n    bind 127.0.0.1:{stats_port}\n"
            "    http-request use-service prometheus-exporter if { path /metrics }\n"
            "    stats enable\n    stats uri /stats\n"
        )
    return text


class HAProxy:
    """HAProxy with `haproxy_config` in the foreground (``-db``)."""

    def __init__(self, workdir: Path, gateways: list[int]) -> None:
        assert HAPROXY is not None
        self.port = free_port()
        self.stats_port = free_port()
        self.cfg = workdir / "haproxy.cfg"
        self.cfg.write_text(haproxy_config(self.port, gateways, self.stats_port))
        self.log = workdir / "haproxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert HAPROXY is not None
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(self.cfg)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return
            time.sleep(0.05)
        raise RuntimeError(f"haproxy did not start: {self.log.read_text()[-2000:]}")

    def servers(self) -> dict[tuple[str, str], str]:
        """``(backend, server)``: status (``UP``, ``DOWN``, ...) from HAProxy's CSV stats."""
        import csv
        import io

        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {
            (row["pxname"], row["svname"]): row["status"]
            for row in rows
            if row["svname"] not in ("FRONTEND", "BACKEND")
        }

    def all_up(self) -> bool:
        """True when every server of every backend is UP."""
        return all(status == "UP" for status in self.servers().values())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
