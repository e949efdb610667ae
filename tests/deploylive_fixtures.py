"""Session fixtures of the live deployment tests: the private dockerd, the built image, the
Debian 12 root filesystem, and a table of how long each phase took (printed after the run)."""

from __future__ import annotations

import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploylive import bookworm_rootfs, docker_root, noble_rootfs, skip_reason
from tests.dockerhost import (
    IMAGE,
    Dockerd,
    build_image,
    import_ubuntu,
    private_dockerd,
    standin_build_args,
    standin_server,
)

# Phase -> seconds, filled by the fixtures and tests; printed in the terminal summary.
TIMINGS: dict[str, float] = {}


class timed:
    """``with timed("phase"):`` adds the block's wall time to TIMINGS."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.started = 0.0

    def __enter__(self) -> None:
        self.started = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        TIMINGS[self.phase] = TIMINGS.get(self.phase, 0.0) + time.monotonic() - self.started


@dataclass
class BuiltImage:
    """The image built from deploy/docker/Dockerfile with the stand-ins, and how."""

    tag: str
    build_args: dict[str, str]
    log: str
    seconds: float
    standins: Path = field(default_factory=Path)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def deploy_host() -> None:
    """Skip (one line) where this host cannot boot systemd-nspawn or run dockerd. A SIGTERM to
    this pytest process becomes an interrupt, so the finalizers still stop what was started."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(scope="session")
def dockerd(deploy_host: None) -> Iterator[Dockerd]:
    """A private Docker 26 daemon with ``ubuntu:24.04`` imported; stopped after the session."""
    with timed("docker (trixie packages)"):
        docker_root()
    with timed("ubuntu 24.04 rootfs"):
        noble_rootfs()
    with private_dockerd() as daemon:
        with timed("ubuntu:24.04 import"):
            import_ubuntu(daemon)
        yield daemon


@pytest.fixture(scope="session")
def standins(dockerd: Dockerd) -> Iterator[tuple[Path, dict[str, str]]]:
    """The stand-in server on 127.0.0.1 and the build arguments that point the Dockerfile at it."""
    with (
        tempfile.TemporaryDirectory(prefix="q38-standins-") as tmp,
        standin_server(Path(tmp)) as url,
    ):
        yield Path(tmp), standin_build_args(Path(tmp), url)


@pytest.fixture(scope="session")
def qwen38_image(dockerd: Dockerd, standins: tuple[Path, dict[str, str]]) -> BuiltImage:
    """deploy/docker/Dockerfile built as ``qwen38:test`` (fails the session's tests that use it
    with the build's log when it does not build)."""
    directory, build_args = standins
    started = time.monotonic()
    with timed("image build"):
        result = build_image(dockerd, build_args)
    if result.returncode != 0:
        pytest.fail(f"docker build failed:\n{result.stderr[-6000:]}")
    return BuiltImage(IMAGE, build_args, result.stderr, time.monotonic() - started, directory)


@pytest.fixture(scope="session")
def bookworm_tar(deploy_host: None) -> Path:
    """The Debian 12 + systemd + Docker 26 root filesystem tarball."""
    with timed("debian 12 rootfs"):
        return bookworm_rootfs()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Also write the phases' times to .ci-report/deploy-live-phases.txt (under pytest-xdist the
    worker that ran the tests holds them, not the process printing the summary)."""
    if TIMINGS:
        report = Path(__file__).resolve().parent.parent / ".ci-report"
        report.mkdir(exist_ok=True)
        lines = [f"{phase:<52} {seconds:7.1f}\n" for phase, seconds in TIMINGS.items()]
        (report / "deploy-live-phases.txt").write_text("".join(lines))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the live deployment phases' times when any ran."""
    if TIMINGS:
        terminalreporter.section("deployment run for real: seconds per phase")
        for phase, seconds in TIMINGS.items():
            terminalreporter.write_line(f"{phase:<40} {seconds:7.1f}")
