"""Property-based tests of the SSE relay: any framing, split, encoding or junk from the engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.sse import DONE_EVENT, SseRelay

pytestmark = pytest.mark.fast

ENGINE = "qwen3.8-27b"
PROPERTY_SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# JSON objects like an engine's chunks, without the fields the relay rewrites (model, usage,
# reasoning), so a valid event must come out byte for byte.
_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12
)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(10**6), 10**6), _text)
_objects = st.dictionaries(
    st.sampled_from(["id", "object", "created", "choices", "delta", "content", "index"]),
    st.one_of(_scalar, st.lists(_scalar, max_size=3)),
    max_size=5,
)


def _encode(obj: dict[str, Any], ascii_only: bool) -> bytes:
    return json.dumps(obj, ensure_ascii=ascii_only, separators=(",", ":")).encode()


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, start = [], 0
    for point in [*points, len(data)]:
        out.append(data[start:point])
        start = point
    return out


def _relay(reads: list[bytes]) -> tuple[bytes, SseRelay]:
    relay = SseRelay(ENGINE, ENGINE, client_wants_usage=True)
    out = b"".join(relay.feed(read) for read in reads) + relay.finish()
    return out, relay


def _client_events(out: bytes) -> list[bytes]:
    assert out == b"" or out.endswith(b"\n\n")
    return [block for block in out.split(b"\n\n") if block]


@PROPERTY_SETTINGS
@given(
    events=st.lists(_objects, min_size=1, max_size=8),
    newline=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    ascii_only=st.booleans(),
    done=st.booleans(),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_valid_events_pass_unchanged_whatever_the_framing(
    events: list[dict[str, Any]], newline: bytes, ascii_only: bool, done: bool, cuts: list[int]
) -> None:
    """Valid events come out byte for byte, in order, under any line ending and any read split."""
    payloads = [_encode(e, ascii_only) for e in events]
    wire = b"".join(b"data: " + p + newline + newline for p in payloads)
    if done:
        wire += b"data: [DONE]" + newline + newline
    out, relay = _relay(_split(wire, cuts))
    expected = b"".join(b"data: " + p + b"\n\n" for p in payloads)
    if done:
        expected += DONE_EVENT
    assert out == expected
    assert relay.state.dropped_events == 0


@PROPERTY_SETTINGS
@given(
    events=st.lists(_objects, min_size=1, max_size=6),
    junk=st.lists(
        st.one_of(
            st.sampled_from([b"data:", b"data: ", b"data: null", b"data: hello", b"data: [1,2]"]),
            st.binary(max_size=20)
            .map(lambda b: b"data: " + b.replace(b"\n", b"").replace(b"\r", b""))
            .filter(lambda line: line.strip() != b"data: [DONE]"),  # the end, not junk
            st.sampled_from([b": keepalive", b"event: x", b"id: 3", b"retry: 10"]),
        ),
        max_size=6,
    ),
    positions=st.lists(st.integers(0, 100), max_size=6),
    cuts=st.lists(st.integers(0, 10_000), max_size=8),
)
def test_junk_between_valid_events_is_dropped_never_raises(
    events: list[dict[str, Any]], junk: list[bytes], positions: list[int], cuts: list[int]
) -> None:
    """Junk lines between valid events never raise; the client sees only JSON objects, comments and [DONE]; valid events survive."""
    blocks = [b"data: " + _encode(e, False) for e in events]
    for line, position in zip(junk, positions, strict=False):
        blocks.insert(position % (len(blocks) + 1), line)
    wire = b"".join(block + b"\n\n" for block in blocks) + b"data: [DONE]\n\n"
    out, _ = _relay(_split(wire, cuts))
    kept = []
    for block in _client_events(out):
        if block.startswith(b":"):
            continue
        assert block.startswith(b"data: ")
        payload = block[6:]
        if payload == b"[DONE]":
            continue
        stripped = payload.strip()
        assert stripped.startswith(b"{") and stripped.endswith(b"}"), block
        kept.append(payload)
    valid = [_encode(e, False) for e in events]
    for payload in valid:
        assert payload in kept
    assert out.endswith(DONE_EVENT)


@PROPERTY_SETTINGS
@given(data=st.binary(max_size=400), cuts=st.lists(st.integers(0, 10_000), max_size=10))
def test_arbitrary_bytes_never_raise_and_emit_only_sse(data: bytes, cuts: list[int]) -> None:
    """Random bytes from the engine never raise; whatever goes out is whole SSE blocks of data objects or comments."""
    out, relay = _relay(_split(data, cuts))
    for block in _client_events(out):
        if block.startswith(b":"):
            continue
        assert block.startswith(b"data: "), block
        payload = block[6:]
        assert payload == b"[DONE]" or (
            payload.strip().startswith(b"{") and payload.strip().endswith(b"}")
        )
    assert relay.state.events >= 0


@PROPERTY_SETTINGS
@given(
    events=st.lists(_objects, min_size=1, max_size=6),
    cuts_a=st.lists(st.integers(0, 10_000), max_size=10),
    cuts_b=st.lists(st.integers(0, 10_000), max_size=10),
)
def test_output_does_not_depend_on_read_boundaries(
    events: list[dict[str, Any]], cuts_a: list[int], cuts_b: list[int]
) -> None:
    """Two different splits of the same engine bytes give the same client bytes and the same counts."""
    wire = b"".join(b"data: " + _encode(e, False) + b"\r\n\r\n" for e in events)
    wire += b"data: [DONE]\r\n\r\n"
    out_a, relay_a = _relay(_split(wire, cuts_a))
    out_b, relay_b = _relay(_split(wire, cuts_b))
    assert out_a == out_b
    assert relay_a.state.events == relay_b.state.events
    assert relay_a.state.content_events == relay_b.state.content_events
