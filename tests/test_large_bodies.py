"""Request bodies over 1 MiB, parsed and planned in the gateway's worker process
(`gateway.plan_worker`): the event loop keeps answering meanwhile, the engine gets what it would
get for the same request sent small, and a worker that dies costs one retryable 503 at most.
A real gateway process in front of the engine simulator."""

from __future__ import annotations

import asyncio
import functools
import gzip
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from tests.conftest import ALIAS, KEY_A, KEY_B, Gateway, wait_until
from tests.test_memory_bounds import probed

ANTHROPIC = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
OPENAI = {"Authorization": f"Bearer {KEY_A}"}
ITEMS = 200_000  # short messages: some 10 MB of JSON, millions of Python objects decoded


def many(path: str) -> dict[str, Any]:
    """A body of `ITEMS` short messages for ``path``: past the context, so refused."""
    if path == "/v1/responses":
        items = [{"type": "message", "role": "user", "content": f"m{i}"} for i in range(ITEMS)]
        return {"model": ALIAS, "input": items}
    if path.startswith("/v1/messages"):
        messages = [
            {"role": "user", "content": [{"type": "text", "text": f"m{i}"}]} for i in range(ITEMS)
        ]
        body: dict[str, Any] = {"model": ALIAS, "messages": messages}
        return body if path.endswith("count_tokens") else {**body, "max_tokens": 10}
    return {
        "model": ALIAS,
        "messages": [{"role": "user", "content": f"m{i}"} for i in range(ITEMS)],
    }


def post(gw: Gateway, path: str, raw: bytes, timeout: float = 120) -> httpx.Response:
    """POST ``raw`` as JSON to ``path`` with KEY_A, in the path's API's headers."""
    headers = ANTHROPIC if path.startswith("/v1/messages") else OPENAI
    return httpx.post(
        gw.url(path),
        content=raw,
        headers={**headers, "Content-Type": "application/json"},
        timeout=timeout,
    )


def escaped(text: str) -> str:
    """``text`` with every character written as a JSON ``\\uXXXX`` escape: six bytes on the wire
    for one character of the prompt, so a body passes 1 MiB while its prompt stays small."""
    return "".join(f"\\u{ord(c):04x}" for c in text)


@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/messages/count_tokens"],
)
def test_health_answers_fast_while_a_huge_body_is_planned(
    sim_factory, gateway_factory, path: str
) -> None:
    """A body of 200,000 messages (some 10 MB, far more Python objects once decoded) takes the
    gateway seconds to parse and check: /health and /ready keep answering within 100 ms of
    their pace without it, and the body gets its answer (the context refused; its count)."""
    gw = gateway_factory(sim_factory())
    raw = json.dumps(many(path)).encode()
    assert len(raw) > 4 * 1024 * 1024
    started = time.monotonic()
    r, slowest, _ = probed(gw, lambda: post(gw, path, raw))
    took = time.monotonic() - started
    _, control, _ = probed(gw, lambda: (time.sleep(took), post(gw, path, b"{}"))[1])
    if path.endswith("count_tokens"):
        assert r.status_code == 200, r.text[:300]
        assert r.json()["input_tokens"] > 254_976
    else:
        assert r.status_code == 400, r.text[:300]
        assert "context" in r.text or "too long" in r.text, r.text[:300]
    bound = max(control + 0.1, 3 * control)
    assert slowest < bound, f"slowest probe {slowest * 1000:.0f} ms (control {control * 1000:.0f})"


SMALL_CHAT = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@functools.cache
def bomb(coding: str) -> bytes:
    """1 GiB of spaces in ``coding``: 1.6 KB of brotli, 32 KB of zstd, 4.7 MB of gzip."""
    raw = b" " * (1 << 30)
    if coding == "br":
        import brotli  # type: ignore[import-untyped]

        return bytes(brotli.compress(raw, quality=5))
    if coding == "zstd":
        if sys.version_info >= (3, 14):
            from compression import zstd
        else:
            from backports import zstd
        return bytes(zstd.compress(raw))
    return gzip.compress(raw, 1)


