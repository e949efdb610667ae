"""A private Docker 26 daemon on this machine, the stand-in downloads, and the image build.

The daemon listens on a socket in a temp directory, keeps its data in the cache
(``tests/deploylive.py``) and runs with networking off (no bridge, no iptables, no forwarding):
it never touches the machine's firewall. Containers get ``--network none`` or, for a build,
``--network host`` (a build's ``RUN`` reaches the package registries and the stand-in server on
127.0.0.1). Stopping it removes every container it ran and ends the processes it started.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.deploylive import (
    CACHE,
    DOCKERD_NO_NETWORK,
    REPO,
    docker_root,
    key,
    locked,
    noble_rootfs,
    say,
)

IMAGE = "qwen38:test"
# Stand-ins for what cannot be downloaded here; names as the real ones.
VLLM_WHEEL = "1cat_vllm-1.5.0-cp312-cp312-linux_x86_64.whl"
FLASH_ATTN_WHEEL = "flash_attn_v100-2.8.3-cp312-cp312-linux_x86_64.whl"
CUDA_PACKAGES = (("cuda-nvcc-12-8", "12.8.93-1"), ("cuda-cudart-dev-12-8", "12.8.90-1"))
# The stand-in server's port: fixed, so build arguments and so the build cache stay the same
# from run to run (a random port, taken when this one is busy, costs a rebuild of the layers).
STANDIN_PORT = int(os.environ.get("QWEN38_STANDIN_PORT", "47138"))
PATH_IN_IMAGES = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class Dockerd:
    """A running private dockerd; `docker` runs the matching client against it."""

    root: Path
    run_dir: Path
    proc: subprocess.Popen[bytes]
    env: dict[str, str]

    def docker(
        self, *args: str, check: bool = True, timeout: float = 120, input: bytes | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``docker ARGS`` against this daemon; raises with the output when ``check`` fails."""
        result = subprocess.run(
            [str(self.root / "usr/bin/docker"), *args],
            env=self.env,
            capture_output=True,
            timeout=timeout,
            input=input,
            check=False,
        )
        out = subprocess.CompletedProcess(
            result.args,
            result.returncode,
            result.stdout.decode(errors="replace"),
            result.stderr.decode(errors="replace"),
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"docker {' '.join(args[:3])} exited {out.returncode}:\n{out.stderr[-4000:]}"
            )
        return out


