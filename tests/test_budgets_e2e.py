"""C26: budgets hold against any body. Concurrent requests of adversarial shapes (tool schemas of
empty arrays and objects, deep nesting, punctuation and characters that escape, long names, many
tools, system blocks, tool-call history) in every dialect never charge a tenant more than its
quota or ``tpm`` plus one request's worth, against the simulator (whose prompt count is the
rendered template's) and against real vLLM (whose template renders tools as JSON). Real gateway,
real engines; the charge is read back from ``/v1/usage`` and the access lines.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from gateway.rewrite import estimate_prompt_tokens
from tests.conftest import Gateway, _stop, start_gateway, wait_until
from tests.realengine.launcher import MAX_MODEL_LEN, LaunchedEngine

MODEL = "qwen3.8-27b"
DIALECTS = ("chat", "completions", "responses", "messages")
ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")
KEYS = {
    f"K_{name}": (f"t_{name}", f"sk-q38-budget{name[:4]}{'Z' * 28}") for name in (*DIALECTS, "tpm")
}


def secret(tenant: str) -> str:
    return next(s for t, s in KEYS.values() if t == tenant)


def headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret(tenant)}", "x-api-key": secret(tenant)}


def schema(arrays: int) -> dict[str, Any]:
    """A JSON schema holding ``arrays`` empty arrays, empty objects and punctuation."""
    return {
        "type": "object",
        "properties": {"x": {"type": "array", "description": "<&>'\"" * 8}},
        "x-pad": [[] for _ in range(arrays)] + [{} for _ in range(arrays // 4)],
        "x-deep": json.loads("[" * 60 + "]" * 60),
    }


def bodies(dialect: str, arrays: int) -> list[dict[str, Any]]:
    """Adversarial bodies of one dialect (each a different shape, all heavy in the template)."""
    unicode = "é\u0301😀한\u0344" * (arrays // 20)
    if dialect == "chat":
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema(arrays)}}]
        many = [
            {"type": "function", "function": {"name": "n" * 60 + str(i), "parameters": {}}}
            for i in range(arrays // 40)
        ]
        base = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        system = {"role": "system", "content": [{"type": "text", "text": "{}[]"}] * 50}
        return [
            {**base, "tools": tools},
            {**base, "tools": many},
            {**base, "messages": [system, *base["messages"]], "tools": tools[:1]},
            {
                **base,
                "tools": [{"type": "function", "function": {"name": "u", "description": unicode}}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "object"}},
                },
            },
        ]
    if dialect == "completions":
        return [{"model": MODEL, "max_tokens": 8, "prompt": ("😀<&>" + unicode) * 4}]
    if dialect == "responses":
        return [
            {
                "model": MODEL,
                "max_output_tokens": 16,
                "instructions": "{}[]" * 20,
                "input": "hi",
                "tools": [{"type": "function", "name": "f", "parameters": schema(arrays)}],
            }
        ]
    return [
        {
            "model": MODEL,
            "max_tokens": 8,
            "system": [{"type": "text", "text": "[]{}<>"}, {"type": "text", "text": unicode}],
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": schema(arrays)}],
        }
    ]


async def fire(gw: Gateway, tenant: str, dialect: str, payloads: list[dict[str, Any]]) -> list[int]:
    """Send all payloads at once; their statuses."""
    async with httpx.AsyncClient(timeout=120) as client:
        answers = await asyncio.gather(
            *(
                client.post(gw.url(ROUTES[dialect]), headers=headers(tenant), json=body)
                for body in payloads
            )
        )
    return [a.status_code for a in answers]


def charges(gw: Gateway, tenant: str) -> list[int]:
    """Prompt plus completion tokens charged to each request of ``tenant`` (access lines)."""
    return [
        int(e.get("prompt_tokens") or 0) + int(e.get("completion_tokens") or 0)
        for e in gw.access_logs()
        if e.get("tenant") == tenant and e.get("route") in ROUTES.values()
    ]


def used_today(gw: Gateway, tenant: str) -> int:
    answer = httpx.get(gw.url("/v1/usage"), headers=headers(tenant), timeout=10).json()
    return int(answer["quota"]["tokens_per_day"]["used"])


def budget_gateway(workdir: Any, socket: str, quota: int, tpm: int, **engine: Any) -> Gateway:
    tenants: dict[str, Any] = {f"t_{d}": {"tokens_per_day": quota} for d in DIALECTS}
    tenants["t_tpm"] = {"tpm": tpm}
    config = {"engine": {"socket": socket, **engine}, "tenants": tenants}
    return start_gateway(workdir, None, config, keys=KEYS)


def check_dialects(gw: Gateway, quota: int, arrays: int, copies: int) -> dict[str, list[int]]:
    """Fire ``copies`` of each dialect's adversarial bodies at once per tenant; assert the
    quota arithmetic; return the statuses."""
    statuses: dict[str, list[int]] = {}
    for dialect in DIALECTS:
        tenant = f"t_{dialect}"
        payloads = bodies(dialect, arrays) * copies
        statuses[dialect] = asyncio.run(fire(gw, tenant, dialect, payloads))
        assert set(statuses[dialect]) <= {200, 429}, statuses[dialect]
        expected = len(payloads)
        assert wait_until(lambda: len(charges(gw, tenant)) == expected, 10)  # noqa: B023
        charged = charges(gw, tenant)
        total = sum(charged)
        # Σ charged <= quota + one request's worth (the arithmetic in gateway/README.md).
        assert wait_until(lambda: used_today(gw, tenant) == total, 10)  # noqa: B023
        assert sum(charged) <= quota + max(charged), (dialect, sum(charged), charged)
    assert gw.metric("gateway_prompt_ceiling_exceeded_total") == 0
    return statuses


def test_c26_empty_arrays_never_pass_a_small_quota(
    workdir: Any, sim_factory: Any, gateway_factory: Any
) -> None:
    """C26 as reported: 20 concurrent chat requests whose tool schema is 20,000 empty arrays
    against a 2,000-token daily quota are all refused (the engine counts 60,000 tokens each
    here), nothing is charged; the old estimate was 28 tokens."""
    sim = sim_factory(*TOOL_FLAGS)
    gw = gateway_factory(
        sim,
        {"tenants": {"t_chat": {"tokens_per_day": 2000}}},
        keys=KEYS,
    )
    body = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"x": [[] for _ in range(20_000)]}},
            }
        ],
    }
    assert estimate_prompt_tokens(body, "chat") < 40
    statuses = asyncio.run(fire(gw, "t_chat", "chat", [body] * 20))
    assert statuses == [429] * 20
    assert used_today(gw, "t_chat") == 0
    # The ceiling refused; the engine's exact count was asked (when it answers within its
    # time limit on a busy machine) and refused too.
    asked = [e for e in gw.logs() if e.get("event") == "prompt_counted"]
    assert len(asked) == 20
    assert gw.metric("gateway_prompt_counts_total") == sum(1 for e in asked if e["count"])


def test_adversarial_bodies_hold_quota_and_tpm_on_the_simulator(
    workdir: Any, sim_factory: Any
) -> None:
    """Every dialect: concurrent adversarial bodies charge at most the daily quota plus one
    request, some pass (after the engine's exact count when the ceiling does not fit), each
    costing far more than the old estimate; tpm holds the same way."""
    sim = sim_factory("--max-model-len", "65536", *TOOL_FLAGS)
    quota, arrays = 30_000, 2_000
    gw = budget_gateway(workdir, sim.socket, quota, tpm=20_000, max_model_len=65536)
    try:
        statuses = check_dialects(gw, quota, arrays, copies=5)
        assert statuses["chat"].count(200) >= 2
        assert gw.metric("gateway_prompt_counts_total") > 0
        biggest = max(charges(gw, "t_chat"))
        assert biggest > 10 * estimate_prompt_tokens(bodies("chat", arrays)[0], "chat")
        # tpm: the same bodies within one minute's bucket (it drains tpm/60 per second).
        started = time.monotonic()
        payloads = bodies("chat", arrays) * 4
        tpm_statuses = asyncio.run(fire(gw, "t_tpm", "chat", payloads))
        assert wait_until(lambda: len(charges(gw, "t_tpm")) == len(payloads), 10)
        elapsed = time.monotonic() - started
        charged = charges(gw, "t_tpm")
        assert 200 in tpm_statuses and 429 in tpm_statuses
        assert sum(charged) <= 20_000 * (1 + elapsed / 60) + max(charged)
    finally:
        _stop(gw.proc)


@pytest.mark.timeout(600)  # the first real-engine test of a run starts vLLM (minutes when busy)
def test_adversarial_bodies_hold_quota_on_both_engines(
    engine: LaunchedEngine, workdir: Any
) -> None:
    """Against real vLLM (tiny model, tools rendered as JSON) and the simulator: concurrent
    adversarial bodies of every dialect charge at most the quota plus one request, and the
    engine never counts more than the reserved ceiling."""
    quota, arrays = 12_000, 600
    gw = budget_gateway(
        workdir,
        engine.socket,
        quota,
        tpm=10**9,
        ready_file=engine.ready_file,
        max_model_len=MAX_MODEL_LEN,
        health_interval_s=2.0,
    )
    try:
        statuses = check_dialects(gw, quota, arrays, copies=2)
        assert any(s.count(200) for s in statuses.values())
    finally:
        _stop(gw.proc)
