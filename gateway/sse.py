"""The SSE relay core: engine bytes in, client bytes out, with the contract's few rewrites. No I/O.

The engine frames each event as ``data: <json>\\n\\n`` and ends with ``data: [DONE]\\n\\n``
(vLLM's OpenAI-compatible server; the SSE format is WHATWG HTML, "Server-sent events"). This module tolerates what real upstreams and proxies do instead
(cases C02-C08): events split across reads or several in one read, CRLF or bare-CR framing,
comment lines, multi-line data, reads cut inside a UTF-8 character, a missing ``[DONE]``.

It works on bytes and decodes JSON only for the few events that need it (usage chunks, error
events, chunks carrying both reasoning names). Rewrites, all byte-level on compact engine JSON:

- ``"reasoning":`` becomes ``"reasoning_content":`` (the name OpenAI-compatible clients read);
- ``"model":"<engine name>"`` becomes the public alias when they differ;
- the usage-only chunk is dropped unless the client asked for ``include_usage``;
- the running ``usage`` of every chunk (the gateway always asks the engine for it:
  ``continuous_usage_stats``) is observed and cut out byte by byte unless the client asked for
  it too, so the client receives the very bytes it would have received without it;
- ``data: [DONE]`` is sent exactly once, by this module, at a clean end;
- a ``data:`` payload that is not a JSON object (``data:``, ``data: null``, ``data: hello``,
  ``data: [1,2]``: case C24) is dropped, counted in `RelayState.dropped_events`, and logged once
  per stream (length only, never the bytes), so clients only ever see JSON objects and
  ``[DONE]``. "A JSON object" is checked cheaply: the payload starts with ``{`` and ends with
  ``}`` (the engine's encoder writes one object per event).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.framing import DONE, data_event
from gateway.meter import EngineUsage, RunningUsage, parse_usage

log = structlog.get_logger("gateway.sse")

DONE_EVENT = DONE
MAX_EVENT_BYTES = 8 * 1024 * 1024
"""Default of the largest event relayed (``engine.max_event_bytes``)."""


class StreamProtocolError(Exception):
    """The upstream stream cannot be relayed."""


class EventTooLarge(StreamProtocolError):
    """One upstream event is larger than the relay's ``max_event_bytes``."""


@dataclass
class RelayState:
    """What the relay observed; read by the caller for accounting, metrics and logs.

    Attributes:
        events: data events received (JSON or ``[DONE]``), comments excluded.
        content_events: data events other than the first (role) chunk, usage and errors; an upper
            bound of tokens streamed, used only when the engine never sent usage (a drop).
        usage: the engine's final usage, once its usage-only chunk (``choices: []``) was seen.
        running: the engine's running usage (tokens streamed so far), once a chunk carried one;
            read from `running_raw` when asked (once per stream), not per chunk.
        running_raw: choice index -> the bytes of the last ``,"usage":{...}`` that choice's
            chunks carried (to the end of the chunk), kept as received.
        done: the engine sent ``[DONE]``.
        finished_choices: ``finish_reason`` values seen (one per choice at a normal end).
        error: the error object of an in-stream error event, if any.
        dropped_events: ``data:`` events dropped because their payload is not a JSON object.
    """

    events: int = 0
    content_events: int = 0
    usage: EngineUsage | None = None
    running_raw: dict[int, bytes] = field(default_factory=dict)
    done: bool = False
    finished_choices: int = 0
    error: dict[str, Any] | None = None
    dropped_events: int = 0

    @property
    def running(self) -> RunningUsage | None:
        """The running usage of the last chunk of each choice, None when none was readable."""
        running = None
        for index, raw in sorted(self.running_raw.items()):
            usage = read_usage_tail(raw)
            if usage is not None:
                if running is None:
                    running = RunningUsage()
                running.observe(usage, index)
        return running