def _our_processes(marker: str) -> list[int]:
    """Pids whose command line names ``marker`` (our run directory): the daemon's own children."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
    return pids


def _unmount_under(*roots: Path) -> None:
    """Lazily unmount what a killed daemon left mounted under ``roots``."""
    prefixes = tuple(str(r) + "/" for r in roots)
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith(prefixes):
            mounts.append(point)
    for point in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


@contextlib.contextmanager
def private_dockerd(data_root: Path | None = None) -> Iterator[Dockerd]:
    """Start dockerd (socket in a temp dir, ``data_root`` default the cache's), stop it after."""
    root = docker_root()
    data = data_root or CACHE / "docker-data"
    with locked("docker-data"):
        run_dir = Path(tempfile.mkdtemp(prefix="q38dock-", dir="/tmp"))
        config = run_dir / "config"
        (config / "cli-plugins").mkdir(parents=True)
        buildx = root / "usr/libexec/docker/cli-plugins/docker-buildx"
        (config / "cli-plugins" / "docker-buildx").symlink_to(buildx)
        (run_dir / "daemon.json").write_text("{}\n")
        env = {
            "PATH": f"{root}/usr/bin:{root}/usr/sbin:{os.environ.get('PATH', PATH_IN_IMAGES)}",
            "DOCKER_HOST": f"unix://{run_dir}/docker.sock",
            "DOCKER_CONFIG": str(config),
            "HOME": str(run_dir),
        }
        log = open(run_dir / "dockerd.log", "wb")  # noqa: SIM115 (closed in finally)
        proc = subprocess.Popen(
            [
                str(root / "usr/sbin/dockerd"),
                f"--host=unix://{run_dir}/docker.sock",
                f"--data-root={data}",
                f"--exec-root={run_dir}/exec",
                f"--pidfile={run_dir}/dockerd.pid",
                f"--config-file={run_dir}/daemon.json",
                "--storage-driver=overlay2",
                "--log-level=warn",
                *DOCKERD_NO_NETWORK,
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        daemon = Dockerd(root, run_dir, proc, env)
        try:
            deadline = time.monotonic() + 60
            while daemon.docker("version", check=False, timeout=10).returncode != 0:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "dockerd did not start:\n" + (run_dir / "dockerd.log").read_text()[-3000:]
                    )
                time.sleep(0.3)
            yield daemon
        finally:
            ids = daemon.docker("ps", "-aq", check=False, timeout=30).stdout.split()
            if ids:
                daemon.docker("rm", "-f", *ids, check=False, timeout=120)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            for pid in _our_processes(str(run_dir)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _unmount_under(run_dir, data)
            log.close()
            shutil.rmtree(run_dir, ignore_errors=True)


def import_ubuntu(daemon: Dockerd) -> None:
    """``ubuntu:24.04`` from the cached Ubuntu rootfs, unless this daemon has that one already."""
    tar = noble_rootfs()
    label = f"io.qwen38.rootfs={tar.stem}"
    found = daemon.docker(
        "image",
        "inspect",
        "--format",
        '{{index .Config.Labels "io.qwen38.rootfs"}}',
        "ubuntu:24.04",
        check=False,
    )
    if found.returncode == 0 and found.stdout.strip() == tar.stem:
        return
    started = time.monotonic()
    with open(tar, "rb") as handle:
        subprocess.run(
            [
                str(daemon.root / "usr/bin/docker"),
                "import",
                "--change", 'CMD ["/bin/bash"]',
                "--change", f"ENV PATH={PATH_IN_IMAGES}",
                "--change", f"LABEL {label}",
                "-",
                "ubuntu:24.04",
            ],
            env=daemon.env, stdin=handle, capture_output=True, check=True, timeout=300,
        )  # fmt: skip
    say(f"ubuntu:24.04 imported in {time.monotonic() - started:.0f} s")


# --- stand-ins -----------------------------------------------------------------------------


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def standin_server(directory: Path) -> Iterator[str]:
    """Serve ``directory`` on 127.0.0.1 (STANDIN_PORT, else a free port); yields its base URL."""

    def handler(*args: object, **kwargs: object) -> _Quiet:
        return _Quiet(*args, directory=str(directory), **kwargs)  # type: ignore[arg-type]

    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", STANDIN_PORT), handler)  # type: ignore[arg-type]
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # type: ignore[arg-type]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _wheel(path: Path, name: str, version: str) -> str:
    """An installable wheel with no code and no dependencies; returns its sha256."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        "Summary: stand-in for a wheel that cannot be downloaded here\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: qwen38-tests\nRoot-Is-Purelib: false\n"
        "Tag: cp312-cp312-linux_x86_64\n",
    }
    record = "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for member, text in {**files, f"{dist}/RECORD": record}.items():
            archive.writestr(zipfile.ZipInfo(member, (2024, 1, 1, 0, 0, 0)), text)
    path.write_bytes(buffer.getvalue())
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def _deb(out: Path, package: str, version: str, files: dict[str, str]) -> None:
    """A binary package holding ``files`` (path -> text), built with dpkg-deb."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "DEBIAN").mkdir()
        arch = "all" if package == "cuda-keyring" else "amd64"
        (root / "DEBIAN" / "control").write_text(
            f"Package: {package}\nVersion: {version}\nArchitecture: {arch}\n"
            "Maintainer: qwen38 tests <tests@localhost>\n"
            "Description: stand-in for a package that cannot be downloaded here\n"
        )
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", "--build", str(root), str(out)],
            capture_output=True, check=True,
        )  # fmt: skip


def standin_build_args(directory: Path, base_url: str) -> dict[str, str]:
    """Lay the stand-ins in ``directory`` (served at ``base_url``); the ``--build-arg`` values.

    - ``cuda-keyring``: points apt at ``/cuda/``, a trusted flat repository of empty
      ``cuda-nvcc-12-8`` and ``cuda-cudart-dev-12-8`` packages (NVIDIA's repository is not
      reachable here);
    - the 1Cat-vLLM and flash-attn-v100 wheels: empty wheels with the real names, with their
      sha256 (the Dockerfile checks them as it checks the real ones);
    - the PyTorch index: an empty simple index (the stand-in wheels need no torch).
    """
    repo = directory / "cuda"
    repo.mkdir(parents=True, exist_ok=True)
    for package, version in CUDA_PACKAGES:
        _deb(repo / f"{package}_{version}_amd64.deb", package, version, {})
    packages = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", "."], cwd=repo, capture_output=True, check=True
    ).stdout
    (repo / "Packages").write_bytes(packages)
    digest = hashlib.sha256(packages).hexdigest()
    (repo / "Release").write_text(
        f"Origin: qwen38-tests\nLabel: cuda stand-in\nSuite: ./\nArchitectures: amd64 all\n"
        f"SHA256:\n {digest} {len(packages)} Packages\n"
    )
    _deb(
        directory / "cuda-keyring_1.1-1_all.deb",
        "cuda-keyring",
        "1.1-1",
        {
            "etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list": f"deb [trusted=yes] {base_url}/cuda ./\n"
        },
    )
    (directory / "wheels").mkdir(exist_ok=True)
    vllm_sha = _wheel(directory / "wheels" / VLLM_WHEEL, "1cat_vllm", "1.5.0")
    flash_sha = _wheel(directory / "wheels" / FLASH_ATTN_WHEEL, "flash_attn_v100", "2.8.3")
    (directory / "simple").mkdir(exist_ok=True)
    (directory / "simple" / "index.html").write_text("<!DOCTYPE html><html><body></body></html>\n")
    return {
        "CUDA_KEYRING_URL": f"{base_url}/cuda-keyring_1.1-1_all.deb",
        "VLLM_WHEEL": f"{base_url}/wheels/{VLLM_WHEEL}",
        "VLLM_WHEEL_SHA256": vllm_sha,
        "FLASH_ATTN_WHEEL": f"{base_url}/wheels/{FLASH_ATTN_WHEEL}",
        "FLASH_ATTN_WHEEL_SHA256": flash_sha,
        "TORCH_INDEX_URL": f"{base_url}/simple/",
    }


def build_image(
    daemon: Dockerd, build_args: dict[str, str], tag: str = IMAGE, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """``docker build`` of deploy/docker/Dockerfile from the repository root (not checked)."""
    argv = ["build", "--progress=plain", "--network=host", "-f", "deploy/docker/Dockerfile"]
    for name, value in build_args.items():
        argv += ["--build-arg", f"{name}={value}"]
    argv += ["-t", tag, str(REPO)]
    return daemon.docker(*argv, check=False, timeout=timeout)


def image_key() -> str:
    """A digest naming the current Dockerfile (for log lines)."""
    return key((REPO / "deploy/docker/Dockerfile").read_text())
