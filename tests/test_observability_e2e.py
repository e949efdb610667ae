"""Observability against real processes: token counts, label bounds, the joint scrape, logs.

One simulator and one gateway (tenants acme, beta, tight configured; carol and JWT subjects
unconfigured) serve the module; tests that need their own engine or config start their own.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http
import json
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import jwt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sim.tokens import chat_prompt_tokens, text_tokens
from engine.status import StatusFile
from gateway.exposition import label_engine
from gateway.metrics import (
    AUTH_FAILURE_REASONS,
    DEADLINE_REASONS,
    DIALECTS,
    FORECAST_DIRECTIONS,
    FORECAST_PHASES,
    RATE_LIMITS,
    RATELIMIT_BACKENDS,
    RELOAD_RESULTS,
    TOKEN_TYPES,
    UPSTREAM_ERROR_KINDS,
)
from gateway.retries import MATCHES, OUTCOMES
from tests import test_prometheus_rules as deploy_rules
from tests.conftest import (
    ALIAS,
    DEFAULT_KEYS,
    KEY_A,
    KEY_B,
    KEY_C,
    Gateway,
    Sim,
    _stop,
    free_port,
    running_stack,
    start_gateway,
    wait_until,
    write_keys,
)

KEY_T = "sk-q38-testTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTT"
JWT_SECRET = b"obs-signing-secret-0123456789abcdef-XYZ"
JWT_SECRET_TEXT = base64.urlsafe_b64encode(JWT_SECRET).rstrip(b"=").decode()
METRICS_TOKEN = "obs-metrics-token-Zq9u2Lw8Xv4Rk7Tn3Ms6"
MODULE_KEYS = {**DEFAULT_KEYS, "KEY_T": ("tight", KEY_T)}
# DESIGN section 5: the routes; section 7: configured tenants plus `unknown` (and `default`).
ROUTE_LABELS = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/models/{id}",
    "/health",
    "/ready",
    "other",
}
TENANT_LABELS = {"acme", "beta", "tight", "default", "unknown"}
HTTP_CODES = {str(int(status)) for status in http.HTTPStatus} | {"499"}
ACCESS_FIELDS = {
    "engine_request_id",
    "event",
    "level",
    "logger",
    "timestamp",
    "request_id",
    "method",
    "route",
    "status",
    "tenant",
    "duration_ms",
    "key_id",
    "stream",
    "thinking",
    "ttft_ms",
    "prompt_tokens",
    "completion_tokens",
    "reason",
}
# Every string a test of this module sends as a credential, for the secret scan at the end.
SENT_SECRETS: set[str] = {KEY_A, KEY_B, KEY_C, KEY_T, JWT_SECRET_TEXT}


def token_for(sub: str, secret: bytes = JWT_SECRET, kid: str = "obs") -> str:
    """An HS256 JWT for tenant ``sub``, valid for ten minutes."""
    now = int(time.time())
    token = jwt.encode(
        {"sub": sub, "iat": now, "exp": now + 600}, secret, algorithm="HS256", headers={"kid": kid}
    )
    SENT_SECRETS.add(token)
    return token


@pytest.fixture(scope="module")
def obs() -> Iterator[Gateway]:
    """Simulator + gateway; keys for acme, beta, carol, tight (1 request a minute) and a JWT key;
    a launcher status file as `qwen38-engine serve` writes it."""
    status_dir = Path(tempfile.mkdtemp(prefix="q38s-", dir="/tmp"))
    status = status_dir / "engine.status.json"
    StatusFile(str(status), 1800).update(state="ready")
    try:
        with running_stack(
            {"tenants": {"tight": {"rpm": 1}}, "engine": {"launcher_status_file": str(status)}},
            keys=MODULE_KEYS,
            keys_extra=f"JWT_obs=hs256:{JWT_SECRET_TEXT}\n",
        ) as gw:
            yield gw
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------ helpers


def scrape(gw: Gateway, token: str | None = None) -> httpx.Response:
    """GET the metrics listener, with a bearer token when given."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(gw.metrics_url, headers=headers, timeout=10)


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of every sample of an exposition text."""
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        value
        for sample, got, value in samples(text)
        if sample == name and all(got.get(k) == v for k, v in labels.items())
    )


def type_lines(text: str) -> list[tuple[str, str]]:
    """(family, type) of every ``# TYPE`` line, in order."""
    return re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE)


def tokens(gw: Gateway) -> dict[tuple[str, str], float]:
    """``gateway_tokens_total`` by (tenant, type)."""
    out: dict[tuple[str, str], float] = {}
    for name, labels, value in samples(scrape(gw).text):
        if name == "gateway_tokens_total":
            out[(labels["tenant"], labels["type"])] = value
    return out


