"""End to end: the official openai SDK -> gateway process -> engine simulator process."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import ALIAS, KEY_A, KEY_B, Gateway

_CLIENTS: list[openai.OpenAI] = []


def sdk(gw: Gateway, key: str = KEY_A, **kwargs: object) -> openai.OpenAI:
    client = openai.OpenAI(base_url=gw.url("/v1"), api_key=key, **kwargs)  # type: ignore[arg-type]
    _CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
def _close_sdk_clients() -> Iterator[None]:
    """Close every client a test made (an unclosed connection is a ResourceWarning, an error)."""
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


def test_sdk_non_stream_thinking_on_has_reasoning_content(stack: Gateway) -> None:
    """Thinking on (the default): message.reasoning_content holds the reasoning, content the answer."""
    r = sdk(stack).chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": "Capital of France?"}]
    )
    message = r.choices[0].message
    extra = message.model_extra or {}
    assert extra.get("reasoning_content")
    assert "reasoning" not in extra
    assert message.content and "<think>" not in message.content
    assert r.model == ALIAS
    assert r.usage is not None and r.usage.completion_tokens > 0


def test_sdk_stream_thinking_off_has_no_reasoning(stack: Gateway) -> None:
    """Thinking off via extra_body: deltas carry content only, and no usage chunk unasked."""
    stream = sdk(stack).chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    for chunk in chunks:
        assert chunk.usage is None
        for choice in chunk.choices:
            assert not (choice.delta.model_extra or {}).get("reasoning_content")
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


async def test_async_sdk_stream_with_usage(stack: Gateway) -> None:
    """The async SDK streams reasoning then content, and gets usage when it asks for it."""
    client = openai.AsyncOpenAI(base_url=stack.url("/v1"), api_key=KEY_A)
    stream = await client.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    reasoning, content, usage = "", "", None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    await client.close()
    assert reasoning and content
    assert usage is not None and usage.completion_tokens > 0


def test_sdk_completions_stream_and_not(stack: Gateway) -> None:
    """/v1/completions works streaming and not, under the alias."""
    client = sdk(stack)
    r = client.completions.create(model=ALIAS, prompt="Once upon a time", max_tokens=8)
    assert r.choices[0].text and r.model == ALIAS
    chunks = list(client.completions.create(model=ALIAS, prompt="Hi", max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def test_sdk_models_list_and_retrieve(stack: Gateway) -> None:
    """/v1/models shows the alias only, with max_model_len and no server path."""
    client = sdk(stack)
    models = client.models.list().data
    assert [m.id for m in models] == [ALIAS]
    card = client.models.retrieve(ALIAS)
    assert (card.model_extra or {}).get("max_model_len") == 254976
    assert "root" not in (card.model_extra or {})
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_sdk_errors_have_openai_shape(stack: Gateway) -> None:
    """Bad key -> AuthenticationError; unknown model -> NotFoundError; engine 400 passes as 400."""
    with pytest.raises(openai.AuthenticationError) as auth:
        sdk(stack, key="sk-wrong").models.list()
    assert auth.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as missing:
        sdk(stack).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk(stack).chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "x"}], max_tokens=300_000
        )
    assert too_long.value.status_code == 400


def test_request_id_echoed_and_forwarded_and_key_not_forwarded(stack: Gateway) -> None:
    """x-request-id is echoed and reaches the engine as the prefix of a unique id; the client's Authorization never does."""
    r = httpx.post(
        stack.url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {KEY_A}", "X-Request-Id": "trace-123"},
        json={"messages": [{"role": "user", "content": "req id"}], "max_tokens": 4},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-123"
    assert r.json()["id"].startswith("chatcmpl-trace-123")
    assert stack.sim is not None
    rec = [
        x
        for x in stack.sim.model_records()
        if x["body"] and str(x["body"].get("request_id")).startswith("trace-123-")
    ]
    assert rec, "engine did not see the request id"
    headers = {k.lower(): v for k, v in rec[-1]["headers"].items()}
    assert headers.get("x-request-id") == rec[-1]["body"]["request_id"]
    assert "authorization" not in headers
    assert KEY_A not in json.dumps(rec[-1])


def test_insane_request_id_replaced(stack: Gateway) -> None:
    """A request id with unsafe characters is replaced by a generated one."""
    r = httpx.get(stack.url("/health"), headers={"X-Request-Id": "bad id\twith spaces" + "x" * 200})
    assert r.status_code == 200
    assert " " not in r.headers["x-request-id"] and len(r.headers["x-request-id"]) <= 128


def test_ratelimit_headers_on_model_responses(stack: Gateway) -> None:
    """Authenticated model responses carry OpenAI's six x-ratelimit-* headers."""
    r = httpx.post(
        stack.url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {KEY_A}"},
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        timeout=30,
    )
    for kind in ("requests", "tokens"):
        for part in ("limit", "remaining", "reset"):
            assert f"x-ratelimit-{part}-{kind}" in r.headers


def test_health_and_ready(stack: Gateway) -> None:
    """/health and /ready need no key; /ready reports the engine state as JSON."""
    assert httpx.get(stack.url("/health")).status_code == 200
    ready = httpx.get(stack.url("/ready"))
    assert ready.status_code == 200 and ready.json()["engine"] == "ready"


def test_bad_json_and_wrong_method(stack: Gateway) -> None:
    """Malformed JSON is 400 and a wrong method 405, both in OpenAI error shape."""
    h = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    r = httpx.post(stack.url("/v1/chat/completions"), headers=h, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(stack.url("/v1/chat/completions"), headers=h)
    assert r.status_code == 405 and "error" in r.json()


def test_credential_shaped_request_id_replaced(stack: Gateway) -> None:
    """A key sent as x-request-id by mistake is neither echoed nor forwarded nor logged."""
    r = httpx.get(stack.url("/health"), headers={"X-Request-Id": KEY_A})
    assert r.headers["x-request-id"] != KEY_A
    assert KEY_A not in stack.log_path.read_text()


def test_credential_sent_as_model_is_not_echoed(stack: Gateway) -> None:
    """A key pasted into the model field gets 404 without the key in the error body."""
    r = httpx.post(
        stack.url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {KEY_A}"},
        json={"model": KEY_B, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 404 and KEY_B not in r.text
    r = httpx.get(stack.url(f"/v1/models/{KEY_A}"), headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 404 and KEY_A not in r.text
