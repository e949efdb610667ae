"""Cases C19 and C23 and the field checks: what a client body may hold, refused before the engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ALIAS, KEY_A, KEY_B, Gateway, Sim

AUTH = {"Authorization": f"Bearer {KEY_A}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def small(request: pytest.FixtureRequest) -> Any:
    """A simulator and a gateway whose tenant acme has tpm 1000 and rpm 5."""
    from tests.conftest import running_stack

    with running_stack({"tenants": {"acme": {"tpm": 1000, "rpm": 5, "max_tokens": 100}}}) as gw:
        yield gw


def post(gw: Gateway, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    """POST a JSON body (a dict, or raw bytes sent as they are) with KEY_A."""
    if isinstance(body, bytes):
        return httpx.post(
            gw.url(path),
            content=body,
            headers={**AUTH, "Content-Type": "application/json"},
            timeout=30,
        )
    return httpx.post(gw.url(path), json=body, headers=AUTH, timeout=30)


def engine_calls(sim: Sim | None) -> int:
    """Model requests the simulator received."""
    assert sim is not None
    return len(sim.model_records())


# ----------------------------------------------------------------------------------------- C19


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["hi"] * 20, "max_tokens": 100},
        {"prompt": [[1, 2], [3, 4]], "n": 2, "max_tokens": 300},
        {"prompt": ["a", "b"], "n": 3, "max_tokens": 200},
        {"prompt": "hi", "n": 1, "best_of": 4, "max_tokens": 300},
        {"prompt": [[7] * 50] * 10, "max_tokens": 60},
    ],
    ids=["20_prompts", "token_lists_n2", "prompts_times_n", "best_of", "long_token_prompts"],
)
def test_c19_prompt_lists_and_multiples_are_reserved_whole(
    small: Gateway, body: dict[str, Any]
) -> None:
    """C19: every prompt x every choice x max_tokens (plus each prompt's length) is reserved; over tpm is 429 before the engine."""
    before = engine_calls(small.sim)
    r = post(small, COMPLETIONS, {"model": ALIAS, **body})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "tokens"
    assert engine_calls(small.sim) == before


def test_c19_reservation_counts_each_prompt(small: Gateway) -> None:
    """C19: a 5-prompt request within budget reserves 5 x max_tokens (the remaining-tokens header shows it) and is served."""
    r = post(small, COMPLETIONS, {"model": ALIAS, "prompt": ["a"] * 5, "max_tokens": 10})
    assert r.status_code == 200, r.text
    assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 1000 - 5 * 10
    assert len(r.json()["choices"]) == 5


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["hi"] * 2049},
        {"prompt": [[1, 2]] * 1025, "n": 2},
        {"prompt": ["a"] * 17, "n": 1, "best_of": 128},
        {"prompt": ["x"] * 300_000, "stream": True},
    ],
    ids=["prompts", "prompts_times_n", "prompts_times_best_of", "huge_batch_streamed"],
)
def test_a_batch_past_the_sequence_cap_is_a_400_before_the_engine(
    stack: Gateway, body: dict[str, Any]
) -> None:
    """A /v1/completions batch of more than 2,048 sequences (prompts x max(n, best_of)) is hours
    of the engine and an answer past any cap: refused with a 400 naming the count, nothing sent
    to the engine; a batch of exactly 2,048 is served, one choice per prompt."""
    before = engine_calls(stack.sim)
    r = post(stack, COMPLETIONS, {"model": ALIAS, **body})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "prompt" and "at most 2048" in error["message"], error
    assert engine_calls(stack.sim) == before
    r = post(stack, COMPLETIONS, {"model": ALIAS, "prompt": ["hi"] * 2048, "max_tokens": 1})
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["choices"]) == 2048


# ----------------------------------------------------------------------------------------- C23


