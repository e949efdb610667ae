"""What the live deployment tests run on: Docker 26, two root filesystems, a private dockerd.

Built once and cached under ``$QWEN38_DEPLOY_CACHE`` (default ``.ci-cache/deploy`` in the
checkout, gitignored), each artefact under a name that carries a digest of its recipe, so a
changed recipe builds anew and a reused machine reuses the rest:

- ``docker-<key>/``: Debian trixie's Docker 26 (``docker.io``, ``docker-cli``, ``containerd``,
  ``docker-buildx``) fetched with ``apt-get download`` through a private apt state and unpacked
  with ``dpkg-deb -x``, plus bookworm's ``runc`` (trixie's needs glibc 2.38). Docker >= 25 is
  needed: the Dockerfile's ``HEALTHCHECK --start-interval``.
- ``noble-<key>.tar``: an Ubuntu 24.04 root filesystem (mmdebstrap, with apt and this machine's
  CA bundle for its TLS-intercepting egress), imported as ``ubuntu:24.04``.
- ``bookworm-<key>.tar``: the "host" booted under systemd-nspawn: Debian 12, systemd 252,
  Docker 26 (bookworm's docker.io for its units and group, trixie's binaries over it) with
  networking off, and the cgroup v1 controllers remounted writable at boot (Docker needs them).
- ``docker-data/``: the host-side dockerd's data root (``ubuntu:24.04`` and the build cache).

``python -m tests.deploy_prepare`` builds all of it and the image (``.ci/steps/deploy-live.sh``
runs it before the tests); the tests' fixtures call the same functions, which wait on a lock
while another process builds. A step that cannot run says what is missing and how to
get it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("QWEN38_DEPLOY_CACHE") or REPO / ".ci-cache" / "deploy")
# The live deployment suites run wherever the host can run them (`host_problem`); an operator
# switches them off with QWEN38_DEPLOY_LIVE=0 (tests/README.md, "Live deployment tests").
SWITCH_VARIABLE = "QWEN38_DEPLOY_LIVE"


def switched_off() -> str | None:
    """The one-line reason when ``$QWEN38_DEPLOY_LIVE`` is ``0``, else None."""
    if os.environ.get(SWITCH_VARIABLE, "").strip() == "0":
        return f"live deployment tests switched off ({SWITCH_VARIABLE}=0)"
    return None


TRIXIE_DOCKER = ("docker.io", "docker-cli", "containerd", "docker-buildx")
BOOKWORM_RUNC = "runc"
NOBLE_MIRROR = "http://archive.ubuntu.com/ubuntu"
NOBLE_SECURITY = "http://security.ubuntu.com/ubuntu"
NOBLE_COMPONENTS = "main restricted universe multiverse"
NOBLE_INCLUDE = ("apt", "ubuntu-keyring", "ca-certificates")
BOOKWORM_INCLUDE = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "iproute2",
    "procps",
    "curl",
    "ca-certificates",
    "passwd",
    "python3",
    "docker.io",
)
# Docker's own networking rewrites the firewall and forwarding of the machine it runs on: never.
DOCKERD_NO_NETWORK = (
    "--bridge=none",
    "--iptables=false",
    "--ip6tables=false",
    "--ip-forward=false",
    "--ip-masq=false",
    "--userland-proxy=false",
)
DAEMON_JSON = (
    '{"bridge": "none", "iptables": false, "ip6tables": false, "ip-forward": false,'
    ' "ip-masq": false, "userland-proxy": false, "storage-driver": "overlay2"}\n'
)
# Docker in nspawn on cgroup v1: nspawn mounts the controllers read-only.
CGROUP_RW_UNIT = """\
[Unit]
Description=Make the cgroup v1 controllers writable for containerd (systemd-nspawn mounts them read-only)
DefaultDependencies=no
Before=containerd.service docker.service
ConditionPathIsDirectory=/sys/fs/cgroup/memory

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'for c in /sys/fs/cgroup/*/; do mount -o remount,bind,rw "$c" || true; done'

