"""The meter (`gateway.meter`): the engine's ``usage`` read once, a call's tokens settled once."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.counters import Generated
from gateway.meter import EngineUsage, Meter, RunningUsage, parse_usage

pytestmark = pytest.mark.fast

PROPERTY_SETTINGS = settings(max_examples=300, deadline=None)


# ----------------------------------------------------------------------------- parse_usage


def test_flat_usage_as_vllm_sends_it() -> None:
    """vLLM's flat usage (details null) reads as its counts, no cache hit, reasoning unreported."""
    usage = {
        "prompt_tokens": 11,
        "total_tokens": 15,
        "completion_tokens": 4,
        "prompt_tokens_details": None,
    }
    assert parse_usage(usage) == EngineUsage(11, 4, cached_tokens=0, reasoning_tokens=None)


def test_nested_details_give_cached_and_reasoning_tokens() -> None:
    """``prompt_tokens_details.cached_tokens`` and ``completion_tokens_details.reasoning_tokens``
    are read; reasoning stays a part of the completion count, not added to it."""
    usage = {
        "prompt_tokens": 120,
        "completion_tokens": 30,
        "total_tokens": 150,
        "prompt_tokens_details": {"cached_tokens": 96},
        "completion_tokens_details": {"reasoning_tokens": 21},
    }
    parsed = parse_usage(usage)
    assert parsed == EngineUsage(120, 30, cached_tokens=96, reasoning_tokens=21)


def test_zero_reasoning_is_reported_not_missing() -> None:
    """A reasoning count of 0 (thinking off) is a report of 0, unlike an absent one (None)."""
    zero = parse_usage({"completion_tokens_details": {"reasoning_tokens": 0}})
    absent = parse_usage({"completion_tokens_details": {}})
    assert zero is not None and zero.reasoning_tokens == 0
    assert absent is not None and absent.reasoning_tokens is None


@pytest.mark.parametrize("value", [None, "12", 12.0, 12.5, True, False, -3, [12], {"n": 12}])
def test_a_count_that_is_not_a_non_negative_integer_reads_as_zero(value: Any) -> None:
    """Nulls, strings, floats, booleans, negatives and containers count 0 tokens; reasoning
    given so reads as not reported."""
    usage = {
        "prompt_tokens": value,
        "completion_tokens": value,
        "prompt_tokens_details": {"cached_tokens": value},
        "completion_tokens_details": {"reasoning_tokens": value},
    }
    assert parse_usage(usage) == EngineUsage(0, 0, cached_tokens=0, reasoning_tokens=None)


def test_missing_counts_read_as_zero() -> None:
    """An empty usage object is 0 prompt and 0 completion tokens, not an error."""
    assert parse_usage({}) == EngineUsage(0, 0)


@pytest.mark.parametrize("details", ["96", 96, [96], True])
def test_details_that_are_not_objects_are_ignored(details: Any) -> None:
    """Details of the wrong type leave the top-level counts and give no cached or reasoning count."""
    usage = {
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "prompt_tokens_details": details,
        "completion_tokens_details": details,
    }
    assert parse_usage(usage) == EngineUsage(7, 2, cached_tokens=0, reasoning_tokens=None)


@pytest.mark.parametrize("usage", [None, [], [{"prompt_tokens": 1}], "usage", 3, 0.5, True])
def test_a_usage_that_is_not_an_object_is_none(usage: Any) -> None:
    """``usage: null`` (a chunk of a stream without usage) and garbage parse as no usage."""
    assert parse_usage(usage) is None


_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True),
        st.text(max_size=5),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)
_usage_like = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": _json,
        "completion_tokens": _json,
        "total_tokens": _json,
        "prompt_tokens_details": _json
        | st.fixed_dictionaries({}, optional={"cached_tokens": _json}),
        "completion_tokens_details": _json
        | st.fixed_dictionaries({}, optional={"reasoning_tokens": _json}),
    },
)


@PROPERTY_SETTINGS
@given(usage=_usage_like | _json)
def test_any_json_parses_to_non_negative_integer_counts_or_none(usage: Any) -> None:
    """Whatever JSON the engine sends as ``usage``, parsing never raises, and every count read
    is a non-negative int (never a bool), equal to the field when the field is one."""
    parsed = parse_usage(usage)
    if not isinstance(usage, dict):
        assert parsed is None
        return
    assert parsed is not None
    counts = [parsed.prompt_tokens, parsed.completion_tokens, parsed.cached_tokens]
    if parsed.reasoning_tokens is not None:
        counts.append(parsed.reasoning_tokens)
    for count in counts:
        assert type(count) is int and count >= 0
    prompt = usage.get("prompt_tokens")
    if type(prompt) is int and prompt >= 0:
        assert parsed.prompt_tokens == prompt


# ----------------------------------------------------------------------------- RunningUsage


