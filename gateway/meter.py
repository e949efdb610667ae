"""The meter: the one place a model call's tokens are read from the engine, counted and settled.

The engine reports tokens in OpenAI's ``usage`` object (OpenAI API reference, "The chat
completion object"; vLLM adds it to every chunk with ``continuous_usage_stats``). `parse_usage`
is its only reader, for streamed chunks (`gateway.sse`), the dialect writers
(`gateway.translate.chat_events`) and whole answers (`gateway.answers`). `RunningUsage` sums a
stream's running usage per choice; `Meter` holds one call's counts from every source (the final
usage, the running usage of a stream, the engine's counter delta around a cut request, content
events) and makes them final once (`Meter.settle`): the quota and rate-limit settles,
``gateway_tokens_total``, the usage ledger and the access line all read the settled counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.counters import Generated


@dataclass(frozen=True)
class EngineUsage:
    """One ``usage`` object as the engine reported it; counts are tokens.

    Attributes:
        prompt_tokens: ``prompt_tokens``.
        completion_tokens: ``completion_tokens`` (reasoning included).
        cached_tokens: ``prompt_tokens_details.cached_tokens`` (0 when absent).
        reasoning_tokens: ``completion_tokens_details.reasoning_tokens`` when reported (a part
            of ``completion_tokens``), else None.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int | None = None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def parse_usage(usage: Any) -> EngineUsage | None:
    """The engine's ``usage`` object as `EngineUsage`; None when it is not an object. A count
    that is not a non-negative integer reads as 0 (reasoning: as not reported)."""
    if not isinstance(usage, dict):
        return None
    prompt_details = usage.get("prompt_tokens_details")
    completion_details = usage.get("completion_tokens_details")
    cached = _count(prompt_details.get("cached_tokens")) if isinstance(prompt_details, dict) else 0
    reasoning = None
    if isinstance(completion_details, dict):
        value = completion_details.get("reasoning_tokens")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            reasoning = value
    return EngineUsage(
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        cached_tokens=cached,
        reasoning_tokens=reasoning,
    )


@dataclass
class RunningUsage:
    """The engine's running usage (``continuous_usage_stats``): what was streamed so far.

    vLLM's per-chunk ``usage`` counts the tokens of the chunk's own choice (OpenAI API reference,
    ``stream_options``; vLLM docs, "OpenAI-Compatible Server", ``continuous_usage_stats``), so
    the running total is kept per choice index and summed.

    Attributes:
        prompt_tokens: the engine's prompt count (the largest reported; choices share the prompt).
        choices: choice index -> (completion tokens, reasoning tokens or None), the last reported.
    """

    prompt_tokens: int = 0
    choices: dict[int, tuple[int, int | None]] = field(default_factory=dict)

    def observe(self, usage: EngineUsage, index: int = 0) -> None:
        """Take one chunk's running usage, of choice ``index``."""
        self.prompt_tokens = max(self.prompt_tokens, usage.prompt_tokens)
        self.choices[index] = (usage.completion_tokens, usage.reasoning_tokens)

    @property
    def completion_tokens(self) -> int:
        """Completion tokens streamed, all choices together."""
        return sum(completion for completion, _ in self.choices.values())

    @property
    def reasoning_tokens(self) -> int | None:
        """Reasoning tokens streamed (part of `completion_tokens`), None when not reported."""
        counts = [reasoning for _, reasoning in self.choices.values() if reasoning is not None]
        return sum(counts) if counts else None