[Install]
WantedBy=sysinit.target
"""


class Missing(RuntimeError):
    """A host prerequisite is absent; the message names it and how to install it."""


def say(message: str) -> None:
    """One progress line on standard error."""
    print(f"deploy-live: {message}", file=sys.stderr, flush=True)


def host_problem() -> str | None:
    """Why this host cannot run the live deployment tests (one line), or None when it can."""
    if os.geteuid() != 0:
        return "not root: systemd-nspawn, mmdebstrap and dockerd need root"
    if not Path("/sys/fs/cgroup").is_dir() or not any(Path("/sys/fs/cgroup").iterdir()):
        return "no cgroup file system at /sys/fs/cgroup"
    for tool, package in (
        ("systemd-nspawn", "systemd-container"),
        ("mmdebstrap", "mmdebstrap"),
        ("apt-get", "apt"),
        ("dpkg-deb", "dpkg"),
        ("nsenter", "util-linux"),
    ):
        if shutil.which(tool) is None:
            return f"no {tool}: apt-get install -y --no-install-recommends {package}"
    return None


def skip_reason() -> str | None:
    """The one line a live deployment test file skips with (switched off, or what this host
    lacks), or None when they run."""
    off = switched_off()
    if off:
        return off
    problem = host_problem()
    if problem:
        return f"live deployment tests need a root host with cgroups and nspawn: {problem}"
    return None


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run a command, check its status; a failure raises with its last output lines."""
    result = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-25:])
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {result.returncode}:\n{tail}")
    return result  # type: ignore[no-any-return]


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """Hold the cache's lock ``name`` (another process building the same thing waits)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def key(*parts: str) -> str:
    """A short digest of a recipe, for cache file names."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb.debian.org when none is found)."""
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]:
        with contextlib.suppress(OSError):
            text = path.read_text()
            found = re.search(r"^URIs:\s*(\S+/debian)/?\s*$", text, re.MULTILINE) or re.search(
                r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)/?\s", text, re.MULTILINE
            )
            if found:
                return found.group(1)
    return "http://deb.debian.org/debian"


