"""Generated client bodies for every dialect, and the check every answer to them must pass.

Used by `tests/test_fuzz_dialects.py` (bounded, in CI) and by hand for a larger run::

    python -m tests.fuzz_bodies --examples 2000      # per dialect; prints what it found

Bodies are valid-shaped requests of each dialect with values replaced at random paths (wrong
types, huge and non-finite numbers, lone UTF-16 surrogates, credential-shaped strings, deep
nesting), or random JSON, or random bytes. The serialiser writes what `json.dumps` cannot:
``1e400``, 5,000-digit integers, ``\\udc80`` escapes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.conftest import Gateway, start_gateway, start_sim

ALIAS = "qwen3.8-27b"
# A string shaped like a credential; no error may quote it.
CANARY = "sk-fuzz-" + "C" * 32


class Raw:
    """A JSON literal written as it is (``1e400``, a 5,000-digit integer)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:20]!r})"


def dumps(value: Any) -> str:
    """JSON text of ``value``; `Raw` leaves verbatim, strings ASCII-escaped (surrogates as
    ``\\udc80`` escapes, which `json.dumps` writes for a lone surrogate)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


_surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
_text = st.one_of(
    st.text(max_size=12),
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), _surrogate, st.text(max_size=4)),
    st.sampled_from(
        [
            "",
            " ",
            "auto",
            "none",
            "required",
            "user",
            "assistant",
            "system",
            "tool",
            "function",
            "text",
            "message",
            "web_search",
            "json_schema",
            "enabled",
            "x" * 5000,
            CANARY,
            "\\u0073k-",
            "%73k-" + "C" * 20,
        ]
    ),
)
_number = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(
        [
            Raw("1e400"),
            Raw("-1e999"),
            Raw("9" * 5000),
            Raw("1" + "0" * 400),  # an integer no float holds
            Raw("-0"),
            Raw("1.0"),
            Raw("2.5e-400"),
            0,
            -1,
            1,
            2**63,
            2**64,
        ]
    ),
)
_scalar = st.one_of(st.none(), st.booleans(), _number, _text)
JSON = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_text, inner, max_size=3)),
    max_leaves=8,
)
PLAUSIBLE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=0, max_value=6),
    st.text(alphabet="abcdefghij _-", max_size=10),
    st.sampled_from(["auto", "none", "required", "user", "assistant", "text", "low", "high"]),
    st.dictionaries(
        st.text(alphabet="abc", min_size=1, max_size=3), st.text(max_size=5), max_size=2
    ),
)
_deep = st.integers(min_value=50, max_value=3000).map(lambda n: Raw("[" * n + "]" * n))
VALUE = st.one_of(_scalar, JSON, st.sampled_from([[], {}, [{}], [[]], {"type": None}]), _deep)

# A valid body of each dialect and the paths whose values the fuzz replaces.
BASES: dict[str, dict[str, Any]] = {
    "chat": {
        "model": ALIAS,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 4,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    },
    "completions": {"model": ALIAS, "prompt": "hi", "max_tokens": 4},
    "responses": {
        "model": ALIAS,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        ],
        "max_output_tokens": 4,
        "tools": [{"type": "function", "name": "f", "parameters": {}}],
        "metadata": {"k": "v"},
        "reasoning": {"effort": "low", "summary": "auto"},
        "text": {"format": {"type": "text"}},
    },
    "messages": {
        "model": ALIAS,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "system": [{"type": "text", "text": "be brief"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "metadata": {"user_id": "u"},
    },
}
BASES["count_tokens"] = {k: v for k, v in BASES["messages"].items() if k != "max_tokens"}

_COMMON = ["model", "stream", "temperature", "top_p", "metadata", "user", "x_unknown"]
PATHS: dict[str, list[tuple[Any, ...]]] = {
    "chat": [
        *[(name,) for name in _COMMON],
        *[
            (name,)
            for name in (
                "messages",
                "max_tokens",
                "max_completion_tokens",
                "min_tokens",
                "n",
                "best_of",
                "seed",
                "stop",
                "stop_token_ids",
                "logit_bias",
                "logprobs",
                "top_logprobs",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "stream_options",
                "response_format",
                "chat_template_kwargs",
                "reasoning_effort",
                "enable_thinking",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "ignore_eos",
                "priority",
                "request_id",
                "cache_salt",
                "echo",
                "prompt_logprobs",
                "structured_outputs",
                "thinking_token_budget",
                "store",
                "service_tier",
            )
        ],
        ("messages", 0),
        ("messages", 0, "role"),
        ("messages", 0, "content"),
        ("messages", 0, "content", 0),
        ("messages", 0, "content", 0, "type"),
        ("messages", 0, "content", 0, "text"),
        ("messages", 0, "tool_calls"),
        ("messages", 0, "reasoning_content"),
        ("messages", 0, "name"),
        ("stream_options", "include_usage"),
        ("stream_options", "continuous_usage_stats"),
        ("chat_template_kwargs", "enable_thinking"),
        ("response_format", "type"),
        ("tools", 0),
        ("tools", 0, "function"),
        ("tools", 0, "function", "name"),
        ("tools", 0, "function", "parameters"),
        ("tool_choice", "function"),
    ],
    "completions": [
        *[(name,) for name in _COMMON],
        *[
            (name,)
            for name in (
                "prompt",
                "suffix",
                "echo",
                "best_of",
                "n",
                "logprobs",
                "max_tokens",
                "max_completion_tokens",
                "min_tokens",
                "stop",
                "seed",
                "logit_bias",
                "stream_options",
                "ignore_eos",
                "prompt_logprobs",
                "truncate_prompt_tokens",
            )
        ],
        ("prompt", 0),
        ("prompt", 0, 0),
        ("stream_options", "include_usage"),
    ],
    "responses": [
        *[(name,) for name in _COMMON],
        *[
            (name,)
            for name in (
                "input",
                "instructions",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "reasoning",
                "text",
                "max_output_tokens",
                "store",
                "previous_response_id",
                "include",
                "truncation",
                "background",
                "conversation",
                "prompt",
                "service_tier",
                "top_logprobs",
                "max_tool_calls",
                "prompt_cache_key",
                "safety_identifier",
                "stream_options",
            )
        ],
        ("input", 0),
        ("input", 0, "type"),
        ("input", 0, "role"),
        ("input", 0, "content"),
        ("input", 0, "content", 0),
        ("input", 0, "content", 0, "type"),
        ("input", 0, "content", 0, "text"),
        ("input", 0, "call_id"),
        ("input", 0, "output"),
        ("input", 0, "name"),
        ("input", 0, "arguments"),
        ("input", 0, "summary"),
        ("tools", 0),
        ("tools", 0, "type"),
        ("tools", 0, "name"),
        ("tools", 0, "parameters"),
        ("tools", 0, "tools"),
        ("tools", 0, "description"),
        ("tool_choice", "type"),
        ("tool_choice", "name"),
        ("reasoning", "effort"),
        ("reasoning", "summary"),
        ("reasoning", "generate_summary"),
        ("text", "format"),
        ("text", "format", "type"),
        ("text", "format", "schema"),
        ("text", "format", "name"),
        ("text", "format", "strict"),
        ("text", "verbosity"),
        ("metadata", "k"),
        ("metadata", "x" * 70),
    ],
    "messages": [
        *[(name,) for name in _COMMON],
        *[
            (name,)
            for name in (
                "messages",
                "max_tokens",
                "system",
                "stop_sequences",
                "top_k",
                "tools",
                "tool_choice",
                "thinking",
                "output_config",
                "service_tier",
                "container",
                "context_management",
                "mcp_servers",
            )
        ],
        ("messages", 0),
        ("messages", 0, "role"),
        ("messages", 0, "content"),
        ("messages", 0, "content", 0),
        ("messages", 0, "content", 0, "type"),
        ("messages", 0, "content", 0, "text"),
        ("messages", 0, "content", 0, "tool_use_id"),
        ("messages", 0, "content", 0, "content"),
        ("messages", 0, "content", 0, "id"),
        ("messages", 0, "content", 0, "name"),
        ("messages", 0, "content", 0, "input"),
        ("system", 0),
        ("system", 0, "type"),
        ("system", 0, "text"),
        ("system", 0, "cache_control"),
        ("tools", 0),
        ("tools", 0, "name"),
        ("tools", 0, "type"),
        ("tools", 0, "input_schema"),
        ("tools", 0, "description"),
        ("tool_choice", "type"),
        ("tool_choice", "name"),
        ("tool_choice", "disable_parallel_tool_use"),
        ("thinking", "type"),
        ("thinking", "budget_tokens"),
        ("output_config", "effort"),
        ("output_config", "format"),
        ("output_config", "format", "schema"),
        ("metadata", "user_id"),
        ("stop_sequences", 0),
    ],
}
PATHS["count_tokens"] = [p for p in PATHS["messages"] if p[0] not in ("max_tokens", "stream")]
ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
}
DIALECTS = tuple(ROUTES)


def _set(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``body`` with ``value`` at ``path``, creating containers on the way as needed."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        container = list(body) if isinstance(body, list) else []
        while len(container) <= head:
            container.append({})
        container[head] = _set(container[head], rest, value)
        return container
    container2 = dict(body) if isinstance(body, dict) else {}
    container2[head] = _set(container2.get(head), rest, value)
    return container2


def bodies(dialect: str) -> st.SearchStrategy[bytes]:
    """Request bodies for ``dialect``: mostly its valid body with 1-4 paths replaced by random
    values (streamed or not), sometimes random JSON or random bytes."""
    base = BASES[dialect]
    paths = PATHS[dialect]
    mutated = st.builds(
        _mutate,
        st.just(base),
        st.lists(st.tuples(st.sampled_from(paths), VALUE), min_size=1, max_size=4),
        st.sampled_from([None, True, False]),
    )
    # Values of the plausible types, so that more bodies pass the checks and reach the engine
    # and the answer's echo (metadata, tools, reasoning) is exercised too.
    plausible = st.builds(
        _mutate,
        st.just(base),
        st.lists(st.tuples(st.sampled_from(paths), PLAUSIBLE), max_size=2),
        st.sampled_from([None, True, False]),
    )
    return st.one_of(
        mutated,
        mutated,
        plausible,
        plausible,
        JSON.map(lambda v: dumps(v).encode()),
        st.binary(max_size=64),
    )


def _mutate(base: dict[str, Any], changes: list[tuple[tuple[Any, ...], Any]], stream: Any) -> bytes:
    body: Any = base
    if stream is not None:
        body = {**body, "stream": stream}
    for path, value in changes:
        body = _set(body, path, value)
    return dumps(body).encode()


@dataclass
class Verdict:
    """What was wrong with one answer (empty ``problems``: nothing)."""

    status: int
    problems: list[str] = field(default_factory=list)


def _envelope_problem(dialect: str, payload: Any) -> str | None:
    """None when ``payload`` is an error in the dialect's envelope, else what is wrong."""
    if dialect in ("messages", "count_tokens"):
        ok = (
            isinstance(payload, dict)
            and payload.get("type") == "error"
            and isinstance(payload.get("error"), dict)
            and set(payload["error"]) == {"type", "message"}
        )
        return None if ok else "not Anthropic's error envelope"
    ok = (
        isinstance(payload, dict)
        and isinstance(payload.get("error"), dict)
        and set(payload["error"]) == {"message", "type", "param", "code"}
    )
    return None if ok else "not OpenAI's error envelope"


