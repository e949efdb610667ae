"""deploy/docker/Dockerfile built by a real Docker 26 daemon and the image run: the gateway with
the simulator as its engine program, both HEALTHCHECKs healthy, a model call answered.

Only what cannot be downloaded here is replaced, through the Dockerfile's own build arguments:
the CUDA apt repository, the 1Cat-vLLM and flash-attn-v100 wheels, the PyTorch index
(tests/dockerhost.py). Skipped with one line where the host cannot run dockerd (not root, no
cgroups); tests/README.md gives the cost.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

import pytest

from tests.deploylive import skip_reason
from tests.deploylive_fixtures import BuiltImage, timed
from tests.dockerhost import Dockerd, build_image

REPO = Path(__file__).resolve().parent.parent
UID = 10038
# The first build takes minutes (prepared first by .ci/steps/deploy-live.sh in CI);
# one worker for both live deployment files (one private dockerd per data root).
pytestmark = [
    pytest.mark.slow(120),
    pytest.mark.xdist_group("deploy-live"),
    pytest.mark.timeout(1800),
]
# One line for the whole file where the host cannot run it or an operator switched it off.
if skip_reason():
    pytest.skip(str(skip_reason()), allow_module_level=True)


def health(daemon: Dockerd, name: str) -> str:
    """Docker's health status of container ``name`` ("" when it has none or is gone)."""
    out = daemon.docker(
        "inspect", "--format", "{{if .State.Health}}{{.State.Health.Status}}{{end}}", name,
        check=False,
    )  # fmt: skip
    return out.stdout.strip()


def wait_healthy(daemon: Dockerd, name: str, timeout: float) -> float:
    """Seconds until ``name`` is healthy; fails with its health log otherwise."""
    started = time.monotonic()
    while health(daemon, name) != "healthy":
        if time.monotonic() - started > timeout:
            detail = daemon.docker("inspect", "--format", "{{json .State}}", name, check=False)
            raise AssertionError(f"{name} not healthy in {timeout} s: {detail.stdout[-2000:]}")
        time.sleep(0.5)
    return time.monotonic() - started


def owned_dir(path: Path) -> Path:
    """A directory owned by the image's user, as install.sh and tmpfiles.d make them."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o750)
    os.chown(path, UID, UID)
    return path


def test_image_runs_the_gateway_and_the_simulator_engine_both_healthy(
    dockerd: Dockerd, qwen38_image: BuiltImage, tmp_path: Path
) -> None:
    """The built image: the engine role (launcher + simulator) and the gateway role turn healthy
    by their own HEALTHCHECK, and the gateway answers a chat completion from the engine."""
    image = dockerd.docker("image", "inspect", qwen38_image.tag).stdout
    config = json.loads(image)[0]["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"][:2] == ["/usr/bin/tini", "--"]
    assert config["Healthcheck"]["StartInterval"] == 5 * 10**9
    etc, run, state = (owned_dir(tmp_path / d) for d in ("etc", "run", "state"))
    engine_toml = (REPO / "deploy/etc/engine.toml").read_text()
    program = 'program = ["python3", "-m", "vllm.entrypoints.openai.api_server"]'
    assert program in engine_toml
    (etc / "engine.toml").write_text(
        engine_toml.replace(program, 'program = ["python3", "-m", "engine", "sim"]')
    )
    (etc / "gateway.toml").write_text((REPO / "deploy/etc/gateway.toml").read_text())
    secret = "sk-" + secrets.token_urlsafe(24)
    keys = etc / "api-keys.env"
    keys.write_text(f"QWEN38_CACHE_SALT_SECRET={secrets.token_hex(32)}\nci=default:{secret}\n")
    for path in etc.iterdir():
        path.chmod(0o600)
        os.chown(path, UID, UID)
    common = ["--network", "none", "--user", f"{UID}:{UID}", "--cap-drop", "ALL"]
    common += ["--security-opt", "no-new-privileges", "--ulimit", "nofile=20000:20000"]
    dockerd.docker(
        "run", "-d", "--name", "qwen38-engine", *common,
        "--mount", f"type=bind,source={etc}/engine.toml,target=/etc/qwen38/engine.toml,readonly",
        "--mount", f"type=bind,source={run},target=/run/qwen38",
        qwen38_image.tag, "engine", "--skip-preflight",
    )  # fmt: skip
    dockerd.docker(
        "run", "-d", "--name", "qwen38-gateway", *common,
        "--read-only", "--tmpfs", "/tmp:rw,nosuid,nodev,noexec,size=16m",
        "--mount", f"type=bind,source={etc},target=/etc/qwen38,readonly",
        "--mount", f"type=bind,source={run},target=/run/qwen38,readonly",
        "--mount", f"type=bind,source={state},target=/var/lib/qwen38",
        qwen38_image.tag, "gateway",
    )  # fmt: skip
    try:
        with timed("image: engine (simulator) healthy"):
            wait_healthy(dockerd, "qwen38-engine", 180)
        with timed("image: gateway healthy"):
            wait_healthy(dockerd, "qwen38-gateway", 180)

        def ready() -> bool:
            probe = dockerd.docker(
                "exec", "qwen38-gateway", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                "http://127.0.0.1:8000/ready", check=False,
            )  # fmt: skip
            return probe.stdout == "200"

        # healthy is the engine's /health; ready also needs the launcher's warm-up (ready file)
        with timed("image: gateway /ready 200"):
            deadline = time.monotonic() + 120
            while not ready():
                assert time.monotonic() < deadline, "gateway /ready not 200 within 120 s"
                time.sleep(0.5)
        body = json.dumps({"model": "qwen3.8-27b", "messages": [{"role": "user", "content": "hi"}]})
        # The secret goes in on standard input (curl -K -), never on a command line.
        answer = dockerd.docker(
            "exec", "-i", "qwen38-gateway", "curl", "-sS", "-K", "-",
            "-w", "\n%{http_code}", "http://127.0.0.1:8000/v1/chat/completions",
            input=(
                f'header = "Authorization: Bearer {secret}"\n'
                'header = "Content-Type: application/json"\n'
                f"data = {json.dumps(body)}\n"
            ).encode(),
        ).stdout  # fmt: skip
        text, status = answer.rsplit("\n", 1)
        assert status == "200", text
        reply = json.loads(text)
        assert reply["model"] == "qwen3.8-27b"
        assert reply["choices"][0]["message"]["content"]
    finally:
        logs = {
            name: dockerd.docker("logs", name, check=False).stderr[-2000:]
            for name in ("qwen38-engine", "qwen38-gateway")
        }
        dockerd.docker("rm", "-f", "qwen38-engine", "qwen38-gateway", check=False)
        print(logs)  # shown by pytest when the test failed


def test_a_wrong_wheel_checksum_fails_the_build(dockerd: Dockerd, qwen38_image: BuiltImage) -> None:
    """A VLLM_WHEEL_SHA256 that does not match the wheel stops the build at that wheel."""
    wrong = dict(qwen38_image.build_args, VLLM_WHEEL_SHA256="0" * 64)
    result = build_image(dockerd, wrong, tag="qwen38:wrong-checksum")
    assert result.returncode != 0
    assert "fetch-wheel: sha256 mismatch for 1cat_vllm-1.5.0-cp312-cp312-linux_x86_64.whl" in (
        result.stderr
    )
    gone = dockerd.docker("image", "inspect", "qwen38:wrong-checksum", check=False)
    assert gone.returncode != 0
