"""The shipped systemd units run for real: systemd 252 as PID 1 under systemd-nspawn on a Debian 12
root, Docker 26 inside, ``deploy/install.sh`` run live, the image built by
test_deploy_live_image.py's fixture loaded into it.

The tests of this module run in order on one booted machine: install, serve, a second install,
the engine's failing start, reload, ``kill -9``, drain, reboot, the engine's start limit, a
failing gateway start and its start limit (last: each gateway start also starts the engine unit,
its Wants=, so it would spend the engine's start limit). The engine unit cannot run here (no NVIDIA runtime): it fails at its ``docker run
--gpus``; a simulator engine is started by hand in the same image with the unit's flags but
``--gpus`` so the gateway unit has an engine to answer from. Host workaround (this machine only:
no CAP_SYS_RESOURCE, ``nofile`` hard limit 20,000): a ``docker`` wrapper first in PATH lowers the
units' ``--ulimit nofile=65536:65536`` to 20,000; nothing else of deploy/ is changed.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploylive import skip_reason
from tests.deploylive_fixtures import TIMINGS, BuiltImage, timed
from tests.dockerhost import Dockerd
from tests.nspawn import Machine, machine

REPO = Path(__file__).resolve().parent.parent
SRC = "/srv/qwen38-src"
GPU = "GPU-0badc0de-0000-4000-8000-000000000001"
GATEWAY = "qwen38-gateway.service"
ENGINE = "qwen38-engine.service"
# Minutes, most of it waiting (boots, restarts, the start limits): beside the other files under
# xdist; one worker for both live deployment files (one private dockerd per data root).
pytestmark = [
    pytest.mark.slow(420),
    pytest.mark.xdist_group("deploy-live"),
    pytest.mark.timeout(1800),  # the first test also waits for the shared fixtures
]
# One line for the whole file where the host cannot run it or an operator switched it off.
if skip_reason():
    pytest.skip(str(skip_reason()), allow_module_level=True)

NOFILE_WRAPPER = """#!/bin/sh
# Test host only: no CAP_SYS_RESOURCE and a nofile hard limit of 20,000, so the units'
# --ulimit nofile=65536:65536 cannot be granted here; lowered to what the host allows.
for arg do
    shift
    [ "$arg" = nofile=65536:65536 ] && arg=nofile=20000:20000
    set -- "$@" "$arg"
