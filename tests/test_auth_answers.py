"""The 401 as each client reads it: the header the key was sent in, and no retry invited."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.inprocess import Stack, open_stack

pytestmark = pytest.mark.fast

MESSAGES = {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
WRONG = "sk-q38-wrongwrongwrongwrongwrongwrong"


@pytest.fixture
async def stack(aiohttp_client: Any) -> AsyncIterator[Stack]:
    """The gateway app in-process in front of the simulator."""
    async with open_stack(aiohttp_client) as s:
        yield s


async def refused(stack: Stack, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    response = await stack.client.post(path, json=body, headers=headers)
    assert response.status == 401
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    return await response.json()


async def test_messages_with_a_wrong_x_api_key_is_told_about_x_api_key(stack: Stack) -> None:
    """Anthropic's header in, Anthropic's header named: not 'Authorization: Bearer'."""
    body = await refused(stack, "/v1/messages", MESSAGES, {"x-api-key": WRONG})
    assert body["error"]["type"] == "authentication_error"
    message = body["error"]["message"]
    assert "'x-api-key'" in message and "Bearer" not in message
    assert WRONG not in message


async def test_messages_with_a_wrong_bearer_is_told_about_bearer(stack: Stack) -> None:
    """Claude Code's ANTHROPIC_AUTH_TOKEN (Authorization: Bearer): that header named."""
    body = await refused(stack, "/v1/messages", MESSAGES, {"Authorization": f"Bearer {WRONG}"})
    assert "'Authorization: Bearer <key>'" in body["error"]["message"]


async def test_no_key_lists_the_headers_each_api_takes(stack: Stack) -> None:
    """Without a key: Messages names x-api-key and Bearer, OpenAI's APIs name Bearer only."""
    messages = await refused(stack, "/v1/messages", MESSAGES, {})
    assert "No API key provided" in messages["error"]["message"]
    assert "'x-api-key: <key>'" in messages["error"]["message"]
    chat = await refused(stack, "/v1/chat/completions", CHAT, {})
    assert chat["error"]["code"] == "invalid_api_key"
    assert chat["error"]["message"] == (
        "No API key provided. Send one as 'Authorization: Bearer <key>'."
    )


async def test_chat_with_a_wrong_bearer_keeps_openais_shape(stack: Stack) -> None:
    """OpenAI's shape and code; the same sentence for every cause of a bad key."""
    body = await refused(stack, "/v1/chat/completions", CHAT, {"Authorization": f"Bearer {WRONG}"})
    assert body["error"] == {
        "message": "Incorrect API key provided. Send a valid key as 'Authorization: Bearer <key>'.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
