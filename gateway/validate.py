"""Field validation of the OpenAI-compatible request bodies: types and ranges, before the engine.

Every documented field of ``/v1/chat/completions`` and ``/v1/completions`` that the client sets
(not null) is checked here, so a value the engine would refuse (or could not even parse) gets a
400 in OpenAI's shape naming the parameter, before any rate-limit slot or token is taken. Ranges
are those vLLM's ``SamplingParams`` enforces (vLLM docs, "Sampling Parameters"), plus the OpenAI
API reference's documented limits where vLLM has none (``n`` at most 128, ``top_logprobs`` at
most 20). Integers must be JSON integers (``1.0`` is refused like OpenAI does); numbers must be
finite. Endpoints that translate another API onto these bodies get the same checks for free.

`find_unsendable` locates anything JSON cannot carry to the engine (a non-finite number, an
integer too long to print, a lone UTF-16 surrogate) anywhere in a body, with its path.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal

from gateway.errors import BadRequest, quotable_name

Kind = Literal["chat", "completions"]

# JSON Schema's and vLLM's seed type: a signed 64-bit integer (vLLM ``seed`` field bounds).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# OpenAI API reference: n "at most 128"; top_logprobs "between 0 and 20".
MAX_N = 128
MAX_TOP_LOGPROBS = 20
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
"""OpenAI's ``service_tier`` values (API reference, "Create a model response"/"Create chat
completion"); any other is a 400."""
# Python prints integers of up to 4,300 digits (sys.int_info.default_max_str_digits); longer
# ones cannot be serialised for the engine at all.
MAX_INT_DIGITS = 4300

Check = Callable[[Any, str], None]


def _fail(name: str, expected: str) -> BadRequest:
    return BadRequest(f"'{name}' must be {expected}.", param=name)


_FLOAT_MAX = sys.float_info.max