def _trixie_apt_options(state: Path) -> list[str]:
    """apt options for a private apt state that knows only Debian trixie (host apt untouched)."""
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    if not Path(keyring).exists():
        raise Missing(f"no {keyring}: apt-get install -y debian-archive-keyring")
    (state / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (state / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    (state / "status").touch()
    sources = state / "sources.list"
    sources.write_text(f"deb [signed-by={keyring}] {debian_mirror()} trixie main\n")
    return [
        f"-oDir::Etc::SourceList={sources}",
        "-oDir::Etc::SourceParts=/nonexistent",
        f"-oDir::State::Lists={state / 'lists'}",
        f"-oDir::Cache={state / 'cache'}",
        f"-oDir::State::status={state / 'status'}",
        "-oAPT::Architecture=amd64",
        "-oAcquire::Languages=none",
    ]


def _download(packages: tuple[str, ...], into: Path, apt_options: list[str]) -> list[Path]:
    into.mkdir(parents=True, exist_ok=True)
    try:
        run(["apt-get", *apt_options, "download", *packages], cwd=into)
    except RuntimeError as exc:
        raise Missing(f"apt-get download {' '.join(packages)} failed: {exc}") from exc
    return sorted(into.glob("*.deb"))


def docker_root() -> Path:
    """Docker 26 from trixie plus bookworm's runc, unpacked; the binaries are in usr/bin, usr/sbin."""
    root = CACHE / f"docker-{key(*TRIXIE_DOCKER, BOOKWORM_RUNC, debian_mirror())}"
    with locked("docker"):
        if (root / ".done").exists():
            return root
        started = time.monotonic()
        shutil.rmtree(root, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix="apt-", dir=CACHE))
        try:
            options = _trixie_apt_options(work / "state")
            say("apt-get update (trixie, private state)")
            run(["apt-get", *options, "update"])
            debs = _download((*TRIXIE_DOCKER, "ubuntu-keyring"), work / "trixie", options)
            # bookworm's runc, from the host's own apt lists.
            debs += _download((BOOKWORM_RUNC,), work / "bookworm", [])
            unpacked = root.with_name(root.name + ".tmp")
            shutil.rmtree(unpacked, ignore_errors=True)
            for deb in debs:
                run(["dpkg-deb", "-x", str(deb), str(unpacked)])
            dockerd = unpacked / "usr" / "sbin" / "dockerd"
            if not dockerd.exists():
                raise Missing(f"trixie's docker.io has no {dockerd.relative_to(unpacked)}")
            version = run([str(unpacked / "usr/bin/docker"), "--version"]).stdout.strip()
            (unpacked / ".done").write_text(version + "\n")
            unpacked.rename(root)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        say(f"docker unpacked in {time.monotonic() - started:.0f} s: {root}")
    return root


def _mmdebstrap(
    options: list[str], suite: str, mirrors: list[str], target: Path, what: str
) -> None:
    started = time.monotonic()
    tmp = target.with_name(target.name + ".tmp")
    tmp.unlink(missing_ok=True)
    say(f"mmdebstrap {what} (a few minutes the first time)")
    argv = ["mmdebstrap", "--quiet", "--mode=root", "--format=tar", *options, suite, str(tmp)]
    try:
        run([*argv, *mirrors])
    except RuntimeError as exc:
        tmp.unlink(missing_ok=True)
        raise Missing(f"mmdebstrap {what} failed: {exc}") from exc
    tmp.rename(target)
    say(f"{what} rootfs in {time.monotonic() - started:.0f} s: {target}")


def noble_rootfs() -> Path:
    """Ubuntu 24.04 minbase with apt and this machine's CA bundle, as a tarball."""
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    recipe = [*NOBLE_INCLUDE, NOBLE_MIRROR, NOBLE_SECURITY, ca.read_text() if ca.exists() else ""]
    target = CACHE / f"noble-{key(*recipe)}.tar"
    keyring = docker_root() / "usr/share/keyrings/ubuntu-archive-keyring.gpg"
    with locked("noble"):
        if target.exists():
            return target
        hooks = []
        if ca.exists():
            hooks = [
                '--customize-hook=mkdir -p "$1/usr/local/share/ca-certificates"',
                f'--customize-hook=cp {ca} "$1/usr/local/share/ca-certificates/host-egress.crt"',
                '--customize-hook=chroot "$1" update-ca-certificates',
            ]
        _mmdebstrap(
            [
                "--variant=minbase",
                f"--include={','.join(NOBLE_INCLUDE)}",
                f"--keyring={keyring}",
                *hooks,
            ],
            "noble",
            [
                f"deb {NOBLE_MIRROR} noble {NOBLE_COMPONENTS}",
                f"deb {NOBLE_MIRROR} noble-updates {NOBLE_COMPONENTS}",
                f"deb {NOBLE_SECURITY} noble-security {NOBLE_COMPONENTS}",
            ],
            target,
            "ubuntu 24.04",
        )
    return target


def bookworm_rootfs() -> Path:
    """Debian 12 with systemd and Docker 26 (networking off), as a tarball."""
    docker = docker_root()
    target = (
        CACHE / f"bookworm-{key(*BOOKWORM_INCLUDE, docker.name, DAEMON_JSON, CGROUP_RW_UNIT)}.tar"
    )
    with locked("bookworm"):
        if target.exists():
            return target
        binaries = [
            "usr/sbin/dockerd",
            "usr/bin/docker",
            "usr/bin/containerd",
            "usr/bin/containerd-shim-runc-v2",
            "usr/bin/ctr",
        ]
        hooks = [f'--customize-hook=cp -f {docker / b} "$1/{b}"' for b in binaries]
        hooks += [
            '--customize-hook=mkdir -p "$1/etc/docker"',
            f"--customize-hook=printf '%s' '{DAEMON_JSON.strip()}' >\"$1/etc/docker/daemon.json\"",
            "--customize-hook=printf '%s' '"
            + CGROUP_RW_UNIT.replace("'", "'\\''")
            + '\' >"$1/etc/systemd/system/cgroup-rw.service"',
            '--customize-hook=chroot "$1" systemctl enable cgroup-rw.service',
            # a host name and machine id of its own; no getty on the console
            '--customize-hook=echo qwen38-host >"$1/etc/hostname"',
            '--customize-hook=chroot "$1" systemctl mask console-getty.service getty@tty1.service',
        ]
        _mmdebstrap(
            [
                "--variant=minbase",
                f"--include={','.join(BOOKWORM_INCLUDE)}",
                *hooks,
            ],
            "bookworm",
            [debian_mirror()],
            target,
            "debian 12 + systemd + docker",
        )
    return target
