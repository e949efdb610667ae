"""Two real vLLM engines behind one gateway: session affinity keeps the prefix cache warm.

Each engine is the CPU build serving the tiny model under the launcher (about 3 GiB each, 25-60 s
to start). Three agent sessions, each with its own long system prompt, send four turns each, one
request at a time, round robin over the sessions, with their ``prompt_cache_key``. Measured from
the engines' own counters (``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``,
prompt tokens found in / looked up in the prefix cache), summed over both engines, once with
``[engine] affinity = true`` and once with ``false`` (each run with prompts of its own).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ALIAS, KEY_A, Gateway, _stop, start_gateway
from tests.realengine.fixtures import real_engine_skipped
from tests.realengine.launcher import (
    MAX_MODEL_LEN,
    PYTHON_ENV,
    SKIP_ENV,
    EngineUnavailable,
    LaunchedEngine,
    check_engine_python,
    engine_python,
    launch,
)

pytestmark = pytest.mark.real_engine

SESSIONS, TURNS = 3, 4
SYSTEM_WORDS, USER_WORDS = 600, 30


@pytest.fixture(scope="module")
def two_engines() -> Iterator[list[LaunchedEngine]]:
    """Two real vLLM engines under their launchers, each in its own directory."""
    if real_engine_skipped():
        pytest.skip(f"real engine not run: {SKIP_ENV} is set")
    python = engine_python()
    try:
        check_engine_python(python)
    except EngineUnavailable as exc:
        pytest.fail(f"real engine unavailable ({PYTHON_ENV}): {exc}", pytrace=False)
    dirs = [Path(tempfile.mkdtemp(prefix=f"q38r{i}-", dir="/tmp")) for i in range(2)]
    engines: list[LaunchedEngine] = []
    try:
        # Both start at once: each takes 25-60 s (minutes on a busy machine).
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(launch, "real", path, python) for path in dirs]
            for future in futures:
                with contextlib.suppress(RuntimeError):
                    engines.append(future.result())
        if len(engines) < 2:
            pytest.fail("a real engine did not start (see its launcher log)", pytrace=False)
        yield engines
    finally:
        for engine in engines:
            engine.stop()
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def gateway(engines: list[LaunchedEngine], affinity: bool) -> Iterator[Gateway]:
    workdir = Path(tempfile.mkdtemp(prefix="q38rg-", dir="/tmp"))
    config: dict[str, Any] = {
        "engine": {
            "max_model_len": MAX_MODEL_LEN,
            "health_interval_s": 2.0,  # real vLLM's /health is slow while it works
            "affinity": affinity,
        },
        "engines": [
            {"name": f"e{i}", "socket": e.socket, "ready_file": e.ready_file}
            for i, e in enumerate(engines)
        ],
    }
    gw = start_gateway(workdir, None, config)
    try:
        yield gw
    finally:
        _stop(gw.proc)
        shutil.rmtree(workdir, ignore_errors=True)


def prefix_counters(engines: list[LaunchedEngine]) -> tuple[float, float]:
    """(hits, queries) in tokens, summed over the engines."""
    hits = queries = 0.0
    for engine in engines:
        for family in text_string_to_metric_families(engine.metrics_text()):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


def run_sessions(gw: Gateway, run: str) -> list[str]:
    """SESSIONS sessions x TURNS turns, round robin, one request at a time; returns the engine
    of each turn (from the gateway's per-engine request counters around it)."""
    words = [secrets.token_hex(3) for _ in range(64)]
    sessions = []
    for s in range(SESSIONS):
        system = " ".join(
            words[(s * 7 + i) % len(words)] + f"{run}{s}" for i in range(SYSTEM_WORDS)
        )
        sessions.append([{"role": "system", "content": system}])
    served: list[str] = []
    for turn in range(TURNS):
        for s, messages in enumerate(sessions):
            messages.append({"role": "user", "content": " ".join(words[:USER_WORDS]) + f" {turn}"})
            before = {e: gw.metric("gateway_engine_requests_total", engine=e) for e in ("e0", "e1")}
            answer = httpx.post(
                gw.url("/v1/chat/completions"),
                headers={"Authorization": f"Bearer {KEY_A}"},
                json={
                    "model": ALIAS,
                    "messages": messages,
                    "max_tokens": 8,
                    "prompt_cache_key": f"{run}-{s}",
                    "chat_template_kwargs": {"enable_thinking": False},
                },
                timeout=300,
            )
            assert answer.status_code == 200, answer.text
            content = answer.json()["choices"][0]["message"].get("content") or "ok"
            messages.append({"role": "assistant", "content": content})
            after = {e: gw.metric("gateway_engine_requests_total", engine=e) for e in before}
            served += [e for e in before if after[e] > before[e]]
    return served


@pytest.mark.timeout(900)  # two real engines start first (minutes on a busy machine)
def test_affinity_keeps_each_session_on_the_engine_that_caches_its_prefix(
    two_engines: list[LaunchedEngine],
) -> None:
    """With affinity the turns after a session's first find its prompt in the prefix cache of
    the engine they reach; without it about half land on the cold engine (printed numbers)."""
    figures = {}
    for affinity in (True, False):
        with gateway(two_engines, affinity) as gw:
            hits0, queries0 = prefix_counters(two_engines)
            served = run_sessions(gw, "on" if affinity else "off")
            hits1, queries1 = prefix_counters(two_engines)
        hits, queries = hits1 - hits0, queries1 - queries0
        moves = sum(served[i] != served[i - SESSIONS] for i in range(SESSIONS, len(served)))
        figures[affinity] = (hits, queries, moves)
        print(
            f"affinity={affinity}: prefix cache hits {hits:.0f} of {queries:.0f} prompt tokens "
            f"({hits / max(queries, 1):.1%}); turns moved to the other engine: {moves} of "
            f"{len(served) - SESSIONS}"
        )
    on_hits, on_queries, on_moves = figures[True]
    off_hits, off_queries, off_moves = figures[False]
    assert on_moves == 0
    assert off_moves >= (TURNS - 1) * SESSIONS // 3
    assert on_hits / on_queries > off_hits / off_queries + 0.15