NUMBERS = [
    ("temperature", b"1e400"),
    ("top_p", b"-1e400"),
    ("max_tokens", b"1e400"),
    ("seed", b"1e30"),
    ("seed", b"9" * 5000),
    ("max_tokens", b"9" * 5000),
    ("presence_penalty", b"-" + b"9" * 5000),
    ("x_unknown_field", b"1e400"),
    ("x_unknown_field", b"7" * 5000),
    # Integers a float cannot hold (309 digits and more) in the fields the engine reads as
    # floats: its conversion would fail (a 5xx), so they are refused here.
    ("temperature", b"1" + b"0" * 400),
    ("repetition_penalty", b"9" * 309),
    ("length_penalty", b"-" + b"9" * 400),
    # Integers past 64 bits in the integer fields the engine carries in 64 bits.
    ("top_k", b"1" + b"0" * 400),
    ("top_k", str(2**64).encode()),
    ("min_tokens", b"9" * 100),
    ("thinking_token_budget", b"1" + b"0" * 400),
    ("priority", b"-" + b"9" * 30),
]


@pytest.mark.parametrize(("field", "literal"), NUMBERS, ids=[f"{f}-{v[:6]!r}" for f, v in NUMBERS])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_c23_numbers_that_are_not_numbers(
    stack: Gateway, path: str, field: str, literal: bytes
) -> None:
    """C23: non-finite and huge numbers anywhere are a 400 naming the parameter; nothing reaches the engine."""
    before = engine_calls(stack.sim)
    head = b'{"messages":[{"role":"user","content":"hi"}],' if path == CHAT else b'{"prompt":"hi",'
    r = post(stack, path, head + b'"' + field.encode() + b'":' + literal + b"}")
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert engine_calls(stack.sim) == before
    assert (
        b"Infinity"
        not in json.dumps([rec.get("body") for rec in stack.sim.model_records()]).encode()
    )


def test_c23_nested_non_finite_number_named_by_path(stack: Gateway) -> None:
    """C23: 1e400 deep inside a tool schema is refused naming its top-level field and path."""
    raw = (
        b'{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":'
        b'{"name":"f","parameters":{"type":"object","properties":{"a":{"maximum":1e400}}}}}]}'
    )
    r = post(stack, CHAT, raw)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "tools" and "tools[0].function.parameters" in error["message"]


# --------------------------------------------------------------------------------- field types


WRONG = [
    ("temperature", "hot"),
    ("top_p", "x"),
    ("logprobs", "yes"),
    ("n", "2"),
    ("n", 1.5),
    ("max_tokens", "10"),
    ("seed", "x"),
    ("stop", 5),
    ("stop", ["a", 1]),
    ("stream", "yes"),
    ("temperature", -1),
    ("top_p", 0),
    ("top_p", 1.5),
    ("min_p", 2),
    ("n", 0),
    ("n", 129),
    ("max_tokens", 0),
    ("presence_penalty", 3),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0),
    ("top_k", -2),
    ("seed", 2**64),
    ("logit_bias", {"10": 200}),
    ("user", 5),
]


@pytest.mark.parametrize(("field", "value"), WRONG, ids=[f"{f}={v!r}" for f, v in WRONG])
def test_wrong_type_or_range_is_400_naming_the_field(
    small: Gateway, field: str, value: Any
) -> None:
    """A documented field of the wrong type or out of the engine's range is a 400 naming it, before any rpm slot."""
    before = engine_calls(small.sim)
    for path, body in ((CHAT, {"messages": MESSAGES}), (COMPLETIONS, {"prompt": "hi"})):
        if field == "logprobs" and path == COMPLETIONS:
            body["logprobs"] = "yes"
        r = post(small, path, {**body, field: value})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == field, r.text
    assert engine_calls(small.sim) == before