@pytest.mark.parametrize("coding", ["br", "zstd", "gzip"])
@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/v1/chat/completions", 401),  # no credential: the body is never read
        ("GET", "/health", 200),  # a body on a route that reads none
        ("POST", "/v1/models", 405),  # with a credential: a method the route lacks
    ],
)
def test_an_unread_compressed_body_is_not_decoded_in_the_event_loop(
    stack: Gateway, coding: str, method: str, path: str, status: int
) -> None:
    """A compressed body of 1 GiB sent to a route that answers without reading it: the client
    gets its answer, and /health and /ready keep their pace (aiohttp, decoding bodies itself,
    decoded the whole GiB after the answer, in one stretch, to keep the connection)."""
    compressed = bomb(coding)
    headers = {"Content-Encoding": coding, "Content-Type": "application/json"}
    if status == 405:
        headers.update(OPENAI)
    r, slowest, _ = probed(
        stack,
        lambda: httpx.request(method, stack.url(path), content=compressed, headers=headers),
    )
    assert r.status_code == status, r.text[:300]
    assert slowest < 0.25, f"slowest probe {slowest * 1000:.0f} ms"
    r = httpx.post(
        stack.url("/v1/chat/completions"),
        content=gzip.compress(json.dumps(SMALL_CHAT).encode()),
        headers={**OPENAI, **headers, "Content-Encoding": "gzip"},
    )
    assert r.status_code == 200, r.text[:300]


def engine_body(gw: Gateway) -> dict[str, Any]:
    """The body of the last model request the simulator received, without its per-request id."""
    assert gw.sim is not None
    body = dict(gw.sim.model_records()[-1]["body"])
    body.pop("request_id")
    return body


@pytest.mark.parametrize(
    ("path", "make"),
    [
        (
            "/v1/chat/completions",
            lambda text: {
                "model": ALIAS,
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": text},
                ],
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object"}},
                    }
                ],
                "tool_choice": "none",
                "stop": ["\n\n"],
                "n": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
                "metadata": {"k": "v"},
            },
        ),
        (
            "/v1/completions",
            lambda text: {"model": ALIAS, "prompt": [text, "second"], "max_tokens": 5},
        ),
        (
            "/v1/messages",
            lambda text: {
                "model": ALIAS,
                "system": [{"type": "text", "text": "Be brief."}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
                "stop_sequences": ["END"],
                "max_tokens": 20,
                "thinking": {"type": "disabled"},
            },
        ),
        (
            "/v1/responses",
            lambda text: {
                "model": ALIAS,
                "instructions": "Be brief.",
                "input": [{"type": "message", "role": "user", "content": text}],
                "max_output_tokens": 30,
                "store": False,
            },
        ),
    ],
    ids=["chat", "completions", "messages", "responses"],
)
def test_a_large_body_reaches_the_engine_as_the_same_request_sent_small(
    stack: Gateway, path: str, make: Callable[[str], dict[str, Any]]
) -> None:
    """The same request twice: once written plainly (planned in the event loop), once with every
    prompt character escaped (over 1 MiB, planned in the worker). The engine receives the same
    body, and the client the same answer."""
    text = "The quick brown fox jumps over the lazy dog. " * 4_000  # 180,000 characters
    small = json.dumps(make(text)).encode()
    large = json.dumps(make("@@")).encode().replace(b"@@", escaped(text).encode())
    assert len(small) < 1024 * 1024 < len(large)
    answers, bodies = [], []
    for raw in (small, large):
        r = post(stack, path, raw)
        assert r.status_code == 200, r.text[:300]
        answers.append(r)
        bodies.append(engine_body(stack))
    assert bodies[0] == bodies[1]
    if path == "/v1/chat/completions":  # streamed: the same events, the same usage
        events = [
            [json.loads(line[6:]) for line in a.text.splitlines() if line.startswith("data: {")]
            for a in answers
        ]
        assert len(events[0]) == len(events[1])
        assert events[0][-1]["usage"] == events[1][-1]["usage"]
    else:
        first, second = (a.json() for a in answers)
        assert first["usage"] == second["usage"]


