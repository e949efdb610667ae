"""Memory bounds held in the gateway process's real memory (its RSS), and the caps on one engine
answer and one relayed event: a real gateway process in front of the engine simulator."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ALIAS, KEY_A, KEY_B, Gateway, Sim, wait_until

MIB = 1024 * 1024
STORE_BYTES = 20_000_000
# One stored entry of about 1 MB of JSON: a conversation of 20,000 short input items (the
# shape whose decoded Python objects are some 10 times their JSON) and a 300 KB answer.
ITEMS = [{"role": "user", "content": f"m{i}"} for i in range(20_000)]
BIG = {"completion_tokens": 300, "token_bytes": 1000}


def rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` in KiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS line")


def cpu_s(pid: int) -> float:
    """CPU time of ``pid`` so far (user + system, seconds; ``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_busy(sim: Sim) -> float:
    """``vllm:num_requests_running`` of the simulator (over its socket)."""
    transport = httpx.HTTPTransport(uds=sim.socket)
    with httpx.Client(transport=transport, timeout=5) as client:
        text = client.get("http://engine/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


def respond(
    gw: Gateway, key: str, sim: dict[str, Any], items: Any = "Write it.", **extra: Any
) -> httpx.Response:
    """One non-streamed ``/v1/responses`` request with the simulator's ``sim`` behaviour."""
    body = {"model": ALIAS, "input": items, "sim": sim, **extra}
    return httpx.post(
        gw.url("/v1/responses"),
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def test_c27_store_bound_holds_in_rss_and_a_tenant_within_its_share_keeps_its_response(
    sim_factory, gateway_factory
) -> None:
    """store_max_bytes = 20 MB: 40 stored answers of 1 MB grow the gateway by at most 2x the
    bound, and a tenant's only stored response survives another tenant's 39."""
    sim = sim_factory()
    gw = gateway_factory(
        sim, {"responses": {"store": True, "store_max_bytes": STORE_BYTES, "store_ttl_s": 3600}}
    )
    for _ in range(2):  # one request's own working memory is in RSS before the count starts
        warm = respond(gw, KEY_A, BIG, ITEMS, store=False)
        assert warm.status_code == 200, warm.text
    before = rss_kib(gw.proc.pid)
    kept = respond(gw, KEY_B, BIG, ITEMS)
    assert kept.status_code == 200, kept.text
    kept_id = kept.json()["id"]
    for _ in range(39):
        r = respond(gw, KEY_A, BIG, ITEMS)
        assert r.status_code == 200, r.text
    growth_kib = rss_kib(gw.proc.pid) - before
    print(f"RSS growth {growth_kib} KiB")
    assert growth_kib * 1024 < 2 * STORE_BYTES, f"gateway RSS grew {growth_kib} KiB"
    again = httpx.get(
        gw.url(f"/v1/responses/{kept_id}"),
        headers={"Authorization": f"Bearer {KEY_B}"},
        timeout=10,
    )
    assert again.status_code == 200 and again.json()["id"] == kept_id
    chained = respond(gw, KEY_B, {"completion_tokens": 3}, previous_response_id=kept_id)
    assert chained.status_code == 200, chained.text


def test_c30_a_prompt_count_is_read_without_its_token_ids(sim_factory, gateway_factory) -> None:
    """The engine's ``/tokenize`` answer carries every token id beside the count (about 7 bytes
    a token): ``count_tokens`` reads the count as the answer arrives, so a prompt whose ids pass
    ``engine.max_answer_bytes`` is counted exactly, not refused as an engine answer too large."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"engine": {"max_answer_bytes": 64 * 1024}})
    messages = [{"role": "user", "content": "word " * 30_000}]
    r = httpx.post(
        gw.url("/v1/messages/count_tokens"),
        json={"model": ALIAS, "messages": messages},
        headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert r.status_code == 200, r.text[:300]
    transport = httpx.HTTPTransport(uds=sim.socket)
    with httpx.Client(transport=transport, timeout=30) as client:
        engine = client.post(
            "http://engine/tokenize",
            json={
                "model": ALIAS,
                "messages": messages,
                "add_generation_prompt": True,
                "chat_template_kwargs": {"enable_thinking": True},
            },
        )
    assert len(engine.content) > 64 * 1024
    assert r.json() == {"input_tokens": engine.json()["count"]}
    assert gw.metric("gateway_upstream_errors_total", kind="too_large") == 0
    r = httpx.post(
        gw.url("/v1/messages/count_tokens"),
        json={"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert r.status_code == 200 and 0 < r.json()["input_tokens"] < 20


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Go."}]}, "openai"),
        (
            "/v1/messages",
            {"max_tokens": 4000, "messages": [{"role": "user", "content": "Go."}]},
            "anthropic",
        ),
        ("/v1/responses", {"input": "Go."}, "responses"),
    ],
)
def test_c30_answer_over_the_cap_is_a_502_in_the_clients_shape_and_aborted(
    sim_factory, gateway_factory, path: str, body: dict[str, Any], shape: str
) -> None:
    """A non-streamed engine answer over engine.max_answer_bytes: 502 in the client's API
    shape, the engine request aborted, counted once as too_large, logged once."""
    sim = sim_factory("--completion-tokens", "4000", "--token-bytes", "1000")
    gw = gateway_factory(sim, {"engine": {"max_answer_bytes": 1 * MIB}})
    request = {"model": ALIAS, **body}
    r = httpx.post(
        gw.url(path),
        json=request,
        headers={"Authorization": f"Bearer {KEY_A}", "x-api-key": KEY_A},
        timeout=60,
    )
    assert r.status_code == 502, r.text
    error = r.json()
    if shape == "anthropic":
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
    else:
        assert error["error"]["code"] in ("upstream_error", "server_error")
    assert "larger than this gateway relays" in json.dumps(error)
    assert wait_until(lambda: engine_busy(sim) == 0, 10)
    assert gw.metric("gateway_upstream_errors_total", kind="too_large") == 1
    warnings = [e for e in gw.logs() if e.get("event") == "upstream_error"]
    assert [e.get("kind") for e in warnings] == ["too_large"]
    line = gw.access_logs()[-1]
    # Charged as a cut request: the prompt always, the counter delta when a baseline was read.
    assert line["status"] == 502 and line["prompt_tokens"] > 0
    assert line["usage_source"] != "counters" or line["completion_tokens"] > 0


def test_c30_event_over_the_cap_ends_the_stream_with_an_error_and_bounded_memory(
    sim_factory, gateway_factory
) -> None:
    """One streamed event over engine.max_event_bytes (a 20 MB token) is never held whole: the
    stream ends with a 502 error event, the engine request is aborted, RSS stays flat."""
    sim = sim_factory()
    gw = gateway_factory(sim, {"engine": {"max_event_bytes": 1 * MIB}})
    before = rss_kib(gw.proc.pid)
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Go."}],
        "stream": True,
        "sim": {"completion_tokens": 3, "token_bytes": 20_000_000},
    }
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(gw.proc.pid) - before)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = httpx.post(
            gw.url("/v1/chat/completions"),
            json=body,
            headers={"Authorization": f"Bearer {KEY_A}"},
            timeout=60,
        )
    finally:
        done.set()
        watcher.join()
    assert r.status_code == 200
    last = [line for line in r.text.splitlines() if line.startswith("data: ")][-1]
    assert "[DONE]" not in last and json.loads(last[6:])["error"]["code"] == "upstream_error"
    assert peak[0] < 8 * 1024, f"gateway RSS grew {peak[0]} KiB"
    assert wait_until(lambda: engine_busy(sim) == 0, 10)
    assert gw.metric("gateway_upstream_errors_total", kind="too_large") == 1


def probed(gw: Gateway, work: Callable[[], httpx.Response]) -> tuple[httpx.Response, float, int]:
    """Run ``work`` while probing ``/health`` and ``/ready`` every 10 ms: its response, the
    slowest probe (seconds) and the gateway's largest RSS growth meanwhile (KiB)."""
    before = rss_kib(gw.proc.pid)
    times: list[float] = []
    peak = [0]
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=10) as client:
            while not done.is_set():
                for path in ("/health", "/ready"):
                    started = time.monotonic()
                    with contextlib.suppress(httpx.HTTPError):  # a timeout counts as slow
                        client.get(gw.url(path))  # /ready may say 503: the engine's probes
                    times.append(time.monotonic() - started)
                peak[0] = max(peak[0], rss_kib(gw.proc.pid) - before)
                time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        response = work()
        time.sleep(0.2)
    finally:
        done.set()
        prober.join()
    return response, max(times, default=0.0), peak[0]


@pytest.mark.parametrize(("megabytes", "status"), [(30, 200), (100, 502)])
def test_c30_health_answers_fast_while_a_huge_answer_arrives(
    sim_factory, gateway_factory, megabytes: int, status: int
) -> None:
    """A 30 MB non-streamed answer (rewritten in the worker process) and a 100 MB one (over the
    default engine.max_answer_bytes, refused with 502): /health and /ready keep answering
    within 100 ms of their pace without it (the slowest probe of an equally long window), the
    gateway's own CPU shows it only moved bytes, and its memory stays within twice the cap."""
    sim = sim_factory()
    gw = gateway_factory(sim)

    def ask(tokens: int) -> Callable[[], httpx.Response]:
        body = {
            "model": ALIAS,
            "messages": [{"role": "user", "content": "Go."}],
            "sim": {"completion_tokens": tokens, "token_bytes": 1_000_000},
        }
        headers = {"Authorization": f"Bearer {KEY_A}"}
        return lambda: httpx.post(
            gw.url("/v1/chat/completions"), json=body, headers=headers, timeout=120
        )

    started, cpu_before = time.monotonic(), cpu_s(gw.proc.pid)
    r, slowest, peak = probed(gw, ask(megabytes))
    took, cpu = time.monotonic() - started, cpu_s(gw.proc.pid) - cpu_before
    # The machine's own pace: as many probes for as long, with a small request only.
    cpu_before = cpu_s(gw.proc.pid)
    _, control, _ = probed(gw, lambda: (time.sleep(took), ask(1)())[1])
    cpu -= cpu_s(gw.proc.pid) - cpu_before  # the probes' own cost
    assert r.status_code == status, r.text[:500]
    if status == 200:
        assert len(r.content) > megabytes * 500_000  # the whole answer, rewritten
    # The gateway only moved bytes: decoding the answer in its loop cost 17-21 ms of its CPU per
    # MB (measured), moving it 3-6 ms, whatever the machine's load (the probes' CPU, measured
    # over the control window, taken off).
    assert cpu < 0.01 * megabytes, f"gateway CPU {cpu:.2f} s for {megabytes} MB"
    # Probes keep their pace: within 100 ms of an equally long window without the answer (three
    # times that window's slowest on a machine loaded enough to deschedule the gateway).
    bound = max(control + 0.1, 3 * control)
    assert slowest < bound, f"slowest probe {slowest * 1000:.0f} ms (control {control * 1000:.0f})"
    assert peak * 1024 < 2 * 33_554_432, f"gateway RSS grew {peak} KiB"
