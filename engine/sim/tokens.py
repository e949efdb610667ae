"""The simulator's deterministic token rule and the token sequence of every answer.

Prompt tokens (what `usage.prompt_tokens` reports and the context check uses):

- chat: ``3 + sum(4 + ceil(B / 4) for each message)``, where B is the number of UTF-8 bytes of
  the message text: the `content` string, or the `text` of its text parts, concatenated;
- completions: ``ceil(B / 4)`` for a text prompt, the list length for a token-id prompt.

Generated tokens: one token per stream delta chunk, and `usage.completion_tokens` counts them
all, reasoning included, like vLLM. An answer is, in order:

1. with thinking on: reasoning tokens (the last one is ``"\\n"``), then the ``</think>`` token
   (an empty content delta; no chunk at all when the server has a tool parser, as in vLLM);
2. ``"\\n\\n"`` (with thinking on), then the content tokens; or, with the `tool_calls` fault,
   per call one header token and one token per 5-character fragment of its JSON arguments;
3. an end-of-sequence token (its delta is empty), whose presence means finish_reason `stop`.

Default lengths: the whole answer has `completion_tokens` tokens, a third of them reasoning
when thinking is on. Default words cycle through fixed vocabularies holding ASCII, CJK and
emoji (`CONTENT_VOCAB`, `REASONING_VOCAB`), starting 7 words further for each choice index.
`text` / `reasoning_text` overrides are cut by `split_tokens`. When `max_tokens` is smaller
than the answer, the first `max_tokens` tokens are sent and finish_reason is `length`.
"""

from __future__ import annotations

import enum
import json
import math
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.sim.options import Behaviour

CONTENT_VOCAB = (
    "Simulated",
    " answer",
    ":",
    " the",
    " engine",
    " streams",
    " 你",
    "好",
    "，",
    " 世",
    "界",
    " 🚀",
    " tokens",
    " at",
    " a",
    " steady",
    " pace",
    " é",
    "t",
    "é",
    " ✓",
    " 模",
    "型",
    ".",
    " 😀",
    "\n",
)
REASONING_VOCAB = (
    "Let",
    " me",
    " think",
    " about",
    " this",
    ":",
    " 用",
    "户",
    " wants",
    " a",
    " reply",
    ",",
    " 🤔",
    " so",
    " I",
    " will",
    " answer",
    ".",
)
# Arguments of the two parallel calls of the `tool_calls` fault: CJK and emoji inside strings.
TOOL_CALLS: tuple[tuple[str, dict[str, str]], ...] = (
    ("get_weather", {"city": "東京 🌸", "unit": "celsius"}),
    ("get_time", {"timezone": "Asia/Tokyo", "note": "café ☕ 👩‍💻"}),
)
TOOL_FRAGMENT_CHARS = 5
CHOICE_OFFSET = 7
PAD = "~"

_TOKEN_RE = re.compile(r" ?[A-Za-z0-9]+| ?[^\sA-Za-z0-9]|\s+")


class Kind(enum.IntEnum):
    """What a generated token is."""

    REASONING = 1
    THINK_END = 2
    CONTENT = 3
    TOOL_HEADER = 4
    TOOL_ARGS = 5
    EOS = 6


@dataclass(frozen=True)
class Token:
    """One generated token: its kind, its text, and for tool tokens the call it belongs to."""

    kind: Kind
    text: str = ""
    tool_index: int = 0
    tool_id: str = ""
    tool_name: str = ""


@dataclass(frozen=True)
class Answer:
    """The tokens of one choice and its finish_reason (`stop`, `length` or `tool_calls`)."""

    tokens: tuple[Token, ...]
    finish_reason: str

    @property
    def tool_mode(self) -> bool:
        """True when the answer holds tool calls (deltas and final chunk differ)."""
        return self.finish_reason == "tool_calls"


def split_tokens(text: str) -> list[str]:
    """Cut `text` into tokens: ASCII letters/digits with one optional leading space, any other
    single character with one optional leading space, or a run of whitespace. Joining the
    result gives `text` back."""
    return _TOKEN_RE.findall(text)


def text_tokens(text: str) -> int:
    """Tokens of a text prompt: ceil(UTF-8 bytes / 4)."""
    return math.ceil(len(text.encode("utf-8")) / 4)