done
exec /usr/bin/docker "$@"
"""


@dataclass
class Live:
    """The booted machine and what the tests learned on it."""

    box: Machine
    image: str
    secret: str = ""
    install_stdout: str = ""
    notes: dict[str, float] = field(default_factory=dict)


def http(
    box: Machine,
    path: str,
    secret: str | None = None,
    body: dict[str, object] | None = None,
    timeout: float = 60,
) -> tuple[int, dict[str, str], str]:
    """One request to the gateway on the machine's loopback (curl inside it; the secret goes in
    on standard input, never on a command line): status, headers (lower-case), body."""
    config = [f'url = "http://127.0.0.1:8000{path}"', f"max-time = {int(timeout)}"]
    if secret:
        config.append(f'header = "Authorization: Bearer {secret}"')
    if body is not None:
        config += [
            'header = "Content-Type: application/json"',
            f"data = {json.dumps(json.dumps(body))}",
        ]
    out = box.sh(
        "curl -sS -i -K -", input="\n".join(config) + "\n", timeout=timeout + 10, check=False
    )
    if out.returncode != 0:
        return 0, {}, out.stderr
    # text mode: curl's CRLF line ends arrive as "\n"
    head, _, text = out.stdout.partition("\n\n")
    lines = head.split("\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, text


def chat(secret: str, **sim: object) -> dict[str, object]:
    """A chat completion body (with the simulator's per-request ``sim`` object when given)."""
    body: dict[str, object] = {
        "model": "qwen3.8-27b",
        "messages": [{"role": "user", "content": "hi"}],
    }
    if sim:
        body["sim"] = sim
    return body


def wait_for(what: str, predicate: object, timeout: float, interval: float = 0.5) -> float:
    """Seconds until ``predicate()`` is true; fails naming ``what`` after ``timeout``."""
    assert callable(predicate)
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - started


def journal(box: Machine, unit: str, lines: int = 60) -> str:
    """The unit's last journal lines."""
    return box.sh(f"journalctl -u {unit} --no-pager -n {lines} -o cat", check=False).stdout


def seconds(span: str) -> float:
    """A systemd time span as `systemctl show` prints it ("1min 30s", "5s", "900ms") in seconds."""
    units = {"ms": 0.001, "s": 1, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|min|h)", span)
    assert parts and "".join(n + u for n, u in parts) == span.replace(" ", ""), span
    return sum(float(number) * units[unit] for number, unit in parts)


def serving(box: Machine) -> bool:
    """The gateway unit is active and /health answers 200."""
    if box.sh(f"systemctl is-active {GATEWAY}", check=False).stdout.strip() != "active":
        return False
    return http(box, "/health", timeout=5)[0] == 200


@pytest.fixture(scope="module")
def live(dockerd: Dockerd, qwen38_image: BuiltImage, bookworm_tar: Path) -> Iterator[Live]:
    """A booted Debian 12 machine with Docker 26 running and the image loaded (not installed)."""
    started = time.monotonic()
    with machine(bookworm_tar, "qwen38-host") as box:
        TIMINGS["rootfs unpack"] = time.monotonic() - started
        shutil.copytree(REPO / "deploy", box.root / SRC.lstrip("/") / "deploy", symlinks=True)
        shutil.copy(REPO / "README.md", box.root / SRC.lstrip("/") / "README.md")
        # Install step 4: the checkpoint directory (empty here: no engine can load it anyway).
        (box.root / "srv/models/Qwen3.8-27B-QUASAR-NVFP4").mkdir(parents=True)
        wrapper = box.root / "usr/local/bin/docker"
        wrapper.write_text(NOFILE_WRAPPER)
        wrapper.chmod(0o755)
        with timed("image save (host dockerd)"):
            dockerd.docker(
                "save", "-o", str(box.root / "var/tmp/qwen38.tar"), qwen38_image.tag, timeout=300
            )
        with timed("boot (systemd in nspawn)"):
            box.boot()
        wait_for(
            "docker in the machine", lambda: box.sh("docker info", check=False).returncode == 0, 120
        )
        with timed("image load (machine's dockerd)"):
            box.sh("docker load -i /var/tmp/qwen38.tar && rm -f /var/tmp/qwen38.tar", timeout=300)
        yield Live(box, qwen38_image.tag)
        print(journal(box, GATEWAY, 80))


def test_install_sh_live_enables_the_units_and_the_gateway_serves(live: Live) -> None:
    """install.sh as root on a live systemd: the first key on stdout, the gateway unit active and
    healthy, /health 200, /ready 503 and a model call 503 with Retry-After while no engine runs."""
    box = live.box
    started = time.monotonic()
    result = box.sh(
        f"QWEN38_IMAGE={live.image} QWEN38_GPU={GPU} {SRC}/deploy/install.sh", timeout=300
    )
    TIMINGS["install.sh (first run)"] = time.monotonic() - started
    stdout = result.stdout.splitlines()
    assert len(stdout) == 1 and stdout[0].startswith("sk-"), result.stdout
    live.secret = stdout[0]
    assert "enabled" in result.stderr
    with timed("gateway unit active and healthy after install.sh"):
        wait_for("gateway active and /health 200", lambda: serving(box), 240)
    TIMINGS["clean rootfs to serving gateway"] = sum(
        TIMINGS.get(phase, 0.0)
        for phase in (
            "rootfs unpack",
            "boot (systemd in nspawn)",
            "image load (machine's dockerd)",
            "install.sh (first run)",
            "gateway unit active and healthy after install.sh",
        )
    )
    assert box.sh(f"systemctl is-enabled {GATEWAY} {ENGINE}").stdout.split() == ["enabled"] * 2
    health = box.sh(
        "docker inspect --format '{{.State.Health.Status}}' qwen38-gateway"
    ).stdout.strip()
    assert health == "healthy"
    assert http(box, "/ready")[0] == 503
    status, headers, text = http(box, "/v1/chat/completions", live.secret, chat(live.secret))
    assert status == 503, text
    assert int(headers.get("retry-after", "0")) > 0, headers


def test_tmpfiles_and_state_directories_exist_owned_by_qwen38(live: Live) -> None:
    """/run/qwen38, /var/cache/qwen38 and /var/lib/qwen38 exist, 0750, owned by qwen38."""
    out = live.box.sh("stat -c '%n %U %G %a' /run/qwen38 /var/cache/qwen38 /var/lib/qwen38")
    assert out.stdout.split("\n")[:3] == [
        f"{path} qwen38 qwen38 750"
        for path in ("/run/qwen38", "/var/cache/qwen38", "/var/lib/qwen38")
    ]
    assert live.box.sh("stat -c '%a %U' /etc/qwen38/api-keys.env").stdout.split() == [
        "600",
        "qwen38",
    ]


# What install.sh lays, with times; the state directories (the running gateway writes there)
# by mode and owner only.
SNAPSHOT = (
    "find /etc/qwen38 /etc/systemd/system /etc/tmpfiles.d /usr/local/sbin /usr/local/share/qwen38 "
    "/usr/local/share/doc/qwen38 -xdev -printf '%p %y %m %U %G %s %T@ %l\\n' | sort; "
    "stat -c '%n %F %a %U %G' /run/qwen38 /var/lib/qwen38 /var/cache/qwen38"
)


def test_a_second_install_changes_nothing(live: Live) -> None:
    """install.sh again: nothing on stdout, every file, mode, owner and time as before, and the
    running gateway not restarted."""
    box = live.box
    before = box.sh(SNAPSHOT).stdout
    pid = box.prop(GATEWAY, "MainPID")
    started = time.monotonic()
    again = box.sh(f"QWEN38_IMAGE={live.image} {SRC}/deploy/install.sh", timeout=300)
    TIMINGS["install.sh (second run)"] = time.monotonic() - started
    assert again.stdout == ""
    assert "keeping /etc/qwen38/api-keys.env" in again.stderr
    assert box.sh(SNAPSHOT).stdout == before
    assert box.prop(GATEWAY, "MainPID") == pid


def test_engine_unit_without_an_nvidia_runtime_fails_in_seconds(live: Live) -> None:
    """The engine's `docker run --gpus` fails at once here: the unit is failed within seconds
    (not after TimeoutStartSec=1900), and Restart= schedules the next attempt."""
    box = live.box
    box.sh(f"systemctl stop {ENGINE}; systemctl reset-failed {ENGINE}", check=False)
    started = time.monotonic()
    start = box.sh(f"systemctl start {ENGINE}", check=False, timeout=120)
    elapsed = time.monotonic() - started
    TIMINGS["engine unit: failing start to failed"] = elapsed
    assert start.returncode != 0
    assert elapsed < 30, elapsed
    log = journal(box, ENGINE)
    assert "docker run exited before the container was healthy" in log
    # Everything up to the GPU works: the mounts exist, the image is found.
    assert 'could not select device driver "" with capabilities: [[gpu]]' in log, log
    state = box.sh(f"systemctl show -P ActiveState -P SubState {ENGINE}").stdout.split()
    assert state in (["activating", "auto-restart"], ["failed", "failed"]), state
    live.notes["engine_reset_at"] = started


def test_an_engine_template_instance_without_an_nvidia_runtime_fails_in_seconds(live: Live) -> None:
    """qwen38-engine@gpu1 (the template for several cards) with its own engine file and card:
    its failing `docker run --gpus` fails the instance within seconds too."""
    box = live.box
    box.sh(
        "install -d -m 0750 -o qwen38 -g qwen38 /etc/qwen38/engines && "
        "install -m 0640 -o qwen38 -g qwen38 /etc/qwen38/engine.toml /etc/qwen38/engines/gpu1.toml && "
        f"echo QWEN38_GPU={GPU[:-1]}2 >/etc/qwen38/engines/gpu1.env"
    )
    instance = "qwen38-engine@gpu1.service"
    started = time.monotonic()
    start = box.sh(f"systemctl start {instance}", check=False, timeout=120)
    elapsed = time.monotonic() - started
    TIMINGS["engine template instance: failing start to failed"] = elapsed
    log = journal(box, instance)
    box.sh(f"systemctl stop {instance}; systemctl reset-failed {instance}", check=False)
    assert start.returncode != 0 and elapsed < 30, (elapsed, log)
    assert "qwen38-engine-gpu1: docker run exited before the container was healthy" in log
    assert 'could not select device driver "" with capabilities: [[gpu]]' in log, log


def engine_sim_config(box: Machine) -> str:
    """engine.toml with the simulator as the engine program, beside the operator's file."""
    text = (box.root / "etc/qwen38/engine.toml").read_text()
    program = 'program = ["python3", "-m", "vllm.entrypoints.openai.api_server"]'
    assert program in text
    path = box.root / "srv/qwen38-sim/engine.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace(program, 'program = ["python3", "-m", "engine", "sim"]'))
    path.chmod(0o644)
    return "/srv/qwen38-sim/engine.toml"


def test_gateway_unit_answers_a_model_call_from_a_simulator_engine(live: Live) -> None:
    """With the simulator run in the image as the engine unit runs it (minus --gpus), /ready is
    200 and a chat completion through the gateway unit is answered."""
    box = live.box
    config = engine_sim_config(box)
    box.sh(
        "docker run -d --rm --name qwen38-sim --network none --user $(id -u qwen38):$(id -g qwen38) "
        "--cap-drop ALL "
        "--security-opt no-new-privileges --ulimit nofile=20000:20000 --log-driver none "
        f"--mount type=bind,source={config},target=/etc/qwen38/engine.toml,readonly "
        "--mount type=bind,source=/run/qwen38,target=/run/qwen38 "
        "--mount type=bind,source=/var/cache/qwen38,target=/var/cache/qwen38 "
        f"{live.image} engine --skip-preflight"
    )
    with timed("simulator engine ready, gateway /ready 200"):
        wait_for("/ready 200", lambda: http(box, "/ready", timeout=5)[0] == 200, 120)
    status, _, text = http(box, "/v1/chat/completions", live.secret, chat(live.secret))
    assert status == 200, text
    assert json.loads(text)["choices"][0]["message"]["content"]


def test_reload_rereads_the_keys_a_new_key_works_a_revoked_one_is_refused(live: Live) -> None:
    """Keys added and revoked with the installed host wrapper, then `systemctl reload`: the new
    key is accepted, the revoked one answers 401, and the gateway logged a reload on SIGHUP."""
    box = live.box
    added = box.sh("qwen38-gateway keys add --tenant second --id ci_second", timeout=120)
    secret = added.stdout.splitlines()[-1]
    assert secret.startswith("sk-") and secret not in added.stderr
    pid = box.prop(GATEWAY, "MainPID")
    box.sh(f"systemctl reload {GATEWAY}")
    wait_for("new key accepted", lambda: http(box, "/v1/models", secret)[0] == 200, 10)
    box.sh("qwen38-gateway keys revoke ci_second", timeout=120)
    box.sh(f"systemctl reload {GATEWAY}")
    wait_for("revoked key refused", lambda: http(box, "/v1/models", secret)[0] == 401, 10)
    assert http(box, "/v1/models", live.secret)[0] == 200
    assert box.prop(GATEWAY, "MainPID") == pid
    assert re.search(r"reload_ok.*signal|signal.*reload_ok", journal(box, GATEWAY, 200))


def test_kill_9_of_the_main_process_brings_the_gateway_back(live: Live) -> None:
    """SIGKILL to the unit's main process: Restart=always starts a new container and the gateway
    serves again."""
    box = live.box
    pid = box.prop(GATEWAY, "MainPID")
    restarts = int(box.prop(GATEWAY, "NRestarts"))
    box.sh(f"kill -9 {pid}")
    wait_for("a restart", lambda: int(box.prop(GATEWAY, "NRestarts")) == restarts + 1, 60)
    with timed("kill -9 to serving again"):
        wait_for("serving again", lambda: serving(box), 120)
    assert box.prop(GATEWAY, "MainPID") not in ("0", pid)


def test_stop_drains_a_stream_within_timeout_stop_sec(live: Live) -> None:
    """`systemctl stop` while a stream is running: the stream ends with [DONE], the unit stops
    within TimeoutStopSec without SIGKILL (result success)."""
    box = live.box
    body = chat(live.secret, completion_tokens=40, tokens_per_second=8)
    body["stream"] = True
    config = (
        'url = "http://127.0.0.1:8000/v1/chat/completions"\nmax-time = 60\n'
        f'header = "Authorization: Bearer {live.secret}"\n'
        'header = "Content-Type: application/json"\n'
        f"data = {json.dumps(json.dumps(body))}\n"
    )
    (box.root / "root/stream.curl").write_text(config)
    (box.root / "root/stream.curl").chmod(0o600)
    box.sh(
        "rm -f /root/stream.out; setsid sh -c 'curl -sS -N -K /root/stream.curl >/root/stream.out 2>&1' </dev/null >/dev/null 2>&1 &"
    )
    out = box.root / "root/stream.out"
    wait_for("first event", lambda: out.exists() and "data:" in out.read_text(), 30, 0.1)
    assert "[DONE]" not in out.read_text()  # still streaming when the stop begins
    started = time.monotonic()
    box.sh(f"systemctl stop {GATEWAY}", timeout=120)
    elapsed = time.monotonic() - started
    TIMINGS["systemctl stop with a stream in flight"] = elapsed
    assert elapsed < seconds(box.prop(GATEWAY, "TimeoutStopUSec")), elapsed
    assert box.prop(GATEWAY, "Result") == "success"
    wait_for("stream finished", lambda: "data: [DONE]" in out.read_text(), 30, 0.2)
    # the whole answer (the simulator's 40 tokens end with "stop"), no error event
    stream = out.read_text().replace(" ", "")
    assert '"finish_reason":"stop"' in stream and '"error"' not in stream, stream[-2000:]
    box.sh(f"systemctl start {GATEWAY}", timeout=300)
    wait_for("serving after start", lambda: serving(box), 120)


def test_after_a_reboot_the_gateway_starts_and_run_qwen38_is_recreated(live: Live) -> None:
    """Power off and boot the machine again: the enabled gateway unit starts by itself, tmpfiles
    recreates /run/qwen38 (a tmpfs) and the usage ledger in /var/lib/qwen38 is kept."""
    box = live.box
    ledger = box.sh("ls /var/lib/qwen38").stdout.split()
    box.sh("docker rm -f qwen38-sim", check=False)
    with timed("poweroff"):
        box.poweroff()
    with timed("boot again to serving"):
        box.boot()
        wait_for("serving after boot", lambda: serving(box), 240)
    out = box.sh("stat -c '%U %G %a' /run/qwen38").stdout.split()
    assert out == ["qwen38", "qwen38", "750"]
    assert box.sh("ls /var/lib/qwen38").stdout.split() == ledger
    live.notes["booted_at"] = time.monotonic()


def test_the_engine_unit_stops_at_its_start_limit(live: Live) -> None:
    """Without an NVIDIA runtime the engine unit fails each start at once: after StartLimitBurst
    starts within StartLimitIntervalSec systemd refuses the next restart and it stays failed."""
    box = live.box
    burst = int(box.prop(ENGINE, "StartLimitBurst"))
    restart_s = seconds(box.prop(ENGINE, "RestartUSec"))
    # Counting from the last boot: each attempt is RestartSec plus a few seconds of failing.
    budget = burst * (restart_s + 15)
    elapsed = time.monotonic() - live.notes["booted_at"]
    wait_for("the start limit", lambda: start_limit_hit(box, ENGINE), max(budget - elapsed, 30), 2)
    TIMINGS["engine unit: boot to start limit hit"] = time.monotonic() - live.notes["booted_at"]
    assert int(box.prop(ENGINE, "NRestarts")) == burst


def start_limit_hit(box: Machine, unit: str) -> bool:
    """The unit is failed for good: systemd refused a restart ("Start request repeated too
    quickly"; systemd 252 keeps the first failure's Result, so that property does not say it)."""
    if box.prop(unit, "ActiveState") != "failed":
        return False
    this_boot = box.sh(f"journalctl -b -u {unit} --no-pager -n 30 -o cat", check=False).stdout
    return "Start request repeated too quickly" in this_boot


def set_image(box: Machine, image: str) -> None:
    """QWEN38_IMAGE in /etc/qwen38/units.env."""
    box.sh(f"sed -i 's|^QWEN38_IMAGE=.*|QWEN38_IMAGE={image}|' /etc/qwen38/units.env")


def test_a_gateway_start_that_fails_at_once_fails_in_seconds_and_hits_the_start_limit(
    live: Live,
) -> None:
    """An image that does not exist: each start is failed within seconds, and Restart= stops at
    the start limit (20 starts in 300 s), long before one TimeoutStartSec (300 s) would pass."""
    box = live.box
    set_image(box, "qwen38:missing")
    try:
        box.sh(f"systemctl stop {GATEWAY}; systemctl reset-failed {GATEWAY}", timeout=120)
        started = time.monotonic()
        first = box.sh(f"systemctl start {GATEWAY}", check=False, timeout=120)
        elapsed = time.monotonic() - started
        TIMINGS["gateway unit: failing start to failed"] = elapsed
        assert first.returncode != 0 and elapsed < 30, (elapsed, first.stderr)
        assert "docker run exited before the container was healthy" in journal(box, GATEWAY)
        burst = int(box.prop(GATEWAY, "StartLimitBurst"))
        interval_s = seconds(box.prop(GATEWAY, "StartLimitIntervalUSec"))
        with timed("gateway unit: start limit hit"):
            wait_for("the start limit", lambda: start_limit_hit(box, GATEWAY), interval_s, 2)
        # the first start and burst - 1 restarts ran; the next restart was refused
        assert int(box.prop(GATEWAY, "NRestarts")) == burst
    finally:
        set_image(box, live.image)
        box.sh(
            f"systemctl reset-failed {GATEWAY}; systemctl start {GATEWAY}", check=False, timeout=300
        )
