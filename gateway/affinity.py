"""Session affinity: which engine holds a session's prompt prefix in its cache.

An agent session (Codex, Claude Code, an SDK loop) resends its whole, growing conversation every
turn; the engine that served the previous turn has its prefix in vLLM's prefix cache (automatic
prefix caching, "Automatic Prefix Caching" in the vLLM docs), and a cold engine re-prefills it,
tens of seconds for a 30k-token prompt on a V100. So a session's requests go back to the engine
that served it last (`gateway.placement` bounds the load this may add to one engine).

The session key, first found of:

1. ``prompt_cache_key`` in the body (OpenAI chat and Responses; Codex sends its conversation id);
2. the ``X-Claude-Code-Session-Id`` header (Claude Code);
3. Anthropic ``metadata.user_id``: Claude Code's is a JSON string whose ``session_id`` names the
   session (older versions: ``user_<hash>_account_<uuid>_session_<uuid>``), taken alone;
   any other ``user_id`` is the key as a whole;
4. the ``X-Session-Id`` header (any client).

Keys are scoped by tenant and kept only as a digest (no client text in memory), in a map of at
most `MAX_SESSIONS` entries, the least recently used dropped first.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

MAX_SESSIONS = 65_536
"""Sessions remembered (about 100 bytes each); the least recently used are forgotten first."""
_MAX_KEY_CHARS = 1024
_LEGACY_SESSION_RE = re.compile(r"_session_([A-Za-z0-9-]{8,64})\Z")


def session_key(headers: Mapping[str, str], body: Any) -> str | None:
    """The session a request belongs to (the rules in the module doc), or None.

    Args:
        headers: the client's request headers (case-insensitive mapping).
        body: the parsed JSON body (any JSON value).
    """
    if isinstance(body, dict):
        key = body.get("prompt_cache_key")
        if isinstance(key, str) and key:
            return "pck:" + key[:_MAX_KEY_CHARS]
    header = headers.get("X-Claude-Code-Session-Id")
    if header:
        return "cc:" + header[:_MAX_KEY_CHARS]
    if isinstance(body, dict):
        metadata = body.get("metadata")
        user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
        if isinstance(user_id, str) and user_id:
            session = _claude_code_session(user_id)
            if session is not None:
                return "cc:" + session
            return "user:" + user_id[:_MAX_KEY_CHARS]
    header = headers.get("X-Session-Id")
    if header:
        return "sid:" + header[:_MAX_KEY_CHARS]
    return None


def _claude_code_session(user_id: str) -> str | None:
    """The session id Claude Code puts in ``metadata.user_id``, or None."""
    if user_id.startswith("{"):
        try:
            parsed = json.loads(user_id)
        except (ValueError, RecursionError):  # a client's text: anything, any depth
            return None
        session = parsed.get("session_id") if isinstance(parsed, dict) else None
        return session[:_MAX_KEY_CHARS] if isinstance(session, str) and session else None
    match = _LEGACY_SESSION_RE.search(user_id)
    return match.group(1) if match else None


class Affinity:
    """Sessions and the engine each was last served by (an LRU map of `MAX_SESSIONS` digests).

    Args:
        max_sessions: entries kept.
    """

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self._homes: OrderedDict[bytes, str] = OrderedDict()
        self._max = max_sessions

    def __len__(self) -> int:
        return len(self._homes)

    @staticmethod
    def digest(tenant: str, session: str) -> bytes:
        """The map's key: SHA-256 of tenant and session (16 bytes), no client text kept."""
        raw = f"{tenant}\0{session}".encode("utf-8", "surrogatepass")
        return hashlib.sha256(raw).digest()[:16]

    def home(self, key: bytes | None) -> str | None:
        """The engine that served the session last, or None (new, forgotten, or no session)."""
        if key is None:
            return None
        engine = self._homes.get(key)
        if engine is not None:
            self._homes.move_to_end(key)
        return engine

    def served(self, key: bytes | None, engine: str) -> None:
        """Record that ``engine`` now holds the session (its prefix is cached there)."""
        if key is None:
            return
        self._homes[key] = engine
        self._homes.move_to_end(key)
        while len(self._homes) > self._max:
            self._homes.popitem(last=False)

    def forget_engine(self, engine: str) -> None:
        """Drop every session of an engine that restarted (its prefix cache is empty)."""
        for key in [k for k, v in self._homes.items() if v == engine]:
            del self._homes[key]
