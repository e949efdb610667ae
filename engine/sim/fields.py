"""Types and ranges of request fields, checked as vLLM checks them, with vLLM's 400 answers.

Types follow vLLM's pydantic request models in lax mode (`ChatCompletionRequest`,
`CompletionRequest`): a number may come as a numeric string, a boolean as "yes"/"no"/0/1, a
wrong type is a request-validation failure (400 "Bad Request", the pydantic error listed).
Ranges follow `SamplingParams._verify_args` and the request validators (vLLM 0.32, observed on
the real engine: `temperature` must be >= 0, `top_p` in (0, 1], `top_k` -1, 0 or >= 1, `min_p`
in [0, 1], penalties in [-2, 2], `repetition_penalty` > 0, `top_logprobs` needs `logprobs` and
is at most 20); the messages are vLLM's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from engine.sim.errors import ApiError, validation_error, vllm_error

# vLLM's default `--max-logprobs` (ModelConfig.max_logprobs).
MAX_LOGPROBS = 20

_TYPE_ERRORS = {
    bool: ("bool_type", "Input should be a valid boolean"),
    int: ("int_type", "Input should be a valid integer"),
    float: ("float_type", "Input should be a valid number"),
    str: ("string_type", "Input should be a valid string"),
    list: ("list_type", "Input should be a valid list"),
    dict: ("dict_type", "Input should be a valid dictionary"),
}
_PARSE_ERRORS = {
    bool: ("bool_parsing", "Input should be a valid boolean, unable to interpret input"),
    int: ("int_parsing", "Input should be a valid integer, unable to parse string as an integer"),
    float: ("float_parsing", "Input should be a valid number, unable to parse string as a number"),
}
_FRACTION_ERROR = (
    "int_from_float",
    "Input should be a valid integer, got a number with a fractional part",
)

# pydantic's lax mode (what vLLM's request models use) also takes these spellings of a boolean.
_LAX_BOOLS = {
    "true": True, "t": True, "yes": True, "y": True, "on": True, "1": True,
    "false": False, "f": False, "no": False, "n": False, "off": False, "0": False,
}  # fmt: skip

# Sampling fields of both routes with their types (vLLM's request models).
_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
)
_INTS = ("seed", "top_k", "min_tokens", "prompt_logprobs", "truncate_prompt_tokens")
_BOOLS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "use_beam_search",
    "echo",
    "add_special_tokens",
)
_CHAT_BOOLS = (
    "logprobs",
    "add_generation_prompt",
    "continue_final_message",
    "include_reasoning",
    "parallel_tool_calls",
)
_CHAT_INTS = ("top_logprobs",)
_STRINGS = ("user",)


def _fail(name: str, value: object, error: tuple[str, str]) -> ApiError:
    return validation_error(
        {"type": error[0], "loc": ("body", name), "msg": error[1], "input": value}
    )


def _convert(name: str, value: object, kind: type) -> Any:
    """`value` as pydantic's lax mode converts it to `kind`; ApiError 400 when it would not."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            found = _LAX_BOOLS.get(value.strip().lower())
            if found is None:
                raise _fail(name, value, _PARSE_ERRORS[bool])
            return found
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float):
            if not value.is_integer():
                raise _fail(name, value, _FRACTION_ERROR)
            return int(value)
        if isinstance(value, str):
            if not value.strip().lstrip("+-").isdigit():
                raise _fail(name, value, _PARSE_ERRORS[int])
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)):  # bool too: pydantic's lax mode takes it
            return float(value)
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                raise _fail(name, value, _PARSE_ERRORS[float]) from None
            if not math.isfinite(number):
                raise _fail(name, value, _PARSE_ERRORS[float])
            return number
    elif isinstance(value, kind):
        return value
    raise _fail(name, value, _TYPE_ERRORS[kind])


def read_field(body: Mapping[str, Any], name: str, kind: type) -> Any:
    """The body's field `name` converted to `kind` (None when absent or null).

    Raises ApiError (400 "Bad Request", pydantic's error) when the value has the wrong type.
    """
    value = body.get(name)
    if value is None:
        return None
    return _convert(name, value, kind)


def _check_stop(value: object) -> None:
    if value is None or isinstance(value, str):
        return
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return
    raise validation_error(
        {
            "type": "string_type",
            "loc": ("body", "stop"),
            "msg": _TYPE_ERRORS[str][1],
            "input": value,
        },
        {
            "type": "list_type",
            "loc": ("body", "stop"),
            "msg": _TYPE_ERRORS[list][1],
            "input": value,
        },
    )


def _plain(message: str) -> ApiError:
    """A `ValueError` from `SamplingParams`: 400 BadRequestError, no parameter named."""
    return ApiError(400, "BadRequestError", message)


def check_sampling(body: Mapping[str, Any], *, chat: bool) -> None:
    """Check the types and ranges of the sampling fields of a chat (`chat`) or completions
    body. Raises ApiError (400) with vLLM's message for the first bad field found."""
    values: dict[str, Any] = {}
    groups: list[tuple[tuple[str, ...], type]] = [
        (_FLOATS, float),
        (_INTS, int),
        (_BOOLS, bool),
        (_STRINGS, str),
    ]
    if chat:
        groups += [(_CHAT_BOOLS, bool), (_CHAT_INTS, int)]
    else:
        groups.append((("logprobs",), int))
    for names, kind in groups:
        for name in names:
            values[name] = read_field(body, name, kind)
    _check_stop(body.get("stop"))
    temperature = values["temperature"]
    if temperature is not None and temperature < 0:
        raise vllm_error(
            f"temperature must be non-negative, got {temperature}.", "temperature", temperature
        )
    top_p = values["top_p"]
    if top_p is not None and not 0 < top_p <= 1:
        raise vllm_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = values["top_k"]
    if top_k is not None and top_k < -1:
        raise _plain(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = values["min_p"]
    if min_p is not None and not 0 <= min_p <= 1:
        raise _plain(f"min_p must be in [0, 1], got {min_p}.")
    for name in ("presence_penalty", "frequency_penalty"):
        penalty = values[name]
        if penalty is not None and not -2 <= penalty <= 2:
            raise _plain(f"{name} must be in [-2, 2], got {penalty}.")
    repetition = values["repetition_penalty"]
    if repetition is not None and repetition <= 0:
        raise _plain(f"repetition_penalty must be greater than zero, got {repetition}.")
    wanted = values.get("top_logprobs") if chat else values.get("logprobs")
    if chat and wanted is not None and not values["logprobs"]:
        raise ApiError(
            400,
            "BadRequestError",
            "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
            "top_logprobs",
        )
    if wanted is not None and wanted > MAX_LOGPROBS:
        raise vllm_error(
            f"Requested sample logprobs of {wanted}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
            "logprobs",
            wanted,
        )