@functools.lru_cache(maxsize=8)
def _model_field(name: str) -> bytes:
    """``"model":"<name>"`` as the engine writes it (JSON-escaped); the same two names serve
    every stream, so each is written once."""
    return b'"model":' + json.dumps(name).encode()


class SseRelay:
    """Incremental relay of one chat or completion stream.

    Args:
        engine_model: the model name the engine echoes (``engine.model``).
        alias: the public name to show instead.
        client_wants_usage: the client set ``stream_options.include_usage``; otherwise the usage
            chunk the gateway asked for is observed and dropped.
        client_wants_running_usage: the client also set ``continuous_usage_stats``; otherwise
            the ``usage`` of each chunk is observed and cut out of the chunk's bytes.
        n: choices requested; a stream that ends after ``n`` finish reasons without ``[DONE]``
            still counts as a clean end (case C06a).
        max_event_bytes: the largest event relayed (``engine.max_event_bytes``): an event, or
            an unterminated rest of one, past it stops the relay, so one stream holds at most
            about this much of the engine's answer at once.

    Usage: call `feed` with each upstream read and write what it returns (possibly ``b""``);
    at upstream EOF call `finish` and write what it returns.
    """

    def __init__(
        self,
        engine_model: str,
        alias: str,
        *,
        client_wants_usage: bool,
        client_wants_running_usage: bool = False,
        n: int = 1,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        self.state = RelayState()
        self._max_event = max_event_bytes
        self._buf = b""
        self._pending_cr = False
        self._wants_usage = client_wants_usage
        self._wants_running = client_wants_usage and client_wants_running_usage
        self._n = max(1, n)
        self._model_from = _model_field(engine_model)
        self._model_to = _model_field(alias)
        self._rename_model = engine_model != alias

    def feed(self, data: bytes) -> bytes:
        """Consume one upstream read; return the bytes to send to the client now.

        Raises:
            EventTooLarge: an event (or the unterminated rest of one) is over
                ``max_event_bytes``.
        """
        if b"\r" in data or self._pending_cr:
            data = self._normalise_newlines(data)
        buf = self._buf + data if self._buf else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            if self._over_max(buf):
                raise EventTooLarge(f"an event larger than {self._max_event} bytes")
            self._buf = buf
            return b""
        if end + 2 == len(buf):
            complete, self._buf = buf, b""
        else:
            complete, self._buf = buf[: end + 2], buf[end + 2 :]
            if self._over_max(self._buf):
                raise EventTooLarge(f"an event larger than {self._max_event} bytes")
        if len(complete) > self._max_event and any(
            len(block) > self._max_event for block in complete.split(b"\n\n")
        ):
            raise EventTooLarge(f"an event larger than {self._max_event} bytes")
        # A run that ends the answer (its usage chunk, [DONE]): the events before its last two
        # are usually plain, so they take the fast path and only the end goes event by event.
        cut = complete.rfind(b"\n\n", 0, complete.rfind(b"\n\n", 0, len(complete) - 2))
        if cut > 0:
            tail = complete[cut + 2 :]
            if b"data: [DONE]" in tail or b'"choices":[]' in tail:
                fast = self._plain_events(complete[: cut + 2])
                if fast is not None:
                    return fast + self._each_event(tail)
                return self._each_event(complete)
        fast = self._plain_events(complete)
        if fast is not None:
            return fast
        return self._each_event(complete)

    def _over_max(self, rest: bytes) -> bool:
        """``rest``, an event without its blank line (none inside), is over ``max_event_bytes``;
        the first newline of its terminator, when a read ended after it, does not count, so an
        event's size does not depend on where the reads cut it."""
        return len(rest) - rest.endswith(b"\n") > self._max_event

    def _each_event(self, complete: bytes) -> bytes:
        """Relay a run of whole events (ending in a blank line) event by event."""
        out = []
        for block in complete[:-2].split(b"\n\n"):
            if block:
                piece = self._event(block)
                if piece:
                    out.append(piece)
        return b"".join(out)

    def finish(self) -> bytes:
        """Upstream reached EOF: flush a final unterminated event and close the stream properly.

        Returns the last bytes for the client: ``[DONE]`` after a clean end (the engine sent
        ``[DONE]``, or every choice finished), else one OpenAI error event and no ``[DONE]`` so
        clients see the truncation (case C06b).
        """
        tail = b""
        rest = self._buf.strip(b"\n")
        self._buf = b""
        if rest:
            tail = self._event(rest)
        if self.clean_end:
            return tail + DONE_EVENT
        return tail

    @property
    def clean_end(self) -> bool:
        """True when the upstream stream ended as a complete answer (or reported its own error)."""
        s = self.state
        return s.done or s.error is not None or s.finished_choices >= self._n

    def _plain_events(self, chunk: bytes) -> bytes | None:
        """Relay a run of whole events in a few byte operations, or None to go event by event.

        Applies to the common read: one or more ``data: {"id":<...>}\\n\\n`` events (vLLM
        writes ``id`` first; an error event, ``{"error"...``, never matches), so none is
        ``[DONE]``, no comment, multi-line or empty block, nothing after ``[DONE]``, no
        usage-only chunk (``"choices":[]``), no chunk carrying both reasoning names. For these
        `_data` would only count events and finish reasons, cut the running usage and rename
        ``reasoning``/``model``, which give the same bytes done on the whole run at once. (The
        model rename is done run-wide only when there is one ``"model":"<engine name>"`` per
        event: vLLM puts exactly one at the top of each chunk.) The framing takes two counts:
        every newline of the run belongs to a ``}\\n\\ndata: {"id":`` boundary or to the
        final ``}\\n\\n``.
        """
        state = self.state
        if state.done or not chunk.startswith(_FIRST_EVENT) or not chunk.endswith(b"}\n\n"):
            return None
        lines = chunk.count(b"\n")
        events = lines >> 1
        if lines & 1 or (events > 1 and chunk.count(_EVENT_BOUNDARY) != events - 1):
            return None
        reasoning = b'"reasoning":' in chunk
        if (
            (reasoning and b'"reasoning_content":' in chunk)
            or (self._rename_model and chunk.count(self._model_from) != events)
            or b'"choices":[]' in chunk
        ):
            return None
        usages = chunk.count(_USAGE_KEY)
        if usages:
            if events == 1:
                chunk = self._take_running_usage(chunk)  # the framing is left as it is
            else:
                run = self._running_of_run(chunk, events) if usages == events else None
                if run is not None:
                    chunk = run
                else:
                    chunk = b"".join(
                        data_event(self._take_running_usage(event[6:]))
                        for event in chunk[:-2].split(b"\n\n")
                    )
        state.content_events += events if state.events else events - 1
        state.events += events
        state.finished_choices += chunk.count(b'"finish_reason":"')
        if reasoning:
            chunk = chunk.replace(b'"reasoning":', b'"reasoning_content":')
        if self._rename_model:
            chunk = chunk.replace(self._model_from, self._model_to)
        return chunk

    def _normalise_newlines(self, data: bytes) -> bytes:
        """CRLF and bare CR become LF at once; an LF that completes a CR of the previous read
        is dropped, so the CR and LF of one terminator may arrive in different reads (C04)."""
        if self._pending_cr:
            self._pending_cr = False
            if data.startswith(b"\n"):
                data = data[1:]
        self._pending_cr = data.endswith(b"\r")
        return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _event(self, block: bytes) -> bytes:
        """One complete event block (no blank line inside); returns its client bytes."""
        if block.startswith(b"data: ") and b"\n" not in block:
            payload = block[6:]
        else:
            lines = block.split(b"\n")
            data_lines = []
            comments = []
            for line in lines:
                if line.startswith(b"data:"):
                    value = line[5:]
                    data_lines.append(value[1:] if value.startswith(b" ") else value)
                elif line.startswith(b":"):
                    comments.append(line)
                # other fields (event:, id:, retry:) carry nothing this API uses
            if not data_lines:
                return b"\n".join(comments) + b"\n\n" if comments else b""
            payload = b"\n".join(data_lines)
        return self._data(payload)

    def _data(self, payload: bytes) -> bytes:
        """One ``data:`` payload: observe, rewrite, and frame it for the client."""
        state = self.state
        stripped = payload.strip()
        if stripped == b"[DONE]":
            state.events += 1
            state.done = True
            return b""
        if not (stripped.startswith(b"{") and stripped.endswith(b"}")):
            state.dropped_events += 1
            if state.dropped_events == 1:
                log.warning("engine_event_dropped", reason="not a JSON object", size=len(payload))
            return b""
        state.events += 1
        if state.done:
            return b""  # nothing after [DONE] is valid; the engine never sends any
        if b'"error"' in payload and payload.lstrip().startswith(b'{"error"'):
            try:
                obj = json.loads(payload)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
                state.error = obj["error"]
                return data_event(payload)
        if b'"choices":[]' in payload and b'"usage":' in payload:
            self._observe_usage(payload)
            if not self._wants_usage:
                return b""
        else:
            if b'"usage":' in payload:
                payload = self._take_running_usage(payload)
            if state.events > 1:
                state.content_events += 1
        state.finished_choices += payload.count(b'"finish_reason":"')
        if b'"reasoning":' in payload:
            if b'"reasoning_content":' in payload:
                payload = _merge_reasoning(payload)
            else:
                payload = payload.replace(b'"reasoning":', b'"reasoning_content":')
        if self._rename_model:
            payload = payload.replace(self._model_from, self._model_to, 1)
        return data_event(payload)

    def _observe_usage(self, payload: bytes) -> None:
        """Record the final usage of the usage-only chunk (``choices: []``)."""
        try:
            obj = json.loads(payload)
        except ValueError:
            return
        if not isinstance(obj, dict) or obj.get("choices") != []:
            return
        usage = parse_usage(obj.get("usage"))
        if usage is not None:
            self.state.usage = usage

    def _running_of_run(self, chunk: bytes, events: int) -> bytes | None:
        """A run of ``events`` single-choice events each carrying one ``usage`` object of
        vLLM's form (the caller counted one ``usage`` key per event): the last one recorded,
        the run returned without them (unless the client asked for them); None to go event by
        event. The objects are found by `_USAGE_OBJECT` in one pass."""
        if self._n != 1:
            return None
        if self._wants_running:
            if len(_USAGE_OBJECT.findall(chunk)) != events:
                return None
            out = chunk
        else:
            out, found = _USAGE_OBJECT.subn(b"", chunk)
            if found != events:
                return None
        self.state.running_raw[0] = chunk[chunk.rfind(_USAGE_KEY) : -2]
        return out

    def _take_running_usage(self, payload: bytes) -> bytes:
        """Record the running ``usage`` of one chunk (its bytes, read when the stream settles);
        the chunk without it unless the client asked for it (the bytes vLLM sends without
        ``continuous_usage_stats``)."""
        start = payload.find(_USAGE_KEY)
        if start < 0:
            return payload
        end = _usage_end(payload, start)
        if end is None:
            return payload
        self.state.running_raw[_choice_index(payload) if self._n > 1 else 0] = payload[start:]
        if self._wants_running:
            return payload
        return payload[:start] + payload[end:]


_USAGE_KEY = b',"usage":{'
_FIRST_EVENT = b'data: {"id":'
_EVENT_BOUNDARY = b'}\n\ndata: {"id":'
_USAGE_OBJECT = re.compile(
    rb',"usage":\{(?:[^{}\[\]\\"]|"[^"\\]*"|\{(?:[^{}\[\]\\"]|"[^"\\]*")*\})*\}'
)
"""A ``usage`` object as vLLM writes it: counts, and objects of counts one level deep
(``completion_tokens_details``); strings are skipped whole, so a brace in one is not taken for
the end. No array and no escape (anything else is read by `usage_span`)."""


def _usage_end(payload: bytes, start: int) -> int | None:
    """The offset just past the ``usage`` object whose key starts at ``start``, or None."""
    match = _USAGE_OBJECT.match(payload, start)
    if match is not None:
        return match.end()
    span = usage_span(payload[start:])
    return start + span[1] if span is not None else None


def read_usage_tail(raw: bytes) -> EngineUsage | None:
    """The usage object at the start of ``raw`` (``,"usage":{...}`` and what followed it in
    its chunk) as `EngineUsage`; None when it cannot be read.

    vLLM's flat object of counts (``{"prompt_tokens":9,"total_tokens":12,"completion_tokens":
    3}``) is read with a few byte operations; any other form is decoded as JSON.
    """
    end = _usage_end(raw, 0)
    if end is None:
        return None
    inner = raw[len(_USAGE_KEY) : end - 1]
    if b"{" not in inner and b"[" not in inner and b"\\" not in inner:
        prompt = completion = 0
        for pair in inner.split(b","):
            key, _, value = pair.partition(b":")
            if not value.isdigit():
                if value != b"null":
                    break
                continue
            if key == b'"prompt_tokens"':
                prompt = int(value)
            elif key == b'"completion_tokens"':
                completion = int(value)
        else:
            return EngineUsage(prompt, completion)
    try:
        usage = json.loads(raw[len(_USAGE_KEY) - 1 : end])
    except ValueError:
        return None
    return parse_usage(usage)


_CHOICE_INDEX = re.compile(rb'"choices":\[\{"index":(\d+)')


def usage_span(payload: bytes) -> tuple[int, int] | None:
    """Where ``,"usage":{...}`` sits in a compact chunk: (start, end) byte offsets, or None.

    The key is found by its bytes: inside a JSON string a quote is escaped, so ``,"usage":{``
    only ever matches the structure (vLLM's chunks have no other ``usage`` key). The object's
    end is found by counting braces outside strings.
    """
    start = payload.find(_USAGE_KEY)
    if start < 0:
        return None
    depth = 0
    in_string = False
    escaped = False
    for offset in range(start + len(_USAGE_KEY) - 1, len(payload)):
        byte = payload[offset]
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte == 0x7B:  # {
            depth += 1
        elif byte == 0x7D:  # }
            depth -= 1
            if depth == 0:
                return start, offset + 1
    return None


def _choice_index(payload: bytes) -> int:
    """The index of a chunk's (only) choice; 0 when not found."""
    match = _CHOICE_INDEX.search(payload)
    return int(match.group(1)) if match is not None else 0


def _merge_reasoning(payload: bytes) -> bytes:
    """A chunk with both ``reasoning`` and ``reasoning_content``: keep the text once (case C08)."""
    try:
        obj = json.loads(payload)
    except ValueError:
        return payload
    _rename_reasoning(obj, ("delta", "message"))
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _rename_reasoning(obj: Any, parts: tuple[str, ...]) -> None:
    """In each choice's ``parts`` objects, move ``reasoning`` to ``reasoning_content`` (once)."""
    if not isinstance(obj, dict):
        return
    for choice in obj.get("choices") or ():
        for part in parts:
            holder = choice.get(part) if isinstance(choice, dict) else None
            if isinstance(holder, dict) and "reasoning" in holder:
                text = holder.pop("reasoning")
                if holder.get("reasoning_content") is None:
                    holder["reasoning_content"] = text


def rewrite_completion_body(body: dict[str, Any], alias: str) -> dict[str, Any]:
    """Rewrite a non-streaming engine answer in place: alias as ``model``, ``reasoning_content``.

    Args:
        body: the engine's JSON object (OpenAI's chat completion or completion object).
        alias: the public model id.

    Returns the same object, for chaining.
    """
    if "model" in body:
        body["model"] = alias
    _rename_reasoning(body, ("message",))
    return body
