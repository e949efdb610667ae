"""`qwen38-gateway demo` as a new user runs it: tool calls through the SDK, ports already taken."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

import gateway.demo as demo_module
from gateway.demo import DemoEngine, Supervisor, demo_settings
from tests.conftest import free_port, start_sim, wait_until

REPO = Path(__file__).resolve().parent.parent
MODEL = "qwen3.8-27b"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}


def demo_command(port: int, metrics_port: int, *extra: str) -> list[str]:
    """The demo's command line on the given ports, tokens as fast as possible."""
    return [
        sys.executable, "-m", "gateway", "demo",
        "--port", str(port), "--metrics-port", str(metrics_port), "--tokens-per-second", "0",
        *extra,
    ]  # fmt: skip


@dataclass
class Demo:
    """A running demo and the key it printed."""

    proc: subprocess.Popen[str]
    base_url: str
    key: str
    banner: str
    logs: list[str]
    errors: list[str] = field(default_factory=list)

    def access_logs(self) -> list[dict[str, object]]:
        """The gateway's access lines (event ``request``) printed so far."""
        parsed = [json.loads(line) for line in list(self.logs) if line.startswith("{")]
        return [entry for entry in parsed if entry.get("event") == "request"]


@contextlib.contextmanager
def running_demo(*extra: str) -> Iterator[Demo]:
    """The demo started as the README says (with ``extra`` flags), stopped with Ctrl-C
    (SIGINT); its stderr lines collected in `Demo.errors`."""
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen(
        demo_command(port, metrics_port, *extra),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    errors: list[str] = []
    stderr = proc.stderr
    # Kept reading from the start: a full pipe would stall the demo.
    err_reader = threading.Thread(target=lambda: errors.extend(iter(stderr.readline, "")))
    err_reader.daemon = True
    err_reader.start()
    key = None
    banner: list[str] = []
    deadline = time.monotonic() + 90  # a busy 2-core machine starts Python slowly
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        banner.append(line)
        found = re.search(r"(sk-q38-demo-\S+)", line)
        key = key or (found.group(1) if found else None)
        if line.startswith("Press Ctrl-C"):
            break
    if key is None:
        proc.kill()
        proc.wait(5)
        err_reader.join(5)
        proc.stdout.close()
        stderr.close()
        pytest.fail(f"the demo printed no key: {''.join(banner + errors)[-2000:]}")
    base = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=10)
    while True:  # the gateway listens shortly after the banner
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, "the demo gateway did not answer"
            time.sleep(0.1)
    logs: list[str] = []
    # The gateway logs to the demo's stdout: keep reading it, or a full pipe would stall it.
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: logs.extend(iter(stdout.readline, "")))
    reader.daemon = True
    reader.start()
    try:
        yield Demo(proc, base, key, "".join(banner), logs, errors)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        reader.join(5)
        err_reader.join(5)
        stdout.close()
        stderr.close()


@pytest.fixture(scope="module")
def demo() -> Iterator[Demo]:
    """The demo started as the README says, stopped with Ctrl-C (SIGINT)."""
    with running_demo() as started:
        yield started


def client_for(demo: Demo) -> openai.OpenAI:
    """An `openai` client of the demo."""
    return openai.OpenAI(base_url=demo.base_url, api_key=demo.key, max_retries=0, timeout=10)


def test_demo_auto_tool_choice_calls_a_tool(demo: Demo) -> None:
    """tools with tool_choice auto (the SDK's default) get a call of the first tool whose
    arguments are valid JSON for its schema, then a text answer to the tool result."""
    client = client_for(demo)
    messages: list[dict[str, object]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert isinstance(arguments["city"], str) and arguments["unit"] in ("celsius", "fahrenheit")
    assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 7
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content
    assert not second.choices[0].message.tool_calls


def test_demo_required_and_named_tool_choice_stream(demo: Demo) -> None:
    """required calls the first tool, a named choice that tool (finish_reason stop, guided
    JSON), both streamed with arguments that join to valid JSON."""
    client = client_for(demo)
    for choice, name, reason in (
        ("required", "get_weather", "tool_calls"),
        ({"type": "function", "function": {"name": "add"}}, "add", "stop"),
    ):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "go"}],
            tools=[WEATHER, ADD],
            tool_choice=choice,  # type: ignore[arg-type]
            stream=True,
        )
        names, arguments, finish = [], "", None
        for chunk in stream:
            for part in chunk.choices:
                finish = part.finish_reason or finish
                for delta in part.delta.tool_calls or ():
                    if delta.function and delta.function.name:
                        names.append(delta.function.name)
                    arguments += (delta.function and delta.function.arguments) or ""
        assert (names, finish) == ([name], reason)
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.fast
@pytest.mark.parametrize("engines", [1, 2])
def test_demo_keeps_every_file_under_its_own_directory(tmp_path: Path, engines: int) -> None:
    """The demo's sockets, keys file, ledger and quarantine state are all under its directory,
    which it removes on exit (its quarantine state used to go to /var/lib/qwen38 and stay)."""
    settings = demo_settings(tmp_path, "127.0.0.1", 8000, 9400, engines)
    files = [settings.auth.keys_file, settings.ledger.path, settings.quarantine.state_file]
    files += [spec.socket or "" for spec in settings.engine_specs]
    assert all(Path(f).parent == tmp_path for f in files), files


