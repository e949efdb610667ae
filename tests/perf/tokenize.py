"""What the prompt ceiling and the engine's exact count cost: ``python -m tests.perf.tokenize``.

For chat bodies of several shapes and sizes, prints the gateway's prompt ceiling
(`gateway.ceiling.chat_ceiling`) and its CPU time, and the engine's ``POST /tokenize`` (chat
form, messages and tools, as `gateway.upstream.Upstream.count_prompt` sends it): its count and
its round trip, median of ``--repeat`` calls, against the simulator and, with ``--real``, real
vLLM (CPU build, the tiny model of `tests.realengine.model`; ``QWEN38_REAL_ENGINE_PYTHON`` or
``.engine-venv``). The engine is idle while it is measured. Results: ``gateway/README.md``,
"The prompt ceiling".
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.ceiling import chat_ceiling
from tests.realengine.launcher import engine_python, launch

MODEL = "qwen3.8-27b"


def shapes(scale: int) -> dict[str, dict[str, Any]]:
    """Chat bodies (engine shape) whose template is ``scale`` times heavier each step."""
    words = "The quick brown fox jumps over the lazy dog. " * (20 * scale)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city, now or as a forecast.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name."}},
                "required": ["city"],
            },
        },
    }
    arrays = {
        "type": "function",
        "function": {"name": "f", "parameters": {"x": [[] for _ in range(200 * scale)]}},
    }
    base = {"model": MODEL, "chat_template_kwargs": {"enable_thinking": False}}
    return {
        f"text x{scale}": {**base, "messages": [{"role": "user", "content": words}]},
        f"tools x{scale}": {
            **base,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool] * (4 * scale),
        },
        f"empty arrays x{scale}": {
            **base,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [arrays],
        },
    }


def tokenize(socket: str, body: dict[str, Any], repeat: int) -> tuple[int, float]:
    """The engine's count and the median round trip (seconds) of ``/tokenize``."""
    ask = {**body, "add_generation_prompt": True}
    transport = httpx.HTTPTransport(uds=socket)
    times: list[float] = []
    count = -1
    with httpx.Client(transport=transport, base_url="http://engine", timeout=60) as client:
        for _ in range(repeat):
            started = time.perf_counter()
            answer = client.post("/tokenize", json=ask)
            times.append(time.perf_counter() - started)
            answer.raise_for_status()
            count = int(answer.json()["count"])
    return count, statistics.median(times)


def ceiling_cost(body: dict[str, Any], repeat: int) -> tuple[int, float]:
    """The ceiling and the median CPU seconds to compute it."""
    times = []
    value = 0
    for _ in range(repeat):
        started = time.process_time()
        value = chat_ceiling(body)
        times.append(time.process_time() - started)
    return value, statistics.median(times)


def measure(kind: str, repeat: int, scales: list[int]) -> list[str]:
    """Rows for one engine kind (``sim`` or ``real``)."""
    workdir = Path(tempfile.mkdtemp(prefix="q38tok-", dir="/tmp"))
    rows = []
    try:
        python = engine_python() if kind == "real" else None
        engine = launch(kind, workdir, python, max_model_len=65536)  # type: ignore[arg-type]
        try:
            for scale in scales:
                for name, body in shapes(scale).items():
                    size = len(json.dumps(body))
                    ceiling, cpu = ceiling_cost(body, repeat)
                    count, rtt = tokenize(engine.socket, body, repeat)
                    rows.append(
                        f"| {kind} | {name} | {size:,} | {count:,} | {ceiling:,} | "
                        f"{ceiling / max(count, 1):.1f} | {cpu * 1000:.2f} | {rtt * 1000:.1f} |"
                    )
        finally:
            engine.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--real", action="store_true", help="also measure real vLLM")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--scales", type=int, nargs="*", default=[1, 10, 50])
    args = parser.parse_args()
    print(
        "| engine | body | JSON bytes | engine count | ceiling | ceiling / count | "
        "ceiling CPU ms | /tokenize ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in ("sim", "real") if args.real else ("sim",):
        for row in measure(kind, args.repeat, args.scales):
            print(row, flush=True)


if __name__ == "__main__":
    main()
