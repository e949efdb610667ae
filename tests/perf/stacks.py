"""The processes a benchmark profile measures: one engine simulator and the proxies in front of it.

Targets, all reaching the same simulator socket:

- ``direct``: the load generator talks to the simulator's Unix socket itself (the baseline);
- ``nginx``: nginx 1.x, one worker, ``proxy_buffering off`` (`tests.perf.nginx`);
- ``gateway``: ``qwen38-gateway serve`` with auth, memory rate limits, rewrites and metrics on;
- ``gateway-limits-off``: the same with the rate limiter admitting everything (`tests.perf.nolimits`);
- ``gateway-gc-tuned``: the same under other garbage-collector thresholds (`tests.perf.gcpolicy`);
- ``gateway-ledger-off``: the same with the usage ledger off (``[ledger] enabled = false``);
- ``gateway-one-slot``: the same with production's ``engine.max_concurrency = 1`` (measured at
  c=1 only): the engine-counter baseline of exact cut charges is taken for every request.

The gateway config is production's except where the benchmark would measure something else:
``engine.max_concurrency`` 4096 (production: 1, one V100) so the admission queue does not
serialise the load, and tenant limits no request reaches, so nothing is refused.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from tests.conftest import (
    ALIAS,
    KEY_A,
    REPO,
    Sim,
    free_port,
    start_gateway,
    start_sim,
    to_toml,
    wait_until,
)
from tests.perf.nginx import run_nginx

# Engine slots at once in the benchmark (the config's maximum; production uses 1).
BENCH_MAX_CONCURRENCY = 4096
BENCH_CONFIG: dict[str, Any] = {
    "engine": {
        "max_concurrency": BENCH_MAX_CONCURRENCY,
        "queue_size": 100_000,
        "health_interval_s": 2.0,
    },
    "auth": {"reload_poll_s": 1.0},
    "ledger": {"flush_interval_s": 0.5},
    "logging": {"level": "info"},
    "tenants": {"default": {"rpm": 10**9, "tpm": 10**12, "concurrency": 100_000}},
}


@dataclass(frozen=True)
class Profile:
    """How the simulator answers: pacing, answer length, and the concurrencies measured.

    Attributes:
        name: ``fast`` or ``paced`` (or ``slow`` for the slow-streams scenario).
        tokens_per_second: the simulator's ``--tokens-per-second`` (0: as fast as it can).
        completion_tokens: tokens per answer (``--completion-tokens``).
        concurrencies: rows measured, in order.
    """

    name: str
    description: str
    tokens_per_second: float
    completion_tokens: int
    concurrencies: tuple[int, ...]


@dataclass
class Target:
    """One way to reach the engine.

    Attributes:
        url: ``unix:/path`` or ``http://127.0.0.1:PORT``.
        headers: what the client sends besides the body (Bearer credential for the gateway).
        cpu_pids: processes whose CPU is charged to this target (none for ``direct``).
        rss_pid: the process whose peak RSS is reported, or None.
    """

    name: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    cpu_pids: list[int] = field(default_factory=list)
    rss_pid: int | None = None


def request_body(max_tokens: int) -> dict[str, Any]:
    """The chat request every target gets: streamed, thinking on (so ``reasoning`` is renamed)."""
    return {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Tell me about the weather on the coast."}],
        "stream": True,
        "max_tokens": max_tokens,
        "chat_template_kwargs": {"enable_thinking": True},
    }


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# Gateway variants started beside the real one: name -> the command before ``--config FILE``.
VARIANTS: dict[str, list[str]] = {
    "gateway-limits-off": ["-m", "tests.perf.nolimits"],
    "gateway-gc-tuned": ["-m", "tests.perf.gcpolicy", "tuned", "gateway", "serve"],
    "gateway-ledger-off": ["-m", "gateway", "serve"],
    "gateway-one-slot": ["-m", "gateway", "serve"],
    "aiohttp-floor": ["-m", "tests.perf.floor"],
}
# Config sections a variant changes in its copy of the gateway's config.
VARIANT_CONFIG: dict[str, dict[str, dict[str, Any]]] = {
    "gateway-ledger-off": {"ledger": {"enabled": False}},
    "gateway-one-slot": {"engine": {"max_concurrency": 1}},
}


def _variant_gateway(
    workdir: Path, config_path: Path, name: str
) -> tuple[subprocess.Popen[bytes], str]:
    """Start variant ``name`` of `VARIANTS` with a copy of ``config_path`` on fresh ports."""
    config = tomllib.loads(config_path.read_text())
    port = free_port()
    config["server"]["port"] = port
    config["metrics"]["port"] = free_port()
    for section, values in VARIANT_CONFIG.get(name, {}).items():
        config.setdefault(section, {}).update(values)
    path = workdir / f"{name}.toml"
    path.write_text(to_toml(config))
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, *VARIANTS[name], "--config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    log.close()
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited; see {name}.log")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/ready", timeout=1).status_code == 200
        return False

    if not wait_until(ready, 20):
        _terminate(proc)
        raise RuntimeError(f"{name} did not become ready")
    return proc, url


def start_engine(workdir: Path, profile: Profile, max_num_seqs: int, *, gc_off: bool) -> Sim:
    """The simulator for ``profile`` (`tests.conftest.start_sim`), or with its collector off.

    Raises:
        RuntimeError: it did not create its socket within 15 s.
    """
    extra = [
        "--tokens-per-second", str(profile.tokens_per_second),
        "--completion-tokens", str(profile.completion_tokens),
        "--max-num-seqs", str(max_num_seqs),
    ]  # fmt: skip
    if not gc_off:
        return start_sim(workdir, *extra, name=profile.name)
    sock = str(workdir / f"{profile.name}.sock")
    record = workdir / f"{profile.name}-record.jsonl"
    args = [
        sys.executable, "-m", "tests.perf.gcpolicy", "off", "engine.sim",
        "--socket", sock, "--served-model-name", ALIAS, "--record", str(record), *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(args, cwd=REPO)
    if not wait_until(lambda: Path(sock).exists(), 15):
        _terminate(proc)
        raise RuntimeError("simulator did not start")
    return Sim(socket=sock, record=record, proc=proc, args=args)


@contextlib.contextmanager
def run_stack(
    workdir: Path,
    profile: Profile,
    *,
    nginx_binary: str | None,
    variants: tuple[str, ...] = (),
    engine_gc_off: bool = False,
    max_num_seqs: int = 4096,
) -> Iterator[tuple[Sim, list[Target]]]:
    """Start the simulator for ``profile`` and every target in front of it; stop all on exit.

    Args:
        nginx_binary: nginx to start as a target, or None for no nginx row.
        variants: names from `VARIANTS` to start beside the gateway.
        engine_gc_off: run the simulator with its garbage collector off (`tests.perf.gcpolicy`).

    Yields the simulator and the targets in row order (direct, nginx, gateway, variants).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    sim = start_engine(workdir, profile, max_num_seqs, gc_off=engine_gc_off)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with contextlib.ExitStack() as stack:
            targets = [Target("direct", f"unix:{sim.socket}")]
            if nginx_binary:
                nginx = stack.enter_context(run_nginx(nginx_binary, workdir / "nginx", sim.socket))
                targets.append(
                    Target(
                        "nginx",
                        nginx.url,
                        cpu_pids=[nginx.master.pid, nginx.worker_pid],
                        rss_pid=nginx.worker_pid,
                    )
                )
            gw = start_gateway(workdir, sim, BENCH_CONFIG, name=f"gw-{profile.name}")
            procs.append(gw.proc)
            auth = {"Authorization": f"Bearer {KEY_A}"}
            targets.append(Target("gateway", gw.base_url, auth, [gw.proc.pid], rss_pid=gw.proc.pid))
            for name in variants:
                proc, url = _variant_gateway(workdir, gw.config_path, name)
                procs.append(proc)
                targets.append(Target(name, url, auth, [proc.pid], rss_pid=proc.pid))
            yield sim, targets
    finally:
        for proc in procs:
            _terminate(proc)
        sim.stop()