@pytest.mark.parametrize("taken", ["--port", "--metrics-port"])
def test_demo_on_a_taken_port_says_which_flag(taken: str) -> None:
    """A port in use: one line naming the flag to pass, exit 1, no banner, no key, no
    traceback, nothing started."""
    port, metrics_port = free_port(), free_port()
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", port if taken == "--port" else metrics_port))
        busy.listen()
        done = subprocess.run(
            demo_command(port, metrics_port),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and taken in lines[0] and "in use" in lines[0], done.stderr
    assert "sk-q38" not in done.stderr and "Traceback" not in done.stderr


def printed(demo: Demo, starts: str) -> list[str]:
    """The banner's command line starting with ``starts``, as argv, ``qwen38-gateway`` run as
    this checkout's ``python -m gateway``."""
    (line,) = [ln.strip() for ln in demo.banner.splitlines() if ln.strip().startswith(starts)]
    argv = shlex.split(line)
    return [sys.executable, "-m", "gateway", *argv[1:]] if argv[0] == "qwen38-gateway" else argv


def test_demo_prints_commands_that_work_against_itself(demo: Demo) -> None:
    """On ports other than 8000: the printed `keys add --wait` waits on this demo and succeeds,
    the printed curl answers with the key read from a file (never on its command line), and the
    printed `usage report` reads this demo's ledger and names it."""
    added = subprocess.run(
        printed(demo, "qwen38-gateway keys add"), capture_output=True, text=True, timeout=60
    )
    assert added.returncode == 0, added.stderr
    assert f"the gateway at {demo.base_url.removesuffix('/v1')} has loaded it" in added.stderr
    curl_lines = [ln for ln in demo.banner.splitlines() if "curl -N" in ln or "-d '{" in ln]
    assert demo.key not in "".join(curl_lines) and "-H @/" in curl_lines[0]
    curl = "\n".join(ln.strip() for ln in curl_lines).replace("\\\n", " ")
    answered = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
    assert answered.returncode == 0 and "data: [DONE]" in answered.stdout, answered.stderr
    ledger = re.search(r"ledger: +(\S+)", demo.banner)
    assert ledger is not None

    def reported() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            printed(demo, "qwen38-gateway usage report"), capture_output=True, text=True, timeout=60
        )

    deadline = time.monotonic() + 20
    report = reported()
    while "demo" not in report.stdout and time.monotonic() < deadline:
        time.sleep(0.5)
        report = reported()
    assert report.returncode == 0 and "demo" in report.stdout, report.stderr
    assert f"ledger {ledger.group(1)}" in report.stderr


def chat(demo: Demo, extra: dict[str, object], timeout: float = 20.0) -> httpx.Response:
    """A short non-streamed chat completion through the demo, with ``extra`` body fields."""
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(
        demo.base_url + "/chat/completions",
        json={**body, **extra},
        headers={"Authorization": f"Bearer {demo.key}"},
        timeout=timeout,
    )


