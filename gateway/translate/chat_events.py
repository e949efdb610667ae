"""The engine's chat answer as a flat sequence of events both dialect writers consume.

A streamed answer is read chunk by chunk (vLLM's ``chat.completion.chunk`` objects: ``delta``
with ``reasoning``/``reasoning_content``, ``content``, ``tool_calls``; a final chunk with
``finish_reason``; the usage chunk), a non-streamed one from its single ``chat.completion``
object; both give the same events, so one writer builds the SSE events and the JSON answer.
Only choice 0 is read: the dialects ask for one choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.meter import EngineUsage, parse_usage


@dataclass(frozen=True)
class Reasoning:
    """A piece of reasoning text."""

    text: str


@dataclass(frozen=True)
class Text:
    """A piece of answer text."""

    text: str


@dataclass(frozen=True)
class ToolStart:
    """A tool call begins: its position among the answer's calls, its id and function name."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ToolArgs:
    """A fragment of the JSON arguments of tool call ``index``."""

    index: int
    text: str


@dataclass(frozen=True)
class Finish:
    """The choice ended: OpenAI ``finish_reason`` and vLLM's ``stop_reason`` (the matched stop
    string, a stop token id, or None)."""

    reason: str
    stop_reason: Any = None


UsageSeen = EngineUsage
"""Token counts from the engine (``usage``), as the writers receive them (`gateway.meter`)."""

Event = Reasoning | Text | ToolStart | ToolArgs | Finish | UsageSeen


usage_event = parse_usage
"""The ``usage`` object of a chunk or answer as `UsageSeen`, None when absent."""


def _str(value: Any, default: str) -> str:
    return value if isinstance(value, str) else default


def _reasoning_of(holder: dict[str, Any]) -> str | None:
    value = holder.get("reasoning")
    if value is None:
        value = holder.get("reasoning_content")
    return value if isinstance(value, str) else None


class ChunkReader:
    """Turns streamed chat chunks into events, tracking tool-call indexes across chunks."""

    def __init__(self) -> None:
        self._calls: dict[int, int] = {}

    def read(self, chunk: Any) -> list[Event]:
        """The events of one parsed chunk (possibly none: the role chunk, empty deltas)."""
        events: list[Event] = []
        if not isinstance(chunk, dict):
            return events
        choices = chunk.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and choice.get("index", 0) == 0:
                    self._choice(choice, events)
        usage = usage_event(chunk.get("usage"))
        if usage is not None:
            events.append(usage)
        return events

    def _choice(self, choice: dict[str, Any], events: list[Event]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            reasoning = _reasoning_of(delta)
            if reasoning:
                events.append(Reasoning(reasoning))
            content = delta.get("content")
            if isinstance(content, str) and content:
                events.append(Text(content))
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    self._tool_delta(call, events)
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            events.append(Finish(reason, choice.get("stop_reason")))

    def _tool_delta(self, call: dict[str, Any], events: list[Event]) -> None:
        raw_index = call.get("index")
        engine_index = raw_index if isinstance(raw_index, int) else len(self._calls)
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        assert isinstance(function, dict)
        if engine_index not in self._calls:
            index = len(self._calls)
            self._calls[engine_index] = index
            call_id = _str(call.get("id"), f"call_{index}")
            name = _str(function.get("name"), "")
            events.append(ToolStart(index, call_id, name))
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            events.append(ToolArgs(self._calls[engine_index], arguments))


def answer_events(body: dict[str, Any]) -> list[Event]:
    """The events of a non-streamed ``chat.completion`` answer, in stream order."""
    events: list[Event] = []
    choices = body.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") if isinstance(choice, dict) else None
    if isinstance(message, dict):
        reasoning = _reasoning_of(message)
        if reasoning:
            events.append(Reasoning(reasoning))
        content = message.get("content")
        if isinstance(content, str) and content:
            events.append(Text(content))
        for index, call in enumerate(message.get("tool_calls") or ()):
            if not isinstance(call, dict):
                continue
            function = call.get("function") if isinstance(call.get("function"), dict) else {}
            assert isinstance(function, dict)
            call_id = _str(call.get("id"), f"call_{index}")
            name = _str(function.get("name"), "")
            events.append(ToolStart(index, call_id, name))
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                events.append(ToolArgs(index, arguments))
    if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
        events.append(Finish(choice["finish_reason"], choice.get("stop_reason")))
    usage = usage_event(body.get("usage"))
    if usage is not None:
        events.append(usage)
    return events