def judge(dialect: str, body: bytes, response: httpx.Response) -> Verdict:
    """The checks every answer must pass: < 500; no traceback; a request id; an error in the
    dialect's envelope that quotes no 16 characters of the credential-shaped canary (an answer
    may echo it where the API echoes a field, Responses ``metadata``); a stream that ends in its
    dialect's last event."""
    verdict = Verdict(response.status_code)
    problems = verdict.problems
    text = response.text
    if response.status_code >= 500:
        problems.append(f"status {response.status_code}")
    if "Traceback" in text or 'File "' in text:
        problems.append("traceback in the answer")
    if response.status_code >= 400 and CANARY[:16] in text:
        problems.append("canary echoed in an error")
    if not response.headers.get("x-request-id"):
        problems.append("no x-request-id")
    content_type = response.headers.get("content-type", "")
    if response.status_code >= 400:
        try:
            payload = json.loads(text)
        except ValueError:
            problems.append(f"error body not JSON ({content_type})")
        else:
            problem = _envelope_problem(dialect, payload)
            if problem:
                problems.append(problem)
    elif "text/event-stream" in content_type:
        events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
        last = events[-1] if events else ""
        if dialect == "messages":
            done = last in ("message_stop", "error")
        elif dialect == "responses":
            done = last in ("response.completed", "response.incomplete", "response.failed")
        else:
            data = [line for line in text.splitlines() if line.startswith("data: ")]
            done = bool(data) and (data[-1] == "data: [DONE]" or '"error"' in data[-1])
        if not done:
            problems.append("stream without its last event")
    return verdict