def delta(
    after: dict[tuple[str, str], float], before: dict[tuple[str, str], float]
) -> dict[tuple[str, str], float]:
    """Per-key difference, zero entries dropped."""
    keys = set(after) | set(before)
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}
    return {k: v for k, v in diff.items() if v}


def chat_body(sim: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A chat request for the alias, with per-request simulator behaviour."""
    out: dict[str, Any] = {"model": ALIAS, "messages": [{"role": "user", "content": "hello"}]}
    if sim:
        out["sim"] = sim
    out.update(extra)
    return out


def post(
    gw: Gateway, path: str, body: dict[str, Any], key: str = KEY_A, request_id: str | None = None
) -> tuple[httpx.Response, list[dict[str, Any]]]:
    """POST a model request; returns the response and, for streams, its JSON data events."""
    headers = {"Authorization": f"Bearer {key}"}
    if request_id:
        headers["X-Request-Id"] = request_id
    r = httpx.post(gw.url(path), json=body, headers=headers, timeout=60)
    events = []
    if body.get("stream"):
        for line in r.text.replace("\r\n", "\n").split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return r, events


def engine_usage(sim: Sim, request_id: str) -> tuple[int, int]:
    """(prompt, completion) tokens the engine reported for the request with ``request_id``.

    From the simulator's record: completion = tokens it sent (what its usage reports),
    prompt = its token rule applied to the body it received (engine.sim.tokens).
    """
    for record in sim.model_records():
        headers = {k.lower(): v for k, v in record["headers"].items()}
        engine_id = headers.get("x-request-id") or ""
        if engine_id != request_id and not engine_id.startswith(request_id + "-"):
            continue
        body = record["body"]
        if record["path"] == "/v1/chat/completions":
            prompt = chat_prompt_tokens(body["messages"])
        else:
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            prompt = sum(text_tokens(p) for p in prompts)
        return prompt, record["tokens_sent"]
    raise AssertionError(f"no engine record for {request_id}")


def access_line(gw: Gateway, request_id: str) -> dict[str, Any]:
    """The access line of request ``request_id`` (waits up to 3 s for it)."""
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        found[:] = [e for e in gw.access_logs() if e.get("request_id") == request_id]
        return bool(found)

    assert wait_until(seen, 3), request_id
    assert len(found) == 1, found
    return found[0]


# ------------------------------------------------------------------------- token accounting


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_tokens_of_a_stream_equal_its_usage_chunk(obs: Gateway, path: str) -> None:
    """A stream that asked for usage adds exactly the usage chunk's numbers to the tenant."""
    body: dict[str, Any] = {
        "model": ALIAS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "sim": {"completion_tokens": 23},
    }
    if path == "/v1/completions":
        body["prompt"] = "Once upon a time in a quiet village"
    else:
        body["messages"] = [{"role": "user", "content": "Tell me a story."}]
    before = tokens(obs)
    r, events = post(obs, path, body, key=KEY_B)
    assert r.status_code == 200
    usage = events[-1]["usage"]
    assert delta(tokens(obs), before) == {
        ("beta", "prompt"): usage["prompt_tokens"],
        ("beta", "completion"): usage["completion_tokens"],
    }


def test_tokens_of_a_stream_without_usage_equal_the_engine_usage(obs: Gateway) -> None:
    """A stream that did not ask for usage gets none, yet is counted exactly as the engine said."""
    assert obs.sim is not None
    before = tokens(obs)
    r, events = post(
        obs,
        "/v1/chat/completions",
        chat_body({"completion_tokens": 41}, stream=True),
        key=KEY_B,
        request_id="obs-nousage-1",
    )
    assert r.status_code == 200
    assert all("usage" not in e for e in events)
    prompt, completion = engine_usage(obs.sim, "obs-nousage-1")
    assert completion == 41
    assert delta(tokens(obs), before) == {
        ("beta", "prompt"): prompt,
        ("beta", "completion"): completion,
    }


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_tokens_of_a_non_stream_equal_its_usage(obs: Gateway, path: str) -> None:
    """A non-streaming answer adds exactly its ``usage`` to the tenant's counters."""
    body: dict[str, Any] = {"model": ALIAS, "sim": {"completion_tokens": 17}}
    if path == "/v1/completions":
        body["prompt"] = "Count to ten:"
    else:
        body["messages"] = [{"role": "user", "content": "Count to ten, slowly."}]
    before = tokens(obs)
    r, _ = post(obs, path, body, key=KEY_B)
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert delta(tokens(obs), before) == {
        ("beta", "prompt"): usage["prompt_tokens"],
        ("beta", "completion"): usage["completion_tokens"],
    }


@pytest.mark.parametrize("stream", [True, False])
def test_tokens_of_several_choices_equal_the_usage(obs: Gateway, stream: bool) -> None:
    """With n=3 the tenant is charged the usage of all three choices, streaming or not."""
    extra: dict[str, Any] = {"n": 3}
    if stream:
        extra.update(stream=True, stream_options={"include_usage": True})
    before = tokens(obs)
    r, events = post(obs, "/v1/chat/completions", chat_body({"completion_tokens": 9}, **extra))
    assert r.status_code == 200
    usage = events[-1]["usage"] if stream else r.json()["usage"]
    assert usage["completion_tokens"] == 27
    assert delta(tokens(obs), before) == {
        ("acme", "prompt"): usage["prompt_tokens"],
        ("acme", "completion"): usage["completion_tokens"],
    }


def test_tokens_of_concurrent_mixed_traffic_match_engine_usage_per_tenant(obs: Gateway) -> None:
    """Concurrent streams and non-streams of four tenants: each tenant gets exactly its usage;
    the engine's counters agree (its prompt counter counts the prompt once per choice, as
    vLLM's does)."""
    assert obs.sim is not None
    rng = random.Random(6)
    credentials = {
        "acme": KEY_A,
        "beta": KEY_B,
        "default": KEY_C,
        "jwt": token_for("obs-subject-x"),
    }
    plan = []
    for i in range(24):
        label = rng.choice(list(credentials))
        path = rng.choice(["/v1/chat/completions", "/v1/completions"])
        body: dict[str, Any] = {
            "model": ALIAS,
            "stream": rng.random() < 0.6,
            "n": rng.choice([1, 1, 2]),
            "sim": {"completion_tokens": rng.randint(1, 40)},
        }
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if path == "/v1/completions":
            body["prompt"] = "word " * rng.randint(1, 60)
        else:
            body["messages"] = [{"role": "user", "content": "word " * rng.randint(1, 60)}]
        plan.append((f"obs-mix-{i}", label, path, body))
    engine_before = scrape(obs).text
    before = tokens(obs)

    def send(item: tuple[str, str, str, dict[str, Any]]) -> int:
        rid, label, path, body = item
        return post(obs, path, body, key=credentials[label], request_id=rid)[0].status_code

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(send, plan)) == [200] * len(plan)
    expected: dict[tuple[str, str], float] = {}
    engine_prompt = 0.0
    for rid, label, _, body in plan:
        prompt, completion = engine_usage(obs.sim, rid)
        engine_prompt += prompt * body["n"]
        tenant = "default" if label == "jwt" else label
        expected[(tenant, "prompt")] = expected.get((tenant, "prompt"), 0) + prompt
        expected[(tenant, "completion")] = expected.get((tenant, "completion"), 0) + completion
    assert delta(tokens(obs), before) == expected
    engine_after = scrape(obs).text
    generated = sum(v for (_, t), v in expected.items() if t == "completion")
    for engine_name, counted in (
        ("vllm:prompt_tokens_total", engine_prompt),
        ("vllm:generation_tokens_total", generated),
    ):
        engine_delta = total(engine_after, engine_name) - total(engine_before, engine_name)
        assert engine_delta == counted


