"""The engine's chat answer as Anthropic Messages SSE events and as a ``Message`` object.

Event sequence (Anthropic API reference, "Streaming Messages"): ``message_start``, then per
content block ``content_block_start`` / ``content_block_delta`` (``thinking_delta`` and
``signature_delta``, ``text_delta``, ``input_json_delta``) / ``content_block_stop``, then
``message_delta`` (``stop_reason``, ``usage``) and ``message_stop``. ``ping`` events may come
at any time; a failure after the stream started is one ``error`` event (Claude Code retries a
stream that ended with it, while a bare close makes it resend the request without streaming).

Shapes are those of the ``anthropic`` SDK's ``RawMessageStreamEvent`` and ``Message`` types;
they are built as plain JSON here and checked against the SDK models in the tests.

Usage: ``input_tokens`` is the engine's prompt count (cached tokens included, no split into
``cache_read_input_tokens``), ``output_tokens`` the engine's completion count (reasoning
included, as Anthropic counts thinking in output).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from typing import Any

from gateway.framing import json_event
from gateway.translate.chat_events import (
    Event,
    Finish,
    Reasoning,
    Text,
    ToolArgs,
    ToolStart,
    UsageSeen,
)
from gateway.translate.common import arguments_object, new_id

PING_EVENT = json_event("ping", {"type": "ping"})


def sse(name: str, data: dict[str, Any]) -> bytes:
    """One named SSE event with compact JSON data (`gateway.framing`)."""
    return json_event(name, data)


def stop_reason(finish: Finish | None, has_tools: bool, stops: Sequence[str]) -> tuple[str, Any]:
    """(Anthropic ``stop_reason``, ``stop_sequence``) for the chat ``finish_reason``."""
    if finish is None:
        return "end_turn", None
    if finish.reason == "length":
        return "max_tokens", None
    if finish.reason == "tool_calls" or has_tools:
        return "tool_use", None
    if isinstance(finish.stop_reason, str) and finish.stop_reason in stops:
        return "stop_sequence", finish.stop_reason
    return "end_turn", None


class AnthropicWriter:
    """Builds one answer's events (when ``stream``) and its final ``Message``.

    Args:
        model: the model id to show.
        input_estimate: prompt tokens to report in ``message_start`` until the engine's count is
            known.
        stops: the request's ``stop_sequences`` (to report which one matched).
        stream: produce SSE bytes; False only accumulates the final message.

    Feed events with `feed`; end with `finish` (a complete answer) or `error` (a failure).
    """

    def __init__(
        self,
        model: str,
        *,
        input_estimate: int,
        stops: Sequence[str] = (),
        stream: bool = True,
    ) -> None:
        self.message_id = new_id("msg_")
        self.model = model
        self.stream = stream
        self.started = False
        self.ended = False
        self.blocks: list[dict[str, Any]] = []
        self.usage: UsageSeen | None = None
        self._estimate = input_estimate
        self._stops = tuple(stops)
        self._open: str | None = None
        self._pending_ws = ""
        self._tool_blocks: dict[int, int] = {}
        self._tool_args: dict[int, list[str]] = {}
        self._finish: Finish | None = None

    # ------------------------------------------------------------------ event production

    def _emit(self, name: str, data: dict[str, Any]) -> bytes:
        return sse(name, data) if self.stream else b""

    def start(self, *, counted: bool = True) -> bytes:
        """``message_start`` once (called by `feed` on the first event too).

        ``counted=False`` (a stream opened while it waits for the engine): ``input_tokens`` is 0
        in ``message_start``, the engine's count comes in the final ``message_delta``. Claude
        Code adds the running usage to its session cost at every ``message_delta``, so the
        waiting stream's `progress` events must carry no tokens.
        """
        if self.started:
            return b""
        self.started = True
        prompt = self.usage.prompt_tokens if self.usage is not None else self._estimate
        if not counted and self.usage is None:
            prompt = 0
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": 0},
        }
        return self._emit("message_start", {"type": "message_start", "message": message})

    def progress(self) -> bytes:
        """A sign of life the clients' event watchdogs count, while nothing was generated yet.

        ``ping`` events do not reset Claude Code's stream watchdog (300 s without a non-ping
        event; the ``anthropic`` SDKs drop pings before the caller sees them), so a stream that
        waits longer gets a ``message_delta`` that changes nothing: ``stop_reason`` null and
        ``output_tokens`` 0 (Anthropic API reference, "Streaming Messages": one or more
        ``message_delta`` events). Empty once a content block was opened or the stream ended.
        """
        if not self.started or self.ended or self.blocks or not self.stream:
            return b""
        return sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": None, "stop_sequence": None},
                "usage": {"output_tokens": 0},
            },
        )

    def feed(self, events: Iterable[Event]) -> bytes:
        """Translate chat events; returns the SSE bytes to send (possibly empty)."""
        out: list[bytes] = []
        for event in events:
            if isinstance(event, UsageSeen):
                self.usage = event
                continue
            if isinstance(event, Finish):
                self._finish = event
                continue
            if not self.started:
                out.append(self.start())
            if isinstance(event, Reasoning):
                out.append(self._reasoning(event.text))
            elif isinstance(event, Text):
                out.append(self._text(event.text))
            elif isinstance(event, ToolStart):
                out.append(self._tool_start(event))
            elif isinstance(event, ToolArgs):
                out.append(self._tool_args_delta(event))
        return b"".join(out)

    def _open_block(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close_block()
        self._open = kind
        self.blocks.append(block)
        start = dict(block)
        if kind == "tool_use":
            start["input"] = {}
        return out + self._emit(
            "content_block_start",
            {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start},
        )

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        index = len(self.blocks) - 1
        out = b""
        if self._open == "thinking":
            signature = secrets.token_hex(16)
            self.blocks[index]["signature"] = signature
            out = self._delta(index, {"type": "signature_delta", "signature": signature})
        self._open = None
        return out + self._emit(
            "content_block_stop", {"type": "content_block_stop", "index": index}
        )

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return self._emit(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )

    def _reasoning(self, text: str) -> bytes:
        out = b""
        if self._open != "thinking":
            out = self._open_block(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""}
            )
        self.blocks[-1]["thinking"] += text
        return out + self._delta(len(self.blocks) - 1, {"type": "thinking_delta", "thinking": text})

    def _text(self, text: str) -> bytes:
        out = b""
        if self._open != "text":
            # The blank line the model writes after its reasoning (or before a tool call) is
            # not a text block of its own: wait for real text, and drop the leading newlines.
            text = (self._pending_ws + text).lstrip("\n")
            if not text.strip():
                self._pending_ws = text
                return b""
            self._pending_ws = ""
            out = self._open_block("text", {"type": "text", "text": ""})
        self.blocks[-1]["text"] += text
        return out + self._delta(len(self.blocks) - 1, {"type": "text_delta", "text": text})

    def _tool_start(self, event: ToolStart) -> bytes:
        self._pending_ws = ""
        block = {"type": "tool_use", "id": event.call_id, "name": event.name, "input": {}}
        out = self._open_block("tool_use", block)
        self._tool_blocks[event.index] = len(self.blocks) - 1
        self._tool_args[event.index] = []
        return out

    def _tool_args_delta(self, event: ToolArgs) -> bytes:
        block = self._tool_blocks.get(event.index)
        if block is None:
            return b""
        self._tool_args[event.index].append(event.text)
        if block != len(self.blocks) - 1 or self._open != "tool_use":
            return b""  # a fragment for an earlier call: kept for the final input only
        return self._delta(block, {"type": "input_json_delta", "partial_json": event.text})

    # --------------------------------------------------------------------------- endings

    def _settle_tools(self) -> None:
        for index, block in self._tool_blocks.items():
            self.blocks[block]["input"] = arguments_object("".join(self._tool_args[index]))

    def stop(self) -> tuple[str, Any]:
        """The final (``stop_reason``, ``stop_sequence``)."""
        return stop_reason(self._finish, bool(self._tool_blocks), self._stops)

    def usage_object(self) -> dict[str, int]:
        """Anthropic ``usage``: the engine's counts (the estimate when it sent none)."""
        if self.usage is None:
            return {"input_tokens": self._estimate, "output_tokens": 0}
        return {
            "input_tokens": self.usage.prompt_tokens,
            "output_tokens": self.usage.completion_tokens,
        }

    def finish(self) -> bytes:
        """A complete answer: close the open block, ``message_delta`` and ``message_stop``."""
        out = [self.start(), self._close_block()]
        self._settle_tools()
        reason, sequence = self.stop()
        out.append(
            self._emit(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": self.usage_object(),
                },
            )
        )
        out.append(self._emit("message_stop", {"type": "message_stop"}))
        self.ended = True
        return b"".join(out)

    def error(self, error_type: str, message: str) -> bytes:
        """A failure after the stream began: one ``error`` event (Anthropic's error object)."""
        self.ended = True
        return sse("error", {"type": "error", "error": {"type": error_type, "message": message}})

    def message(self) -> dict[str, Any]:
        """The final ``Message`` object (for a non-streamed answer; call after `feed`)."""
        self._close_block()
        self._settle_tools()
        reason, sequence = self.stop()
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self.usage_object(),
        }
