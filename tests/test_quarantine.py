"""Poison-request quarantine with real processes: the simulator crashes on a request, a restarter
brings it back like the launcher, the gateway retries once, then refuses that request alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import QuarantineSettings
from gateway.errors import RequestQuarantined
from gateway.metrics import Metrics
from gateway.quarantine import Quarantine, fingerprint, fingerprint_key
from gateway.state import ADMISSION, QUARANTINE
from tests.conftest import ALIAS, KEY_A, KEY_B, REPO, Gateway, Sim, wait_until
from tests.inprocess import AUTH_A, chat_body, open_stack, until

CHAT = "/v1/chat/completions"

# The simulator holds the request 1 s, then exits before any byte of an answer.
POISON = {"headers_delay_s": 1.0, "exit_after": 0}


class Restarter:
    """Restarts the simulator whenever it exits, as the launcher does; counts the crashes."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.crashes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sim.proc.poll() is not None:
                self.crashes += 1
                time.sleep(0.3)  # a restart is not instant
                self.sim.restart()
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def crashing(sim_factory: Any, gateway_factory: Any) -> Iterator[tuple[Gateway, Restarter]]:
    sim = sim_factory("--tokens-per-second", "200")
    gw = gateway_factory(sim, {"engine": {"queue_timeout_s": 30, "health_interval_s": 0.1}})
    restarter = Restarter(sim)
    yield gw, restarter
    restarter.stop()


def client(gw: Gateway, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url("/v1"), api_key=key, max_retries=0, timeout=60)


def ask(gw: Gateway, key: str, sim: dict[str, Any] | None = None, content: str = "hi") -> Any:
    extra = {"sim": sim} if sim else None
    with client(gw, key) as openai_client:
        return openai_client.chat.completions.create(
            model=ALIAS,
            messages=[{"role": "user", "content": content}],
            max_tokens=8,
            extra_body=extra,
        )


def test_request_that_killed_the_engine_twice_is_refused_the_third_time(
    crashing: tuple[Gateway, Restarter],
) -> None:
    """A request killing the engine is retried once, then 422 request_quarantined, and the third
    send is refused without reaching the engine; another tenant's queued request is served."""
    gw, restarter = crashing
    outcome: dict[str, Any] = {}

    def poison() -> None:
        try:
            ask(gw, KEY_A, POISON)
        except openai.APIStatusError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=poison)
    thread.start()
    time.sleep(0.4)
    other = ask(gw, KEY_B, content="queued behind the poison")  # waits through both crashes
    thread.join(60)
    assert other.usage.completion_tokens > 0
    error = outcome["error"]
    assert isinstance(error, openai.UnprocessableEntityError)
    body = error.response.json()["error"]
    assert body["code"] == "request_quarantined" and body["type"] == "invalid_request_error"
    assert int(error.response.headers["Retry-After"]) > 3600
    assert restarter.crashes == 2
    assert gw.metric("gateway_engine_retries_total") == 1

    with pytest.raises(openai.UnprocessableEntityError):
        ask(gw, KEY_A, POISON)
    with pytest.raises(openai.UnprocessableEntityError):
        ask(gw, KEY_B, POISON)  # the same request from another tenant is the same poison
    time.sleep(0.5)
    assert restarter.crashes == 2, "a quarantined request never reaches the engine"
    assert ask(gw, KEY_A, content="a different request").usage.completion_tokens > 0
    assert gw.metric("gateway_quarantine_entries") == 1
    assert gw.metric("gateway_quarantined_requests_total", tenant="acme") == 2
    assert gw.metric("gateway_quarantined_requests_total", tenant="beta") == 1
    fp = body["message"].split("fingerprint ")[1][:32]
    events = [e for e in gw.logs() if e.get("event") == "engine_death_suspect"]
    assert [e["fingerprint"] for e in events] == [fp, fp] and events[-1]["quarantined"]
    assert "exit_after" not in gw.log_path.read_text(), "the content is never logged"

    listed = cli(gw, "list")
    assert listed.returncode == 0 and fp in listed.stdout
    cleared = cli(gw, "clear", fp)
    assert cleared.returncode == 0 and f"cleared {fp}" in cleared.stdout
    assert wait_until(lambda: gw.metric("gateway_quarantine_entries") == 0, 5)
    assert fp not in cli(gw, "list", "--all").stdout
    assert cli(gw, "clear", fp).returncode == 1


