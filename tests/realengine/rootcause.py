"""The root-cause line of an engine that failed to start, from the launcher's log file.

The launcher writes its own JSON lines and passes the engine's output through. When vLLM fails,
the launcher's last word is ``engine exited with code 1``; the cause is earlier, in vLLM's
output. vLLM prefixes lines of its processes with ``(APIServer pid=N)``, ``(EngineCore pid=N)``,
``(Worker pid=N)`` and its logger's header (``ERROR 12-01 16:22:06 [core.py:1510]``), and a
failure in a worker is re-raised by EngineCore and the API server ("See root cause above"). So
the root cause is the exception line that ends the FIRST traceback in the log (with up to two
indented lines after it: pydantic puts the reason there); without a traceback, the first line
logged at ERROR or CRITICAL level, or one that starts with an exception name; without either,
the launcher's last error event.
"""

from __future__ import annotations

import json
import re

# "(EngineCore pid=30183) " and then "ERROR 12-01 16:22:06 [core.py:1510] ".
_PROCESS = re.compile(r"^\([A-Za-z0-9_]+ pid=\d+\) ")
_HEADER = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:]+ \[[^\]]*\] ?")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b(: .*)?$")
_LIMIT = 600


def _strip(line: str) -> tuple[str, str]:
    """(level, text) of one line without vLLM's process prefix and log header."""
    line = _PROCESS.sub("", line.rstrip("\n"))
    match = _HEADER.match(line)
    if match is None:
        return "", line
    return match.group(1), line[match.end() :]


def _shorten(text: str) -> str:
    return text if len(text) <= _LIMIT else text[: _LIMIT - 3] + "..."


def root_cause(log: str) -> str:
    """The engine's own root-cause line in ``log`` (see the module docstring); "" if none."""
    lines = [_strip(line) for line in log.splitlines() if not line.startswith("{")]
    texts = [text for _, text in lines]
    for start, text in enumerate(texts):
        if not text.startswith("Traceback (most recent call last)"):
            continue
        for index in range(start + 1, len(texts)):
            candidate = texts[index]
            if candidate[:1].isspace() or not _EXCEPTION.match(candidate):
                continue
            extra = []
            for follow in texts[index + 1 : index + 3]:
                if not follow[:1].isspace() or not follow.strip():
                    break
                extra.append(follow.strip())
            return _shorten(" / ".join([candidate, *extra]))
        break
    for level, text in lines:
        if level in ("ERROR", "CRITICAL") and text.strip():
            return _shorten(text.strip())
        if not level and _EXCEPTION.match(text):
            return _shorten(text)
    for line in reversed(log.splitlines()):
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("level") == "error":
                return _shorten(str(event.get("reason") or event.get("error") or event))
    return ""
