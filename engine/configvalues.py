"""engine.toml's value rules: the error type, flags and variables it refuses, and one checker per
kind of value (each takes the dotted key and the TOML value and returns the value, or raises
`ConfigError` naming the key)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from engine.gpus import gpu_kind

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Flags the launcher computes from engine.toml keys; in extra_args they would silently override
# (argparse keeps the last value), so they are refused with the key to use instead.
MANAGED_FLAGS: Mapping[str, str] = MappingProxyType(
    {
        "--model": "engine.model_path",
        "--served-model-name": "engine.served_model",
        "--uds": "engine.socket",
        "--max-model-len": "engine.max_model_len",
        "--kv-cache-dtype": "engine.kv_cache_dtype",
        "--gpu-memory-utilization": "engine.gpu_memory_utilization",
        "--max-num-seqs": "engine.max_num_seqs",
        "--reasoning-parser": "engine.reasoning_parser",
        "--tool-call-parser": "engine.tool_call_parser",
        "--attention-backend": "engine.attention_backend",
        "--enable-auto-tool-choice": "engine.tool_call_parser",
        "--disable-fastapi-docs": "(always set)",
        "--tensor-parallel-size": "engine.gpus (one rank per listed GPU)",
        "-tp": "engine.gpus (one rank per listed GPU)",
        "--speculative-config": "[engine.speculative]",
        "-sc": "[engine.speculative]",
    }
)

# Environment variables refused in [engine.env] and dropped from the inherited environment,
# each with the reason (vllm-protocol.md section 1.4).
FORBIDDEN_ENV: Mapping[str, str] = MappingProxyType(
    {
        "VLLM_API_KEY": (
            "an API key on the engine breaks the gateway and is visible in the process "
            "environment; the engine listens only on the Unix socket and the gateway checks keys"
        ),
        "VLLM_ATTENTION_BACKEND": (
            "this vLLM build ignores it (removed upstream by PR #32812); set "
            "engine.attention_backend, which becomes --attention-backend"
        ),
        "VLLM_SERVER_DEV_MODE": "it mounts the dev/admin routes (/sleep, /collective_rpc ...)",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "it mounts the LoRA load/unload routes",
        "VLLM_DEBUG_LOG_API_SERVER_RESPONSE": "it logs response bodies (completions) in clear",
        "CUDA_VISIBLE_DEVICES": "the launcher sets it from engine.gpu or engine.gpus",
        "CUDA_DEVICE_ORDER": "the launcher sets it to PCI_BUS_ID so indices follow slot order",
    }
)


class ConfigError(ValueError):
    """A configuration problem; the message names the file, key and offending value."""


Check = Callable[[str, Any], Any]


def show(value: Any) -> str:
    """A value as TOML-ish text for error messages."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def check_string(key: str, value: Any) -> str:
    """A string."""
    if not isinstance(value, str):
        raise ConfigError(f"{key} = {show(value)}: expected a string")
    return value


def check_name(key: str, value: Any) -> str:
    """A name: letters, digits, ``_ . -``."""
    text = check_string(key, value)
    if not _NAME_RE.match(text):
        raise ConfigError(f"{key} = {show(value)}: expected a name (letters, digits, _ . -)")
    return text


def check_path(key: str, value: Any) -> str:
    """A non-empty path without NUL."""
    text = check_string(key, value)
    if not text or "\x00" in text:
        raise ConfigError(f"{key} = {show(value)}: expected a non-empty path")
    return text


def check_socket(key: str, value: Any) -> str:
    """An absolute socket path of at most 107 bytes (unix(7) ``sun_path``)."""
    text = check_path(key, value)
    if not os.path.isabs(text):
        raise ConfigError(f"{key} = {show(value)}: expected an absolute path")
    # sockaddr_un.sun_path is 108 bytes including the terminating NUL (unix(7)).
    if len(os.fsencode(text)) > 107:
        raise ConfigError(f"{key} = {show(value)}: longer than 107 bytes (unix(7) sun_path)")
    return text