def post(
    client: httpx.Client, base_url: str, key: str, dialect: str, body: bytes
) -> httpx.Response:
    """POST ``body`` to the dialect's route with ``key`` (Anthropic's header on its routes)."""
    headers = {"Content-Type": "application/json"}
    if dialect in ("messages", "count_tokens"):
        headers["x-api-key"] = key
        headers["anthropic-version"] = "2023-06-01"
    else:
        headers["Authorization"] = f"Bearer {key}"
    return client.post(base_url + ROUTES[dialect], content=body, headers=headers, timeout=60)


def fuzz_dialect(
    client: httpx.Client,
    base_url: str,
    key: str,
    dialect: str,
    examples: int,
    out: Callable[[str], None],
) -> tuple[Counter[int], Counter[str]]:
    """Send ``examples`` generated bodies of ``dialect``; (statuses, problems) counted, the
    first three bodies of each problem printed with ``out``."""
    statuses: Counter[int] = Counter()
    found: Counter[str] = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies(dialect))
    def one(body: bytes) -> None:
        try:
            verdict = judge(dialect, body, post(client, base_url, key, dialect, body))
        except httpx.HTTPError as exc:  # an answer broken on the wire (a 500 inside a stream)
            verdict = Verdict(0, [f"broken answer ({type(exc).__name__})"])
        statuses[verdict.status] += 1
        for problem in verdict.problems:
            if found[problem] < 3:
                out(f"  {dialect}: {problem}: {body[:300]!r}")
            found[problem] += 1

    one()
    return statuses, found


