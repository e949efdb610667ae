"""The SSE relay core on hand-made engine byte streams (no I/O)."""

from __future__ import annotations

import json

import pytest

from gateway.sse import (
    DONE_EVENT,
    EventTooLarge,
    SseRelay,
    StreamProtocolError,
    rewrite_completion_body,
)

pytestmark = pytest.mark.fast

ROLE = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
REASON = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"reasoning":"\xe6\x80\x9d\xe8\x80\x83 \xf0\x9f\xa4\x94"},"logprobs":null,"finish_reason":null}]}'
CONTENT = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}'
FINAL = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}'
USAGE = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":11,"total_tokens":15,"completion_tokens":4}}'
EVENTS = [ROLE, REASON, CONTENT, FINAL, USAGE]


def frame(payloads: list[bytes], sep: bytes = b"\n\n", done: bool = True) -> bytes:
    out = b"".join(b"data: " + p + sep for p in payloads)
    return out + (b"data: [DONE]" + sep if done else b"")


def run(relay: SseRelay, pieces: list[bytes]) -> bytes:
    return b"".join(relay.feed(p) for p in pieces) + relay.finish()


def client_events(raw: bytes) -> list[bytes]:
    return [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


def relay(wants_usage: bool = False, alias: str = "m") -> SseRelay:
    return SseRelay("m", alias, client_wants_usage=wants_usage)


def test_whole_stream_renames_reasoning_and_hides_usage() -> None:
    """reasoning becomes reasoning_content; the usage chunk is observed but not sent; one [DONE]."""
    r = relay()
    out = run(r, [frame(EVENTS)])
    events = client_events(out)
    assert events[-1] == b"[DONE]" and out.count(b"[DONE]") == 1
    assert b'"reasoning_content":' in events[1] and b'"reasoning":' not in out
    assert all(b'"usage"' not in e for e in events)
    assert r.state.usage is not None and r.state.usage.completion_tokens == 4


def test_usage_forwarded_when_asked() -> None:
    """A client that asked include_usage gets the usage-only chunk unchanged."""
    out = run(relay(wants_usage=True), [frame(EVENTS)])
    assert client_events(out)[-2] == USAGE


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_c03_events_split_across_reads(size: int) -> None:
    """C03: any split of the byte stream, even one byte a read, yields identical events."""
    raw = frame(EVENTS)
    whole = run(relay(True), [raw])
    pieces = [raw[i : i + size] for i in range(0, len(raw), size)]
    r = relay(True)
    assert run(r, pieces) == whole
    assert r.state.usage is not None and r.state.usage.prompt_tokens == 11


@pytest.mark.parametrize("sep", [b"\r\n\r\n", b"\r\r", b"\n\n"])
def test_c04_crlf_and_bare_cr_framing(sep: bytes) -> None:
    """C04: CRLF and bare-CR framing give the same events as LF framing, usage still counted."""
    r = relay()
    out = run(r, [frame(EVENTS, sep=sep)])
    assert out == run(relay(), [frame(EVENTS)])
    assert r.state.usage is not None


def test_c04_crlf_terminator_split_between_reads() -> None:
    """C04: the CR and LF of a terminator in different reads still end the event at once."""
    r = relay()
    first = r.feed(b"data: " + ROLE + b"\r\n\r")
    assert first == b"data: " + ROLE + b"\n\n"
    assert r.feed(b"\ndata: " + CONTENT + b"\r\n\r\n") == b"data: " + CONTENT + b"\n\n"


def test_c02_comment_lines_never_become_data() -> None:
    """C02: comment lines pass as comments; every data line holds JSON or [DONE]."""
    raw = b": keepalive\n\n" + b"data: " + ROLE + b"\n\n: ping\n\n" + frame([CONTENT, FINAL])
    out = run(relay(), [raw])
    for line in out.split(b"\n"):
        if line.startswith(b"data: "):
            body = line[6:]
            assert body == b"[DONE]" or isinstance(json.loads(body), dict)
    assert b": keepalive" in out


def test_c05_utf8_split_inside_character() -> None:
    """C05: a read that ends inside a multi-byte character loses nothing."""
    raw = frame([ROLE, REASON, FINAL])
    cut = raw.index(b"\xf0\x9f") + 1
    out = run(relay(), [raw[:cut], raw[cut:]])
    text = json.loads(client_events(out)[1])["choices"][0]["delta"]["reasoning_content"]
    assert text == "思考 🤔"


def test_c06a_finish_without_done_gets_one_done() -> None:
    """C06a: finish_reason then EOF without [DONE]: the client still gets exactly one [DONE]."""
    r = relay()
    out = run(r, [frame([ROLE, CONTENT, FINAL], done=False)])
    assert r.clean_end and out.endswith(DONE_EVENT) and out.count(b"[DONE]") == 1


def test_c06b_drop_is_not_a_clean_end() -> None:
    """C06b: content then EOF: not clean, no [DONE]; streamed chunks counted for charging."""
    r = relay()
    out = run(r, [frame([ROLE] + [CONTENT] * 10, done=False)])
    assert not r.clean_end and b"[DONE]" not in out
    assert r.state.content_events == 10


def test_error_event_passes_and_is_recorded() -> None:
    """An in-stream engine error event reaches the client and is recorded."""
    err = b'{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}'
    r = relay()
    out = run(r, [frame([ROLE, CONTENT, err])])
    assert r.state.error is not None and r.state.error["code"] == 500
    assert err in out


def test_c08_both_reasoning_names_sent_once() -> None:
    """C08: a chunk with reasoning and reasoning_content carries the text once, as reasoning_content."""
    both = b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"reasoning":"x","reasoning_content":"x"},"finish_reason":null}]}'
    out = run(relay(), [frame([both, FINAL])])
    delta = json.loads(client_events(out)[0])["choices"][0]["delta"]
    assert delta == {"reasoning_content": "x"}