def check_gpu(key: str, value: Any) -> str:
    """One GPU: an index, a UUID or a PCI bus id."""
    if not isinstance(value, str):
        raise ConfigError(
            f'{key} = {show(value)}: expected a string: an index ("0"), a UUID ("GPU-...") '
            'or a PCI bus id ("00000000:00:1E.0")'
        )
    try:
        gpu_kind(value)
    except ValueError:
        raise ConfigError(
            f'{key} = {show(value)}: expected one GPU as an index ("0"), a UUID '
            '("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx") or a PCI bus id ("00000000:00:1E.0")'
        ) from None
    return value


def check_gpus(key: str, value: Any) -> tuple[str, ...]:
    """A non-empty list of distinct GPUs, each as `check_gpu` takes it."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{key} = {show(value)}: expected a non-empty list of GPUs")
    gpus = tuple(check_gpu(f"{key}[{i}]", item) for i, item in enumerate(value))
    if len({gpu.lower() for gpu in gpus}) != len(gpus):
        raise ConfigError(f"{key} = {show(value)}: a GPU is listed twice")
    return gpus


def check_int(low: int, high: int) -> Callable[[str, Any], int]:
    """A checker of integers between ``low`` and ``high``."""

    def check(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {show(value)}: expected an integer")
        if not low <= value <= high:
            raise ConfigError(f"{key} = {show(value)}: must be between {low} and {high}")
        return value

    return check


def check_float(low: float, high: float, *, low_open: bool = False) -> Callable[[str, Any], float]:
    """A checker of finite numbers between ``low`` (excluded with ``low_open``) and ``high``."""

    def check(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} = {show(value)}: expected a number")
        number = float(value)
        too_low = number <= low if low_open else number < low
        if not math.isfinite(number) or too_low or number > high:
            bound = f"more than {low}" if low_open else f"at least {low}"
            raise ConfigError(f"{key} = {show(value)}: must be {bound} and at most {high}")
        return number

    return check


def check_bool(key: str, value: Any) -> bool:
    """true or false."""
    if not isinstance(value, bool):
        raise ConfigError(f"{key} = {show(value)}: expected true or false")
    return value


def check_program(key: str, value: Any) -> tuple[str, ...]:
    """A non-empty list of non-empty strings."""
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(item, str) and item for item in value)
    ):
        raise ConfigError(f"{key} = {show(value)}: expected a non-empty list of non-empty strings")
    return tuple(value)


def option_name(arg: str) -> str:
    """The option an argv item sets, as vLLM's parser sees it (``--a_b=x`` -> ``--a-b``).

    vLLM's FlexibleArgumentParser accepts underscores in option names and treats them as dashes.
    """
    return arg.split("=", 1)[0].replace("_", "-")


def check_extra_args(key: str, value: Any) -> tuple[str, ...]:
    """vLLM flags: never ``--api-key`` (by any prefix), never a flag in `MANAGED_FLAGS`."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        # Not echoed: the list could hold a secret.
        raise ConfigError(f"{key}: expected a list of strings")
    for item in value:
        if not item.startswith("--"):
            continue
        option = option_name(item)
        # argparse accepts unambiguous prefixes, so "--api-k" is "--api-key" too.
        if len(option) > len("--api-") and "--api-key".startswith(option):
            raise ConfigError(
                f"{key}: --api-key is refused: an API key on the command line is visible in ps "
                "and unit files, and the engine listens only on its Unix socket (the gateway "
                "checks keys)"
            )
        if option in MANAGED_FLAGS:
            raise ConfigError(
                f"{key}: {option} is set by the launcher; use {MANAGED_FLAGS[option]} instead"
            )
    return tuple(value)


def check_env(key: str, value: Any) -> Mapping[str, str]:
    """A table of environment variables, none of `FORBIDDEN_ENV`; values never echoed."""
    if not isinstance(value, dict):
        raise ConfigError(f'{key}: expected a table of NAME = "value"')
    env: dict[str, str] = {}
    for name, item in value.items():
        dotted = f"{key}.{name}"
        if name in FORBIDDEN_ENV:
            raise ConfigError(f"{dotted} is refused: {FORBIDDEN_ENV[name]}")
        if not _ENV_NAME_RE.match(name):
            raise ConfigError(f"{dotted}: not a valid environment variable name")
        if not isinstance(item, str):
            raise ConfigError(f"{dotted} = {show(item)}: expected a string")
        if "\x00" in item:
            raise ConfigError(f"{dotted}: contains a NUL byte")
        env[name] = item
    return MappingProxyType(env)
