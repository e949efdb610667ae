"""A Debian 12 machine booted with systemd 252 as PID 1 under ``systemd-nspawn``, for the units.

``systemd-nspawn -b --private-network``: its own network namespace with only ``lo`` (nothing it
listens on reaches this machine's network), ``--keep-unit --register=no`` (this machine's PID 1 is
not systemd), ``--capability=all --system-call-filter=@keyring`` (Docker inside needs them).
With ``--keep-unit`` nspawn puts the container in ``<its own cgroup>/payload`` and itself in
``<its own cgroup>/supervisor`` of the ``name=systemd`` hierarchy (and the same paths of the
unified one); on a cgroup v1 host whose PID 1 is not systemd its own cgroup is the root, so every
machine booted on the host would share ``/payload``, and the container's systemd (whose cgroup
namespace starts there) would see and manage the units of any other machine running beside it.
So nspawn starts in a cgroup of this machine's own in both (`private_cgroup`), removed after.
Commands run inside through ``nsenter`` into the container's namespaces, with a clean
environment. `kill` ends everything in it: its PID 1 dies and the kernel kills the rest of its
PID namespace, the Docker containers inside included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from engine.procgroup import start_ticks
from tests.deploylive import CACHE

# Room for Debian (300 MB), the image tarball and the image loaded from it (about 1 GB each).
ROOT_TMPFS = "6g"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# The hierarchies nspawn places itself and the container in on a cgroup v1 host: name=systemd
# and, on a hybrid host, the unified one beside it (where systemd 252 reads its own cgroup).
CGROUP_HIERARCHIES = (
    ("name=systemd", Path("/sys/fs/cgroup/systemd")),
    ("", Path("/sys/fs/cgroup/unified")),
)


def private_cgroup(name: str) -> list[Path]:
    """On a cgroup v1 host (``name=systemd`` hierarchy mounted), a new empty cgroup below this
    process's own in that hierarchy and in the unified one beside it (hybrid), for one machine's
    nspawn; none elsewhere (a systemd host gives nspawn's unit a cgroup of its own already)."""
    if not (CGROUP_HIERARCHIES[0][1] / "cgroup.procs").exists():
        return []
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        own[controllers] = path
    leaf = f"qwen38-{name}-{os.getpid()}-{time.time_ns()}"
    cgroups = []
    for controllers, mount in CGROUP_HIERARCHIES:
        if controllers in own and (mount / "cgroup.procs").exists():
            cgroup = mount / own[controllers].strip("/") / leaf
            cgroup.mkdir(parents=True)
            cgroups.append(cgroup)
    return cgroups


def remove_cgroups(cgroups: list[Path], timeout: float = 10) -> None:
    """Remove ``cgroups`` and what nspawn and the container made below them (empty cgroups only;
    a few retries while the container's last processes are reaped)."""
    deadline = time.monotonic() + timeout
    while True:
        for tree in cgroups:
            for directory, _, _ in sorted(os.walk(tree, topdown=False), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
        if not any(tree.exists() for tree in cgroups) or time.monotonic() > deadline:
            return
        time.sleep(0.2)


class Machine:
    """One root directory and, while booted, the ``systemd-nspawn`` process running it."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader = 0
        self.leader_started: int | None = None
        self.boots = 0
        self.console = root.parent / f"{name}.console"
        self.cgroups = private_cgroup(name)

    def boot(self, timeout: float = 120) -> float:
        """Boot and wait until systemd reports the boot finished; the seconds it took."""
        assert self.proc is None, "already booted"
        started = time.monotonic()
        self.boots += 1
        with open(self.console, "ab") as console:
            # nspawn enters this machine's own cgroup first (see the module's docstring).
            enter = []
            if self.cgroups:
                script = 'for c in $0; do echo $$ >"$c/cgroup.procs" || exit 1; done; exec "$@"'
                enter = ["/bin/sh", "-c", script, " ".join(map(str, self.cgroups))]
            self.proc = subprocess.Popen(
                [
                    *enter,
                    "systemd-nspawn",
                    "--boot",
                    f"--directory={self.root}",
                    f"--machine={self.name}",
                    "--register=no",
                    "--keep-unit",
                    "--private-network",
                    "--console=pipe",
                    "--capability=all",
                    "--system-call-filter=@keyring",
                ],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = started + timeout
        while not self.leader:
            self.leader = self._find_leader()
            self.leader_started = start_ticks(self.leader) if self.leader else None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"nspawn did not start:\n{self.console_tail()}")
            time.sleep(0.1)
        while True:
            state = self.sh("systemctl is-system-running", check=False, timeout=30).stdout.strip()
            if state in ("running", "degraded"):
                return time.monotonic() - started
            if time.monotonic() > deadline:
                raise AssertionError(f"boot did not finish ({state}):\n{self.console_tail()}")
            time.sleep(0.2)

    def _find_leader(self) -> int:
        """The host pid of the container's PID 1 (a child of systemd-nspawn), or 0."""
        assert self.proc is not None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        with contextlib.suppress(OSError):
            for pid in children.read_text().split():
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                if comm == "systemd":
                    return int(pid)
        return 0

    def console_tail(self, lines: int = 40) -> str:
        """The last lines nspawn and the container's console printed."""
        with contextlib.suppress(OSError):
            return "\n".join(self.console.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def sh(
        self,
        script: str,
        check: bool = True,
        timeout: float = 120,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``/bin/sh -c script`` inside, as root; raises with its output when ``check`` fails."""
        assert self.leader, "not booted"
        argv = ["nsenter", f"--target={self.leader}", "--all", "--root", "--wd"]
        argv += ["/usr/bin/env", "-i", f"PATH={PATH}", "LANG=C.UTF-8", "/bin/sh", "-c", script]
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"in {self.name}: {script[:200]!r} exited {result.returncode}:\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result

    def prop(self, unit: str, name: str) -> str:
        """``systemctl show -P NAME UNIT``."""
        return self.sh(f"systemctl show -P {name} {unit}").stdout.strip()

    def poweroff(self, timeout: float = 90) -> float:
        """``systemctl poweroff`` and wait for nspawn to exit; the seconds it took."""
        assert self.proc is not None
        started = time.monotonic()
        self.sh("systemctl poweroff --no-block", check=False, timeout=30)
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()
        self.proc = None
        self.leader = 0
        return time.monotonic() - started

    def kill(self) -> None:
        """End the container at once: SIGKILL to its PID 1, then to nspawn."""
        # Only while the pid is still the container's PID 1 (not a process that took it since).
        if self.leader and start_ticks(self.leader) == self.leader_started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.leader, signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
        self.leader = 0


def _unmount_stale(directory: Path) -> None:
    """Unmount the tmpfs roots a killed test run left under ``directory``, and remove them."""
    prefix = str(directory) + "/"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point.startswith(prefix):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    for stale in directory.iterdir():
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def machine(rootfs_tar: Path, name: str) -> Iterator[Machine]:
    """A fresh root directory unpacked from ``rootfs_tar``, on a tmpfs of its own (unpacked and
    removed in seconds: removing 2 GB from this disk takes minutes); killed and unmounted after,
    whatever happened."""
    machines = CACHE / "machines"
    machines.mkdir(parents=True, exist_ok=True)
    _unmount_stale(machines)
    workdir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=machines))
    root = workdir / "root"
    root.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={ROOT_TMPFS},mode=0755", "tmpfs", str(root)],
        capture_output=True,
        check=True,
    )
    box = Machine(root, name)
    try:
        subprocess.run(
            ["tar", "--numeric-owner", "--xattrs", "-xpf", str(rootfs_tar), "-C", str(root)],
            capture_output=True,
            check=True,
        )
        yield box
    finally:
        box.kill()
        remove_cgroups(box.cgroups)
        subprocess.run(["umount", "-l", str(root)], capture_output=True, check=False)
        shutil.rmtree(workdir, ignore_errors=True)