@dataclass
class Meter:
    """The tokens of one model call: the one place they are counted, settled once.

    Filled by the relay from the engine's ``usage`` objects (OpenAI API reference, "The chat
    completion object"; vLLM's ``continuous_usage_stats``), by `gateway.proxy` from the engine's
    counters around a request cut short (`gateway.counters`), then made final by `settle`. The
    quota and rate-limit settles, ``gateway_tokens_total``, the usage ledger and the access log
    all read the settled counts.

    Attributes:
        reached_engine: the engine accepted the request (it may have generated tokens).
        rejected: the engine answered with an error status (it generated nothing).
        unanswered: no byte of an answer came before the request ended (the connection
            dropped before the engine's headers, or a non-streamed answer was an error): a
            counter delta of nothing then means the engine computed nothing, and it is free.
        prompt_tokens: the engine's final count; after `settle`, the count charged.
        completion_tokens: the engine's final count; after `settle`, the count charged.
        reasoning_tokens: ``completion_tokens_details.reasoning_tokens`` when the engine
            reports it (a part of ``completion_tokens``), else None.
        streamed: the engine's running usage of a stream (what was streamed), if any.
        generated: the engine's counter delta of a request cut short while it held the
            engine's only slot (what was generated), if measured.
        streamed_events: content events relayed to the client.
        source: after `settle`, where the counts came from: ``engine`` (the final usage),
            ``counters`` (the counter delta), ``streamed`` (the running usage), ``estimate``
            (prompt estimate or count, one token a content event), ``none`` (never reached
            the engine), ``rejected`` (refused by the engine with an error status).
        settled: `settle` ran; the counts are final.
    """

    reached_engine: bool = False
    rejected: bool = False
    unanswered: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    streamed: RunningUsage | None = None
    generated: Generated | None = None
    streamed_events: int = 0
    source: str | None = None
    settled: bool = False

    def record_final(self, usage: EngineUsage | None) -> None:
        """Take the engine's final usage of a complete answer (nothing when it sent none)."""
        if usage is not None:
            self.prompt_tokens = usage.prompt_tokens
            self.completion_tokens = usage.completion_tokens
            self.reasoning_tokens = usage.reasoning_tokens

    def record_stream(
        self, final: EngineUsage | None, running: RunningUsage | None, content_events: int
    ) -> None:
        """Take what a stream showed, however it ended: its final usage (if it came), its
        running usage (what was streamed) and its content events (`gateway.sse.RelayState`)."""
        self.streamed_events = content_events
        self.streamed = running
        self.record_final(final)

    @property
    def cut(self) -> bool:
        """The engine took the request and no final usage came: it was cut short."""
        return (
            self.reached_engine
            and not self.rejected
            and (self.prompt_tokens is None or self.completion_tokens is None)
        )

    def engine_prompt(self, sequences: int = 1) -> int | None:
        """The engine's own prompt count, when known: the final usage's, the streamed
        running usage's, or the counter delta's (one sequence only: vLLM counts the prompt once
        per sequence)."""
        if not self.cut:
            return self.prompt_tokens
        if self.streamed is not None and self.streamed.prompt_tokens > 0:
            return self.streamed.prompt_tokens
        generated = self.generated
        if generated is not None and sequences == 1 and generated.prompt_tokens > 0:
            return generated.prompt_tokens
        return None

    def completion_so_far(self) -> int:
        """The completion tokens a cut request is known to have cost before `settle`, by the
        same rule as `settle`: the counter delta unless it is below what was streamed (then
        not this request's counts), else the streamed count, else the content events."""
        streamed = self.streamed.completion_tokens if self.streamed is not None else None
        generated = self.generated
        if generated is not None and generated.completion_tokens >= (streamed or 0):
            return generated.completion_tokens
        if streamed is not None:
            return streamed
        return self.streamed_events

    def settle(self, prompt_estimate: int, sequences: int = 1) -> tuple[int, int]:
        """Make the counts final (once; later calls return the same); returns (prompt,
        completion) tokens to charge.

        A request that never reached the engine, or that the engine refused with an error
        status, costs nothing; a complete one its final usage.
        One cut short is charged, completion: the engine's counter delta when measured and at
        least what was streamed, else the streamed running usage (an undercharge bounded by
        what the engine generated after the last streamed chunk), else one token per content
        event; prompt: the engine's streamed count, else the counter delta (one sequence: vLLM
        counts the prompt once per sequence), else a count or the estimate already set in
        ``prompt_tokens``, else ``prompt_estimate``.
        """
        if self.settled:
            return self.prompt_tokens or 0, self.completion_tokens or 0
        if not self.reached_engine:
            self.prompt_tokens, self.completion_tokens, self.source = 0, 0, "none"
        elif self.rejected:
            # The engine refused it before any prefill (its 4xx/5xx status came first): no
            # token was computed, whatever the prompt's size (an over-long prompt included).
            self.prompt_tokens, self.completion_tokens, self.source = 0, 0, "rejected"
        elif not self.cut:
            self.source = "engine"
            if self.prompt_tokens is None:
                self.prompt_tokens = prompt_estimate
            if self.completion_tokens is None:
                self.completion_tokens = 0
        else:
            self._settle_cut(prompt_estimate, sequences)
        self.settled = True
        return self.prompt_tokens or 0, self.completion_tokens or 0

    def _settle_cut(self, prompt_estimate: int, sequences: int) -> None:
        streamed, generated = self.streamed, self.generated
        streamed_completion = streamed.completion_tokens if streamed is not None else 0
        if generated is not None and generated.completion_tokens < streamed_completion:
            generated = self.generated = None  # not this request's counts
        if (
            self.unanswered
            and generated is not None
            and generated.prompt_tokens == generated.completion_tokens == 0
        ):
            # The engine's counters around it moved by nothing and it sent no byte: refused
            # or dropped before any prefill (a 503 while loading, a connection closed at once).
            self.prompt_tokens, self.completion_tokens, self.source = 0, 0, "counters"
            return
        prompt = self.engine_prompt(sequences)
        if streamed is not None:
            self.reasoning_tokens = streamed.reasoning_tokens
        if generated is not None:
            self.source = "counters"
            self.completion_tokens = generated.completion_tokens
        elif streamed is not None:
            self.source = "streamed"
            self.completion_tokens = streamed_completion
        else:
            self.source = "estimate"
            self.completion_tokens = self.streamed_events
        if prompt is None:
            prompt = self.prompt_tokens if self.prompt_tokens is not None else prompt_estimate
        self.prompt_tokens = prompt
