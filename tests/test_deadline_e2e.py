"""Requests whose client will not wait for them are refused at the door: the official openai and
anthropic SDKs against the real gateway and the simulator, the engine's one slot held by another
tenant's request."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import ALIAS, KEY_A, KEY_B, KEY_C, Gateway, wait_until

CONFIG = {
    "engine": {"max_concurrency": 1, "queued_comment_after_s": 0.2},
    "server": {"sse_keepalive_s": 0.25},
    # Until measured, 100-token answers at 5 tokens/s: 20 s of predicted work a request.
    "deadline": {"decode_tokens_per_s": 5.0, "expected_output_tokens": 100},
    "tenants": {"carol": {"deadline_s": 2.0}},
}
HOLD_S = 5.0
SHORT_S = 3.0
MESSAGE = [{"role": "user", "content": "deadline"}]


@pytest.fixture
def gw(sim_factory: Callable[..., Any], gateway_factory: Callable[..., Gateway]) -> Gateway:
    """A fresh gateway (no speeds measured yet) in front of a one-slot simulator."""
    return gateway_factory(sim_factory("--completion-tokens", "12"), CONFIG)


def hold_slot(gw: Gateway, seconds: float = HOLD_S, queued: int = 0) -> list[threading.Thread]:
    """Tenant beta takes the engine's slot for ``seconds`` (a stream), and ``queued``
    non-streamed requests of tenant acme (no deadline) wait behind it; all read to their end."""

    def run(stream: bool, hold_ms: float) -> None:
        body = {
            "model": ALIAS,
            "messages": [{"role": "user", "content": "hold"}],
            "stream": stream,
            "sim": {"prefill_ms": hold_ms},
        }
        gw.read_through(KEY_B if stream else KEY_A, body, 120)

    threads = [threading.Thread(target=run, args=(True, seconds * 1000), daemon=True)]
    threads[0].start()
    assert wait_until(lambda: gw.metric("gateway_requests_in_flight", tenant="beta") == 1, 10)
    for _ in range(queued):
        threads.append(threading.Thread(target=run, args=(False, 0), daemon=True))
        threads[-1].start()
    assert wait_until(lambda: gw.metric("gateway_queue_depth") == queued, 10)
    return threads


def refusals(gw: Gateway, request_id: str) -> list[dict[str, Any]]:
    """The gateway's ``deadline_refused`` log lines of one request."""
    return [
        e
        for e in gw.logs()
        if e.get("event") == "deadline_refused" and e.get("request_id") == request_id
    ]


def engine_saw(gw: Gateway, text: str) -> int:
    """Model requests the simulator received whose body mentions ``text``."""
    assert gw.sim is not None
    return sum(1 for r in gw.sim.model_records() if text in str(r.get("body")))


def test_openai_non_streamed_request_over_its_timeout_gets_503_at_once(gw: Gateway) -> None:
    """openai SDK, timeout shorter than the predicted wait: 503 with Retry-After before the
    timeout; nothing reaches the engine or is charged, no slot is held, one log line; the same
    request with a generous timeout is served."""
    threads = hold_slot(gw, queued=1)
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0)
    began = time.monotonic()
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "short"}], timeout=SHORT_S
        )
    elapsed = time.monotonic() - began
    assert elapsed < SHORT_S
    response = refused.value.response
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "engine_overloaded" and error["type"] == "server_error"
    assert "timeout of 3 s" in error["message"]
    retry_after = int(response.headers["retry-after"])
    # Ahead: beta's running request (20 s predicted) and acme's own queued one (20 s): about
    # 40 s; it would fit when its slot comes within 3 s and its own 20 s of work with it.
    assert 20 <= retry_after <= 45
    request_id = response.headers["x-request-id"]
    lines = refusals(gw, request_id)
    assert len(lines) == 1
    line = lines[0]
    assert line["ahead"] == 2 and line["source"] == "x-stainless-read-timeout"
    assert line["deadline_s"] == SHORT_S and line["predicted_start_s"] > SHORT_S
    access = [e for e in gw.access_logs() if e.get("request_id") == request_id]
    assert [(e["status"], e["reason"]) for e in access] == [(503, "deadline")]
    assert gw.metric("gateway_requests_in_flight", tenant="acme") == 1  # its queued one only
    assert gw.metric("gateway_queue_depth") == 1
    assert gw.metric("gateway_deadline_refusals_total", tenant="acme", dialect="chat") == 1
    assert gw.metric("gateway_deadline_refusals_total", reason="queue") == 1

    # The Responses API in the same shape.
    with pytest.raises(openai.InternalServerError) as refused:
        client.responses.create(model=ALIAS, input="short", timeout=SHORT_S)
    assert refused.value.response.json()["error"]["code"] == "engine_overloaded"
    assert gw.metric("gateway_deadline_refusals_total", dialect="responses") == 1

    served = client.chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": "generous"}], timeout=120
    )
    assert served.choices[0].finish_reason == "stop"
    for thread in threads:
        thread.join(60)
    client.close()
    assert engine_saw(gw, "short") == 0 and engine_saw(gw, "generous") == 1
    ledger = gw.config_path.with_name("gw-usage.sqlite3")

    def recorded() -> list[tuple[int, int, int]]:
        with sqlite3.connect(ledger) as db:
            query = "SELECT status, prompt_tokens, completion_tokens FROM usage WHERE request_id=?"
            return list(db.execute(query, (request_id,)))

    assert wait_until(lambda: recorded() == [(503, 0, 0)], 10)  # recorded, charged nothing
    assert gw.metric("gateway_tokens_total", tenant="acme", type="prompt") > 0
    assert gw.metric("gateway_deadline_refusals_total") == 2
    # The served request waited in the queue: its predicted start was measured.
    assert gw.metric("gateway_queue_start_forecast_error_seconds_count") >= 1