def test_model_renamed_to_alias() -> None:
    """When the engine's served name differs from the alias, clients see the alias."""
    out = run(relay(alias="public"), [frame([ROLE, FINAL])])
    assert json.loads(client_events(out)[0])["model"] == "public"


def test_multiline_data_is_joined() -> None:
    """A JSON payload spread over two data: lines (valid SSE) is joined with a newline."""
    raw = b'data: {"id":"c","choices":[{"index":0,\ndata: "delta":{"content":"a"},"finish_reason":"stop"}]}\n\n'
    out = run(relay(), [raw])
    assert json.loads(client_events(out)[0])["choices"][0]["delta"]["content"] == "a"


def test_oversized_event_is_refused() -> None:
    """An event over max_event_bytes raises, whether unterminated, whole in one read or
    followed by an unterminated rest, instead of buffering without bound."""
    r = relay()
    r.feed(b"data: " + b"x" * (4 * 1024 * 1024))
    with pytest.raises(StreamProtocolError):
        r.feed(b"x" * (5 * 1024 * 1024))
    small = SseRelay("m", "m", client_wants_usage=False, max_event_bytes=1024)
    assert small.feed(b'data: {"a":"' + b"x" * 900 + b'"}\n\n')
    with pytest.raises(EventTooLarge):
        small.feed(b'data: {"a":"' + b"x" * 2000 + b'"}\n\n')
    with pytest.raises(EventTooLarge):
        SseRelay("m", "m", client_wants_usage=False, max_event_bytes=1024).feed(
            b'data: {"a":1}\n\ndata: {"b":"' + b"x" * 2000
        )


def test_non_stream_body_rewrite() -> None:
    """Non-streaming: message.reasoning becomes reasoning_content and model the alias."""
    body = {"model": "m", "choices": [{"message": {"content": "a", "reasoning": "r"}}]}
    rewrite_completion_body(body, "alias")
    assert body == {
        "model": "alias",
        "choices": [{"message": {"content": "a", "reasoning_content": "r"}}],
    }


# ------------------------------------------------------------------- running usage (every chunk)
# Real vLLM 0.32 bytes: the same answer asked with include_usage alone, and with
# continuous_usage_stats too (usage on every chunk, reasoning_tokens nested).
_HEAD = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
PLAIN = [
    _HEAD
    + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}',
    _HEAD
    + b'"delta":{"reasoning":"Okay"},"logprobs":null,"finish_reason":null,"token_ids":null}]}',
    _HEAD
    + b'"delta":{"content":"\\n\\nHello \\"usage\\":{"},"logprobs":null,"finish_reason":null,"token_ids":null}]}',
    _HEAD
    + b'"delta":{},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null}]}',
]
RUNNING = [
    b'"usage":{"prompt_tokens":14,"total_tokens":14,"completion_tokens":0,"completion_tokens_details":{"reasoning_tokens":0}}',
    b'"usage":{"prompt_tokens":14,"total_tokens":15,"completion_tokens":1,"completion_tokens_details":{"reasoning_tokens":1}}',
    b'"usage":{"prompt_tokens":14,"total_tokens":18,"completion_tokens":4,"completion_tokens_details":{"reasoning_tokens":1}}',
    b'"usage":{"prompt_tokens":14,"total_tokens":19,"completion_tokens":5,"completion_tokens_details":{"reasoning_tokens":1}}',
]
FINAL_USAGE = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":14,"total_tokens":19,"completion_tokens":5,"completion_tokens_details":{"reasoning_tokens":1}},"system_fingerprint":"vllm-0.32.0"}'