def run(base_url: str, key: str, examples: int, out: Callable[[str], None]) -> int:
    """The by-hand fuzz: ``examples`` generated bodies per dialect; prints counts and the first
    failures of each kind; returns the number of failed answers."""
    failures = 0
    with httpx.Client() as client:
        for dialect in DIALECTS:
            started = time.monotonic()
            statuses, found = fuzz_dialect(client, base_url, key, dialect, examples, out)
            failures += sum(found.values())
            took = time.monotonic() - started
            out(
                f"{dialect}: {sum(statuses.values())} bodies in {took:.0f} s, "
                f"statuses {dict(sorted(statuses.items()))}, problems {dict(found)}"
            )
    return failures


@contextlib.contextmanager
def fuzz_stack() -> Iterator[Gateway]:
    """A simulator that parses tool calls (so tool requests are served) and a gateway in front
    of it with stored responses on, in a private temp dir removed on exit."""
    path = Path(tempfile.mkdtemp(prefix="q38f-", dir="/tmp"))
    os.chmod(path, 0o700)
    sim = start_sim(path, "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")
    try:
        gateway = start_gateway(path, sim, {"responses": {"store": True}})
        try:
            yield gateway
        finally:
            gateway.proc.terminate()
            gateway.proc.wait(10)
    finally:
        sim.stop()
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.fuzz_bodies``: a large fuzz against a running simulator and gateway."""
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000, help="bodies per dialect")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    from tests.conftest import KEY_A

    with fuzz_stack() as gateway:
        failures = run(gateway.base_url, KEY_A, args.examples, print)
        logged = [
            entry
            for entry in gateway.logs()
            if entry.get("exception") or entry.get("level") in ("error", "critical")
        ]
        print(f"log lines with a traceback or at error level: {len(logged)}")
        for entry in logged[:5]:
            print("  ", json.dumps(entry)[:600])
        served = [e for e in gateway.access_logs() if e.get("status", 0) >= 500]
        print(f"access lines with status >= 500: {len(served)}")
    return 1 if failures or logged else 0


if __name__ == "__main__":
    sys.exit(main())
