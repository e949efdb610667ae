"""What both dialects share: the translated request, output clamping, ids, field checks.

A dialect's request becomes a `Translated`: a chat-completions body written as a client would
write it (``messages``, ``tools``, ``max_tokens``, ...), which then goes through the same
`gateway.rewrite.plan_request` as ``/v1/chat/completions`` (alias, thinking policy, sampling,
``cache_salt``, ``request_id``, reservation). Nothing here talks to the network.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.body import MAX_DEPTH, nested_past
from gateway.errors import (
    FIELD_NAME_MAX_CHARS,
    BadRequest,
    EngineRejected,
    GatewayError,
    quotable,
    quotable_name,
)
from gateway.validate import INT64_MAX

BACKGROUND_TIERS = frozenset({"flex"})
"""``service_tier`` values that mark a request as background work: OpenAI's ``flex`` tier is
"lower priority, slower" processing (OpenAI API reference, "Flex processing"). The others are
served in the ordinary line."""


@dataclass
class Translated:
    """A dialect request translated onto the chat route.

    Attributes:
        chat: the chat-completions body (client shape; `plan_request` finishes it).
        stream: the client asked for SSE.
        requested_output: the output budget the client asked for (before clamping), or None.
        dropped_tools: names of built-in tools this deployment cannot run and left out.
        extra: dialect facts the answer needs (echoed fields, tool namespaces, ...).
    """

    chat: dict[str, Any]
    stream: bool
    requested_output: int | None = None
    dropped_tools: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def new_id(prefix: str) -> str:
    """A fresh public id: ``prefix`` + 24 random hex digits (no tenant or request data in it)."""
    return prefix + secrets.token_hex(12)


def positive_int(body: Mapping[str, Any], name: str, *, required: bool = False) -> int | None:
    """``body[name]`` as a positive int, None when absent (unless ``required``).

    Raises:
        BadRequest: absent while required, or not a positive integer (``param`` names it).
    """
    value = body.get(name)
    if value is None:
        if required:
            raise BadRequest(f"{name}: Field required", param=name)
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(f"{name}: must be a positive integer", param=name)
    if value > INT64_MAX:  # no engine field holds more; a response would echo it whole
        raise BadRequest(f"{name}: must be a positive integer of at most 64 bits", param=name)
    return value


def number(body: Mapping[str, Any], name: str) -> float | None:
    """``body[name]`` as a number, None when absent. Raises BadRequest on another type."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRequest(f"{name}: must be a number", param=name)
    return value


def expect(value: Any, kind: type | tuple[type, ...], name: str) -> Any:
    """``value`` when it is of ``kind``; else BadRequest naming ``name``."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        wanted = " or ".join(_KIND_LABELS.get(one, "valid") for one in kinds)
        raise BadRequest(f"{name}: must be {wanted}", param=name)
    return value


_KIND_LABELS: dict[type, str] = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "an integer",
}


# A hosted tool's versioned type: a snake_case name in letters and its date, Anthropic's
# ``web_search_20250305`` or OpenAI's ``web_search_preview_2025_03_11``.
_DATED_TOOL_RE = re.compile(r"[a-z]+(?:_[a-z]+)*_(?:\d{8}|\d{4}_\d{2}_\d{2})")


def label(value: Any) -> str:
    """A tool name or type for an error message: a field-like name (`quotable_name`:
    ``str_replace_based_edit_tool``, ``web_search_preview``) or a hosted tool's dated type
    (``web_search_20250305``) as it is; anything else as `quotable` shows it, so a name shaped
    like a hand-written secret (``team_alpha_prod_secret_42``) is not echoed."""
    dated = isinstance(value, str) and len(value) <= FIELD_NAME_MAX_CHARS
    if dated and _DATED_TOOL_RE.fullmatch(value):
        return str(value)
    return quotable_name(value)


def one_of(value: Any, choices: tuple[str, ...], name: str) -> str:
    """``value`` when it is one of ``choices``; else BadRequest naming ``name`` and the choices
    (the value itself quoted only when `quotable`)."""
    if isinstance(value, str) and value in choices:
        return value
    allowed = ", ".join(f"'{choice}'" for choice in choices)
    shown = f"'{quotable(value)}'" if isinstance(value, str) else "a value of another type"
    raise BadRequest(f"{name}: must be one of {allowed}, not {shown}", param=name)


def arguments_object(raw: str) -> dict[str, Any]:
    """A tool call's JSON arguments as an object; ``{}`` when the model produced none or
    something that is not a JSON object, or one nested past `gateway.body.MAX_DEPTH` (which no
    answer could carry: the client then reports the bad call to the model)."""
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(value, dict) or nested_past(value, MAX_DEPTH):
        return {}
    return value


def arguments_text(value: Any) -> str:
    """A tool call's input (object or already-encoded string) as the chat API's JSON string."""
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


# vLLM's wordings of a prompt over the context: "This model's maximum context length is M
# tokens. However, you requested W output tokens and your prompt contains [at least ]N input
# tokens, for a total of ..." (the 0.2x renderer) and "... However, your prompt contains [at
# least ]N input tokens, which exceeds this limit even without any output tokens."
# (vllm/renderers/params.py). "At least": the prompt was tokenized with truncation, so N is a
# lower bound.
_OVERFLOW_RE = re.compile(
    r"maximum context length is (\d+) tokens.*?(?:requested (\d+) output tokens.*?)?"
    r"prompt contains (at least )?(\d+) input tokens",
    re.S,
)
# vLLM's other wording (a prompt of token ids): "However, you requested 3100 tokens (3000 in
# the prompt, 100 for the completion)."
_OVERFLOW_TOTAL_RE = re.compile(
    r"maximum context length is (\d+) tokens.*?requested \d+ tokens "
    r"\((\d+) in the (?:prompt|messages), (\d+) for the completion\)",
    re.S,
)


MIN_OUTPUT_TOKENS = 1
"""The least output a request asks for: vLLM's ``SamplingParams`` needs ``max_tokens`` >= 1."""