def test_stored_responses_work_from_a_large_body(sim_factory, gateway_factory) -> None:
    """A large Responses body is stored, retrieved, and continued by another large body through
    ``previous_response_id`` (the worker asks the gateway's store for the conversation)."""
    gw = gateway_factory(sim_factory(), {"responses": {"store": True}})
    text = escaped("Remember the number 4711. " * 8_000)
    first = json.dumps({"model": ALIAS, "input": "@@", "max_output_tokens": 8}).encode()
    r = post(gw, "/v1/responses", first.replace(b"@@", text.encode()))
    assert r.status_code == 200, r.text[:300]
    stored = r.json()
    got = httpx.get(gw.url(f"/v1/responses/{stored['id']}"), headers=OPENAI, timeout=10)
    assert got.status_code == 200 and got.json()["id"] == stored["id"]
    second = {"model": ALIAS, "input": "@@", "previous_response_id": stored["id"]}
    raw = json.dumps(second).encode().replace(b"@@", escaped("And now? " * 20_000).encode())
    r = post(gw, "/v1/responses", raw)
    assert r.status_code == 200, r.text[:300]
    messages = engine_body(gw)["messages"]
    assert "Remember the number 4711." in json.dumps(messages[0])
    assert messages[-1]["content"].startswith("And now?")
    missing = json.dumps({**second, "previous_response_id": "resp_0"}).encode()
    r = post(gw, "/v1/responses", missing.replace(b"@@", escaped("x" * 200_000).encode()))
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_a_small_body_continuing_a_large_stored_conversation_keeps_health_fast(
    sim_factory, gateway_factory
) -> None:
    """A Responses body of a few bytes whose ``previous_response_id`` names a conversation of
    45,000 stored items is planned in the worker as a large body would be: /health and /ready
    keep their pace while it is planned (in the event loop they waited some 0.3 s)."""
    gw = gateway_factory(sim_factory(), {"responses": {"store": True}})
    items = [{"type": "message", "role": "user", "content": "."} for _ in range(45_000)]
    first = {"model": ALIAS, "input": items, "max_output_tokens": 2}
    r = post(gw, "/v1/responses", json.dumps(first).encode())
    assert r.status_code == 200, r.text[:300]
    follow = {"model": ALIAS, "input": "and?", "max_output_tokens": 2}
    small = json.dumps({**follow, "previous_response_id": r.json()["id"]}).encode()
    started = time.monotonic()
    r, slowest, _ = probed(gw, lambda: post(gw, "/v1/responses", small))
    took = time.monotonic() - started
    assert r.status_code == 200, r.text[:300]
    assert len(engine_body(gw)["messages"]) > 45_000
    _, control, _ = probed(gw, lambda: (time.sleep(took), post(gw, "/v1/responses", b"{}"))[1])
    bound = max(control + 0.1, 3 * control)
    assert slowest < bound, f"slowest probe {slowest * 1000:.0f} ms (control {control * 1000:.0f})"