def with_running_usage(plain: bytes, usage: bytes) -> bytes:
    """Where vLLM puts the running usage: right after ``choices``."""
    at = plain.index(b"}]") + 2
    return plain[:at] + b"," + usage + plain[at:]


CONTINUOUS = [with_running_usage(p, u) for p, u in zip(PLAIN, RUNNING, strict=True)]


@pytest.mark.parametrize("size", [0, 1, 5, 97])
def test_running_usage_cut_out_byte_exactly_for_a_client_that_did_not_ask(size: int) -> None:
    """Usage on every chunk is observed and cut out: the client gets the very bytes vLLM sends
    without continuous_usage_stats (any read size, one or many events a read)."""
    expected = run(relay(), [frame([*PLAIN, FINAL_USAGE])])
    raw = frame([*CONTINUOUS, FINAL_USAGE])
    pieces = [raw] if size == 0 else [raw[i : i + size] for i in range(0, len(raw), size)]
    r = relay()
    assert run(r, pieces) == expected
    assert b'"usage"' not in expected.replace(b'\\"usage\\"', b"")
    assert r.state.running is not None and r.state.running.prompt_tokens == 14
    assert r.state.usage is not None and r.state.usage.completion_tokens == 5


def test_running_usage_kept_for_a_client_that_asked_for_it() -> None:
    """A client that asked include_usage and continuous_usage_stats gets every chunk as sent."""
    r = SseRelay("m", "m", client_wants_usage=True, client_wants_running_usage=True)
    out = run(r, [frame([*CONTINUOUS, FINAL_USAGE])])
    events = client_events(out)
    assert events[:4] == [e.replace(b'"reasoning":', b'"reasoning_content":') for e in CONTINUOUS]
    assert events[4] == FINAL_USAGE and events[5] == b"[DONE]"


def test_include_usage_alone_gets_only_the_final_usage_chunk() -> None:
    """A client that asked include_usage alone: running usage cut out, the final chunk kept."""
    out = run(relay(wants_usage=True), [frame([*CONTINUOUS, FINAL_USAGE])])
    expected = run(relay(wants_usage=True), [frame([*PLAIN, FINAL_USAGE])])
    assert out == expected and client_events(out)[-2] == FINAL_USAGE


def test_cut_stream_keeps_what_was_streamed() -> None:
    """A stream cut before its usage chunk: the running usage is what was streamed (the last
    chunk's counts), not the number of events, and no final usage is claimed."""
    r = relay()
    run(r, [frame(CONTINUOUS[:3], done=False)])
    assert r.state.usage is None and r.state.running is not None
    assert (r.state.running.prompt_tokens, r.state.running.completion_tokens) == (14, 4)
    assert r.state.running.reasoning_tokens == 1 and r.state.content_events == 2


def test_running_usage_is_summed_over_choices() -> None:
    """n=2: vLLM's running usage counts each choice's own tokens; the streamed total sums the
    last count of each choice."""
    first = with_running_usage(PLAIN[2], RUNNING[2])
    second = first.replace(b'"choices":[{"index":0,', b'"choices":[{"index":1,').replace(
        b'"completion_tokens":4', b'"completion_tokens":2'
    )
    r = SseRelay("m", "m", client_wants_usage=False, n=2)
    out = run(r, [frame([CONTINUOUS[0], first, second], done=False)])
    assert b'"usage"' not in out.replace(b'\\"usage\\"', b"")
    assert r.state.running is not None and r.state.running.completion_tokens == 6


def test_running_usage_of_a_run_mixing_flat_and_nested_forms() -> None:
    """Several events in one read whose usage objects differ in form (flat counts, then one with
    nested details): each is cut out and the last one's counts are the running usage."""
    nested = b'"usage":{"prompt_tokens":14,"total_tokens":20,"completion_tokens":6,"completion_tokens_details":{"reasoning_tokens":2}}'
    events = [*CONTINUOUS[:3], with_running_usage(PLAIN[3], nested)]
    r = relay()
    assert run(r, [frame(events, done=False)]) == run(relay(), [frame(PLAIN[:4], done=False)])
    assert r.state.running is not None
    assert (r.state.running.completion_tokens, r.state.running.reasoning_tokens) == (6, 2)