# --------------------------------------------------------------------------------------- logs


def test_access_line_of_a_stream_has_the_contracted_fields(obs: Gateway) -> None:
    """The access line of a stream: ids, tenant, route, status, timings, usage, thinking, stream."""
    r, events = post(
        obs,
        "/v1/chat/completions",
        chat_body(
            {"completion_tokens": 12, "text": "obs-completion-marker here"},
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "obs-prompt-marker please"}],
        ),
        request_id="obs-access-stream",
    )
    assert r.status_code == 200
    usage = events[-1]["usage"]
    line = access_line(obs, "obs-access-stream")
    assert set(line) <= ACCESS_FIELDS
    assert line["event"] == "request" and line["logger"] == "gateway.access"
    assert line["level"] == "info"
    assert (line["method"], line["route"], line["status"]) == ("POST", "/v1/chat/completions", 200)
    assert (line["tenant"], line["key_id"]) == ("acme", "KEY_A")
    assert line["stream"] is True and line["thinking"] is True
    assert 0 < line["ttft_ms"] <= line["duration_ms"]
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"]
    assert "reason" not in line
    log_text = obs.log_path.read_text()
    assert "obs-prompt-marker" not in log_text
    assert "obs-completion-marker" not in log_text


def test_access_line_of_a_non_stream_has_usage_and_no_ttft(obs: Gateway) -> None:
    """A non-streaming answer logs stream false, the thinking mode and usage, and no TTFT."""
    r, _ = post(
        obs,
        "/v1/chat/completions",
        chat_body({"completion_tokens": 5}, chat_template_kwargs={"enable_thinking": False}),
        key=KEY_C,
        request_id="obs-access-json",
    )
    usage = r.json()["usage"]
    line = access_line(obs, "obs-access-json")
    assert (line["tenant"], line["status"], line["stream"], line["thinking"]) == (
        "default",
        200,
        False,
        False,
    )
    assert "ttft_ms" not in line
    assert (line["prompt_tokens"], line["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


def test_access_line_names_the_rate_limit_and_auth_reasons(obs: Gateway) -> None:
    """A 429 logs the limit that refused it; a 401 logs its bounded reason, tenant unknown."""
    post(obs, "/v1/chat/completions", chat_body(), key=KEY_T, request_id="obs-tight-1")
    r, _ = post(obs, "/v1/chat/completions", chat_body(), key=KEY_T, request_id="obs-tight-2")
    assert r.status_code == 429
    line = access_line(obs, "obs-tight-2")
    assert (line["tenant"], line["status"], line["reason"]) == ("tight", 429, "requests")
    assert obs.metric("gateway_rate_limited_total", tenant="tight", limit="requests") == 1
    r, _ = post(obs, "/v1/models", {}, key="sk-not-a-key-0000000000000", request_id="obs-401")
    assert r.status_code == 401
    line = access_line(obs, "obs-401")
    assert (line["tenant"], line["status"], line["reason"]) == ("unknown", 401, "unknown")
    assert "key_id" not in line


def test_request_id_is_bound_on_every_line_about_a_request(obs: Gateway) -> None:
    """An engine failure mid-stream logs upstream_error and the access line, both with the id."""
    r, _ = post(
        obs,
        "/v1/chat/completions",
        chat_body({"drop_after": 3}, stream=True),
        request_id="obs-drop-1",
    )
    assert r.status_code == 200
    line = access_line(obs, "obs-drop-1")
    assert (line["status"], line["reason"], line["error_status"]) == (200, "engine_disconnect", 502)
    assert line["level"] == "warning"
    about = [e for e in obs.logs() if e.get("request_id") == "obs-drop-1"]
    assert [e["event"] for e in about] == ["upstream_error", "request"]
    assert about[0]["kind"] == "disconnect" and about[0]["logger"] == "gateway.upstream"
    lifecycle = [e for e in obs.logs() if e["event"] in ("gateway_started", "engine_up")]
    assert lifecycle and all("request_id" not in e for e in lifecycle)
    ids = [e["request_id"] for e in obs.access_logs()]
    assert len(ids) == len(set(ids))


def test_every_output_line_is_one_json_object(obs: Gateway) -> None:
    """The gateway's whole stdout and stderr so far: one JSON object per line, with the basics."""
    lines = [line for line in obs.log_path.read_text().splitlines() if line.strip()]
    assert lines
    for line in lines:
        entry = json.loads(line)
        assert isinstance(entry, dict)
        assert {"event", "level", "logger", "timestamp"} <= set(entry), entry
        assert entry["timestamp"].endswith("Z")


# ------------------------------------------------------------------------------ label bounds


def _random_request(rng: random.Random) -> tuple[str, str, dict[str, str], bytes, list[str]]:
    """One random request: (method, path, headers, body, planted strings).

    A quarter are valid model requests of configured and unconfigured tenants (an unconfigured
    key, a JWT for a random subject) that go the whole way to the engine; the rest mix random
    paths, methods, credentials, models and bodies. Every one has a random user agent.
    """
    mark = f"zq{rng.getrandbits(40):010x}"
    headers = {
        "User-Agent": f"{mark}-agent/{rng.random()}",
        "X-Forwarded-For": f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
        "Content-Type": "application/json",
    }
    if rng.random() < 0.5:
        headers["X-Request-Id"] = f"rid-{mark}" if rng.random() < 0.5 else f"bad id {mark}"
    if rng.random() < 0.25:
        valid = rng.choice([KEY_A, KEY_B, KEY_C, token_for(f"sub-{mark}")])
        headers["Authorization"] = f"Bearer {valid}"
        payload = chat_body({"completion_tokens": 3}, stream=rng.random() < 0.5, user=mark)
        return "POST", "/v1/chat/completions", headers, json.dumps(payload).encode(), [mark]
    path = rng.choice(
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models",
            f"/v1/models/{mark}",
            f"/v1/models/{KEY_B}",
            f"/{mark}",
            f"/v1/{mark}/chat",
            f"/{KEY_A}",
            f"/v1/chat/completions/{mark}",
            "//v1/chat/completions",
            f"/v1/chat/completions?{mark}=1",
            f"/%7B{mark}%7D",
            f"/{mark}" * 200,
            "/metrics",
            "/tokenize",
            "/invocations",
            "/health",
            "/ready",
        ]
    )
    method = rng.choice(["GET", "POST", "POST", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
    credential = rng.choice(
        [
            None,
            KEY_A,
            KEY_B,
            KEY_C,
            f"sk-q38-{mark}{'x' * 24}",
            KEY_A + mark,
            f"eyJ{mark}.eyJ{mark}.{mark}",
            token_for(f"sub-{mark}"),
            token_for("acme"),
            token_for("acme", secret=b"w" * 32),
            token_for("beta", kid=mark),
        ]
    )
    if credential is not None:
        scheme = rng.choice(["Bearer", "bearer", "Basic", "Token"])
        headers["Authorization"] = f"{scheme} {credential}"
    model = rng.choice([ALIAS, mark, KEY_A, None, 42])
    shape = rng.random()
    if shape < 0.1:
        body = f"{{not json {mark}".encode()
    elif shape < 0.2:
        body = json.dumps([mark]).encode()
    else:
        obj: dict[str, Any] = {
            "messages": [{"role": "user", "content": mark}],
            "prompt": mark,
            "max_tokens": rng.choice([1, 4, mark]),
            "stream": rng.random() < 0.5,
            "user": mark,
            "sim": {"completion_tokens": 2},
        }
        if model is not None:
            obj["model"] = model
        body = json.dumps(obj).encode()
    return method, path, headers, body, [mark]


def _series(text: str) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """Label sets of every sample of each ``gateway_*`` family (histograms without ``le``)."""
    out: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("gateway_"):
            continue
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            out.setdefault(family.name, set()).add(labels)
    return out


def test_random_models_paths_keys_and_agents_cannot_grow_label_sets(obs: Gateway) -> None:
    """Hundreds of random requests leave every gateway label inside its bounded vocabulary."""
    rng = random.Random(1906)
    requests = [_random_request(rng) for _ in range(320)]

    def send(item: tuple[str, str, dict[str, str], bytes, list[str]]) -> int:
        method, path, headers, body, _ = item
        with httpx.Client(timeout=30) as client:
            return client.request(method, obs.url(path), headers=headers, content=body).status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(send, requests))
    assert {401, 404, 200} <= set(codes)
    assert codes.count(200) >= 60
    text = scrape(obs).text
    allowed = {
        "tenant": TENANT_LABELS,
        "route": ROUTE_LABELS,
        "code": HTTP_CODES,
        "type": set(TOKEN_TYPES),
        "limit": set(RATE_LIMITS),
        "reason": set(AUTH_FAILURE_REASONS),
        "kind": set(UPSTREAM_ERROR_KINDS),
        "result": set(RELOAD_RESULTS),
        "backend": set(RATELIMIT_BACKENDS),
        "engine": {"default"},  # the configured engine names: one engine here
        "match": set(MATCHES),
        "outcome": set(OUTCOMES),
        "dialect": set(DIALECTS),
        "direction": set(FORECAST_DIRECTIONS),
        "phase": set(FORECAST_PHASES),
        "thinking": {"true", "false"},
    }
    # A label name some family uses with a vocabulary of its own.
    own = {"gateway_deadline_refusals": {"reason": set(DEADLINE_REASONS)}}
    series = _series(text)
    assert "gateway_requests" in series
    for family, label_sets in series.items():
        vocabulary = allowed | own.get(family, {})
        names = {name for labels in label_sets for name, _ in labels}
        bound = 1
        for name in names:
            bound *= len(vocabulary[name])
        assert len(label_sets) <= bound, family
        for labels in label_sets:
            for name, value in labels:
                assert value in vocabulary[name], (family, name, value)
    for *_, planted in requests:
        for mark in planted:
            assert mark not in text
    for secret in SENT_SECRETS:
        assert secret not in text


# ------------------------------------------------------------------------------ joint scrape


async def _engine_metrics(sim: Sim) -> str:
    connector = aiohttp.UnixConnector(path=sim.socket)
    async with aiohttp.ClientSession(connector=connector) as s, s.get("http://engine/metrics") as r:
        return await r.text()


def test_one_scrape_holds_gateway_and_engine_families_once_each(obs: Gateway) -> None:
    """The scrape has each family once, no _created noise, and the engine's vllm:* unchanged
    but for the ``engine`` label (the configured name; vLLM's index kept as ``vllm_engine``)."""
    assert obs.sim is not None
    r = scrape(obs)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = [name for name, _ in type_lines(r.text)]
    assert len(families) == len(set(families))
    assert not [f for f in families if f.startswith("gateway_") and f.endswith("_created")]
    assert {"gateway_requests_total", "vllm:num_requests_running"} <= set(families)
    assert total(r.text, "gateway_engine_scrape_ok") == 1
    engine = asyncio.run(_engine_metrics(obs.sim))
    engine_lines = [
        line
        for line in engine.splitlines()
        if line.split(" ", 1)[0].startswith("vllm:")
        or re.match(r"# (HELP|TYPE) vllm:", line) is not None
    ]
    ours = [line for line in r.text.splitlines() if "vllm:" in line]
    labelled = [
        line if line.startswith("#") else label_engine(line, "default") for line in engine_lines
    ]
    assert ours == labelled
    assert 'engine="default",vllm_engine="0"' in r.text
    assert not [line for line in r.text.splitlines() if line.startswith(("http_", "python_gc"))]


# What `promtool check metrics` says about upstream vLLM's own families, and why it is not ours
# to fix: vLLM names its metrics `vllm:*` (colons are meant for recording rules), and
# `vllm:iteration_tokens_total` is a histogram whose name ends in `_total`. Anything else,
# about any family, is a problem.
ENGINE_LINTS = (
    re.compile(r"vllm:\S+ metric names should not contain ':'"),
    re.compile(r'vllm:\S+ non-counter metrics should not have "_total" suffix'),
)


def promtool_check(text: str) -> tuple[int, list[str]]:
    """(exit status, non-empty output lines) of ``promtool check metrics`` on ``text``."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return result.returncode, lines


def assert_promtool_clean(text: str) -> None:
    """The gateway's families pass promtool with nothing to say; the engine's have only the
    known upstream lints (`ENGINE_LINTS`)."""
    _, problems = promtool_check(text)
    for line in problems:
        assert any(lint.fullmatch(line) for lint in ENGINE_LINTS), line
    gateway_only = "\n".join(line for line in text.splitlines() if "vllm:" not in line) + "\n"
    status, problems = promtool_check(gateway_only)
    assert status == 0 and not problems, problems


def test_promtool_accepts_a_real_scrape(obs: Gateway) -> None:
    """``promtool check metrics`` on a scrape after traffic: clean, but for vLLM's own lints."""
    text = scrape(obs).text
    _, problems = promtool_check(text)
    assert problems, "expected vLLM's colon names to be reported"
    assert "gateway_requests_total" in text
    assert_promtool_clean(text)


def test_promtool_rejects_a_problem_in_a_gateway_family() -> None:
    """The check is not blind: a gateway counter without ``_total`` is caught, even beside
    the allowed engine lints."""
    engine = '# HELP vllm:x_total X.\n# TYPE vllm:x_total gauge\nvllm:x_total{engine="0"} 1\n'
    assert_promtool_clean(engine)
    bad = "# HELP gateway_widgets Widgets.\n# TYPE gateway_widgets counter\ngateway_widgets 1\n"
    with pytest.raises(AssertionError, match="gateway_widgets"):
        assert_promtool_clean(engine + bad)


def test_promtool_accepts_the_joint_scrape_of_each_engine(
    engine: Any, engine_gateway: Gateway
) -> None:
    """Joint scrape in front of real vLLM (74 families) and the simulator: the gateway's part
    is clean and the engine's has only upstream's known lints."""
    r = httpx.post(
        engine_gateway.url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {KEY_A}"},
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        timeout=60,
    )
    assert r.status_code == 200
    text = scrape(engine_gateway).text
    assert "vllm:generation_tokens_total" in text
    assert total(text, "gateway_engine_scrape_ok") == 1
    assert "gateway_requests_total" in text
    assert_promtool_clean(text)


def test_dashboard_and_alert_rules_name_only_scraped_metrics(obs: Gateway) -> None:
    """Every series the Grafana dashboard and the alert rules read exists in a real scrape."""
    text = scrape(obs).text
    declared = dict(type_lines(text))
    names = deploy_rules.used_series_names()
    assert names
    for name in sorted(names):
        if name in declared:
            continue
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert declared.get(base) == "histogram", f"{name} is not in the scrape"


def test_real_prometheus_scrapes_the_tenant_request_count(obs: Gateway) -> None:
    """A Prometheus server scraping the metrics port answers the tenant's request count."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian package prometheus)")
    for _ in range(3):
        r = httpx.get(obs.url("/v1/models"), headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 200
    expected = obs.metric("gateway_requests_total", tenant="acme")
    target = obs.metrics_url.removeprefix("http://").removesuffix("/metrics")
    workdir = Path(tempfile.mkdtemp(prefix="q38p-", dir="/tmp"))
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: qwen38-gateway\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}/api/v1/query"

    def query(expr: str) -> list[dict[str, Any]]:
        try:
            r = httpx.get(api, params={"query": expr}, timeout=2)
        except httpx.HTTPError:
            return []
        return r.json()["data"]["result"] if r.status_code == 200 else []

    def count() -> float:
        return sum(float(s["value"][1]) for s in query('gateway_requests_total{tenant="acme"}'))

    try:
        assert wait_until(lambda: count() == expected, 40, interval=0.5), (count(), expected)
        assert query('up{job="qwen38-gateway"} == 1')
        assert query('vllm:num_requests_running{job="qwen38-gateway"}')
        assert query("gateway_engine_scrape_ok == 1")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)


# ------------------------------------------------------------------------------------ secrets


def test_no_secret_in_logs_or_scrape_after_good_and_bad_requests(obs: Gateway) -> None:
    """Keys, JWTs, the signing key and key hashes never reach a log line or the scrape."""
    jwt_acme = token_for("acme")
    requests = [
        ("POST", "/v1/chat/completions", KEY_A, {"model": KEY_B}),
        ("POST", "/v1/chat/completions", KEY_A, {"model": jwt_acme}),
        ("GET", f"/v1/models/{KEY_C}", KEY_A, None),
        ("GET", f"/{KEY_B}", KEY_A, None),
        ("GET", f"/v1/{jwt_acme}", None, None),
        ("POST", "/v1/chat/completions", KEY_A + "x", chat_body()),
        ("POST", "/v1/chat/completions", jwt_acme, chat_body()),
        ("POST", "/v1/chat/completions", KEY_B, chat_body(stream=True)),
    ]
    for method, path, credential, body in requests:
        headers = {"User-Agent": KEY_C, "X-Request-Id": KEY_B}
        if credential:
            headers["Authorization"] = f"Bearer {credential}"
        httpx.request(method, obs.url(path), headers=headers, json=body, timeout=30)
    log_text = obs.log_path.read_text()
    scrape_text = scrape(obs).text
    digests = {hashlib.sha256(k.encode()).hexdigest() for k in (KEY_A, KEY_B, KEY_C, KEY_T)}
    for secret in sorted(SENT_SECRETS | digests):
        assert secret not in log_text
        assert secret not in scrape_text
        for fragment in (secret[:16], secret[-16:]):
            assert fragment not in log_text, fragment


# ----------------------------------------------------------- own engine or own configuration


def test_scrape_answers_while_the_engine_is_down(sim_factory: Any, gateway_factory: Any) -> None:
    """Engine stopped: the scrape is still 200, scrape_ok and engine_up 0, no vllm series."""
    sim = sim_factory()
    gw = gateway_factory(sim)
    text = scrape(gw).text
    assert total(text, "gateway_engine_scrape_ok") == 1 and "vllm:" in text
    sim.stop()
    assert wait_until(lambda: gw.metric("gateway_engine_up") == 0, 5)
    r = scrape(gw)
    assert r.status_code == 200
    assert total(r.text, "gateway_engine_scrape_ok") == 0
    assert "vllm:" not in r.text
    assert total(r.text, "gateway_keys_loaded") == 3
    sim.restart()
    assert wait_until(lambda: gw.metric("gateway_engine_scrape_ok") == 1, 10)
    assert "vllm:num_requests_running" in scrape(gw).text
    assert wait_until(lambda: [e["event"] for e in gw.logs()].count("engine_up") == 2, 5)
    assert "engine_down" in [e["event"] for e in gw.logs()]


def test_metrics_bearer_token_guards_the_scrape(sim_factory: Any, gateway_factory: Any) -> None:
    """With QWEN38_METRICS_TOKEN a scrape needs it; a reload of the keys file changes it."""
    sim = sim_factory()
    gw = gateway_factory(sim)
    write_keys(gw.keys_file, DEFAULT_KEYS, extra=f"QWEN38_METRICS_TOKEN={METRICS_TOKEN}\n")
    assert wait_until(lambda: scrape(gw).status_code == 401, 5)
    r = scrape(gw)
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert "gateway_" not in r.text
    assert scrape(gw, METRICS_TOKEN + "x").status_code == 401
    assert scrape(gw, METRICS_TOKEN[:-1]).status_code == 401
    assert scrape(gw, KEY_A).status_code == 401
    ok = httpx.get(gw.metrics_url, headers={"Authorization": f"bearer {METRICS_TOKEN}"})
    assert ok.status_code == 200 and "gateway_requests_total" in ok.text
    new_token = METRICS_TOKEN[::-1]
    write_keys(gw.keys_file, DEFAULT_KEYS, extra=f"QWEN38_METRICS_TOKEN={new_token}\n")
    assert wait_until(lambda: scrape(gw, new_token).status_code == 200, 5)
    assert scrape(gw, METRICS_TOKEN).status_code == 401
    log_text = gw.log_path.read_text()
    assert METRICS_TOKEN not in log_text and new_token not in log_text
    assert METRICS_TOKEN not in ok.text


def test_public_port_never_serves_or_forwards_metrics(
    sim_factory: Any, gateway_factory: Any
) -> None:
    """/metrics on the public port is 401 without a key, 404 with one, and never reaches the engine."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"metrics": {"enabled": False}})
    paths = ["/metrics", "/metrics/", "//metrics", "/v1/../metrics", "/%6Detrics", "/v1/metrics"]
    for i, path in enumerate(paths):
        headers = {"X-Request-Id": f"obs-public-{i}"}
        assert httpx.get(gw.url(path), headers=headers, timeout=5).status_code == 401, path
        headers["Authorization"] = f"Bearer {KEY_A}"
        r = httpx.get(gw.url(path), headers=headers, timeout=5)
        assert r.status_code == 404, path
        assert "vllm:" not in r.text and "gateway_" not in r.text
    with pytest.raises(httpx.ConnectError):
        httpx.get(gw.metrics_url, timeout=2)
    forwarded = [
        r
        for r in sim.records()
        if any(str(v).startswith("obs-public-") for v in r["headers"].values())
    ]
    assert forwarded == []
    assert len([e for e in gw.access_logs() if e["request_id"].startswith("obs-public-")]) == 12


def test_metrics_listener_cannot_share_the_public_port(workdir: Path, sim_factory: Any) -> None:
    """A config putting the metrics listener on the public port makes the gateway exit, not serve."""
    sim = sim_factory()
    port = free_port()
    config = {
        "server": {"host": "127.0.0.1", "port": port},
        "metrics": {"host": "127.0.0.1", "port": port},
    }
    try:
        gw = start_gateway(workdir, sim, config)
    except RuntimeError as exc:
        assert "exited" in str(exc)
    else:
        _stop(gw.proc)
        pytest.fail("the gateway served with its metrics listener on the public port")
    output = (workdir / "gw.log").read_text()
    assert "cannot listen" in output or "metrics.port" in output


def test_lifecycle_events_are_logged(sim_factory: Any, gateway_factory: Any) -> None:
    """Start, reload ok and failed, engine down and up, drain and stop each log one event."""
    sim = sim_factory()
    gw = gateway_factory(sim)
    gw.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: any(e["event"] == "reload_ok" for e in gw.logs()), 5)
    write_keys(gw.keys_file, {"KEY_A": ("acme", KEY_A)}, extra=f"KEY_Y=beta:{KEY_B}:bogus=1\n")
    assert wait_until(lambda: any(e["event"] == "reload_failed" for e in gw.logs()), 5)
    write_keys(gw.keys_file, DEFAULT_KEYS)
    sim.stop()
    assert wait_until(lambda: any(e["event"] == "engine_down" for e in gw.logs()), 5)
    sim.restart()
    assert wait_until(lambda: [e["event"] for e in gw.logs()].count("engine_up") == 2, 10)
    _stop(gw.proc)
    by_event: dict[str, dict[str, Any]] = {}
    for entry in gw.logs():
        by_event.setdefault(entry["event"], entry)
    for event in (
        "gateway_started",
        "reload_ok",
        "reload_failed",
        "engine_down",
        "engine_up",
        "gateway_draining",
        "gateway_stopped",
    ):
        assert event in by_event, event
        assert "request_id" not in by_event[event]
    assert by_event["reload_ok"]["trigger"] == "signal"
    assert by_event["reload_failed"]["level"] == "error"
    assert by_event["engine_down"]["level"] == "warning"
    assert by_event["gateway_started"]["metrics"] == gw.metrics_url.split("//")[1].split("/")[0]
    assert by_event["reload_failed"]["problems"]
    assert KEY_B not in json.dumps(by_event["reload_failed"])


def test_log_level_comes_from_the_config(sim_factory: Any, gateway_factory: Any) -> None:
    """At level warning, a 200 writes no line and a 503 writes its warning access line."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"logging": {"level": "warning"}})
    assert wait_until(lambda: gw.metric("gateway_engine_ready") == 1, 10)
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Request-Id": "obs-level-ok"}
    ok = httpx.post(gw.url("/v1/chat/completions"), json=chat_body(), headers=headers)
    assert ok.status_code == 200
    sim.stop()
    assert wait_until(lambda: gw.metric("gateway_engine_ready") == 0, 5)
    headers["X-Request-Id"] = "obs-level-503"
    down = httpx.post(gw.url("/v1/chat/completions"), json=chat_body(), headers=headers)
    assert down.status_code == 503
    assert wait_until(lambda: any(e.get("status") == 503 for e in gw.access_logs()), 3)
    entries = gw.logs()
    assert entries and all(e["level"] in ("warning", "error") for e in entries)
    assert [e["request_id"] for e in gw.access_logs()] == ["obs-level-503"]
