"""SSE framing (`gateway.framing`) and the framed streams of every dialect, read by the SDKs'
own SSE decoders under any split of the reads; events over ``max_event_bytes``."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from anthropic._streaming import SSEDecoder as AnthropicDecoder
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._streaming import SSEDecoder as OpenAIDecoder

from gateway.errors import GatewayError
from gateway.framing import DONE, comment, compact_json, data_event, json_event, named_event
from gateway.sse import EventTooLarge, SseRelay
from gateway.translate import anthropic_stream, responses_stream
from gateway.translate.anthropic_stream import PING_EVENT, AnthropicWriter
from gateway.translate.relay import TranslatingRelay, Writer
from gateway.translate.responses_stream import KEEPALIVE_COMMENT, ResponsesWriter

pytestmark = pytest.mark.fast

ENGINE = "qwen3.8-27b"


def decode(reads: list[bytes], decoder: Any = None) -> list[tuple[str | None, str]]:
    """(event name, data) of every event in ``reads``, as the `openai` SDK's decoder sees them."""
    events = (decoder or OpenAIDecoder()).iter_bytes(iter(reads))
    return [(event.event, event.data) for event in events]


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


# ----------------------------------------------------------------------------- the writers


def test_each_frame_is_its_exact_bytes() -> None:
    """``data:`` events, named events, comments and OpenAI's terminator, byte for byte."""
    assert data_event(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert named_event("message_start", b"{}") == b"event: message_start\ndata: {}\n\n"
    assert comment("keep-alive") == b": keep-alive\n\n"
    assert DONE == data_event(b"[DONE]") == b"data: [DONE]\n\n"
    assert json_event(None, {"a": 1}) == b'data: {"a":1}\n\n'
    assert json_event("ping", {"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'


def test_compact_json_has_no_spaces_keeps_non_ascii_and_escapes_newlines() -> None:
    """One data line: no separators' spaces, UTF-8 as is (not ``\\u`` escapes), every newline
    and carriage return inside strings escaped."""
    raw = compact_json({"text": "a b\nc\r\n世界 🌍", "n": [1, 2]})
    assert raw == '{"text":"a b\\nc\\r\\n世界 🌍","n":[1,2]}'.encode()
    assert b"\n" not in raw and b"\r" not in raw


def test_comments_are_not_events_for_clients() -> None:
    """A keep-alive comment between events is skipped by the SDKs' decoders."""
    data = comment("keep-alive") + json_event("ping", {"type": "ping"}) + comment("x")
    assert decode([data]) == [("ping", '{"type":"ping"}')]
    assert decode([data], AnthropicDecoder()) == [("ping", '{"type":"ping"}')]


# Strings with lone surrogates too (what ``json.loads`` makes of a ``\\ud83d`` escape).
_text = st.text(st.characters() | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF))
_json: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner),
    max_leaves=12,
)
_names = st.none() | st.sampled_from(
    ["message_start", "content_block_delta", "ping", "response.output_text.delta", "error"]
)


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(st.tuples(_names, _json), min_size=1, max_size=5),
    cuts=st.lists(st.integers(0, 100_000), max_size=10),
)
def test_any_json_is_one_event_the_sdks_read_back_whatever_the_reads(
    events: list[tuple[str | None, Any]], cuts: list[int]
) -> None:
    """Any JSON value (lone surrogates in strings included), named or not, framed one after
    another and cut into arbitrary reads (inside UTF-8 characters and terminators too): the
    `openai` and `anthropic` decoders give back each event's name and exactly its value, one
    data line each."""
    data = b"".join(json_event(name, value) for name, value in events)
    points = sorted({cut % (len(data) + 1) for cut in cuts})
    reads = [data[a:b] for a, b in itertools.pairwise([0, *points, len(data)])]
    for decoder in (OpenAIDecoder(), AnthropicDecoder()):
        got = decode(reads, decoder)
        assert [(name, json.loads(payload)) for name, payload in got] == events
        assert all("\n" not in payload for _, payload in got)


# ----------------------------------------------------------------------------- every dialect


def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    """One vLLM chat.completion.chunk as the engine frames it."""
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": ENGINE,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return data_event(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode())


USAGE = data_event(
    b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"'
    + ENGINE.encode()
    + b'","choices":[],"usage":{"prompt_tokens":12,"total_tokens":18,"completion_tokens":6}}'
)
ENGINE_STREAM = b"".join(
    [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning": "Let me think: 世界?"}),
        chunk({"content": "\n\n"}),
        chunk({"content": "Hello"}),
        chunk({"content": " 世界 🌍"}),
        chunk({}, "stop"),
        USAGE,
        DONE,
    ]
)


