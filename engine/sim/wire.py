"""Response bytes exactly as 1Cat-vLLM serialises them: JSON bodies and SSE chunk payloads.

Sources: vllm-protocol.md sections 5.1 (non-streaming body: `model_dump()`, every field, nulls
included), 5.3-5.4 (chunks: `model_dump_json(exclude_unset=True)`, compact, fixed field
order), 5.6 (in-stream error: `json.dumps`, with spaces) and 8.3 (completions). Chunk payloads
are assembled from per-request byte templates so a token costs a few concatenations.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from engine.sim.tokens import Answer, Kind, Token

IN_STREAM_ERROR = json.dumps(
    {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
).encode()
DONE = b"[DONE]"


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON, as pydantic and Starlette's JSONResponse write it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@lru_cache(maxsize=8192)
def _content_delta(text: str) -> bytes:
    return b'{"content":' + dumps(text) + b"}"


@lru_cache(maxsize=8192)
def _reasoning_delta(field: str, text: str) -> bytes:
    encoded = dumps(text)
    if field == "both":
        return b'{"reasoning":' + encoded + b',"reasoning_content":' + encoded + b"}"
    return b'{"' + field.encode() + b'":' + encoded + b"}"


_EMPTY_CONTENT = b'{"content":""}'
_EMPTY = b"{}"


def usage_object(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """vLLM's `UsageInfo` without `prompt_tokens_details`, fields in vLLM's order."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class ChunkEncoder:
    """The `data:` payloads of one streamed request (chat or text completion).

    `fingerprint` is stamped on each final chunk when no usage chunk follows; with
    `continuous_usage` every chunk carries the running usage of its choice.
    """

    def __init__(
        self,
        *,
        chat: bool,
        request_id: str,
        created: int,
        model: str,
        fingerprint: str,
        prompt_tokens: int,
        include_usage: bool,
        continuous_usage: bool,
        reasoning_field: str,
        drop_think_end: bool,
    ) -> None:
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        self._head = (
            b'{"id":'
            + dumps(request_id)
            + b',"object":"'
            + obj
            + b'","created":'
            + str(created).encode()
            + b',"model":'
            + dumps(model)
            + b',"choices":['
        )
        self._fingerprint = b',"system_fingerprint":' + dumps(fingerprint)
        self._prompt_tokens = prompt_tokens
        self._include_usage = include_usage
        self._continuous = continuous_usage
        self._reasoning_field = reasoning_field
        self._drop_think_end = drop_think_end

    def _usage(self, completion_tokens: int) -> bytes:
        if not self._continuous:
            return b""
        return b',"usage":' + dumps(usage_object(self._prompt_tokens, completion_tokens))

    def _end(self, completed: int, final: bool) -> bytes:
        stamp = self._fingerprint if final and not self._include_usage else b""
        return self._usage(completed) + stamp + b"}"

    def role(self, index: int) -> bytes:
        """The first chunk of a chat choice (section 5.4, kind 1)."""
        return (
            self._head
            + b'{"index":'
            + str(index).encode()
            + b',"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
            + self._usage(0)
            + b',"prompt_token_ids":null,"prompt_text":null}'
        )

    def _delta(self, token: Token, answer: Answer) -> bytes | None:
        kind = token.kind
        if kind is Kind.CONTENT:
            return _content_delta(token.text)
        if kind is Kind.REASONING:
            return _reasoning_delta(self._reasoning_field, token.text)
        if kind is Kind.THINK_END:
            return None if self._drop_think_end or answer.tool_mode else _EMPTY_CONTENT
        if kind is Kind.TOOL_HEADER:
            call = {
                "id": token.tool_id,
                "type": "function",
                "index": token.tool_index,
                "function": {"name": token.tool_name, "arguments": ""},
            }
            return dumps({"tool_calls": [call]})
        if kind is Kind.TOOL_ARGS:
            call = {"index": token.tool_index, "function": {"arguments": token.text}}
            return dumps({"tool_calls": [call]})
        return _EMPTY if answer.tool_mode else _EMPTY_CONTENT

    def token(self, index: int, token: Token, answer: Answer, completed: int) -> bytes | None:
        """The chunk of one generated token of choice `index`, or None when vLLM sends none.

        `completed` counts the choice's tokens so far, this one included; the answer's last
        token carries its finish_reason.
        """
        final = completed == len(answer.tokens)
        delta = self._delta(token, answer)
        if delta is None:
            if not final:
                return None
            delta = _EMPTY
        prefix = self._head + b'{"index":' + str(index).encode() + b',"delta":' + delta
        if not final:
            return (
                prefix
                + b',"logprobs":null,"finish_reason":null,"token_ids":null}]'
                + self._usage(completed)
                + b"}"
            )
        return (
            prefix
            + b',"logprobs":null,"finish_reason":"'
            + answer.finish_reason.encode()
            + b'","stop_reason":null,"token_ids":null}]'
            + self._end(completed, True)
        )

    def text(self, index: int, token: Token, answer: Answer, completed: int) -> bytes:
        """The chunk of one generated token of a text completion (section 8.3)."""
        final = completed == len(answer.tokens)
        reason = b'"' + answer.finish_reason.encode() + b'"' if final else b"null"
        text = b'""' if token.kind is Kind.EOS else dumps(token.text)
        return (
            self._head
            + b'{"index":'
            + str(index).encode()
            + b',"text":'
            + text
            + b',"logprobs":null,"finish_reason":'
            + reason
            + b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
            + self._end(completed, final)
        )

    def usage(self, completion_tokens: int) -> bytes:
        """The usage-only chunk sent after every final chunk (`choices: []`)."""
        return (
            self._head
            + b'],"usage":'
            + dumps(usage_object(self._prompt_tokens, completion_tokens))
            + self._fingerprint
            + b"}"
        )


