"""The output budget the gateway sends for a request that set none fits the context.

vLLM refuses a request whose prompt and output budget together pass ``max_model_len``. The
gateway's default budget is ``min(tenant max_tokens, context - prompt estimate)``; for a prompt
the estimate under-states (here a tool described in punctuation: the template renders the
schema as JSON and the simulator counts a token for each such character, the estimate one for
every 3 bytes) that would pass the context. The engine's own count is asked
then, and the budget sent is what the context leaves.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import Settings
from gateway.rewrite import estimate_prompt_tokens
from tests.inprocess import AUTH_A, chat_body, open_stack

pytestmark = pytest.mark.fast

CONTEXT = Settings().engine.max_model_len
TENANT_MAX = 32_768
CHAT = "/v1/chat/completions"


def long_prompt(characters: int) -> dict[str, Any]:
    """A chat body with a tool described in ``characters`` punctuation marks, and a 5-token
    answer from the simulator."""
    tool = {"type": "function", "function": {"name": "f", "description": "!" * characters}}
    return chat_body(tools=[tool], tool_choice="none", sim={"completion_tokens": 5})


async def test_default_budget_fits_a_prompt_the_estimate_under_states(aiohttp_client: Any) -> None:
    """A prompt near the context without max_tokens is served; the engine got the room its own
    count leaves, not the room the estimate promised."""
    body = long_prompt(CONTEXT - TENANT_MAX + 8_000)
    estimate = estimate_prompt_tokens(body, "chat")
    assert CONTEXT - estimate > TENANT_MAX  # the estimate alone would send the tenant's 32,768
    async with open_stack(aiohttp_client) as stack:
        r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
        answer = await r.json()
        assert r.status == 200, answer
        prompt = answer["usage"]["prompt_tokens"]
        assert prompt + TENANT_MAX > CONTEXT
        assert stack.sim is not None
        sent = stack.sim.model_records()[-1]["body"]
        assert sent["max_completion_tokens"] == CONTEXT - prompt


async def test_default_budget_of_a_short_prompt_is_not_counted(aiohttp_client: Any) -> None:
    """A prompt whose ceiling leaves room for the tenant's budget is sent without a count."""
    async with open_stack(aiohttp_client) as stack:
        r = await stack.client.post(CHAT, json=long_prompt(100), headers=AUTH_A)
        assert r.status == 200
        assert stack.sim is not None
        assert stack.sim.model_records()[-1]["body"]["max_completion_tokens"] == TENANT_MAX
        assert not [
            line for line in stack.sim.record.read_text().splitlines() if "/tokenize" in line
        ]


PAST_THE_ESTIMATE = "a" * 780_000  # 260,000 tokens by the estimate (bytes / 3); 195,000 counted


async def test_a_prompt_the_estimate_puts_past_the_context_still_gets_a_bounded_budget(
    aiohttp_client: Any,
) -> None:
    """A prompt the estimate puts past the context, which the engine counts well inside it,
    sent without max_tokens: the engine body carries the tenant's budget (never nothing, which
    would let the engine generate all the context left, past what was reserved)."""
    body = chat_body(messages=[{"role": "user", "content": PAST_THE_ESTIMATE}])
    body["sim"] = {"completion_tokens": 5}
    assert estimate_prompt_tokens(body, "chat") > CONTEXT
    async with open_stack(aiohttp_client) as stack:
        r = await stack.client.post(CHAT, json=body, headers=AUTH_A)
        answer = await r.json()
        assert r.status == 200, answer
        assert answer["usage"]["prompt_tokens"] + TENANT_MAX < CONTEXT
        assert stack.sim is not None
        assert stack.sim.model_records()[-1]["body"]["max_completion_tokens"] == TENANT_MAX


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
async def test_a_translated_budget_is_not_cut_by_the_estimate_alone(
    aiohttp_client: Any, path: str
) -> None:
    """Anthropic ``max_tokens`` and Responses ``max_output_tokens`` of 16 with a prompt the
    estimate puts past the context but the engine counts inside it: the engine gets 16, as
    asked (the estimate alone used to cut it to 1)."""
    if path == "/v1/messages":
        body: dict[str, Any] = {
            "model": "qwen3.8-27b",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": PAST_THE_ESTIMATE}],
        }
        headers = {"x-api-key": AUTH_A["Authorization"].split()[1]}
    else:
        body = {"model": "qwen3.8-27b", "max_output_tokens": 16, "input": PAST_THE_ESTIMATE}
        headers = AUTH_A
    async with open_stack(aiohttp_client) as stack:
        r = await stack.client.post(path, json=body, headers=headers)
        assert r.status == 200, await r.text()
        assert stack.sim is not None
        assert stack.sim.model_records()[-1]["body"]["max_tokens"] == 16