class Ids:
    """Deterministic public ids, thinking signatures and timestamps, so two runs of a writer
    give the same bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counter = itertools.count()
        for module in (anthropic_stream, responses_stream):
            monkeypatch.setattr(module, "new_id", lambda prefix: f"{prefix}{next(self.counter)}")
        monkeypatch.setattr(anthropic_stream.secrets, "token_hex", lambda n: "ab" * n)
        monkeypatch.setattr(responses_stream.time, "time", lambda: 1_700_000_000.0)

    def reset(self) -> None:
        self.counter = itertools.count()


def _fail(writer: Writer, error: GatewayError) -> bytes:
    if isinstance(writer, AnthropicWriter):
        return writer.error("api_error", error.message)
    assert isinstance(writer, ResponsesWriter)
    return writer.fail("server_error", error.message)


def chat_relay(max_event: int) -> SseRelay:
    return SseRelay(ENGINE, ENGINE, client_wants_usage=True, max_event_bytes=max_event)


def messages_relay(max_event: int) -> TranslatingRelay:
    inner = SseRelay(ENGINE, ENGINE, client_wants_usage=True, max_event_bytes=max_event)
    return TranslatingRelay(inner, AnthropicWriter(ENGINE, input_estimate=12), _fail, PING_EVENT)


def responses_relay(max_event: int) -> TranslatingRelay:
    inner = SseRelay(ENGINE, ENGINE, client_wants_usage=True, max_event_bytes=max_event)
    writer = ResponsesWriter(ENGINE, {})
    return TranslatingRelay(inner, writer, _fail, KEEPALIVE_COMMENT)


DIALECTS: dict[str, Callable[[int], Any]] = {
    "chat": chat_relay,
    "messages": messages_relay,
    "responses": responses_relay,
}


def relay_bytes(dialect: str, reads: list[bytes], max_event: int = 1 << 20) -> bytes:
    relay = DIALECTS[dialect](max_event)
    opening = relay.start() if isinstance(relay, TranslatingRelay) else b""
    return opening + b"".join(relay.feed(read) for read in reads) + relay.finish()


@pytest.fixture
def ids(monkeypatch: pytest.MonkeyPatch) -> Ids:
    return Ids(monkeypatch)


def assert_well_framed(dialect: str, out: bytes) -> None:
    """Every block is one event of the dialect's shape: ``data:`` JSON (then one ``[DONE]``) for
    chat, ``event: NAME`` and ``data:`` JSON whose ``type`` is NAME for the others."""
    assert out.endswith(b"\n\n")
    blocks = out[:-2].split(b"\n\n")
    for block in blocks:
        lines = block.split(b"\n")
        if dialect == "chat":
            assert len(lines) == 1 and lines[0].startswith(b"data: ")
            if lines[0] != b"data: [DONE]":
                assert isinstance(json.loads(lines[0][6:]), dict)
        else:
            assert len(lines) == 2 and lines[0].startswith(b"event: ")
            assert lines[1].startswith(b"data: ")
            assert json.loads(lines[1][6:])["type"] == lines[0][7:].decode()
    if dialect == "chat":
        assert blocks.count(b"data: [DONE]") == 1 and blocks[-1] == b"data: [DONE]"


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
@pytest.mark.parametrize("size", [1, 2, 5, 64, 1 << 20])
@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_each_dialects_stream_is_framed_the_same_whatever_the_engines_reads(
    ids: Ids, dialect: str, size: int, newline: bytes
) -> None:
    """The engine's stream in reads of 1 byte (inside UTF-8 characters and terminators), a few
    bytes or all at once, LF or CRLF: each dialect writes the same well-framed bytes, and the
    SDK's decoder reads the same events."""
    whole = relay_bytes(dialect, [ENGINE_STREAM])
    ids.reset()
    engine = ENGINE_STREAM.replace(b"\n", newline)
    out = relay_bytes(dialect, split(engine, size))
    ids.reset()
    assert out == whole
    assert_well_framed(dialect, out)
    names = [name for name, _ in decode([out])]
    if dialect == "messages":
        assert names[0] == "message_start" and names[-1] == "message_stop"
    elif dialect == "responses":
        assert names[0] == "response.created" and names[-1] == "response.completed"
    else:
        assert set(names) == {None}


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_a_lone_surrogate_escape_from_the_engine_reaches_the_client_as_sent(dialect: str) -> None:
    """Text with an escaped lone surrogate (``\\ud83d``, which UTF-8 cannot carry) is relayed by
    every dialect as the same JSON escape, not a failed stream."""
    text = chunk({"content": "a-b"}).replace(b"a-b", b"a\\ud83db")
    out = relay_bytes(dialect, [chunk({"role": "assistant", "content": ""}), text, DONE])
    assert b"\\ud83d" in out
    texts = [json.loads(data) for _, data in decode([out]) if data != "[DONE]"]
    assert "a\ud83db" in json.dumps(texts, ensure_ascii=False)


def _event_of(size: int) -> bytes:
    """A chunk event (without its blank line) of exactly ``size`` bytes."""
    head = chunk({"content": ""})[:-2]
    padded = head.replace(b'"content":""', b'"content":"' + b"x" * (size - len(head)) + b'"')
    assert len(padded) == size
    return padded


MAX_EVENT = 600


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_an_event_over_max_event_bytes_stops_each_dialect_whatever_the_reads(
    dialect: str,
) -> None:
    """An engine event one byte over ``max_event_bytes`` raises `EventTooLarge` in every dialect,
    whole, unterminated or cut at any byte."""
    event = _event_of(MAX_EVENT + 1) + b"\n\n"
    for cut in range(len(event) + 1):
        with pytest.raises(EventTooLarge):
            relay_bytes(dialect, [event[:cut], event[cut:]], max_event=MAX_EVENT)
    with pytest.raises(EventTooLarge):
        relay_bytes(dialect, [chunk({"role": "assistant"}) + event[:-2]], max_event=MAX_EVENT)


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_an_event_of_exactly_max_event_bytes_passes_whatever_the_reads(
    ids: Ids, dialect: str, newline: bytes
) -> None:
    """An event of exactly ``max_event_bytes`` (its blank line not counted) is relayed whole
    wherever the engine's reads cut it, between the two newlines of its terminator included."""
    event = _event_of(MAX_EVENT) + newline + newline
    whole = relay_bytes(dialect, [event])
    assert b"x" * (MAX_EVENT // 2) in whole
    for cut in range(len(event) + 1):
        ids.reset()
        assert relay_bytes(dialect, [event[:cut], event[cut:]], max_event=MAX_EVENT) == whole
