"""`qwen38-gateway demo` as a new user runs it: tool calls through the SDK, ports already taken."""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from gateway.demo import demo_settings
from tests.conftest import free_port

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


def demo_command(port: int, metrics_port: int) -> list[str]:
    """The demo's command line on the given ports, tokens as fast as possible."""
    return [
        sys.executable, "-m", "gateway", "demo",
        "--port", str(port), "--metrics-port", str(metrics_port), "--tokens-per-second", "0",
    ]  # fmt: skip


@dataclass
class Demo:
    """A running demo and the key it printed."""

    proc: subprocess.Popen[str]
    base_url: str
    key: str
    banner: str
    logs: list[str]

    def access_logs(self) -> list[dict[str, object]]:
        """The gateway's access lines (event ``request``) printed so far."""
        parsed = [json.loads(line) for line in list(self.logs) if line.startswith("{")]
        return [entry for entry in parsed if entry.get("event") == "request"]


@pytest.fixture(scope="module")
def demo() -> Iterator[Demo]:
    """The demo started as the README says, stopped with Ctrl-C (SIGINT)."""
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen(
        demo_command(port, metrics_port),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
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
        proc.stdout.close()
        pytest.fail(f"the demo printed no key: {''.join(banner)[-2000:]}")
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
    reader = threading.Thread(target=lambda: logs.extend(iter(proc.stdout.readline, "")))
    reader.daemon = True
    reader.start()
    yield Demo(proc, base, key, "".join(banner), logs)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    reader.join(5)
    proc.stdout.close()


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
