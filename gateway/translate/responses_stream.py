"""The engine's chat answer as OpenAI Responses SSE events and as a ``Response`` object.

Event sequence (OpenAI API reference, "Responses streaming"): ``response.created``,
``response.in_progress``; per output item ``response.output_item.added``, for reasoning and
messages ``response.content_part.added``, ``response.reasoning_text.delta`` /
``response.output_text.delta`` / ``response.function_call_arguments.delta``, the matching
``*.done`` events, ``response.output_item.done``; finally ``response.completed`` (or
``response.incomplete`` when the output budget ran out, ``response.failed`` on an engine
failure). Every event carries ``sequence_number``. Codex retries a stream that ends without
``response.completed`` or ``response.failed``.

Shapes are those of the ``openai`` SDK's ``ResponseStreamEvent`` and ``Response`` types; they are
built as plain JSON here and checked against the SDK models in the tests.

Usage: ``input_tokens`` / ``output_tokens`` are the engine's counts; ``output_tokens_details.
reasoning_tokens`` is the engine's count (vLLM's reasoning parser, ``completion_tokens_details.
reasoning_tokens``), the same number the chat API and the usage ledger show for the answer, and
0 from an engine that does not count them (1Cat-vLLM): one rule for every API (README, "What each
translated API does here"); ``input_tokens_details.cached_tokens`` the engine's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from gateway.framing import comment, json_event
from gateway.translate.chat_events import (
    Event,
    Finish,
    Reasoning,
    Text,
    ToolArgs,
    ToolStart,
    UsageSeen,
)
from gateway.translate.common import new_id

KEEPALIVE_COMMENT = comment("keepalive")


class ResponsesWriter:
    """Builds one answer's events (when ``stream``) and its final ``Response``.

    Args:
        model: the model id to show.
        extra: `Translated.extra` of the request (echoed fields, tool namespaces).
        stream: produce SSE bytes; False only accumulates the final response.
        response_id: the id to use (a fresh ``resp_`` id when None).
        on_end: called once with the writer when the answer is complete (to store it).
    """

    def __init__(
        self,
        model: str,
        extra: dict[str, Any],
        *,
        stream: bool = True,
        response_id: str | None = None,
        on_end: Callable[[ResponsesWriter], None] | None = None,
    ) -> None:
        self.response_id = response_id or new_id("resp_")
        self.model = model
        self.stream = stream
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.usage: UsageSeen | None = None
        self.started = False
        self.ended = False
        self.status = "in_progress"
        self.extra = extra
        self._on_end = on_end
        self._namespaces: dict[str, str] = extra.get("namespaces") or {}
        self._seq = 0
        self._open: str | None = None
        self._pending_ws = ""
        self._calls: dict[int, int] = {}
        self._finish: Finish | None = None
        self.error: dict[str, Any] | None = None

    # ------------------------------------------------------------------ event production

    def _emit(self, name: str, data: dict[str, Any]) -> bytes:
        if not self.stream:
            return b""
        data = {"type": name, **data, "sequence_number": self._seq}
        self._seq += 1
        return json_event(name, data)

    def start(self, *, counted: bool = True) -> bytes:
        """``response.created`` and ``response.in_progress``, once (``counted`` is ignored: the
        usage of an unfinished response is null)."""
        if self.started:
            return b""
        self.started = True
        snapshot = self.response()
        return self._emit("response.created", {"response": snapshot}) + self._emit(
            "response.in_progress", {"response": snapshot}
        )

    def progress(self) -> bytes:
        """Another ``response.in_progress`` (with the next ``sequence_number``) while nothing was
        generated yet: Codex's idle timer (``stream_idle_timeout_ms``, 300 s by default) counts
        SSE events, and SSE comments are not events. Empty once output began or the stream ended.
        """
        if not self.started or self.ended or self.output or not self.stream:
            return b""
        return self._emit("response.in_progress", {"response": self.response()})

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
                out.append(self._tool_args(event))
        return b"".join(out)

    def _add_item(self, kind: str, item: dict[str, Any], part: dict[str, Any] | None) -> bytes:
        out = self._close_item()
        self._open = kind
        self.output.append(item)
        index = len(self.output) - 1
        out += self._emit("response.output_item.added", {"output_index": index, "item": item})
        if part is not None:
            out += self._emit(
                "response.content_part.added",
                {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
            )
        return out

    def _close_item(self) -> bytes:
        if self._open is None:
            return b""
        index = len(self.output) - 1
        item = self.output[index]
        item_id = item["id"]
        where = {"item_id": item_id, "output_index": index}
        out = b""
        if self._open == "reasoning":
            text = item["content"][0]["text"]
            out += self._emit(
                "response.reasoning_text.done", {**where, "content_index": 0, "text": text}
            )
            out += self._emit(
                "response.content_part.done",
                {**where, "content_index": 0, "part": {"type": "reasoning_text", "text": text}},
            )
        elif self._open == "message":
            part = item["content"][0]
            out += self._emit(
                "response.output_text.done",
                {**where, "content_index": 0, "text": part["text"], "logprobs": []},
            )
            out += self._emit(
                "response.content_part.done", {**where, "content_index": 0, "part": part}
            )
        else:
            out += self._emit(
                "response.function_call_arguments.done",
                {**where, "name": item["name"], "arguments": item["arguments"]},
            )
        item["status"] = "completed"
        self._open = None
        return out + self._emit("response.output_item.done", {"output_index": index, "item": item})

    def _reasoning(self, text: str) -> bytes:
        out = b""
        if self._open != "reasoning":
            item = {
                "id": new_id("rs_"),
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "encrypted_content": None,
                "status": "in_progress",
            }
            out = self._add_item("reasoning", item, {"type": "reasoning_text", "text": ""})
        index = len(self.output) - 1
        self.output[index]["content"][0]["text"] += text
        return out + self._emit(
            "response.reasoning_text.delta",
            {
                "item_id": self.output[index]["id"],
                "output_index": index,
                "content_index": 0,
                "delta": text,
            },
        )

    def _text(self, text: str) -> bytes:
        out = b""
        if self._open != "message":
            text = (self._pending_ws + text).lstrip("\n")
            if not text.strip():
                self._pending_ws = text
                return b""
            self._pending_ws = ""
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {
                "id": new_id("msg_"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [part],
            }
            out = self._add_item("message", item, dict(part))
        index = len(self.output) - 1
        self.output[index]["content"][0]["text"] += text
        return out + self._emit(
            "response.output_text.delta",
            {
                "item_id": self.output[index]["id"],
                "output_index": index,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            },
        )

    def _tool_start(self, event: ToolStart) -> bytes:
        self._pending_ws = ""
        item: dict[str, Any] = {
            "id": new_id("fc_"),
            "type": "function_call",
            "call_id": event.call_id,
            "name": event.name,
            "arguments": "",
            "status": "in_progress",
        }
        namespace = self._namespaces.get(event.name)
        if namespace is not None:
            item["namespace"] = namespace
        out = self._add_item("function_call", item, None)
        self._calls[event.index] = len(self.output) - 1
        return out

    def _tool_args(self, event: ToolArgs) -> bytes:
        index = self._calls.get(event.index)
        if index is None:
            return b""
        self.output[index]["arguments"] += event.text
        if index != len(self.output) - 1 or self._open != "function_call":
            return b""
        return self._emit(
            "response.function_call_arguments.delta",
            {"item_id": self.output[index]["id"], "output_index": index, "delta": event.text},
        )

    # --------------------------------------------------------------------------- endings

    def usage_object(self) -> dict[str, Any] | None:
        """Responses ``usage`` from the engine's counts; None when it sent none."""
        if self.usage is None:
            return None
        reasoning = self.usage.reasoning_tokens or 0
        return {
            "input_tokens": self.usage.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": self.usage.cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": self.usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": self.usage.prompt_tokens + self.usage.completion_tokens,
        }

    def _conclude(self) -> None:
        self._close_item()
        if self._finish is not None and self._finish.reason == "length":
            self.status = "incomplete"
        else:
            self.status = "completed"

    def finish(self) -> bytes:
        """A complete answer: close the open item, then ``response.completed`` (or
        ``response.incomplete`` when the output budget ran out)."""
        out = self.start()
        out += self._close_item()
        self._conclude()
        self.ended = True
        name = "response.completed" if self.status == "completed" else "response.incomplete"
        if self._on_end is not None:
            self._on_end(self)
        return out + self._emit(name, {"response": self.response()})

    def fail(self, code: str, message: str) -> bytes:
        """An engine failure after the stream began: ``response.failed`` with the error."""
        out = self.start()
        self.status = "failed"
        self.error = {"code": code, "message": message}
        self.ended = True
        return out + self._emit("response.failed", {"response": self.response()})

    def response(self) -> dict[str, Any]:
        """The ``Response`` object as of now (final after `finish`; for a non-streamed answer
        call `finalize` first)."""
        extra = self.extra
        incomplete = None
        if self.status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": self.error,
            "incomplete_details": incomplete,
            "instructions": extra.get("instructions"),
            "max_output_tokens": extra.get("max_output_tokens"),
            "metadata": extra.get("metadata"),
            "model": self.model,
            "output": self.output if self.status != "in_progress" else [],
            "parallel_tool_calls": extra.get("parallel_tool_calls", True),
            "previous_response_id": extra.get("previous_response_id"),
            "reasoning": extra.get("reasoning"),
            "store": bool(extra.get("stored", False)),
            "temperature": extra.get("temperature"),
            "text": extra.get("text") or {"format": {"type": "text"}},
            "tool_choice": extra.get("tool_choice", "auto"),
            "tools": extra.get("tools") or [],
            "top_p": extra.get("top_p"),
            "truncation": extra.get("truncation", "disabled"),
            "max_tool_calls": extra.get("max_tool_calls"),
            "top_logprobs": extra.get("top_logprobs"),
            "user": extra.get("user"),
            "safety_identifier": extra.get("safety_identifier"),
            "prompt_cache_key": extra.get("prompt_cache_key"),
            "service_tier": extra.get("service_tier"),
            "background": False,  # ``background: true`` is refused
            "usage": self.usage_object(),
        }

    def finalize(self) -> dict[str, Any]:
        """The final ``Response`` of a non-streamed answer (after `feed`)."""
        self._conclude()
        self.ended = True
        if self._on_end is not None:
            self._on_end(self)
        return self.response()

    def output_text(self) -> str:
        """All output text, for logs and stored responses."""
        return "".join(
            part.get("text", "")
            for item in self.output
            if item["type"] == "message"
            for part in item["content"]
        )
