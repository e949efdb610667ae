"""The simulator's deterministic token rule and the token sequence of every answer.

Prompt tokens (what `usage.prompt_tokens` reports and the context check uses):

- chat: ``3 + sum(4 + ceil(B / 4) for each message)``, where B is the number of UTF-8 bytes of
  the message text: the `content` string, or the `text` of its text parts, concatenated; plus
  the JSON the chat template renders, counted by `json_tokens`: each tool definition as
  Qwen3's template writes it (``tojson``: ``json.dumps`` with ``", "`` and ``": "``), and the
  ``tool_calls`` of assistant history;
- completions: ``ceil(B / 4)`` for a text prompt, the list length for a token-id prompt.

Generated tokens: `usage.completion_tokens` counts them all, reasoning, markup and the
end-of-sequence token included, like vLLM. An answer is, in order:

1. with thinking on: reasoning tokens (the last one is ``"\\n"``), then the ``</think>`` token,
   then a ``"\\n\\n"`` separator token, as Qwen3 writes ``...\\n</think>\\n\\n<answer>``;
2. the content tokens; or, for a tool call (`engine.sim.tools`), per call in the model's
   `qwen3_coder` format: ``<tool_call>``, a header token naming the function, per parameter an
   opening token (``{"city": "``), value tokens and a closing token (``"}``), then
   ``</function>`` and ``</tool_call>``; a named `tool_choice` (guided JSON) has no markup tokens;
3. an end-of-sequence token, whose presence means finish_reason `stop` (`tool_calls` for an
   auto or required call).

Which of these tokens reach the client, and merged how, is `engine.sim.wire`'s business.

Default lengths: a text answer has `completion_tokens` tokens, a third of them reasoning when
thinking is on. Default words cycle through fixed vocabularies holding ASCII, CJK and emoji
(`CONTENT_VOCAB`, `REASONING_VOCAB`), starting 7 words further for each choice index. `text` /
`reasoning_text` overrides are cut by `split_tokens`. When `max_tokens` is smaller than the
answer, the first `max_tokens` tokens are generated and finish_reason is `length`.
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
from engine.sim.tools import ToolPlan

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
CHOICE_OFFSET = 7
PAD = "~"

_TOKEN_RE = re.compile(r" ?[A-Za-z0-9]+| ?[^\sA-Za-z0-9]|\s+")
_LONG_WORD = re.compile(r"[A-Za-z0-9]{5,}")


class Kind(enum.IntEnum):
    """What a generated token is."""

    REASONING = 1
    THINK_END = 2
    SEPARATOR = 3  # the "\n\n" after </think>: content, held by a tool parser
    CONTENT = 4
    TOOL_MARKUP = 5  # <tool_call>, </function>, </tool_call>: never streamed
    TOOL_HEADER = 6
    TOOL_ARGS = 7
    EOS = 8


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
    """The tokens of one choice and its finish_reason (`stop`, `length` or `tool_calls`).

    `forced_tool` is True for an answer to a "required" or named `tool_choice`.
    """

    tokens: tuple[Token, ...]
    finish_reason: str
    forced_tool: bool = False

    @property
    def has_tool_calls(self) -> bool:
        """True when the answer holds at least one tool-call header token."""
        return any(t.kind is Kind.TOOL_HEADER for t in self.tokens)


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


def json_tokens(value: object) -> int:
    """Tokens of ``value`` rendered as the chat template's ``tojson`` writes it
    (``json.dumps(value, ensure_ascii=False)``): a run of ASCII letters and digits (with one
    leading space) is ceil(length / 4) tokens, a run of whitespace one, every other character
    one, as a byte-level BPE that merges no punctuation would count (brackets, commas and
    quotes of a schema are most of its tokens: 20,000 empty arrays are 60,000 tokens here,
    20,031 for Qwen's tokenizer)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        return 0
    # One token per piece, plus the extra tokens of words longer than four characters.
    pieces = len(_TOKEN_RE.sub("x", text))  # every character is in exactly one piece
    return pieces + sum((len(word) + 3) // 4 - 1 for word in _LONG_WORD.findall(text))


def chat_prompt_tokens(messages: Sequence[object], tools: object = None) -> int:
    """Tokens of a chat prompt: 3 + sum of (4 + ceil(UTF-8 bytes of the message text / 4)),
    plus `json_tokens` of each tool definition (the chat template writes them into the
    prompt) and of each assistant message's ``tool_calls``."""
    count = 3
    for message in messages:
        count += 4 + text_tokens(message_text(message))
        if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
            count += json_tokens(message["tool_calls"])
    if isinstance(tools, list) and tools:
        count += sum(json_tokens(tool) for tool in tools)
    return count


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


def tool_call_id() -> str:
    """A streamed or non-streamed tool-call id: ``chatcmpl-tool-`` and 16 hex digits, as the
    real engine sends them (vLLM 0.32, observed)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


def _argument_tokens(arguments: dict[str, object]) -> list[str]:
    """The JSON text of `arguments` (`json.dumps`, ``", "`` and ``": "`` separators, as vLLM
    writes them) cut as the `qwen3_coder` parser streams it: per parameter an opening piece
    (``{"city": "``), the value (a string cut by `split_tokens`, anything else whole) and a
    closing piece (``"`` for a string, ``}`` after the last parameter)."""
    if not arguments:
        return ["{}"]
    pieces: list[str] = []
    last = len(arguments) - 1
    for position, (name, value) in enumerate(arguments.items()):
        quote = '"' if isinstance(value, str) else ""
        pieces.append(
            ("{" if position == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": " + quote
        )
        if isinstance(value, str):
            pieces.extend(json.dumps(p, ensure_ascii=False)[1:-1] for p in split_tokens(value))
        else:
            pieces.append(json.dumps(value, ensure_ascii=False))
        pieces.append(quote + ("}" if position == last else ""))
    return [p for p in pieces if p]


def _tool_tokens(calls: Sequence[tuple[str, dict[str, object]]], *, markup: bool) -> list[Token]:
    tokens: list[Token] = []
    for index, (name, arguments) in enumerate(calls):
        call_id = tool_call_id()
        if markup:
            tokens.append(Token(Kind.TOOL_MARKUP, "<tool_call>"))
        tokens.append(Token(Kind.TOOL_HEADER, "", index, call_id, name))
        tokens.extend(
            Token(Kind.TOOL_ARGS, piece, index, call_id, name)
            for piece in _argument_tokens(arguments)
        )
        if markup:
            tokens += [
                Token(Kind.TOOL_MARKUP, "</function>"),
                Token(Kind.TOOL_MARKUP, "</tool_call>"),
            ]
    return tokens


def _finish(body: list[Token], max_tokens: int, plan: ToolPlan | None) -> Answer:
    tokens = [*body, Token(Kind.EOS)]
    reason = "stop"
    if len(tokens) > max_tokens:
        tokens, reason = tokens[:max_tokens], "length"
    forced = plan is not None and plan.forced
    if plan is not None and not plan.named and any(t.kind is Kind.TOOL_HEADER for t in tokens):
        reason = "tool_calls"
    return Answer(tuple(tokens), reason, forced)


def chat_answer(
    behaviour: Behaviour,
    *,
    choice: int,
    thinking: bool,
    max_tokens: int,
    tools: ToolPlan | None = None,
) -> Answer:
    """The tokens of one chat choice (rule in the module docstring).

    `max_tokens` (>= 1) caps the answer. `tools` is the request's tool plan
    (`engine.sim.tools.plan_tools`); the `tool_calls` behaviour replaces it by two parallel
    calls (`TOOL_CALLS`).
    """
    if behaviour.tool_calls:
        tools = ToolPlan(tuple((name, dict(args)) for name, args in TOOL_CALLS))
    elif behaviour.tool_call:
        tools = ToolPlan(_one_call(behaviour.tool_call))
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
        body.append(Token(Kind.SEPARATOR, "\n\n"))
    if tools is not None:
        if tools.named:
            body = [t for t in body if t.kind is not Kind.SEPARATOR]
        body += _tool_tokens(tools.calls, markup=not tools.named)
        return _finish(body, max_tokens, tools)
    if behaviour.text is not None:
        content = split_tokens(behaviour.text)
    else:
        content = _vocab(CONTENT_VOCAB, start, max(0, total - 1 - len(body)))
    body += [Token(Kind.CONTENT, t) for t in _pad(content, behaviour.token_bytes)]
    if behaviour.text is None and behaviour.reasoning_text is None:
        body = body[: total - 1]
    return _finish(body, max_tokens, None)


def completion_answer(behaviour: Behaviour, *, choice: int, max_tokens: int) -> Answer:
    """The tokens of one /v1/completions choice: content only, no chat template, no reasoning."""
    if behaviour.text is not None:
        content = split_tokens(behaviour.text)
    else:
        content = _vocab(CONTENT_VOCAB, choice * CHOICE_OFFSET, behaviour.completion_tokens - 1)
    body = [Token(Kind.CONTENT, t) for t in _pad(content, behaviour.token_bytes)]
    return _finish(body, max_tokens, None)
