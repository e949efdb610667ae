"""Response bytes exactly as 1Cat-vLLM serialises them: JSON bodies and SSE chunk payloads.

Sources: vllm-protocol.md sections 5.1 (non-streaming body: `model_dump()`, every field, nulls
included), 5.3-5.4 (chunks: `model_dump_json(exclude_unset=True)`, compact, fixed field
order), 5.6 (in-stream error: `json.dumps`, with spaces) and 8.3 (completions). Chunk payloads
are assembled from per-request byte templates so a token costs a few concatenations.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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
        tool_parser: bool,
        include_reasoning: bool = True,
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
        self._reasoning_names = (
            ("reasoning", "reasoning_content") if reasoning_field == "both" else (reasoning_field,)
        )
        self._tool_parser = tool_parser
        self._include_reasoning = include_reasoning
        # per choice: the "\n\n" after </think> a tool parser holds until content follows
        self._held: dict[int, str] = {}

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

    def _delta(
        self, index: int, tokens: Sequence[Token], answer: Answer, final: bool
    ) -> bytes | None:
        """The `delta` of the tokens of one event of choice `index`, merged as vLLM merges the
        outputs its API server had not sent yet; None when they give the client nothing.

        Keys come in vLLM's order (`content`, `reasoning`, `tool_calls`). With a tool parser
        (`--tool-call-parser`, the deployment's setting) the ``</think>`` token yields nothing
        and the ``"\\n\\n"`` after it is held and sent with the first content (real vLLM,
        observed); without one ``</think>`` is an empty content delta. With `include_reasoning`
        false, reasoning is not streamed and content deltas carry ``"reasoning": null``.
        """
        content: list[str] | None = None
        reasoning: list[str] | None = None
        calls: dict[int, dict[str, Any]] = {}
        arguments: dict[int, list[str]] = {}
        for token in tokens:
            kind = token.kind
            if kind is Kind.CONTENT:
                if content is None:
                    content = []
                if index in self._held:
                    content.append(self._held.pop(index))
                content.append(token.text)
            elif kind is Kind.REASONING:
                if self._include_reasoning:
                    if reasoning is None:
                        reasoning = []
                    reasoning.append(token.text)
            elif kind is Kind.THINK_END:
                if not self._tool_parser and content is None:
                    content = []
            elif kind is Kind.SEPARATOR:
                if not self._tool_parser:
                    content = [*(content or ()), token.text]
                elif not answer.has_tool_calls:
                    self._held[index] = self._held.get(index, "") + token.text
            elif kind is Kind.TOOL_HEADER:
                calls[token.tool_index] = {
                    "id": token.tool_id,
                    "type": "function",
                    "index": token.tool_index,
                    "function": {"name": token.tool_name},
                }
            elif kind is Kind.TOOL_ARGS:
                calls.setdefault(token.tool_index, {"index": token.tool_index, "function": {}})
                arguments.setdefault(token.tool_index, []).append(token.text)
        for call_index, parts in arguments.items():
            calls[call_index]["function"]["arguments"] = "".join(parts)
        if final and index in self._held:
            content = [*(content or ()), self._held.pop(index)]
        delta: dict[str, Any] = {}
        if content is not None:
            delta["content"] = "".join(content)
        if reasoning is not None or (content is not None and not self._include_reasoning):
            for name in self._reasoning_names:
                delta[name] = None if reasoning is None else "".join(reasoning)
        if calls:
            delta["tool_calls"] = list(calls.values())
        if not delta:
            return _EMPTY if final else None
        return dumps(delta)

    def event(
        self, index: int, tokens: Sequence[Token], answer: Answer, completed: int
    ) -> bytes | None:
        """The chunk carrying `tokens` (one or more, in order) of chat choice `index`, or None
        when vLLM sends none for them.

        `completed` counts the choice's tokens so far, these included; the chunk holding the
        answer's last token carries its finish_reason.
        """
        final = completed == len(answer.tokens)
        delta = self._delta(index, tokens, answer, final)
        if delta is None:
            return None
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

    def text(self, index: int, tokens: Sequence[Token], answer: Answer, completed: int) -> bytes:
        """The chunk of generated tokens of a text completion (section 8.3), merged."""
        final = completed == len(answer.tokens)
        reason = b'"' + answer.finish_reason.encode() + b'"' if final else b"null"
        text = dumps("".join(t.text for t in tokens if t.kind is Kind.CONTENT))
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


def _joined(answer: Answer, *kinds: Kind) -> str | None:
    text = "".join(t.text for t in answer.tokens if t.kind in kinds)
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
    qwen3 parser does (section 9.3): reasoning only with thinking on, `content` null if empty.

    As in real vLLM, `tool_calls` is present only when the answer holds calls; `content` is
    then null, or "" for a "required" or named `tool_choice` (vLLM builds those messages with
    an empty content).
    """
    reasoning = _joined(answer, Kind.REASONING) if thinking and include_reasoning else None
    calls = _tool_calls(answer)
    if calls:
        content = "" if answer.forced_tool else None
    else:
        content = _joined(answer, Kind.SEPARATOR, Kind.CONTENT)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if calls:
        message["tool_calls"] = calls
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
    """A complete non-streaming chat response (section 5.1), every field present.

    The fork's fields: newer vLLM (0.32) also sends `ec_transfer_params` and `metrics` and a
    `completion_tokens_details` in `usage`; 1Cat-vLLM's base does not.
    """
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
