"""Cases C20, C22 and C24: time limits, keep-alives and odd events on the model request path."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai

from tests.conftest import ALIAS, KEY_A, Gateway

AUTH = {"Authorization": f"Bearer {KEY_A}"}


def chat(sim: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A chat body, with the simulator's per-request ``sim`` object when given."""
    out: dict[str, Any] = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]}
    if sim:
        out["sim"] = sim
    out.update(extra)
    return out


def raw_stream(gw: Gateway, payload: dict[str, Any], timeout: float = 60) -> tuple[int, bytes]:
    """POST a streaming chat request; its status and every byte of the body."""
    with httpx.stream(
        "POST",
        gw.url("/v1/chat/completions"),
        json={**payload, "stream": True},
        headers=AUTH,
        timeout=timeout,
    ) as r:
        return r.status_code, b"".join(r.iter_raw())


def data_payloads(raw: bytes) -> list[bytes]:
    """The payload of every ``data:`` line of an SSE body."""
    return [
        line[5:].strip()
        for line in raw.replace(b"\r\n", b"\n").split(b"\n")
        if line.startswith(b"data:")
    ]


def sdk(gw: Gateway, timeout: float = 60) -> openai.OpenAI:
    """The official client pointed at the gateway, no retries."""
    return openai.OpenAI(base_url=gw.url("/v1"), api_key=KEY_A, max_retries=0, timeout=timeout)


# ----------------------------------------------------------------------------------------- C24


def test_c24_non_json_engine_events_are_dropped(stack: Gateway) -> None:
    """C24: data:, data: null, data: hello, data: [1,2] from the engine never reach the client; the SDK finishes."""
    status, raw = raw_stream(stack, chat({"junk_events": True, "completion_tokens": 8}))
    assert status == 200
    payloads = data_payloads(raw)
    assert payloads[-1] == b"[DONE]"
    for payload in payloads[:-1]:
        assert isinstance(json.loads(payload), dict), payload
    assert len(payloads) >= 8
    stream = sdk(stack).chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"sim": {"junk_events": True, "completion_tokens": 8}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text
    time.sleep(0.2)
    dropped = [e for e in stack.logs() if e.get("event") == "engine_event_dropped"]
    ids = [e.get("request_id") for e in dropped]
    assert len(ids) >= 2 and len(set(ids)) == len(ids), "logged once per request"
