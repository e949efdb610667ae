"""Server-sent events framing, written once for every dialect.

Every stream the gateway writes, whatever the client API, is framed here (WHATWG HTML, "Server-
sent events", "Parsing an event stream"): an event is optional ``event: NAME`` and one ``data:``
line, then a blank line; a line starting with ``:`` is a comment clients ignore (keep-alives).
Chat and completions streams are ``data:`` events ending with ``data: [DONE]`` (OpenAI API
reference, "Streaming"); Anthropic Messages and OpenAI Responses streams name each event
(``event: message_start``, ``event: response.created``, ...; Anthropic API reference,
"Streaming Messages"; OpenAI API reference, "Responses streaming events"), with compact JSON
data. The data is always one line: compact JSON escapes every newline inside strings.
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
"""The end of a chat or completions stream (OpenAI's terminator)."""


def data_event(payload: bytes) -> bytes:
    """One unnamed event carrying ``payload`` (one line of JSON, or ``[DONE]``)."""
    return b"data: " + payload + b"\n\n"


def named_event(name: str, payload: bytes) -> bytes:
    """One event named ``name`` carrying ``payload`` (one line of JSON)."""
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"


def compact_json(data: Any) -> bytes:
    """``data`` as compact UTF-8 JSON (no spaces, non-ASCII as is): one SSE data line.

    A lone surrogate, which UTF-8 cannot carry (a string can only hold one from a ``\\ud83d``
    escape the engine's JSON sent), stays that JSON escape.
    """
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace")


def json_event(name: str | None, data: Any) -> bytes:
    """``data`` as compact JSON in one event, named ``name`` unless None."""
    payload = compact_json(data)
    return data_event(payload) if name is None else named_event(name, payload)


def comment(text: str) -> bytes:
    """A comment line (``: text``), which clients ignore: keep-alives while the engine is
    silent or the request waits in the queue."""
    return b": " + text.encode() + b"\n\n"
