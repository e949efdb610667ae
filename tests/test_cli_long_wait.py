"""Claude Code and Codex CLI each finish a turn whose first request waits more than 330 s in the
gateway's queue behind another tenant's request, each request sent once: the clients' idle
timers (300 s without an event in both) never fire, because the waiting stream carries the
API's own events (`gateway.waiting`).

Each test waits about 6 minutes, most of it idle; they run side by side (one xdist group each).
``QWEN38_LONG_WAIT_S`` changes the wait (the 20-minute trial in tests/README.md).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import KEY_B, Gateway, wait_until
from tests.test_cli_clients import MARK, find, run_claude, run_codex

WAIT_S = float(os.environ.get("QWEN38_LONG_WAIT_S", "345"))
HOLD = "hold the engine"

pytestmark = pytest.mark.slow(400)


def long_stack(
    sim_factory: Callable[..., Any], gateway_factory: Callable[..., Gateway], tool_call: str
) -> Gateway:
    """The simulator answering one tool round trip, and a gateway with the shipped queue and
    keep-alive settings."""
    sim = sim_factory(
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "qwen3_coder",
        "--completion-tokens",
        "12",
        "--tool-call",
        tool_call,
    )
    # The holder's silent prefill must not reach the engine's read timeout (900 s).
    engine = {"read_timeout_s": max(900.0, WAIT_S + 120)}
    return gateway_factory(sim, {"model": {"accepted": ["*"]}, "engine": engine})


def hold(gw: Gateway, seconds: float) -> threading.Thread:
    """Another tenant's stream holds the engine's one slot for ``seconds`` (a long prefill)."""
    body = {
        "messages": [{"role": "user", "content": HOLD}],
        "stream": True,
        "sim": {"prefill_ms": seconds * 1000, "completion_tokens": 2},
    }

    def run() -> None:
        gw.read_through(KEY_B, body, 120)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert wait_until(lambda: gw.metric("gateway_requests_in_flight", tenant="beta") == 1, 10)
    return thread


def client_records(gw: Gateway) -> list[dict[str, Any]]:
    """The engine's requests other than the holder's."""
    assert gw.sim is not None
    return [
        r
        for r in gw.sim.model_records()
        if r["path"] == "/v1/chat/completions" and HOLD not in json.dumps(r["body"]["messages"])
    ]


def check_one_turn(gw: Gateway, route: str, started: float) -> None:
    """Two requests (the tool call, then the answer), each sent once and generated once, the
    first after a wait of at least 330 s."""
    records = client_records(gw)
    assert [r["outcome"] for r in records] == ["finished", "finished"]
    waited = records[0]["received_at"] - started
    print(f"{route}: the first request reached the engine after {waited:.0f} s")
    assert waited >= WAIT_S - 15
    lines = [e for e in gw.access_logs() if e.get("route") == route]
    assert [e["status"] for e in lines] == [200, 200], lines
    assert lines[0]["duration_ms"] >= (WAIT_S - 15) * 1000
    assert gw.metric("gateway_client_disconnects_total") == 0


@pytest.mark.xdist_group("long-wait-claude")
@pytest.mark.timeout(WAIT_S + 300)
def test_claude_code_survives_a_long_queue_wait_sending_once(
    sim_factory: Any, gateway_factory: Any, workdir: Path
) -> None:
    """`claude -p` waits > 330 s behind another tenant, then finishes its turn; its request
    reached the gateway and the engine once (no resend, no non-streaming fallback)."""
    binary = find("claude")
    if binary is None:
        pytest.skip("Claude Code not installed (npm install @anthropic-ai/claude-code)")
    gw = long_stack(
        sim_factory,
        gateway_factory,
        f'Bash {{"command": "echo {MARK}", "description": "Print a greeting"}}',
    )
    holder = hold(gw, WAIT_S)
    started = time.time()
    run = run_claude(binary, gw, workdir, f"Run echo {MARK}", timeout=WAIT_S + 240)
    holder.join(60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert '"subtype":"success"' in run.stdout and '"num_turns":2' in run.stdout
    check_one_turn(gw, "/v1/messages", started)


@pytest.mark.xdist_group("long-wait-codex")
@pytest.mark.timeout(WAIT_S + 300)
def test_codex_survives_a_long_queue_wait_sending_once(
    sim_factory: Any, gateway_factory: Any, workdir: Path
) -> None:
    """`codex exec` waits > 330 s behind another tenant, then finishes its turn; its request
    reached the gateway and the engine once (no "Reconnecting...")."""
    binary = find("codex")
    if binary is None:
        pytest.skip("Codex CLI not installed (npm install @openai/codex)")
    gw = long_stack(sim_factory, gateway_factory, f'exec_command {{"cmd": "echo {MARK}"}}')
    holder = hold(gw, WAIT_S)
    started = time.time()
    run = run_codex(binary, gw, workdir, f"Run echo {MARK}", timeout=WAIT_S + 240)
    holder.join(60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Reconnecting" not in run.stderr
    check_one_turn(gw, "/v1/responses", started)
