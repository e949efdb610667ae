"""The stream relay of a translated dialect: engine chat SSE in, dialect SSE out. No I/O.

The engine's bytes first go through `gateway.sse.SseRelay` (the one tolerant SSE framer: split
and merged events, CRLF, comments, a missing ``[DONE]``, cases C02-C08), which also keeps the
`RelayState` the pipeline reads for accounting. Its output events are parsed and translated by
a dialect writer (`AnthropicWriter` or `ResponsesWriter`). An error event from the engine becomes
the dialect's in-stream error; comments pass through (both dialects' clients ignore them).
"""

from __future__ import annotations

import json
from typing import Protocol

from gateway.errors import GatewayError
from gateway.sse import RelayState, SseRelay
from gateway.translate.chat_events import ChunkReader, Event


class Writer(Protocol):
    """What `TranslatingRelay` drives (`AnthropicWriter`, `ResponsesWriter`)."""

    ended: bool

    def start(self, *, counted: bool = True) -> bytes:
        """The stream's opening events (``counted=False``: opened before the engine counted
        the prompt, while the request waits)."""

    def progress(self) -> bytes:
        """An event that changes nothing, as a sign of life while nothing was generated (or
        ``b""``)."""

    def feed(self, events: list[Event]) -> bytes:
        """Translated events for the client."""

    def finish(self) -> bytes:
        """The closing events of a complete answer."""


class TranslatingRelay:
    """A `gateway.dialects.StreamRelay` for a dialect translated from chat chunks.

    Args:
        inner: the chat `SseRelay` (built with ``client_wants_usage=True``: the usage chunk is
            needed to report usage in the dialect's final event).
        writer: the dialect writer.
        fail: renders a `GatewayError` as the dialect's final in-stream error event (given the
            writer, which knows what was already sent).
        keepalive: bytes to send while the engine is silent (a ping event or an SSE comment).
    """

    def __init__(
        self, inner: SseRelay, writer: Writer, fail: FailRenderer, keepalive: bytes
    ) -> None:
        self.inner = inner
        self.state: RelayState = inner.state  # the chat relay's observations (accounting)
        self.writer = writer
        self._fail = fail
        self.keepalive = keepalive
        self._reader = ChunkReader()

    @property
    def clean_end(self) -> bool:
        """The engine's stream ended as a complete answer (or with its own error event)."""
        return self.inner.clean_end

    def start(self, *, waiting: bool = False) -> bytes:
        """The dialect's opening events (sent before the first token, so prefill shows life;
        ``waiting``: sent while the request is still queued for the engine)."""
        return self.writer.start(counted=not waiting)

    def progress(self) -> bytes:
        """The writer's no-op event for clients whose idle timers count events, not bytes."""
        return self.writer.progress()

    def feed(self, data: bytes) -> bytes:
        """One engine read in; the dialect's bytes out (possibly ``b""``)."""
        return self._translate(self.inner.feed(data))

    def finish(self) -> bytes:
        """Engine EOF: the last events; the closing ones only after a complete answer."""
        out = self._translate(self.inner.finish())
        if self.inner.clean_end and not self.writer.ended:
            out += self.writer.finish()
        return out

    def error_event(self, error: GatewayError) -> bytes:
        """``error`` as the dialect's final event (after what was sent so far)."""
        if self.writer.ended:
            return b""
        return self._fail(self.writer, error)

    def _translate(self, chat: bytes) -> bytes:
        if not chat:
            return b""
        out: list[bytes] = []
        for block in chat.split(b"\n\n"):
            if not block:
                continue
            if block.startswith(b":"):
                out.append(block + b"\n\n")
                continue
            if not block.startswith(b"data: ") or block == b"data: [DONE]":
                continue
            try:
                obj = json.loads(block[6:])
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
                out.append(self._engine_error(obj["error"]))
                continue
            events = self._reader.read(obj)
            if events:
                out.append(self.writer.feed(events))
        return b"".join(out)

    def _engine_error(self, error: dict[str, object]) -> bytes:
        """The engine's in-stream error event (vLLM: ``{"error": {...}}`` then ``[DONE]``)."""
        if self.writer.ended:
            return b""
        message = error.get("message")
        failure = GatewayError(
            message if isinstance(message, str) and message else "The engine failed mid-answer.",
            reason="stream_error",
        )
        return self._fail(self.writer, failure)


class FailRenderer(Protocol):
    """Renders a failure as a dialect's final stream event."""

    def __call__(self, writer: Writer, error: GatewayError) -> bytes:
        """The bytes of the final error event."""