def serves(demo: Demo) -> bool:
    """An ordinary request gets its answer (200)."""
    try:
        return chat(demo, {}, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def simulator_pids(demo: Demo) -> list[int]:
    """The demo's simulator processes (children running ``engine.sim``), from /proc; zombies
    included."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == demo.proc.pid and b"engine.sim" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def is_zombie(pid: int) -> bool:
    """``pid`` exists and has exited without being reaped."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def restart_lines(demo: Demo) -> list[str]:
    """The demo's lines about a simulator that exited."""
    return [line for line in list(demo.errors) if "engine simulator" in line and "exited" in line]


def test_demo_ignores_a_requests_sim_object(demo: Demo) -> None:
    """Without --faults a client's `sim` object changes nothing: `exit_after` and `hang` get a
    normal answer, the same simulator keeps serving (it used to exit, and every later request
    got 503 until the demo was restarted)."""
    (pid,) = simulator_pids(demo)
    for sim in ({"exit_after": 1}, {"exit_after": 0}, {"hang": True}):
        answer = chat(demo, {"sim": sim})
        assert answer.status_code == 200, (sim, answer.text)
        assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length"), answer.text
    assert serves(demo)
    assert simulator_pids(demo) == [pid] and not restart_lines(demo), demo.errors
    assert "Fault injection: off" in demo.banner


def test_demo_starts_a_killed_simulator_again(demo: Demo) -> None:
    """A simulator that dies is reaped, named in one line on stderr with its exit status and
    started again on its socket; the gateway serves again within 30 s."""
    assert wait_until(lambda: serves(demo), 30)
    (pid,) = simulator_pids(demo)
    before = len(restart_lines(demo))
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: len(restart_lines(demo)) > before, 15), demo.errors
    (line,) = restart_lines(demo)[before:]
    assert f"(pid {pid})" in line and "killed by SIGKILL" in line and "starting it again" in line
    assert wait_until(lambda: serves(demo), 30), demo.errors
    (new_pid,) = simulator_pids(demo)
    assert new_pid != pid and not is_zombie(pid)
    assert len(restart_lines(demo)) == before + 1


def test_demo_with_faults_lets_a_request_crash_the_engine() -> None:
    """With --faults the `sim` object works: `exit_after` crashes the simulator (status 70),
    the demo starts it again, and a later request is answered within 30 s."""
    with running_demo("--faults") as demo:
        assert "Fault injection: on" in demo.banner
        crashed = chat(demo, {"sim": {"exit_after": 1}}, timeout=30)
        assert crashed.status_code != 200, crashed.text
        assert wait_until(lambda: bool(restart_lines(demo)), 15), demo.errors
        assert "(status 70)" in restart_lines(demo)[0]
        assert wait_until(lambda: serves(demo), 30), demo.errors
        assert all(not is_zombie(pid) for pid in simulator_pids(demo))


def test_sim_request_control_off_ignores_the_sim_object(workdir: Path) -> None:
    """`python -m engine.sim --request-control off` answers a body's `sim` object as vLLM
    answers a field it does not know: no 400 for an unknown key, no fault, no other text."""
    sim = start_sim(workdir, "--request-control", "off")
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=sim.socket), timeout=20) as client:
            for control in ({"no_such_key": 1}, {"text": "zzz"}, {"exit_after": 0}):
                answer = client.post(
                    "http://engine/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "sim": control},
                )
                assert answer.status_code == 200, (control, answer.text)
                assert answer.json()["choices"][0]["message"]["content"] != "zzz"
        assert sim.proc.poll() is None
    finally:
        sim.stop()


@pytest.mark.fast
def test_supervisor_gives_up_on_a_simulator_that_keeps_exiting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A simulator that exits at once is started again until its RESTART_LIMIT-th exit within
    the window: then one line says so (with its last word) and the demo is told to stop."""
    monkeypatch.setattr(demo_module, "RESTART_LIMIT", 3)
    monkeypatch.setattr(demo_module, "SUPERVISE_INTERVAL_S", 0.05)
    argv = [sys.executable, "-c", "import sys; sys.exit('cannot start')"]
    engine = DemoEngine("sim0", tmp_path / "sim0.sock", argv, tmp_path / "sim0.log")
    supervisor = Supervisor([engine])
    engine.start()
    gave_up = threading.Event()
    supervisor.watch(gave_up.set)
    try:
        assert gave_up.wait(30)
    finally:
        supervisor.stop()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all("starting it again" in line for line in lines[:2]), lines
    assert '"sim0" exited 3 times within 30 s (last: status 1)' in lines[2]
    assert lines[2].endswith("stopping the demo; it said: cannot start")
    assert supervisor.gave_up and engine.proc is not None and engine.proc.returncode == 1


@pytest.mark.fast
def test_supervisor_stop_is_not_an_exit_to_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopping the supervisor stops its simulators (SIGTERM, reaped) without starting any
    again or reporting them."""
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    engine = DemoEngine("sim0", tmp_path / "sim0.sock", argv, tmp_path / "sim0.log")
    supervisor = Supervisor([engine])
    proc = engine.start()
    supervisor.watch(lambda: None)
    started = time.monotonic()
    supervisor.stop()
    assert time.monotonic() - started < 10
    assert proc.returncode == -signal.SIGTERM and engine.proc is proc
    assert capsys.readouterr().err == "" and not supervisor.gave_up