def test_listing_the_items_of_a_large_stored_conversation_keeps_health_fast(
    sim_factory, gateway_factory
) -> None:
    """``GET /v1/responses/{id}/input_items`` of a stored response made from 30,000 items, one
    of them megabytes long: pages of it in either order, their cursors followed, while /health
    and /ready keep their pace (a stored input that large is listed in the plan worker)."""
    gw = gateway_factory(sim_factory(), {"responses": {"store": True}})
    items = [{"type": "message", "role": "user", "content": f"m{i}"} for i in range(30_000)]
    items[0]["junk"] = [0] * 1_000_000  # one item of megabytes, never sent to the engine
    body = {"model": ALIAS, "input": items, "max_output_tokens": 2}
    r = post(gw, "/v1/responses", json.dumps(body).encode())
    assert r.status_code == 200, r.text[:300]
    url = gw.url(f"/v1/responses/{r.json()['id']}/input_items")
    first = httpx.get(url, params={"order": "asc", "limit": 100}, headers=OPENAI, timeout=30)
    assert first.status_code == 200, first.text[:300]
    page = first.json()
    assert [i["content"][0]["text"] for i in page["data"]] == [f"m{i}" for i in range(100)]
    assert page["has_more"] and page["last_id"] == page["data"][-1]["id"]

    def last_page() -> httpx.Response:
        return httpx.get(url, params={"limit": 2}, headers=OPENAI, timeout=30)

    started = time.monotonic()
    newest, slowest, _ = probed(gw, last_page)
    took = time.monotonic() - started
    assert [i["content"][0]["text"] for i in newest.json()["data"]] == ["m29999", "m29998"]
    after = {"order": "asc", "after": page["last_id"], "limit": 1}
    nxt = httpx.get(url, params=after, headers=OPENAI, timeout=30).json()
    assert [i["content"][0]["text"] for i in nxt["data"]] == ["m100"]
    _, control, _ = probed(gw, lambda: (time.sleep(took), httpx.get(gw.url("/v1/models")))[1])
    bound = max(control + 0.1, 3 * control)
    assert slowest < bound, f"slowest probe {slowest * 1000:.0f} ms (control {control * 1000:.0f})"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", {"messages": "not a list"}, 400, "messages"),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": []}, 404, "model"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "n": 0},
            400,
            "n",
        ),
        (
            "/v1/messages",
            {"max_tokens": 10, "messages": [{"role": "robot", "content": "x"}]},
            400,
            None,
        ),
        ("/v1/messages/count_tokens", {"model": "gpt-4", "messages": []}, 404, None),
        ("/v1/responses", {"input": 5}, 400, "input"),
    ],
)
def test_a_large_bad_body_is_refused_as_a_small_one_is(
    stack: Gateway, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    """A body the dialect refuses gets the same error large (planned in the worker) as small:
    status, API shape, message and field; nothing reaches the engine."""
    assert stack.sim is not None
    before = len(stack.sim.model_records())
    small = json.dumps({"model": ALIAS, **body}).encode()
    large = small[:-1] + b', "padding": "' + b"x" * (1024 * 1024 + 10) + b'"}'
    answers = [post(stack, path, raw) for raw in (small, large)]
    assert [a.status_code for a in answers] == [status, status], answers[1].text[:300]
    assert answers[0].json() == answers[1].json()
    if param is not None:
        assert answers[1].json()["error"]["param"] == param
    assert len(stack.sim.model_records()) == before


def deep_tool_body(path: str, extra: int) -> bytes:
    """A request for ``path`` whose one tool's schema holds ``extra`` nested empty lists (the
    tool offered, not called: the simulator parses no tool calls)."""
    raw = json.dumps(deep_tool_dict(path)).encode()
    return raw.replace(b'"@@"', b"[" * extra + b"]" * extra)


def deep_tool_dict(path: str) -> dict[str, Any]:
    """`deep_tool_body` with ``"@@"`` in place of the nested lists."""
    schema = {"type": "object", "properties": {}, "x": "@@"}
    prompt = {"role": "user", "content": "hi"}
    if path == "/v1/chat/completions":
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        return {"model": ALIAS, "messages": [prompt], "tools": [tool], "tool_choice": "none"}
    if path == "/v1/responses":
        tool = {"type": "function", "name": "f", "parameters": schema}
        return {"model": ALIAS, "input": "hi", "tools": [tool], "tool_choice": "none"}
    tools = [{"name": "f", "input_schema": schema}]
    body = {"model": ALIAS, "messages": [prompt], "tools": tools, "tool_choice": {"type": "none"}}
    return body if path.endswith("count_tokens") else {**body, "max_tokens": 2}


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw`` (no brackets in its
    strings)."""
    depth = deepest = 0
    for byte in raw:
        if byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"],
)
def test_nesting_depth_is_judged_alike_small_and_large(stack: Gateway, path: str) -> None:
    """A body nested 128 levels deep is served; one level more, or hundreds or thousands more, is
    a 400 saying so, with the same answer whether the body is small (planned in the event loop)
    or padded past 1 MiB (planned in the worker), which keeps serving."""
    base = json_depth(deep_tool_body(path, 1)) - 1
    for depth, status in [(128, 200), (129, 400), (500, 400), (985, 400), (5_000, 400)]:
        small = deep_tool_body(path, depth - base)
        assert json_depth(small) == depth
        large = small[:-1] + b" " * (1024 * 1024 + 10) + b"}"
        answers = [post(stack, path, raw) for raw in (small, large)]
        assert [a.status_code for a in answers] == [status, status], (depth, answers[1].text[:300])
        if status == 400:
            assert answers[0].json() == answers[1].json()
            assert "nested more than 128 levels deep" in answers[0].text
    r = post(stack, path, deep_tool_body(path, 3))
    assert r.status_code == 200, r.text[:300]


def test_a_large_body_carrying_the_own_key_is_refused_without_echo(stack: Gateway) -> None:
    """The request's own API key inside a large body is found there too (400, not quoted)."""
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "x" * 1_100_000 + KEY_A}]}
    r = post(stack, "/v1/chat/completions", json.dumps(body).encode())
    assert r.status_code == 400, r.text[:300]
    assert "own API key" in r.json()["error"]["message"] and KEY_A not in r.text