def is_int(value: Any) -> bool:
    """True for a JSON integer (a Python int that is not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for a finite JSON number (int or float, not bool) that a 64-bit float can hold: the
    engine reads these fields as floats, and an integer past ``sys.float_info.max`` (a JSON
    number of 309 digits or more) would fail its conversion there (`OverflowError`, a 5xx)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and -_FLOAT_MAX <= value <= _FLOAT_MAX


def number(
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
) -> Check:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); None is no bound."""
    if lo is not None and hi is not None:
        left = "(" if lo_open else "["
        expected = f"a number in {left}{lo:g}, {hi:g}]"
    elif lo is not None:
        expected = f"a number {'>' if lo_open else '>='} {lo:g}"
    else:
        expected = "a number"

    def check(value: Any, name: str) -> None:
        if not is_number(value):
            raise _fail(name, f"{expected}, not {_kind(value)}")
        if lo is not None and (value <= lo if lo_open else value < lo):
            raise _fail(name, expected)
        if hi is not None and value > hi:
            raise _fail(name, expected)

    return check


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    """A JSON integer in ``[lo, hi]``; None is no bound but 64 bits': the engine carries every
    integer field in 64 bits (an integer of 2**64 or more fails its encoding there, a 5xx)."""
    if lo is not None and hi is not None:
        expected = f"an integer between {lo} and {hi}"
    elif lo is not None:
        expected = f"an integer >= {lo}"
    else:
        expected = "an integer"

    def check(value: Any, name: str) -> None:
        if not is_int(value):
            raise _fail(name, f"{expected}, not {_kind(value)}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise _fail(name, expected)
        if not INT64_MIN <= value <= INT64_MAX:
            raise _fail(name, f"{expected} that fits in 64 bits")

    return check


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return "a number out of range (JSON numbers must be finite)"
    if isinstance(value, int) and not -_FLOAT_MAX <= value <= _FLOAT_MAX:
        return "a number out of range (larger than a 64-bit float holds)"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null"


def boolean(value: Any, name: str) -> None:
    """``true`` or ``false``."""
    if not isinstance(value, bool):
        raise _fail(name, f"a boolean, not {_kind(value)}")


def one_of(values: tuple[str, ...]) -> Check:
    """One of the strings ``values``."""
    expected = "one of " + ", ".join(f"'{value}'" for value in values)

    def check(value: Any, name: str) -> None:
        if not isinstance(value, str) or value not in values:
            raise _fail(name, expected)

    return check


def string(value: Any, name: str) -> None:
    """A string."""
    if not isinstance(value, str):
        raise _fail(name, f"a string, not {_kind(value)}")


def obj(value: Any, name: str) -> None:
    """A JSON object."""
    if not isinstance(value, dict):
        raise _fail(name, f"an object, not {_kind(value)}")


def array_of(item: Check, what: str) -> Check:
    """A JSON array whose every item passes ``item``."""

    def check(value: Any, name: str) -> None:
        if not isinstance(value, list):
            raise _fail(name, f"an array of {what}, not {_kind(value)}")
        for index, element in enumerate(value):
            item(element, f"{name}[{index}]")

    return check


def stop(value: Any, name: str) -> None:
    """A string or an array of strings (OpenAI ``stop``)."""
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _fail(name, "a string or an array of strings")


TOOL_CHOICES = ("none", "auto", "required")
"""The strings ``tool_choice`` may be (OpenAI API reference, chat ``tool_choice``; vLLM's
``ChatCompletionRequest`` accepts these and a named function object)."""


def tool_choice(value: Any, name: str) -> None:
    """``none``, ``auto``, ``required`` or an object (a named function, checked by the engine);
    another string is refused here, unquoted, before the engine would echo it."""
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise _fail(name, "'none', 'auto', 'required' or an object naming a function")
    elif not isinstance(value, dict):
        raise _fail(name, f"a string or an object, not {_kind(value)}")


def logit_bias(value: Any, name: str) -> None:
    """An object mapping token ids (as strings) to biases in [-100, 100] (OpenAI ``logit_bias``)."""
    obj(value, name)
    for bias in value.values():
        if not is_number(bias) or not -100 <= bias <= 100:
            raise BadRequest(f"'{name}' values must be numbers in [-100, 100].", param=name)


def prompt(value: Any, name: str) -> None:
    """``/v1/completions`` ``prompt``: a string, an array of strings, an array of token ids, or
    an array of arrays of token ids; never empty (OpenAI API reference, vLLM docs)."""
    if isinstance(value, str):
        return
    expected = "a string, an array of strings, or an array (of arrays) of token ids"
    if not isinstance(value, list) or not value:
        raise _fail(name, f"{expected}, not empty")
    if all(isinstance(p, str) for p in value):
        return
    if all(is_int(t) for t in value):
        _token_ids(value, name)
        return
    if all(isinstance(p, list) for p in value):
        for index, ids in enumerate(value):
            if not ids:
                raise _fail(f"{name}[{index}]", "a non-empty array of token ids")
            _token_ids(ids, f"{name}[{index}]")
        return
    raise _fail(name, expected)


def _token_ids(ids: list[Any], name: str) -> None:
    for token in ids:
        if not is_int(token) or not 0 <= token <= INT64_MAX:
            raise _fail(name, "an array of token ids (integers >= 0)")


_SAMPLING: dict[str, Check] = {
    "model": string,
    "stream": boolean,
    "stream_options": obj,
    "n": integer(1, MAX_N),
    "temperature": number(0),
    "top_p": number(0, 1, lo_open=True),
    "top_k": integer(-1),
    "min_p": number(0, 1),
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "repetition_penalty": number(0, lo_open=True),
    "length_penalty": number(),
    "max_tokens": integer(1),
    "min_tokens": integer(0),
    "seed": integer(INT64_MIN, INT64_MAX),
    "stop": stop,
    "stop_token_ids": array_of(integer(0, INT64_MAX), "token ids"),
    "logit_bias": logit_bias,
    "user": string,
    "ignore_eos": boolean,
    "skip_special_tokens": boolean,
    "spaces_between_special_tokens": boolean,
    "include_stop_str_in_output": boolean,
    "add_special_tokens": boolean,
    "prompt_logprobs": integer(0),
    "truncate_prompt_tokens": integer(-1),
    "response_format": obj,
    "priority": integer(),
    "thinking_token_budget": integer(),
    "allowed_token_ids": array_of(integer(0, INT64_MAX), "token ids"),
    # vLLM's chat and completions requests both carry it; a string "2" must be a 400 on
    # either route, never reach a comparison (case C28).
    "best_of": integer(1, MAX_N),
}
_CHAT: dict[str, Check] = {
    **_SAMPLING,
    "messages": array_of(obj, "message objects"),
    "max_completion_tokens": integer(1),
    "logprobs": boolean,
    "top_logprobs": integer(0, MAX_TOP_LOGPROBS),
    "tools": array_of(obj, "tool objects"),
    "tool_choice": tool_choice,
    "parallel_tool_calls": boolean,
    "chat_template_kwargs": obj,
    "reasoning_effort": string,
    "prompt_cache_key": string,
    "safety_identifier": string,
    # Checked as OpenAI checks it; every tier is served alike here but ``flex``, which also
    # puts the request in the background line (`gateway.waiting.background_request`).
    "service_tier": one_of(SERVICE_TIERS),
    "enable_thinking": boolean,
    "add_generation_prompt": boolean,
    "continue_final_message": boolean,
    "echo": boolean,
}
_COMPLETIONS: dict[str, Check] = {
    **_SAMPLING,
    "prompt": prompt,
    "echo": boolean,
    "logprobs": integer(0, MAX_TOP_LOGPROBS),
    "suffix": string,
}
FIELDS: Mapping[Kind, Mapping[str, Check]] = {"chat": _CHAT, "completions": _COMPLETIONS}
_KNOWN_NAMES = frozenset(_CHAT) | frozenset(_COMPLETIONS) | {"reasoning_content", "tool_call_id"}


def validate_fields(body: Mapping[str, Any], kind: Kind) -> None:
    """Check the type and range of every documented field present (null means absent).

    Cross-field rules: ``min_tokens`` <= the output limit; ``best_of`` >= ``n``. They compare
    only values that passed their own checks above (on either route, a field the route does not
    document is compared only when it is a JSON integer), so no value reaches a comparison of
    the wrong type.

    Raises:
        BadRequest: the first field at fault, named in ``param``.
    """
    fields = FIELDS[kind]
    try:
        # The body's own keys (a handful) instead of every documented name (about 45).
        for name, value in body.items():
            check = fields.get(name)
            if check is not None and value is not None:
                check(value, name)
    except BadRequest:
        # Several fields at fault: the first in `FIELDS`' order is named, whatever the body's.
        for name, check in fields.items():
            value = body.get(name)
            if value is not None:
                check(value, name)
        raise
    options = body.get("stream_options")
    if options is not None:
        for flag in ("include_usage", "continuous_usage_stats"):
            if options.get(flag) is not None:
                boolean(options[flag], f"stream_options.{flag}")
    limit = _int_or_none(body.get("max_completion_tokens")) or _int_or_none(body.get("max_tokens"))
    min_tokens = _int_or_none(body.get("min_tokens"))
    if limit is not None and min_tokens is not None and min_tokens > limit:
        raise BadRequest("'min_tokens' must not exceed the output limit.", param="min_tokens")
    n = _int_or_none(body.get("n")) or 1
    best_of = _int_or_none(body.get("best_of"))
    if best_of is not None and best_of < n:
        raise BadRequest("'best_of' must be >= 'n'.", param="best_of")


def _int_or_none(value: Any) -> int | None:
    return value if is_int(value) else None


def find_unsendable(value: Any) -> tuple[str, str] | None:
    """The first value JSON cannot carry to the engine, as ``(path, why)``; None when all can.

    Finds non-finite floats (``1e400`` parses as infinity; JSON has no literal for it, RFC 8259
    section 6), integers longer than `MAX_INT_DIGITS` digits, and strings or object keys with a
    lone UTF-16 surrogate (``"\\ud800"`` is legal JSON but no UTF-8 text, RFC 8259 section 8.2).
    Iterative, so any nesting the parser accepted is walked without recursion. The path uses
    dots and ``[i]`` (``messages[0].content``).
    """
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return path or "body", "a number out of range (JSON numbers must be finite)"
        elif isinstance(item, int) and not isinstance(item, bool):
            if item.bit_length() > MAX_INT_DIGITS * 3:  # > ~4,300 decimal digits
                return path or "body", "an integer too large"
        elif isinstance(item, str):
            if _has_surrogate(item):
                return path or "body", "text with an unpaired UTF-16 surrogate"
        elif isinstance(item, list):
            for index in range(len(item) - 1, -1, -1):
                stack.append((item[index], f"{path}[{index}]"))
        elif isinstance(item, dict):
            for key in reversed(list(item)):
                segment = key if key in _KNOWN_NAMES else quotable_name(key)
                child = f"{path}.{segment}" if path else segment
                if _has_surrogate(key):
                    return path or "body", "a key with an unpaired UTF-16 surrogate"
                stack.append((item[key], child))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