@dataclass(frozen=True)
class Overflow:
    """A prompt over the context, as the engine's 400 (or a count) states it.

    Attributes:
        prompt: prompt tokens; a lower bound when ``at_least``.
        at_least: ``prompt`` is a lower bound (the engine stopped tokenizing past the limit).
        output: the output budget the engine was asked for, when known.
        context: the context length (``max_model_len``).
    """

    prompt: int
    at_least: bool
    output: int | None
    context: int

    @property
    def max_prompt(self) -> int:
        """The longest prompt this context serves: the context less the least answer, one
        token (vLLM refuses a prompt whose length plus ``max_tokens``, at least 1, passes
        ``max_model_len``)."""
        return self.context - MIN_OUTPUT_TOKENS

    def anthropic_message(self) -> str:
        """The Anthropic API's wording, with true numbers (case C31).

        A prompt with no room for one output token: ``prompt is too long: P tokens > M
        maximum``, M always `max_prompt` (the context less one token), whether the prompt is
        exactly the context or past it (the wording Claude Code compacts on, reading both
        numbers). A prompt that fits but not with the output budget W: ``input length and
        `max_tokens` exceed context limit: P + W > C, ...`` with C the context (the wording
        Claude Code lowers ``max_tokens`` on). ``at least`` stays in front of a count that is
        only a lower bound.
        """
        shown = f"at least {self.prompt}" if self.at_least else str(self.prompt)
        if self.prompt > self.max_prompt or not self.output:
            return f"prompt is too long: {shown} tokens > {self.max_prompt} maximum"
        return (
            f"input length and `max_tokens` exceed context limit: {shown} + {self.output} > "
            f"{self.context}, decrease input length or `max_tokens` and try again"
        )

    def openai_message(self) -> str:
        """vLLM's wording (vllm/renderers/params.py) with true numbers, for a request whose
        output budget this server sized (the client set none, or its budget was cut to the
        room the prompt leaves): it never says the client requested output tokens (case C31).
        ``maximum context length is M tokens`` and ``prompt contains N input tokens`` stay, as
        clients that parse vLLM's message read them."""
        shown = f"at least {self.prompt}" if self.at_least else str(self.prompt)
        head = (
            f"This model's maximum context length is {self.context} tokens. However, your "
            f"prompt contains {shown} input tokens"
        )
        if self.prompt > self.context:
            return f"{head}, which exceeds this limit even without any output tokens."
        if self.prompt > self.max_prompt or not self.output:
            bound = "at least " if self.at_least else ""
            return f"{head}, which leaves no room for {bound}one output token."
        room = self.context - self.prompt
        bound = "at most " if self.at_least else ""
        return (
            f"{head}, which leaves {bound}{room} tokens for the answer, fewer than the output "
            f"budget of {self.output} tokens this server set for it; set max_tokens to at most "
            f"{room}."
        )

    def requested_message(self) -> str:
        """vLLM's wording (vllm/renderers/params.py) with true numbers, for a request whose
        output budget the client set: a prompt over the context alone says so (fewer output
        tokens cannot help), else the requested output and the prompt's count, summed."""
        output = self.output or 0
        if self.prompt > self.context or not output:
            return self.openai_message()
        return (
            f"This model's maximum context length is {self.context} tokens. However, you "
            f"requested {output} output tokens and your prompt contains {self.prompt} "
            f"input tokens, for a total of {self.prompt + output} tokens. Please reduce "
            "the length of the input prompt or the number of requested output tokens."
        )


def overflow_of(error: GatewayError) -> Overflow | None:
    """The engine's prompt-too-long 400 read into an `Overflow`, or None for any other error."""
    if isinstance(error, PromptTooLong):
        return error.overflow
    if error.status != 400:
        return None
    match = _OVERFLOW_RE.search(error.message)
    if match is None:
        total = _OVERFLOW_TOTAL_RE.search(error.message)
        if total is None:
            return None
        return Overflow(int(total.group(2)), False, int(total.group(3)), int(total.group(1)))
    output = int(match.group(2)) if match.group(2) else None
    return Overflow(int(match.group(4)), bool(match.group(3)), output, int(match.group(1)))


def context_overflow(error: GatewayError) -> tuple[int, int] | None:
    """(prompt tokens, context length) when ``error`` is the engine's prompt-too-long 400."""
    overflow = overflow_of(error)
    return None if overflow is None else (overflow.prompt, overflow.context)


class PromptTooLong(EngineRejected):
    """The engine's prompt-too-long 400 with the prompt's exact count when one was taken.

    ``message`` stays the engine's (OpenAI's routes pass it through); ``overflow`` holds the
    numbers the Anthropic route states.
    """

    def __init__(self, engine_error: GatewayError, overflow: Overflow) -> None:
        super().__init__(engine_error.status, engine_error.message, param=engine_error.param)
        self.headers.update(engine_error.headers)
        self.overflow = overflow


def tool_function(name: str, description: str | None, parameters: Any) -> dict[str, Any]:
    """One chat-completions function tool (OpenAI API reference, ``tools[].function``)."""
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object"}
    return {"type": "function", "function": function}