def worker_pids(gw: Gateway) -> list[int]:
    """The gateway's plan worker processes (children running ``gateway.plan_worker``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == gw.proc.pid and b"gateway.plan_worker" in cmdline:
            found.append(int(entry.name))
    return found


def test_a_dead_worker_costs_one_retryable_503_at_most(sim_factory, gateway_factory) -> None:
    """Killed while idle, or once while it plans a body, the worker is started again and the
    body planned there (its answer as without the kill); killed in both tries, the request gets
    a 503 with ``Retry-After`` in its API's shape, and the next large body is served. The
    gateway stops its worker when it stops."""
    gw = gateway_factory(sim_factory())
    text = escaped("Count the words here. " * 9_000)
    ok = json.dumps({"model": ALIAS, "messages": [{"role": "user", "content": "@@"}]}).encode()
    ok = ok.replace(b"@@", text.encode())
    assert post(gw, "/v1/chat/completions", ok).status_code == 200
    for _ in range(5):  # the next body at once: the gateway may not have seen the death yet
        (pid,) = worker_pids(gw)
        os.kill(pid, signal.SIGKILL)
        r = post(gw, "/v1/chat/completions", ok)
        assert r.status_code == 200, r.text[:300]

    huge = json.dumps(many("/v1/messages")).encode()

    def killing(times: int) -> httpx.Response:
        """``huge`` posted while a thread kills the worker ``times`` times as it plans."""
        killed: list[int] = []

        def kill() -> None:
            while len(killed) < times:
                pids = [p for p in worker_pids(gw) if p not in killed]
                if pids:
                    time.sleep(0.3)  # planning the huge body takes the worker seconds
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
                time.sleep(0.01)

        killer = threading.Thread(target=kill)
        killer.start()
        r = post(gw, "/v1/messages", huge)
        killer.join(10)
        assert len(killed) == times
        return r

    r = killing(1)
    assert r.status_code == 400 and "prompt is too long" in r.text, r.text[:300]
    assert any(e.get("event") == "plan_worker_restarted" for e in gw.logs())
    r = killing(2)
    assert r.status_code == 503, r.text[:300]
    assert r.headers["Retry-After"] == "1"
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    assert [e["event"] for e in gw.logs() if e.get("event") == "plan_worker_failed"] == [
        "plan_worker_failed"
    ]
    r = post(gw, "/v1/chat/completions", ok)
    assert r.status_code == 200, r.text[:300]
    (pid,) = worker_pids(gw)
    gw.proc.send_signal(signal.SIGTERM)
    gw.proc.wait(20)
    assert wait_until(lambda: not alive(pid), 5)


def alive(pid: int) -> bool:
    """``pid`` runs (exists and is not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("grace", [0.3, 10.0], ids=["cut_in_planning", "planned_then_refused"])
def test_a_body_being_planned_at_sigterm_gets_a_503(sim_factory, gateway_factory, grace) -> None:
    """SIGTERM while a large body is planned in the worker: the drain waits for it within the
    grace; cut by the grace's end, or planned but no longer admitted, it is answered 503
    ``shutting_down`` (not a cut connection logged as a client that left)."""
    gw = gateway_factory(sim_factory(), {"server": {"shutdown_grace_s": grace}})
    huge = json.dumps(many("/v1/chat/completions")).encode()
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(post(gw, "/v1/chat/completions", huge)))
    sender.start()
    assert wait_until(lambda: len(worker_pids(gw)) == 1, 10)
    time.sleep(0.1)
    gw.proc.send_signal(signal.SIGTERM)
    sender.join(grace + 20)
    (r,) = answer
    assert r.status_code == 503, r.text[:300]
    assert r.json()["error"]["code"] == "shutting_down"
    gw.proc.wait(grace + 10)
    lines = [e for e in gw.access_logs() if e.get("route") == "/v1/chat/completions"]
    assert [e["status"] for e in lines] == [503], lines
    assert lines[0].get("reason") == "shutdown", lines