def test_several_wrong_fields_name_the_same_one_whatever_their_order(small: Gateway) -> None:
    """Two wrong fields: the 400 names the same one (the first documented) in either key order,
    and a wrong field after many good ones is still found."""
    wrong = {"temperature": "hot", "seed": "x", "n": 0}
    for path, body in ((CHAT, {"messages": MESSAGES}), (COMPLETIONS, {"prompt": "hi"})):
        named = set()
        for order in (list(wrong), list(reversed(wrong))):
            r = post(small, path, {**{k: wrong[k] for k in order}, **body})
            assert r.status_code == 400, r.text
            named.add(r.json()["error"]["param"])
        assert named == {"n"}, named
        good = {"top_p": 0.5, "top_k": 5, "stop": ["x"], "user": "u", "max_tokens": 5}
        r = post(small, path, {**body, **good, "min_p": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text


def test_bad_fields_use_no_rate_limit_slot(small: Gateway) -> None:
    """Ten refused bodies against rpm 5 are all 400, and a good request still passes."""
    for _ in range(10):
        assert post(small, CHAT, {"messages": MESSAGES, "temperature": "hot"}).status_code == 400
        assert post(small, CHAT, {"messages": MESSAGES, "max_tokens": 10**7}).status_code == 400
    assert post(small, CHAT, {"messages": MESSAGES, "max_tokens": 5}).status_code == 200


def test_max_tokens_larger_than_the_context_refused_first(stack: Gateway) -> None:
    """max_tokens above max_model_len (or a token prompt plus max_tokens over it) is a 400 before the engine."""
    before = engine_calls(stack.sim)
    r = post(stack, CHAT, {"messages": MESSAGES, "max_tokens": 300_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = post(stack, CHAT, {"messages": MESSAGES, "max_completion_tokens": 300_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    r = post(stack, COMPLETIONS, {"prompt": [5] * 200_000, "max_tokens": 60_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "maximum context length" in r.json()["error"]["message"]
    assert engine_calls(stack.sim) == before


def test_completions_default_to_16_tokens(stack: Gateway) -> None:
    """/v1/completions without max_tokens generates at most 16 tokens, as the OpenAI API and vLLM do."""
    with openai.OpenAI(base_url=stack.url("/v1"), api_key=KEY_A, max_retries=0) as client:
        answer = client.completions.create(
            model=ALIAS, prompt="Once upon a time", extra_body={"sim": {"completion_tokens": 200}}
        )
    assert answer.usage is not None and answer.usage.completion_tokens == 16
    assert stack.sim is not None
    assert stack.sim.model_records()[-1]["body"]["max_tokens"] == 16


# ------------------------------------------------------------------------------ no credentials


def credential_shapes() -> list[Any]:
    """KEY_A as clients paste it by mistake: bare, without its sk- prefix, padded, with Bearer, in a list."""
    return [KEY_A, KEY_A[3:], f"  {KEY_A}  ", f"Bearer {KEY_A}", [KEY_A], {"k": KEY_A}]


@pytest.mark.parametrize("where", ["model", "temperature", "stop", "key", "unknown"])
def test_credentials_never_echoed_in_errors(stack: Gateway, where: str) -> None:
    """A credential in any field, key or shape is never echoed in the error body or headers."""
    for shape in credential_shapes():
        body: dict[str, Any] = {"messages": MESSAGES}
        if where == "key":
            body["tools"] = [{"type": "function", "function": {KEY_A: float("inf")}}]
            raw = json.dumps(body).replace("Infinity", "1e400").encode()
        else:
            body[where if where != "unknown" else "x_field"] = shape
            if where == "unknown":
                body["temperature"] = [shape]
            if where == "stop":
                body["stop"] = [shape, 5]
            raw = json.dumps(body).encode()
        r = post(stack, CHAT, raw)
        assert 400 <= r.status_code < 500, r.text[:200]
        text = r.text + json.dumps(dict(r.headers))
        for fragment in (KEY_A, KEY_A[3:], KEY_A[7:27]):
            assert fragment not in text, (where, shape, r.text[:300])
    logs = stack.log_path.read_text()
    assert KEY_A[7:27] not in logs


def test_engine_error_messages_never_echo_a_credential(stack: Gateway) -> None:
    """An engine 400 that quotes the request (the simulator names an unknown `sim` key) passes through with any credential in it redacted."""
    for shape in (KEY_A, KEY_A[3:], f"Bearer {KEY_A}"):
        body = {"messages": MESSAGES, "max_tokens": 2, "sim": {shape: 1}}
        r = httpx.post(
            stack.url(CHAT), json=body, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30
        )
        assert r.status_code == 400, r.text[:200]
        text = r.text + json.dumps(dict(r.headers))
        assert "unknown `sim` key" in r.json()["error"]["message"]
        for fragment in (KEY_A, KEY_A[3:], KEY_A[7:27]):
            assert fragment not in text, r.text


def test_own_credential_in_the_body_is_refused(stack: Gateway) -> None:
    """A body carrying the request's own API key (pasted into a message) is a 400 that does not echo it, and never reaches the engine."""
    before = engine_calls(stack.sim)
    content = f"my key is {KEY_A}, why does it fail?"
    r = post(stack, CHAT, {"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert r.status_code == 400
    assert KEY_A not in r.text and KEY_A[7:27] not in r.text
    assert engine_calls(stack.sim) == before


@pytest.mark.parametrize(
    ("path", "head"),
    [
        ("/v1/responses", b'{"input":"hi","max_output_tokens":4,'),
        ("/v1/messages", b'{"max_tokens":4,"messages":[{"role":"user","content":"hi"}],'),
    ],
    ids=["responses", "messages"],
)
def test_c23_an_integer_no_float_holds_is_refused_on_translated_routes(
    stack: Gateway, path: str, head: bytes
) -> None:
    """C23 (C28's kind): ``temperature`` of 401 digits is a 400 in the route's own error shape
    on the routes translated onto chat; the engine, which reads it as a float, never sees it."""
    before = engine_calls(stack.sim)
    r = post(
        stack, path, head + b'"model":"' + ALIAS.encode() + b'","temperature":1' + b"0" * 400 + b"}"
    )
    assert r.status_code == 400, r.text[:300]
    body = r.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error"
    assert "temperature" in r.text and "0" * 50 not in r.text
    assert engine_calls(stack.sim) == before


@pytest.mark.parametrize(
    ("path", "raw", "field"),
    [
        (
            "/v1/responses",
            b'{"input":"hi","max_output_tokens":1' + b"0" * 400 + b"}",
            "max_output_tokens",
        ),
        ("/v1/responses", b'{"input":"hi","max_tool_calls":' + str(2**64).encode() + b"}", "max_tool_calls"),
        (
            "/v1/messages",
            b'{"max_tokens":2' + b"0" * 400 + b',"thinking":{"type":"enabled","budget_tokens":1'
            + b"0" * 400 + b'},"messages":[{"role":"user","content":"hi"}]}',
            "budget_tokens",
        ),
        (
            "/v1/messages",
            b'{"max_tokens":4,"top_k":1' + b"0" * 400 + b',"messages":[{"role":"user","content":"hi"}]}',
            "top_k",
        ),
    ],
    ids=["responses-max_output_tokens", "responses-max_tool_calls", "messages-thinking", "messages-top_k"],
)  # fmt: skip
def test_c23_integers_past_64_bits_are_refused_on_translated_routes(
    stack: Gateway, path: str, raw: bytes, field: str
) -> None:
    """C23 (C28's kind): an integer past 64 bits in an integer field of the translated routes
    (an output limit, a thinking budget, ``top_k``) is a 400 naming the field; it never reaches
    the engine, and no answer echoes it."""
    before = engine_calls(stack.sim)
    r = post(stack, path, raw[:1] + b'"model":"' + ALIAS.encode() + b'",' + raw[1:])
    assert r.status_code == 400, r.text[:300]
    assert field in r.text and "0" * 50 not in r.text
    assert engine_calls(stack.sim) == before


@pytest.mark.parametrize("output", [5, {"text": "x"}, True])
def test_a_tool_output_of_the_wrong_type_names_the_output_field(
    stack: Gateway, output: Any
) -> None:
    """A Responses ``function_call_output`` whose ``output`` is neither a string nor an array
    is a 400 naming ``input[N].output`` and what it must be, not the item itself."""
    items = [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": output},
    ]
    r = post(stack, "/v1/responses", {"model": ALIAS, "input": items})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "input[2].output", error
    assert "must be a string or an array" in error["message"], error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"model": ALIAS, "input": 5}, "input"),
        ("/v1/messages", {"model": ALIAS, "max_tokens": 8, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ("/v1/messages", {"model": ALIAS, "max_tokens": 8, "system": 5, "messages": [{"role": "user", "content": "hi"}]}, "system"),
    ],
    ids=["responses-input", "messages-content", "messages-system"],
)  # fmt: skip
def test_a_field_that_takes_a_string_or_an_array_says_so(
    stack: Gateway, path: str, body: dict[str, Any], param: str
) -> None:
    """A field that takes a string or an array of parts, sent as a number: the 400 names the
    field and says both forms, not "must be an array"."""
    r = post(stack, path, body)
    assert r.status_code == 400, r.text[:300]
    text = r.text
    assert param in text and "must be a string or an array" in text, text
