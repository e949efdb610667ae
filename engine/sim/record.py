"""The `--record` file: one JSON line per request received, written when the request ends.

A line is ``{"method", "path", "headers", "body", "outcome", "tokens_sent", "status",
"received_at", "ended_at"}``:
`headers` as received (Authorization included: the file is test evidence of what reached the
engine, keep it private), `body` the parsed JSON or null, `outcome` one of `finished`,
`aborted` (the client went away) or `error` (an error status, an in-stream error or a fault
that cut the answer), `tokens_sent` the generated tokens written to the client (for a
non-streaming request: produced so far), `status` the HTTP status sent or 0 when none was,
`received_at` and `ended_at` Unix times in seconds (float) when the request's headers had been
read and when its handler returned (the last byte of the answer written, but for the chunked
terminator), so a reader can tell when the engine was busy.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import IO, Any, Literal

Outcome = Literal["finished", "aborted", "error"]


@dataclass
class Trace:
    """What happened to one request, filled in by the handler as it goes; `body` holds the
    JSON body once the handler has parsed it (`parsed` true); `received_at` is Unix seconds."""

    outcome: Outcome | None = None
    tokens_sent: int = 0
    status: int | None = None
    body: Any = None
    parsed: bool = False
    received_at: float = field(default_factory=time.time)


class Recorder:
    """Appends lines to the record file and flushes each one, so readers see it at once."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(
        self, *, method: str, path: str, headers: dict[str, str], body: Any, trace: Trace
    ) -> None:
        """Append the line of one finished request."""
        line = {
            "method": method,
            "path": path,
            "headers": headers,
            "body": body,
            "outcome": trace.outcome,
            "tokens_sent": trace.tokens_sent,
            "status": trace.status if trace.status is not None else 0,
            "received_at": trace.received_at,
            "ended_at": time.time(),
        }
        self._file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()