def test_a_body_still_arriving_at_sigterm_gets_a_503_at_the_grace(
    sim_factory, gateway_factory
) -> None:
    """SIGTERM while a body is still being uploaded: the drain waits for it through the grace,
    then answers 503 ``shutting_down``."""
    gw = gateway_factory(sim_factory(), {"server": {"shutdown_grace_s": 1.0}})
    body = json.dumps(SMALL_CHAT).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    address = urlparse(gw.base_url)
    with socket.create_connection((address.hostname, address.port), timeout=15) as sock:
        sock.sendall(head + body[:10])
        time.sleep(0.3)
        gw.proc.send_signal(signal.SIGTERM)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 503"), received[:300]
    assert b"shutting_down" in received
    gw.proc.wait(10)


def test_the_worker_runs_the_gateways_own_code_whatever_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway started in a directory holding another ``gateway`` package (an old checkout):
    its worker still imports the gateway's own code and plans the body."""
    from gateway.config import parse_settings
    from gateway.plan_worker import Job, Planned, PlanWorker

    shadow = tmp_path / "gateway"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the wrong gateway package')\n")
    monkeypatch.chdir(tmp_path)
    settings = parse_settings({})
    job = Job("chat", None, {}, settings, settings.tenant("acme"), "r1", b"s" * 32)
    raw = json.dumps(SMALL_CHAT).encode()[:-1] + b" " * (1 << 20) + b"}"

    async def plan() -> Planned:
        worker = PlanWorker(store=None)
        try:
            return await worker.plan(job, raw)
        finally:
            await worker.close()

    planned = asyncio.run(plan())
    assert json.loads(planned.plan.body)["messages"] == SMALL_CHAT["messages"]


def test_tenants_take_turns_at_the_worker(sim_factory, gateway_factory) -> None:
    """Four large bodies of one tenant, then one of another: the other's is planned next
    (turns go round the tenants), not after all four; a body over 8 MiB leaves no worker
    behind holding the memory it took."""
    gw = gateway_factory(sim_factory())
    raw = json.dumps({**many("/v1/chat/completions"), "max_tokens": 1}).encode()
    raw = raw[:-1] + b" " * ((9 << 20) - len(raw)) + b"}"
    done: list[tuple[str, int]] = []

    def send(tenant: str, key: str) -> None:
        r = httpx.post(
            gw.url("/v1/chat/completions"),
            content=raw,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            timeout=120,
        )
        done.append((tenant, r.status_code))

    first = [threading.Thread(target=send, args=("acme", KEY_A)) for _ in range(4)]
    for thread in first:
        thread.start()
    assert wait_until(lambda: len(worker_pids(gw)) == 1, 10)
    other = threading.Thread(target=send, args=("beta", KEY_B))
    other.start()
    for thread in [*first, other]:
        thread.join(120)
    assert [status for _, status in done] == [400] * 5, done
    assert [tenant for tenant, _ in done].index("beta") <= 2, done
    assert wait_until(lambda: worker_pids(gw) == [], 5)


