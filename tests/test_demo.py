"""`qwen38-gateway demo` as a new user runs it: tool calls through the SDK, ports already taken."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

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


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
    deadline = time.monotonic() + 30
    while key is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        found = re.search(r"(sk-q38-demo-\S+)", line)
        key = found.group(1) if found else None
    assert key, "the demo printed no key"
    base = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=10)
    while True:  # the gateway listens shortly after the banner
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, "the demo gateway did not answer"
            time.sleep(0.1)
    yield Demo(proc, base, key)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
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