def test_running_usage_keeps_each_choices_last_count_and_sums_them() -> None:
    """With n=2 each choice reports its own running count: the last of each is kept (counts are
    cumulative), the completion is their sum, the prompt (shared) the largest reported."""
    running = RunningUsage()
    running.observe(EngineUsage(10, 1), index=0)
    running.observe(EngineUsage(10, 1), index=1)
    running.observe(EngineUsage(10, 2), index=0)
    running.observe(EngineUsage(10, 5, reasoning_tokens=4), index=1)
    running.observe(EngineUsage(10, 3, reasoning_tokens=2), index=0)
    assert (running.prompt_tokens, running.completion_tokens) == (10, 8)
    assert running.reasoning_tokens == 6


def test_running_reasoning_is_none_until_a_choice_reports_it() -> None:
    """No choice reporting reasoning gives None (not 0); one that does counts alone."""
    running = RunningUsage()
    running.observe(EngineUsage(10, 4), index=0)
    assert running.reasoning_tokens is None
    running.observe(EngineUsage(10, 2, reasoning_tokens=0), index=1)
    assert running.reasoning_tokens == 0


# ----------------------------------------------------------------------------- Meter.settle


def streamed(*choices: tuple[int, int | None], prompt: int = 40) -> RunningUsage:
    """The running usage of a stream with one (completion, reasoning) per choice."""
    running = RunningUsage()
    for index, (completion, reasoning) in enumerate(choices):
        running.observe(EngineUsage(prompt, completion, reasoning_tokens=reasoning), index)
    return running


def test_a_call_that_never_reached_the_engine_costs_nothing() -> None:
    """Refused before the engine (queue, limits, validation): (0, 0), source ``none``."""
    meter = Meter()
    assert meter.settle(prompt_estimate=500) == (0, 0)
    assert (meter.source, meter.settled, meter.cut) == ("none", True, False)


def test_a_call_the_engine_refused_costs_nothing_whatever_its_prompt() -> None:
    """An engine error status (an over-long prompt) computed nothing: (0, 0), ``rejected``."""
    meter = Meter(reached_engine=True, rejected=True)
    assert not meter.cut
    assert meter.settle(prompt_estimate=200_000) == (0, 0)
    assert meter.source == "rejected"


def test_a_complete_answer_is_charged_its_final_usage_exactly() -> None:
    """The engine's final usage is what is charged, reasoning kept, the estimate ignored."""
    meter = Meter(reached_engine=True)
    meter.record_final(EngineUsage(42, 17, cached_tokens=32, reasoning_tokens=9))
    assert not meter.cut
    assert meter.settle(prompt_estimate=999) == (42, 17)
    assert (meter.source, meter.reasoning_tokens) == ("engine", 9)


def test_a_stream_whose_final_usage_came_is_charged_it_not_its_running_usage() -> None:
    """A complete stream: its final usage wins over the running usage and the event count."""
    meter = Meter(reached_engine=True)
    meter.record_stream(EngineUsage(40, 12), streamed((11, None)), content_events=30)
    assert meter.settle(prompt_estimate=999) == (40, 12)
    assert meter.source == "engine"


def test_settle_is_final_once() -> None:
    """A second settle returns the first result whatever it is given; counts stay put."""
    meter = Meter(reached_engine=True)
    meter.record_stream(None, streamed((5, None)), content_events=5)
    first = meter.settle(prompt_estimate=100)
    meter.generated = Generated(1000, 1000)
    assert meter.settle(prompt_estimate=7, sequences=3) == first == (40, 5)
    assert meter.source == "streamed"


def test_a_cut_stream_is_charged_what_was_streamed() -> None:
    """Cut with running usage and no counter delta: the streamed completion of every choice
    (n=2) and the engine's streamed prompt count; the reasoning streamed is kept."""
    meter = Meter(reached_engine=True)
    meter.record_stream(None, streamed((7, 5), (3, 3)), content_events=12)
    assert meter.cut
    assert meter.completion_so_far() == 10
    assert meter.settle(prompt_estimate=500, sequences=2) == (40, 10)
    assert (meter.source, meter.reasoning_tokens) == ("streamed", 8)


def test_a_cut_with_a_counter_delta_is_charged_the_delta() -> None:
    """The engine's counter delta (what it generated, past the last streamed chunk) is charged;
    the prompt is still the engine's streamed count."""
    meter = Meter(reached_engine=True)
    meter.record_stream(None, streamed((7, None)), content_events=7)
    meter.generated = Generated(prompt_tokens=40, completion_tokens=9)
    assert meter.completion_so_far() == 9
    assert meter.settle(prompt_estimate=500) == (40, 9)
    assert meter.source == "counters"


def test_a_counter_delta_below_what_was_streamed_is_not_this_requests() -> None:
    """A delta smaller than the streamed count belongs to another reading: it is dropped and
    the streamed count charged."""
    meter = Meter(reached_engine=True)
    meter.record_stream(None, streamed((7, None)), content_events=7)
    meter.generated = Generated(prompt_tokens=3, completion_tokens=2)
    assert meter.settle(prompt_estimate=500) == (40, 7)
    assert (meter.source, meter.generated) == ("streamed", None)


