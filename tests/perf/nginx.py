"""nginx in front of the engine socket: the reference proxy of the benchmark (issue 8).

One worker, ``proxy_buffering off`` (each upstream read is passed on at once, as for SSE),
HTTP/1.1 with a keep-alive pool to the Unix socket, no access log, every path (pid, temp
directories, error log) inside a private directory, in the foreground as the current user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_port, wait_until
from tests.perf.procstat import children

NGINX_PATHS = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")


def find_nginx() -> str | None:
    """The nginx binary on PATH or in a usual place, or None."""
    found = shutil.which("nginx")
    if found:
        return found
    return next((path for path in NGINX_PATHS if os.access(path, os.X_OK)), None)


def nginx_config(workdir: Path, engine_socket: str, port: int) -> str:
    """The nginx.conf text: ``127.0.0.1:port`` proxied to ``unix:engine_socket``.

    ``keepalive 1024`` keeps up to 1,024 idle upstream connections per worker, closed after
    4 s idle, below the engine's 5 s keep-alive (vllm-protocol.md section 1.4).
    """
    user = ""
    if os.geteuid() == 0:  # otherwise nginx ignores `user`; as root it would switch to nobody
        entry = pwd.getpwuid(os.getuid())
        user = f"user {entry.pw_name} {entry.pw_name};"
    temp = "\n".join(
        f"    {name}_temp_path {workdir / name};"
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""
{user}
worker_processes 1;
worker_rlimit_nofile 65536;
daemon off;
master_process on;
pid {workdir / "nginx.pid"};
error_log {workdir / "error.log"} warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
{temp}
    upstream engine {{
        server unix:{engine_socket};
        keepalive 1024;
        keepalive_timeout 4s;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 900s;
        }}
    }}
}}
"""


@dataclass
class Nginx:
    """A running nginx: its address and the pid of its one worker (the measured process)."""

    url: str
    master: subprocess.Popen[bytes]
    worker_pid: int
    workdir: Path


@contextlib.contextmanager
def run_nginx(binary: str, workdir: Path, engine_socket: str) -> Iterator[Nginx]:
    """Start nginx in front of ``engine_socket``; stop it on exit.

    Raises:
        RuntimeError: nginx did not start (its error log is in the message).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(nginx_config(workdir, engine_socket, port))
    error_log = workdir / "error.log"
    proc = subprocess.Popen(
        [binary, "-p", str(workdir), "-c", str(conf), "-e", str(error_log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        up = wait_until(lambda: proc.poll() is not None or _listening(port), 10)
        if not up or proc.poll() is not None or not children(proc.pid):
            log = error_log.read_text() if error_log.exists() else ""
            raise RuntimeError(f"nginx did not start: {log[-2000:]}")
        yield Nginx(f"http://127.0.0.1:{port}", proc, children(proc.pid)[0], workdir)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGQUIT)  # graceful: finish requests, then exit
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False