def test_the_same_request_queued_behind_is_refused_at_its_turn(
    crashing: tuple[Gateway, Restarter],
) -> None:
    """A copy of the poison waiting in the queue is refused when its turn comes, without
    reaching the engine: two crashes in all."""
    gw, restarter = crashing
    errors: list[Exception] = []

    def poison(key: str) -> None:
        try:
            ask(gw, key, POISON)
        except openai.APIStatusError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=poison, args=(key,)) for key in (KEY_A, KEY_B)]
    threads[0].start()
    time.sleep(0.4)
    threads[1].start()
    for thread in threads:
        thread.join(60)
    assert [type(e) for e in errors] == [openai.UnprocessableEntityError] * 2
    assert restarter.crashes == 2 and gw.metric("gateway_engine_retries_total") == 1


def cli(gw: Gateway, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gateway", "quarantine", args[0], "--config"]
    return subprocess.run(
        [*command, str(gw.config_path), *args[1:]],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
        check=False,
    )


def test_request_that_streamed_a_byte_is_never_retried(
    crashing: tuple[Gateway, Restarter],
) -> None:
    """The engine dying after 3 streamed tokens ends the stream with an error event, once."""
    gw, restarter = crashing
    payload = {
        "model": ALIAS,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "sim": {"exit_after": 3},
    }
    with httpx.stream(
        "POST",
        gw.url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {KEY_A}"},
        json=payload,
        timeout=30,
    ) as resp:
        text = resp.read().decode()
    assert resp.status_code == 200
    assert '"error"' in text.rsplit("data: ", 1)[-1]
    assert wait_until(lambda: restarter.crashes == 1, 5)
    time.sleep(1.0)
    assert restarter.crashes == 1 and gw.metric("gateway_engine_retries_total") == 0
    assert gw.metric("gateway_quarantine_entries") == 0, "one death is not enough"


@pytest.mark.fast
@pytest.mark.parametrize("cut", ["time limit", "client gone"])
async def test_a_request_cut_at_the_engine_is_no_longer_tracked_there(
    aiohttp_client: Any, cut: str
) -> None:
    """A non-streamed request cut while the engine generates its answer (its time limit, or its
    client leaving) is forgotten by the quarantine like a finished one: not kept as at the
    engine, nor its engine body with it."""
    limit = {"engine": {"request_timeout_s": 0.5 if cut == "time limit" else 0}}
    async with open_stack(aiohttp_client, limit, handler_cancellation=True) as stack:
        quarantine = stack.app[QUARANTINE]
        answer = await stack.client.post(CHAT, json=chat_body(max_tokens=4), headers=AUTH_A)
        assert answer.status == 200 and not quarantine._running
        slow = chat_body(max_tokens=40, sim={"tokens_per_second": 20})
        if cut == "time limit":
            answer = await stack.client.post(CHAT, json=slow, headers=AUTH_A)
            assert answer.status == 504
        else:
            sending = asyncio.ensure_future(stack.client.post(CHAT, json=slow, headers=AUTH_A))
            assert await until(lambda: bool(quarantine._running))
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending
        sim = stack.sim
        assert sim is not None
        assert await until(lambda: [r["outcome"] for r in sim.model_records()][1:] == ["aborted"])
        assert await until(lambda: stack.app[ADMISSION].in_flight == 0)
        assert quarantine._running == {}


def make_quarantine(tmp_path: Path, **settings: Any) -> Quarantine:
    config = QuarantineSettings(state_file=str(tmp_path / "q.json"), **settings)
    return Quarantine(config, fingerprint_key(b"secret"), Metrics(CollectorRegistry()))


def test_fingerprint_ignores_ids_and_salts_and_depends_on_the_secret() -> None:
    """Two sends of one request match whatever their request id, salt or key order; content and
    the server secret change it."""
    key = fingerprint_key(b"secret")
    a = json.dumps({"model": "m", "messages": [1], "request_id": "x", "cache_salt": "s1"})
    b = json.dumps({"cache_salt": "s2", "request_id": "y", "messages": [1], "model": "m"})
    assert fingerprint(key, a.encode()) == fingerprint(key, b.encode())
    assert fingerprint(key, a.encode()) != fingerprint(key, a.replace("[1]", "[2]").encode())
    assert fingerprint(fingerprint_key(b"other"), a.encode()) != fingerprint(key, a.encode())
    assert len(fingerprint(key, b"not json")) == 32


def test_only_requests_at_the_engine_are_suspects(tmp_path: Path) -> None:
    """A death marks requests whose engine connection failed around it, never those that
    finished or kept their connection; two deaths within the window quarantine, and the state
    survives in the file."""
    q = make_quarantine(tmp_path)
    running = q.started("aa" * 16, "r1")
    done = q.started("bb" * 16, "r2")
    alive = q.started("dd" * 16, "r4")
    q.finished(done, dropped=False)
    assert q.engine_died() == []
    q.finished(running, dropped=True)  # the same death, seen later by the request itself
    q.finished(alive, dropped=False)  # its connection outlived the outage: no death
    q.engine_ready()
    assert not q.entries()
    for _ in range(2):
        again = q.started("dd" * 16, "r5")
        q.engine_died()
        q.finished(again, dropped=False)
        q.engine_ready()
    assert not q.entries(), "a live connection through two outages is no suspect"
    again = q.started("aa" * 16, "r3")
    q.finished(again, dropped=True)
    assert q.engine_died() == ["aa" * 16]
    assert list(q.entries()) == ["aa" * 16]
    assert list(make_quarantine(tmp_path).entries()) == ["aa" * 16]


def test_a_request_print_is_the_body_fingerprint_and_is_quarantined(tmp_path: Path) -> None:
    """The print the gateway makes per request (computed when first needed) is the body's
    fingerprint: a body that killed the engine twice is refused by it, another body is not."""
    q = make_quarantine(tmp_path)
    body = b'{"messages":[{"role":"user","content":"boom"}],"request_id":"r1"}'
    same_request_again = b'{"request_id":"r2","messages":[{"role":"user","content":"boom"}]}'
    other = b'{"messages":[{"role":"user","content":"fine"}]}'
    assert str(q.fingerprint(body)) == fingerprint(q.key, body)
    assert str(q.fingerprint(body)) == str(q.fingerprint(same_request_again))
    q.check(q.fingerprint(body), "acme")  # nothing quarantined: passes
    for rid in ("r1", "r2"):
        token = q.started(q.fingerprint(body), rid)
        q.finished(token, dropped=True)
        q.engine_died()
        q.engine_ready()
    assert list(q.entries()) == [fingerprint(q.key, body)]
    with pytest.raises(RequestQuarantined):
        q.check(q.fingerprint(same_request_again), "acme")
    q.check(q.fingerprint(other), "acme")


def test_deaths_outside_the_window_do_not_add_up(tmp_path: Path) -> None:
    """Two deaths further apart than quarantine.window_s quarantine nothing."""
    now = [1000.0]
    q = Quarantine(
        QuarantineSettings(state_file=str(tmp_path / "q.json"), window_s=60),
        fingerprint_key(b"secret"),
        Metrics(CollectorRegistry()),
        clock=lambda: now[0],
    )
    for _ in range(2):
        token = q.started("cc" * 16, "r")
        q.finished(token, dropped=True)
        q.engine_died()
        q.engine_ready()
        now[0] += 61
    assert not q.entries()
    now[0] -= 30  # 31 s after the second death
    token = q.started("cc" * 16, "r")
    q.finished(token, dropped=True)
    assert q.engine_died() == ["cc" * 16], "within the window two deaths do quarantine"


def test_unreadable_state_file_keeps_the_last_state(tmp_path: Path) -> None:
    """A state file that cannot be read (a directory in its place) is logged, not fatal."""
    (tmp_path / "q.json").mkdir()
    q = make_quarantine(tmp_path)
    q.refresh()
    assert not q.entries()


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ({"state": "killing", "detail": "hung: no progress for 1800 s"}, True),
        ({"state": "ready", "last_restart": {"reason": "hang", "at": 990.0}}, True),
        ({"state": "ready", "last_restart": {"reason": "hang", "at": 100.0}}, False),
        ({"state": "killing", "detail": "unhealthy: /health failed"}, False),
        ({"state": "ready", "last_restart": {"reason": "exited", "at": 990.0}}, False),
    ],
)
def test_a_hang_kill_is_told_apart_from_a_crash(
    tmp_path: Path, status: dict[str, Any], expected: bool
) -> None:
    """The launcher's status file says when the engine was killed for a hang (no retry then)."""
    from gateway.launcher_status import killed_for_hang

    path = tmp_path / "status.json"
    path.write_text(json.dumps({"format": 1, **status}))
    assert killed_for_hang(str(path), 1000.0) is expected
    assert killed_for_hang(str(tmp_path / "absent.json"), 1000.0) is False