def test_anthropic_non_streamed_request_over_its_timeout_gets_529_overloaded(
    gw: Gateway,
) -> None:
    """anthropic SDK: 529 overloaded_error with retry-after at once; a stream with the same
    short timeout is admitted and finishes, kept alive while it waits."""
    # Held long enough that the stream still waits more than SHORT_S after the refusal's
    # checks, however long a loaded machine takes over them.
    threads = hold_slot(gw, HOLD_S + SHORT_S)
    client = anthropic.Anthropic(base_url=gw.base_url, api_key=KEY_A, max_retries=0)
    began = time.monotonic()
    with pytest.raises(anthropic.OverloadedError) as refused:
        client.messages.create(model=ALIAS, max_tokens=64, messages=MESSAGE, timeout=SHORT_S)
    assert time.monotonic() - began < SHORT_S
    response = refused.value.response
    assert response.status_code == 529
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert int(response.headers["retry-after"]) >= 1
    assert len(refusals(gw, response.headers["x-request-id"])) == 1
    assert gw.metric("gateway_deadline_refusals_total", tenant="acme", dialect="messages") == 1

    began = time.monotonic()
    with client.messages.stream(
        model=ALIAS, max_tokens=64, messages=MESSAGE, timeout=SHORT_S
    ) as stream:
        message = stream.get_final_message()
    waited = time.monotonic() - began
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 12
    assert waited > SHORT_S  # it outlived its read timeout in the queue
    for thread in threads:
        thread.join(60)
    client.close()


def test_an_openai_stream_with_a_short_timeout_is_admitted_and_finishes(gw: Gateway) -> None:
    """openai SDK stream, timeout shorter than the wait: admitted, kept alive, finished."""
    threads = hold_slot(gw)
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0)
    began = time.monotonic()
    chunks = list(
        client.chat.completions.create(model=ALIAS, messages=MESSAGE, stream=True, timeout=SHORT_S)
    )
    assert time.monotonic() - began > SHORT_S
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert gw.metric("gateway_deadline_refusals_total") == 0
    for thread in threads:
        thread.join(60)
    client.close()


def test_without_a_deadline_requests_wait_as_before(gw: Gateway) -> None:
    """No timeout header (or an unusable one) and no tenant default: served after the wait."""
    threads = hold_slot(gw)
    plain = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0, timeout=None)
    answer = plain.chat.completions.create(model=ALIAS, messages=MESSAGE)
    assert answer.choices[0].finish_reason == "stop"
    threads[0].join(60)
    threads = hold_slot(gw)
    for value in ("NOT_GIVEN", "-1", "nan", "ten"):
        r = httpx.post(
            gw.url("/v1/chat/completions"),
            json={"model": ALIAS, "messages": MESSAGE, "max_tokens": 8},
            headers={"Authorization": f"Bearer {KEY_A}", "x-stainless-timeout": value},
            timeout=60,
        )
        assert r.status_code == 200, (value, r.text)
    threads[0].join(60)
    assert gw.metric("gateway_deadline_refusals_total") == 0
    ignored = [e for e in gw.logs() if e.get("event") == "deadline_header_ignored"]
    assert len(ignored) == 4


def test_a_tenant_default_deadline_applies_when_the_client_states_none(gw: Gateway) -> None:
    """tenants.carol.deadline_s = 2: a bare request is refused; a stated timeout wins."""
    threads = hold_slot(gw)
    body = {"model": ALIAS, "messages": MESSAGE, "max_tokens": 8}
    bare = httpx.post(
        gw.url("/v1/chat/completions"),
        json=body,
        headers={"Authorization": f"Bearer {KEY_C}"},
        timeout=60,
    )
    assert bare.status_code == 503 and bare.json()["error"]["code"] == "engine_overloaded"
    line = refusals(gw, bare.headers["x-request-id"])[0]
    assert line["source"] == "tenant" and line["deadline_s"] == 2.0
    stated = httpx.post(
        gw.url("/v1/chat/completions"),
        json=body,
        headers={"Authorization": f"Bearer {KEY_C}", "x-stainless-read-timeout": "60"},
        timeout=60,
    )
    assert stated.status_code == 200
    threads[0].join(60)


def test_a_stream_without_keepalives_in_time_is_judged_like_a_non_streamed_one(
    sim_factory: Callable[..., Any], gateway_factory: Callable[..., Gateway]
) -> None:
    """With no keep-alive while queued (queued_comment_after_s = 0), a stream whose slot comes
    after its timeout is refused at once (reason stream_silence); without a timeout it waits."""
    config = {**CONFIG, "engine": {"max_concurrency": 1, "queued_comment_after_s": 0}}
    gw = gateway_factory(sim_factory("--completion-tokens", "12"), config)
    threads = hold_slot(gw)
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0)
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(model=ALIAS, messages=MESSAGE, stream=True, timeout=SHORT_S)
    assert refused.value.response.status_code == 503
    assert gw.metric("gateway_deadline_refusals_total", reason="stream_silence") == 1
    chunks = list(
        client.chat.completions.create(model=ALIAS, messages=MESSAGE, stream=True, timeout=60)
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    threads[0].join(60)
    client.close()