def test_a_stuck_worker_costs_a_503_after_the_plan_timeout(sim_factory, gateway_factory) -> None:
    """A worker that stops answering (here SIGSTOP, so it reads nothing: sending it a body of
    several MB blocks on the pipe) is given ``server.plan_timeout_s`` for the whole job, then
    killed: the request gets a 503 with ``Retry-After``, and the next large body a fresh
    worker."""
    gw = gateway_factory(sim_factory(), {"server": {"plan_timeout_s": 2.0}})
    text = escaped("Count the words here. " * 9_000)
    ok = json.dumps({"model": ALIAS, "messages": [{"role": "user", "content": "@@"}]}).encode()
    ok = ok.replace(b"@@", text.encode())
    assert post(gw, "/v1/chat/completions", ok).status_code == 200
    (pid,) = worker_pids(gw)
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    r = post(gw, "/v1/chat/completions", ok, timeout=30)
    took = time.monotonic() - started
    assert r.status_code == 503, r.text[:300]
    assert r.headers["Retry-After"] == "1"
    assert 1.9 < took < 10, took
    assert wait_until(lambda: not alive(pid), 5)
    assert any("within 2 s" in e.get("error", "") for e in gw.logs())
    assert post(gw, "/v1/chat/completions", ok).status_code == 200


def test_a_stuck_worker_during_a_listing_says_the_listing_failed(
    sim_factory, gateway_factory
) -> None:
    """A listing of input items the plan worker does not answer (SIGSTOP) is a 503 with
    ``Retry-After`` after ``server.plan_timeout_s`` whose message names the listing: the
    request had no body, so a message about reading a large request body would mislead. The
    next listing gets a fresh worker (whose start counts against the same timeout: 3 s leaves
    a loaded machine room for it)."""
    gw = gateway_factory(
        sim_factory(), {"responses": {"store": True}, "server": {"plan_timeout_s": 3.0}}
    )
    items = [{"type": "message", "role": "user", "content": f"m{i}"} for i in range(2_000)]
    r = post(gw, "/v1/responses", json.dumps({"model": ALIAS, "input": items}).encode())
    assert r.status_code == 200, r.text[:300]
    url = gw.url(f"/v1/responses/{r.json()['id']}/input_items")
    assert httpx.get(url, headers=OPENAI, timeout=30).status_code == 200
    (pid,) = worker_pids(gw)
    os.kill(pid, signal.SIGSTOP)
    r = httpx.get(url, headers=OPENAI, timeout=30)
    assert r.status_code == 503, r.text[:300]
    assert r.headers["Retry-After"] == "1"
    message = r.json()["error"]["message"]
    assert "input items" in message and "body" not in message, message
    assert wait_until(lambda: not alive(pid), 5)
    assert httpx.get(url, headers=OPENAI, timeout=30).status_code == 200


def test_refused_bodies_free_their_memory_with_their_answer(stack: Gateway) -> None:
    """Thirty compressed bombs (each decoded to the 32 MiB limit, then 413) and thirty bodies of
    900 KB refused for a bad field (400): the gateway's memory does not grow with them (each
    refused body's frames used to stay, 3-10 MiB a request, until a rare garbage collection)."""
    from tests.test_memory_bounds import rss_kib

    zstd_bomb = bomb("zstd")
    bad = json.dumps({**SMALL_CHAT, "max_tokens": "x", "pad": "p" * 900_000}).encode()
    before = rss_kib(stack.proc.pid)
    with httpx.Client(timeout=60, headers={**OPENAI, "Content-Type": "application/json"}) as client:
        for _ in range(30):
            r = client.post(
                stack.url("/v1/chat/completions"),
                content=zstd_bomb,
                headers={"Content-Encoding": "zstd"},
            )
            assert r.status_code == 413, r.text[:300]
            r = client.post(stack.url("/v1/chat/completions"), content=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    grown = (rss_kib(stack.proc.pid) - before) // 1024
    assert grown < 100, f"the gateway grew by {grown} MiB"