def _joined(answer: Answer, kind: Kind) -> str | None:
    text = "".join(t.text for t in answer.tokens if t.kind is kind)
    return text or None


def _tool_calls(answer: Answer) -> list[dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for token in answer.tokens:
        if token.kind is Kind.TOOL_HEADER:
            calls[token.tool_index] = {
                "id": token.tool_id,
                "type": "function",
                "function": {"name": token.tool_name, "arguments": ""},
            }
        elif token.kind is Kind.TOOL_ARGS:
            calls[token.tool_index]["function"]["arguments"] += token.text
    return list(calls.values())


def chat_message(
    answer: Answer, *, thinking: bool, include_reasoning: bool, field: str
) -> dict[str, Any]:
    """The non-streaming `message` of one choice (section 5.1), reasoning split as vLLM's
    qwen3 parser does (section 9.3): reasoning only with thinking on, `content` null if empty."""
    reasoning = _joined(answer, Kind.REASONING) if thinking and include_reasoning else None
    message: dict[str, Any] = {
        "role": "assistant",
        "content": _joined(answer, Kind.CONTENT),
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": _tool_calls(answer),
    }
    if field in ("reasoning", "both"):
        message["reasoning"] = reasoning
    if field in ("reasoning_content", "both"):
        message["reasoning_content"] = reasoning
    return message


def chat_body(
    *,
    request_id: str,
    created: int,
    model: str,
    fingerprint: str,
    messages: list[tuple[dict[str, Any], Answer]],
    prompt_tokens: int,
) -> bytes:
    """A complete non-streaming chat response (section 5.1), every field present."""
    choices = [
        {
            "index": index,
            "message": message,
            "logprobs": None,
            "finish_reason": answer.finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
        for index, (message, answer) in enumerate(messages)
    ]
    completion_tokens = sum(len(answer.tokens) for _, answer in messages)
    return dumps(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": {
                **usage_object(prompt_tokens, completion_tokens),
                "prompt_tokens_details": None,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
        }
    )


def completion_body(
    *,
    request_id: str,
    created: int,
    model: str,
    fingerprint: str,
    answers: list[Answer],
    prompt_tokens: int,
) -> bytes:
    """A complete non-streaming text completion response (section 8.3)."""
    choices = [
        {
            "index": index,
            "text": "".join(t.text for t in answer.tokens if t.kind is Kind.CONTENT),
            "logprobs": None,
            "finish_reason": answer.finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }
        for index, answer in enumerate(answers)
    ]
    completion_tokens = sum(len(answer.tokens) for answer in answers)
    return dumps(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": {
                **usage_object(prompt_tokens, completion_tokens),
                "prompt_tokens_details": None,
            },
            "kv_transfer_params": None,
        }
    )
