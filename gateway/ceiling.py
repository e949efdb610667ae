"""The prompt token ceiling: a bound the engine's prompt count cannot exceed, without a tokenizer.

A request reserves its prompt ceiling plus its output budget against the tenant's ``tpm`` and
quotas before admission, and is settled to the engine's own count when it ends. The ceiling is a
bound, not an estimate, so no construction of a body (tool schemas of empty arrays, deep
nesting, punctuation, characters that grow when re-serialised) reserves less than the engine
then counts. The arithmetic (see ``gateway/README.md``, "The prompt ceiling"):

1. **Tokens <= bytes.** Qwen's tokenizer is a byte-level BPE (Qwen model card, "Tokenizer";
   ``tokenizer.json`` of every Qwen2/Qwen3 checkpoint: ``ByteLevel`` pre-tokenizer, ``NFC``
   normalizer): every token covers at least one byte of the normalised text, and added or
   special tokens (``<|im_start|>``, ``<think>``, ...) cover more. So the count of the rendered
   prompt is at most its UTF-8 size after NFC, which is at most its size after NFD (composition
   only shortens; decomposition is per character, so sizes add over concatenation).
2. **The rendered prompt is bounded part by part.** vLLM renders the chat template with
   transformers' sandbox, whose ``tojson`` is ``json.dumps(x, ensure_ascii=False)`` with the
   default separators ``", "`` and ``": "`` (transformers, ``chat_template_utils.py``). Qwen3's
   templates write each message's text verbatim once, each tool definition once as ``tojson``,
   each tool call's arguments once (as ``tojson``, or one ``<parameter=NAME>`` block per key),
   plus fixed markup. `json_ceiling` bounds ``tojson`` of any value: every string counted as if
   each character took its longest escape (``\\u003c`` for ``<``, ``>``, ``&``, ``'``, as
   Jinja's own HTML-safe ``tojson`` writes them; ``\\uXXXX`` for control characters; two bytes
   for ``"`` and ``\\``; non-ASCII as the larger of its NFD UTF-8 bytes and its ``\\u`` escapes),
   two bytes per separator and brackets. Message text is counted verbatim (NFD bytes), plus
   `MESSAGE_OVERHEAD` bytes of markup per message; tools `TOOLS_OVERHEAD` once plus
   `TOOL_OVERHEAD` each; tool calls `CALL_OVERHEAD` each plus `ARGUMENT_OVERHEAD` per argument.
3. **Every other field a template can read counts.** vLLM hands the template the messages, the
   tools, ``documents`` and ``chat_template_kwargs`` (``chat_template`` only when the server
   trusts request templates; else 400); each is counted with `json_ceiling`, and
   ``response_format`` too (`RENDERED_FIELDS`).

The allowances are bytes of the markup Qwen3's templates write (the tool preamble is under 500
bytes, a message's ``<|im_start|>role\\n...<|im_end|>\\n`` with ``<think>`` tags or a
``<tool_response>`` wrapper under 64); a template outside that family that renders a value more
than once or indents ``tojson`` could exceed the ceiling, which the settle step reports
(``prompt_ceiling_exceeded`` in the log and ``gateway_prompt_ceiling_exceeded_total``).
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping
from typing import Any

MESSAGE_OVERHEAD = 64
"""Bytes of template markup per message: ``<|im_start|>``, the role line, ``<|im_end|>``, the
``<think>``/``</think>`` tags of assistant history or the ``<tool_response>`` wrapper of a tool
result (Qwen3's templates write at most 61)."""
TOOLS_OVERHEAD = 1024
"""Bytes of the fixed tool preamble written once when the request has tools (Qwen3's is about
450 bytes: ``# Tools``, the ``<tools></tools>`` instructions and the call format)."""
TOOL_OVERHEAD = 16
"""Bytes of markup around each tool definition (Qwen3: one newline)."""
CALL_OVERHEAD = 96
"""Bytes of markup around each tool call of assistant history (``<tool_call>``,
``<function=...>``, ``</function>``, ``</tool_call>`` and newlines)."""
ARGUMENT_OVERHEAD = 32
"""Bytes of markup per argument of a tool call rendered as ``<parameter=NAME>\\n...\\n</parameter>\\n``
(27 bytes besides the name and value)."""
PROMPT_OVERHEAD = 64
"""Bytes written once per prompt: the generation prompt ``<|im_start|>assistant\\n`` and the
``<think>\\n\\n</think>\\n\\n`` of thinking off."""
COMPLETION_OVERHEAD = 2
"""Special tokens a completions prompt may gain (a BOS token; Qwen's tokenizer adds none)."""

# Fields of a chat request besides messages and tools that vLLM hands to the chat template
# (``documents``, ``chat_template_kwargs``; ``chat_template`` when the server trusts request
# templates), and ``response_format``, which vLLM turns into a decoding constraint, not prompt
# text, counted in case a build renders it. Sampling fields never reach the template.
RENDERED_FIELDS = ("documents", "chat_template_kwargs", "chat_template", "response_format")
# Characters whose JSON text is longer than one byte: control characters and DEL (\uXXXX, 6 bytes at
# worst), Jinja's HTML-safe escapes of < > & ' (6 bytes), and " and \\ (2 bytes).
_WIDE = dict.fromkeys([*range(0x20), 0x7F, *map(ord, "<>&'")])
_QUOTE = {ord('"'): None, ord("\\"): None}


def text_bytes(text: str) -> int:
    """UTF-8 bytes of ``text`` after NFD: at least the bytes after NFC (what the tokenizer
    reads), and additive over concatenation. ASCII text is its length."""
    if text.isascii():
        return len(text)
    return len(unicodedata.normalize("NFD", text).encode("utf-8", "surrogatepass"))


def string_ceiling(text: str) -> int:
    """Bytes of ``text`` as a JSON string in any ``tojson`` (quotes included): every character
    at its longest escape, non-ASCII the larger of its UTF-8 (NFD) and ``\\uXXXX`` forms."""
    size = len(text)
    wide = size - len(text.translate(_WIDE))
    quoted = size - len(text.translate(_QUOTE))
    if text.isascii():
        return 2 + size + 5 * wide + quoted
    ascii_count = len(text.encode("ascii", "ignore"))
    non_ascii = size - ascii_count
    astral = len(text.encode("utf-16-le", "surrogatepass")) // 2 - size
    escaped = 6 * non_ascii + 6 * astral  # \uXXXX, or a pair of them beyond the BMP
    nfd = text_bytes(text) - ascii_count  # ASCII is NFD-stable: the rest is the non-ASCII part
    return 2 + ascii_count + 5 * wide + quoted + max(escaped, nfd)


def json_ceiling(value: Any) -> int:
    """Bytes of ``value`` as JSON in any ``tojson`` without indent (`string_ceiling` for keys and
    strings, ``", "`` and ``": "`` separators). Iterative: any nesting the parser accepted."""
    total = 0
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += string_ceiling(item)
        elif isinstance(item, dict):
            total += 2 + 2 * max(0, len(item) - 1)  # {} and ", "
            for key, inner in item.items():
                total += string_ceiling(str(key)) + 2  # ": "
                stack.append(inner)
        elif isinstance(item, list):
            total += 2 + 2 * max(0, len(item) - 1)  # [] and ", "
            stack.extend(item)
        elif item is None or isinstance(item, bool):
            total += 5
        elif isinstance(item, float):
            total += len(repr(item)) + 2
        else:
            total += len(str(item))
    return total


def _verbatim(value: Any) -> int:
    """Bytes of a value a template writes as text: a string verbatim, a list of content parts
    each (joined with newlines), anything else as ``tojson``."""
    if isinstance(value, str):
        return text_bytes(value)
    if isinstance(value, list):
        total = 0
        for part in value:
            if isinstance(part, dict) and isinstance(part.get("text"), str) and len(part) <= 2:
                total += text_bytes(part["text"]) + 1
            else:
                total += json_ceiling(part) + 1
        return total
    return json_ceiling(value)


def _arguments(raw: Any) -> int:
    """Bytes a tool call's arguments can take: as given and as ``tojson`` of their parsed form
    (vLLM parses string arguments for the template), plus the per-parameter markup."""
    parsed = raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            return text_bytes(raw)
    size = json_ceiling(parsed)
    if isinstance(raw, str):
        size = max(size, text_bytes(raw))
    if isinstance(parsed, dict):
        size += ARGUMENT_OVERHEAD * len(parsed)
    return size


def _tool_call(call: Any) -> int:
    if not isinstance(call, dict):
        return CALL_OVERHEAD + json_ceiling(call)
    total = CALL_OVERHEAD
    for key, value in call.items():
        if key == "function" and isinstance(value, dict):
            for name, inner in value.items():
                if name == "arguments":
                    total += _arguments(inner)
                else:
                    total += string_ceiling(str(name)) + json_ceiling(inner)
        else:
            total += string_ceiling(str(key)) + json_ceiling(value)
    return total


def message_ceiling(message: Any) -> int:
    """Bytes one chat message can take in the rendered prompt (markup included)."""
    if not isinstance(message, dict):
        return MESSAGE_OVERHEAD + json_ceiling(message)
    total = MESSAGE_OVERHEAD
    for key, value in message.items():
        if key == "tool_calls" and isinstance(value, list):
            total += sum(_tool_call(call) for call in value)
        elif key in ("content", "reasoning", "reasoning_content", "role", "name"):
            total += _verbatim(value)
        else:
            total += string_ceiling(str(key)) + json_ceiling(value)
    return total


def chat_ceiling(body: Mapping[str, Any]) -> int:
    """Prompt tokens an engine chat body can take, at most (module doc: the arithmetic)."""
    total = PROMPT_OVERHEAD
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            total += message_ceiling(message)
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        total += TOOLS_OVERHEAD + sum(TOOL_OVERHEAD + json_ceiling(t) for t in tools)
    elif tools:
        total += json_ceiling(tools)
    for key in RENDERED_FIELDS:
        if body.get(key) is not None:
            total += json_ceiling(body[key])
    return total


def completion_ceiling(prompt: str) -> int:
    """Prompt tokens a completions text prompt can take, at most (its NFD UTF-8 bytes)."""
    return text_bytes(prompt) + COMPLETION_OVERHEAD