def message_text(message: object) -> str:
    """The text of one chat message: `content` if a string, else its text parts joined."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def chat_prompt_tokens(messages: Sequence[object]) -> int:
    """Tokens of a chat prompt: 3 + sum of (4 + ceil(UTF-8 bytes of the message text / 4))."""
    return 3 + sum(4 + text_tokens(message_text(m)) for m in messages)


def _vocab(vocab: Sequence[str], start: int, count: int) -> list[str]:
    return [vocab[(start + i) % len(vocab)] for i in range(count)]


def _pad(texts: Iterable[str], size: int) -> list[str]:
    return [t + PAD * max(0, size - len(t.encode("utf-8"))) for t in texts]


def _one_call(spec: str) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The `tool_call` behaviour ``NAME {JSON arguments}`` as a call list (bad JSON: no args)."""
    name, _, raw = spec.strip().partition(" ")
    try:
        arguments = json.loads(raw) if raw.strip() else {}
    except ValueError:
        arguments = {}
    return ((name, arguments if isinstance(arguments, dict) else {}),)


def _tool_tokens(
    stream: bool, calls: tuple[tuple[str, dict[str, Any]], ...] = TOOL_CALLS
) -> list[Token]:
    tokens: list[Token] = []
    for index, (name, arguments) in enumerate(calls):
        call_id = f"call_{uuid.uuid4().hex[:24]}" if stream else f"chatcmpl-tool-{uuid.uuid4().hex}"
        tokens.append(Token(Kind.TOOL_HEADER, "", index, call_id, name))
        encoded = json.dumps(arguments, ensure_ascii=False)
        tokens.extend(
            Token(Kind.TOOL_ARGS, encoded[i : i + TOOL_FRAGMENT_CHARS], index, call_id, name)
            for i in range(0, len(encoded), TOOL_FRAGMENT_CHARS)
        )
    return tokens


def _finish(body: list[Token], max_tokens: int, tools: bool) -> Answer:
    tokens = [*body, Token(Kind.EOS)]
    reason = "stop"
    if len(tokens) > max_tokens:
        tokens, reason = tokens[:max_tokens], "length"
    if tools and any(t.kind is Kind.TOOL_HEADER for t in tokens):
        reason = "tool_calls"
    return Answer(tuple(tokens), reason)


def chat_answer(
    behaviour: Behaviour, *, choice: int, thinking: bool, max_tokens: int, stream: bool
) -> Answer:
    """The tokens of one chat choice (rule in the module docstring).

    `max_tokens` (>= 1) caps the answer; `stream` picks the tool-call id style (`call_` + 24 hex
    streaming, `chatcmpl-tool-` + 32 hex otherwise; vllm-protocol.md section 5.4).
    """
    total = behaviour.completion_tokens
    start = choice * CHOICE_OFFSET
    reasoning_count = total // 3 if thinking else 0
    body: list[Token] = []
    if thinking:
        if behaviour.reasoning_text is not None:
            reasoning = split_tokens(behaviour.reasoning_text)
        else:
            reasoning = [*_vocab(REASONING_VOCAB, start, reasoning_count - 1), "\n"][
                :reasoning_count
            ]
        body += [Token(Kind.REASONING, t) for t in _pad(reasoning, behaviour.token_bytes)]
        body.append(Token(Kind.THINK_END, "</think>"))
    if behaviour.tool_calls or behaviour.tool_call:
        calls = _one_call(behaviour.tool_call) if behaviour.tool_call else TOOL_CALLS
        body += _tool_tokens(stream, calls)
        return _finish(body, max_tokens, tools=True)
    if thinking:
        body.append(Token(Kind.CONTENT, "\n\n"))
    if behaviour.text is not None:
        content = split_tokens(behaviour.text)
    else:
        content = _vocab(CONTENT_VOCAB, start, max(0, total - 1 - len(body)))
    body += [Token(Kind.CONTENT, t) for t in _pad(content, behaviour.token_bytes)]
    if behaviour.text is None and behaviour.reasoning_text is None:
        body = body[: total - 1]
    return _finish(body, max_tokens, tools=False)


def completion_answer(behaviour: Behaviour, *, choice: int, max_tokens: int) -> Answer:
    """The tokens of one /v1/completions choice: content only, no chat template, no reasoning."""
    if behaviour.text is not None:
        content = split_tokens(behaviour.text)
    else:
        content = _vocab(CONTENT_VOCAB, choice * CHOICE_OFFSET, behaviour.completion_tokens - 1)
    body = [Token(Kind.CONTENT, t) for t in _pad(content, behaviour.token_bytes)]
    return _finish(body, max_tokens, tools=False)