def test_the_completion_charged_before_settling_drops_a_delta_below_the_streamed_count() -> None:
    """`Meter.completion_so_far` (the engine slot's charge, before the prompt is counted) takes
    a delta below the streamed count as another reading's, as `Meter.settle` does."""
    meter = Meter(reached_engine=True)
    meter.record_stream(None, streamed((7, None), prompt=0), content_events=7)
    meter.generated = Generated(prompt_tokens=0, completion_tokens=2)
    assert meter.engine_prompt() is None
    assert meter.completion_so_far() == 7
    assert meter.settle(prompt_estimate=500)[1] == 7


def test_a_cut_non_streamed_request_takes_its_prompt_from_the_delta_with_one_sequence() -> None:
    """Nothing streamed: the counter delta gives both counts when n=1."""
    meter = Meter(reached_engine=True)
    meter.generated = Generated(prompt_tokens=55, completion_tokens=20)
    assert meter.engine_prompt() == 55
    assert meter.settle(prompt_estimate=500) == (55, 20)
    assert meter.source == "counters"


def test_with_several_sequences_the_deltas_prompt_is_not_the_prompt() -> None:
    """vLLM counts the prompt once per sequence: with n=3 the delta's prompt (3x) is not used;
    the estimate stands, the delta's completion is charged."""
    meter = Meter(reached_engine=True)
    meter.generated = Generated(prompt_tokens=165, completion_tokens=60)
    assert meter.engine_prompt(sequences=3) is None
    assert meter.settle(prompt_estimate=70, sequences=3) == (70, 60)


def test_a_cut_with_nothing_measured_is_one_token_per_content_event() -> None:
    """No usage streamed, no delta: one token a content event, the prompt estimate."""
    meter = Meter(reached_engine=True)
    meter.record_stream(None, None, content_events=6)
    assert meter.engine_prompt() is None
    assert meter.settle(prompt_estimate=123) == (123, 6)
    assert (meter.source, meter.reasoning_tokens) == ("estimate", None)


def test_a_prompt_count_set_before_settling_beats_the_estimate() -> None:
    """The engine's own count of a cut request's prompt (set by the caller) is charged instead
    of the estimate, while the completion stays an estimate."""
    meter = Meter(reached_engine=True)
    meter.record_stream(None, None, content_events=2)
    meter.prompt_tokens = 88
    assert meter.cut
    assert meter.settle(prompt_estimate=123) == (88, 2)


_counts = st.integers(0, 10_000)
_reasoning = st.none() | st.integers(0, 10_000)
_choices = st.lists(st.tuples(_counts, _reasoning), max_size=4)


@PROPERTY_SETTINGS
@given(
    reached=st.booleans(),
    rejected=st.booleans(),
    final=st.none() | st.builds(EngineUsage, _counts, _counts, _counts, _reasoning),
    choices=st.none() | _choices,
    stream_prompt=_counts,
    delta=st.none() | st.builds(Generated, _counts, _counts),
    events=_counts,
    estimate=_counts,
    sequences=st.integers(1, 4),
)
def test_settled_counts_follow_the_documented_rules(
    reached: bool,
    rejected: bool,
    final: EngineUsage | None,
    choices: list[tuple[int, int | None]] | None,
    stream_prompt: int,
    delta: Generated | None,
    events: int,
    estimate: int,
    sequences: int,
) -> None:
    """Any call: nothing when it never reached the engine or was refused there, the final usage
    exactly when it came, and a cut is never charged less completion than was streamed, the
    delta when it is at least that (`Meter.completion_so_far` saying the same before), and
    never another prompt than the engine's or the estimate; settle is idempotent."""
    running = streamed(*choices, prompt=stream_prompt) if choices is not None else None
    meter = Meter(reached_engine=reached, rejected=rejected, generated=delta)
    meter.record_stream(final, running, events)
    cut = meter.cut
    so_far = meter.completion_so_far()
    charged = meter.settle(estimate, sequences)
    assert meter.settle(estimate + 1, sequences + 1) == charged
    prompt, completion = charged
    if not reached or rejected:
        assert charged == (0, 0)
        return
    if final is not None:
        assert charged == (final.prompt_tokens, final.completion_tokens)
        assert meter.source == "engine"
        return
    assert cut
    shown = running.completion_tokens if running is not None else 0
    assert completion >= shown
    assert so_far == completion  # what the engine slot is charged before settling agrees
    if delta is not None and delta.completion_tokens >= shown:
        assert completion == delta.completion_tokens
    elif running is not None:
        assert completion == shown
    else:
        assert completion == events
    candidates = {estimate}
    if running is not None and running.prompt_tokens > 0:
        candidates = {running.prompt_tokens}
    elif delta is not None and sequences == 1 and delta.prompt_tokens > 0:
        candidates.add(delta.prompt_tokens)
    assert prompt in candidates
