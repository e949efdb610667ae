"""Credentials in client text, in any encoding a client or an attacker may use.

Two questions, asked before anything a client sent is echoed or forwarded:

- `looks_like_credential`: could this short client value be, or carry, a credential? Its raw
  form, its percent-decoded form (RFC 3986 section 2.1) and its base64 / base64url decoding
  (RFC 4648 sections 4 and 5) are each tried for the prefixes credentials have: ``sk-`` API
  keys, ``eyJ`` JWTs (base64url of ``{"``), and the ``Bearer``/``Basic`` forms of an
  ``Authorization`` value (RFC 6750 section 2.1, RFC 7617).
- `OwnCredential.found_in`: does a request body carry the very credential the request was
  authenticated with? The body is searched as sent and as JSON decodes it (a ``\\u0073k-...``
  escape is the key), percent-decoded, and for the key's base64 and base64url encodings at each
  of the three alignments a base64 stream can put it at.
- `OwnCredential.shares_run_with`: does a short client value (an ``X-Request-Id``) hold any
  `MIN_SECRET_CHARS`-long run of that credential, so its secret part without the ``sk-q38-``
  prefix, or a piece of a JWT, is caught as well as the whole?

Nothing here logs or returns the secret; the answers are booleans.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, unquote_to_bytes

# What starts a credential once decoded: API keys, JWTs, Authorization values.
_PREFIXES = ("sk-", "eyj", "bearer", "basic ")
# Credential shapes inside a longer text: an ``sk-`` style key not preceded by a letter or digit
# (``trace_sk-...`` and ``x.sk-...`` included); a JWT (RFC 7519 section 3: base64url segments
# joined by dots, header and payload JSON objects, so each starts ``eyJ``) as a word of three
# segments, or anywhere as a header and a payload (``a1eyJ...eyJ...``: a word like
# ``surveyJob.1`` is neither); and a ``Bearer`` value. What logs redact (`gateway.logs`), what
# request ids and tenant names may not hold.
CREDENTIAL_SHAPE_RE = re.compile(
    r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_\-]{8,}"
    r"|\beyJ[A-Za-z0-9_\-]*\.[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]*"
    r"|eyJ[A-Za-z0-9_\-]+\.eyJ[A-Za-z0-9_\-]*(?:\.[A-Za-z0-9_\-]*)?"
    r"|(?i:\bbearer\s+)[A-Za-z0-9\-._~+/]+=*"
)
_HEX_RE = re.compile(r"(?:[0-9A-Fa-f]{2}){8,}")
_B64_RE = re.compile(r"[A-Za-z0-9+/_-]{8,}={0,2}")
# The public prefix of the keys `keys add` writes (`gateway.credentials`): what follows it is
# the secret, searched for alone as well.
GENERATED_PREFIX = "sk-q38-"
# The shortest credential the gateway accepts (`gateway.credentials.MIN_PLAINTEXT_SECRET`).
MIN_SECRET_CHARS = 16


_PLAIN_SECRET_RE = re.compile(r"[A-Za-z0-9_\-.]+")
_UTF8 = ("utf-8", "utf-8-sig")  # the `json.detect_encoding` names of a UTF-8 body


@functools.lru_cache(maxsize=64)
def _own_credential(authorization: str) -> OwnCredential | None:
    secret = authorization.strip().partition(" ")[2].strip()
    if len(secret) < MIN_SECRET_CHARS:
        return None
    raw = secret.encode("utf-8", "surrogatepass")
    plain = _PLAIN_SECRET_RE.fullmatch(secret) is not None
    bare = ""
    if (
        secret.startswith(GENERATED_PREFIX)
        and len(secret) - len(GENERATED_PREFIX) >= MIN_SECRET_CHARS
    ):
        bare = secret[len(GENERATED_PREFIX) :]
    cores = _base64_cores(raw)
    if bare:
        cores += _base64_cores(bare.encode("utf-8", "surrogatepass"))
    return OwnCredential(secret, raw, tuple(cores), plain, bare)


def decodings(text: str) -> Iterator[str]:
    """``text`` as sent, percent-decoded, hex-decoded (when it is hex) and base64/base64url-decoded
    (when it is base64): the forms a credential may be hidden in inside a short client value."""
    yield text
    stripped = text.strip()
    if _HEX_RE.fullmatch(stripped):
        yield bytes.fromhex(stripped).decode("utf-8", "replace")
    if "%" in text:
        yield unquote(text, errors="replace")
    if _B64_RE.fullmatch(stripped):
        padded = stripped.rstrip("=") + "=" * (-len(stripped.rstrip("=")) % 4)
        for decode in (base64.b64decode, base64.urlsafe_b64decode):
            try:
                yield decode(padded.encode("ascii")).decode("utf-8", "replace")
            except (binascii.Error, ValueError):
                continue


def looks_like_credential(text: str) -> bool:
    """True when ``text`` (or a `decodings` form of it) starts like a credential or an
    ``Authorization`` value (``sk-``, ``eyJ``, ``Bearer``, ``Basic``), case-insensitively, or
    holds a credential's shape further in (`CREDENTIAL_SHAPE_RE`, ``trace_sk-...``)."""
    for decoded in decodings(text):
        if decoded.strip().lower().startswith(_PREFIXES):
            return True
        if CREDENTIAL_SHAPE_RE.search(decoded) or CREDENTIAL_SHAPE_RE.search(decoded.lower()):
            return True
    return False


def _base64_cores(secret: bytes) -> list[bytes]:
    """The substrings that every base64 (and base64url) encoding of a text containing
    ``secret`` contains, one per alignment (the secret starting at offset 0, 1 or 2 mod 3).

    At offset ``k`` the first ``3 - k`` bytes (for ``k`` > 0) share output characters with
    what precedes; from the next multiple of 3 on, the encoding depends on the secret alone.
    Its last partial group is dropped for the same reason.
    """
    cores: list[bytes] = []
    for offset in range(3):
        skip = (3 - offset) % 3
        body = secret[skip:]
        body = body[: len(body) - len(body) % 3]
        if len(body) < 9:
            continue
        encoded = base64.b64encode(body)
        cores.append(encoded)
        url = base64.urlsafe_b64encode(body)
        if url != encoded:
            cores.append(url)
    return cores


@dataclass(frozen=True)
class OwnCredential:
    """The secret a request authenticated with, ready to be searched for in its body.

    Build with `OwnCredential.of`; None there means nothing worth searching (no credential, or
    one shorter than `MIN_SECRET_CHARS`).
    """

    text: str
    raw: bytes
    cores: tuple[bytes, ...]
    plain: bool = False
    bare: str = ""
    """The secret of a ``sk-q38-`` key without its public prefix (searched as the whole is)."""

    @classmethod
    def of(cls, authorization: str | None) -> OwnCredential | None:
        """From an ``Authorization`` value (``Bearer <secret>``); the last few are kept, a
        client sends the same one on every request."""
        if not authorization:
            return None
        return _own_credential(authorization)

    def found_in(self, raw: bytes, body: Any) -> bool:
        """True when ``raw`` (the body's bytes) or any string of ``body`` (the parsed JSON, keys
        included) holds the secret as it is, JSON-unescaped, percent-decoded or base64-encoded.
        Iterative, so any nesting the parser accepted is walked without recursion.

        A secret of base64url characters and dots (keys and JWTs) can only be hidden from a
        search of ``raw`` by a ``\\u`` escape (JSON escapes nothing else of those characters;
        ``\\/`` can hide the ``/`` of a standard base64 form), by percent-encoding, or by a
        body in UTF-16 or UTF-32 (read as `json.detect_encoding` finds it): without any of
        these in a UTF-8 ``raw`` the search is over ``raw`` and its percent-decoding, and the
        strings are not walked.
        """
        if self.raw in raw or (self.bare and self.bare.encode() in raw):
            return True
        for core in self.cores:
            if core in raw:
                return True
        if (
            self.plain
            and b"\\u" not in raw
            and b"\\/" not in raw
            and json.detect_encoding(raw) in _UTF8
        ):
            if b"%" not in raw:
                return False
            decoded = unquote_to_bytes(raw)
            return self.raw in decoded or bool(self.bare and self.bare.encode() in decoded)
        stack: list[Any] = [body]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                if self._in_text(item):
                    return True
            elif isinstance(item, list):
                stack.extend(item)
            elif isinstance(item, dict):
                for key, value in item.items():
                    if self._in_text(key):
                        return True
                    stack.append(value)
        return False

    def shares_run_with(self, text: str) -> bool:
        """True when ``text`` holds the credential as `found_in` searches for it, or any run of
        `MIN_SECRET_CHARS` consecutive characters of it (the secret of an ``sk-q38-`` key
        without its prefix, a JWT's signature or payload).

        The runs of ``text`` go into a set and each run of the credential is looked up by hash:
        the time taken depends on the lengths, not on how many leading characters match (no
        character-by-character compare of the secret against client text). Meant for values of
        at most a few hundred characters; O(len(text) + len(credential)) lookups.
        """
        if self.found_in(text.encode("utf-8", "surrogatepass"), text):
            return True
        size = MIN_SECRET_CHARS
        runs = {text[i : i + size] for i in range(len(text) - size + 1)}
        secret = self.text
        return any(secret[i : i + size] in runs for i in range(len(secret) - size + 1))

    def _in_text(self, text: str) -> bool:
        bare = self.bare
        if self.text in text or (bare and bare in text):
            return True
        if "%" in text:
            decoded = unquote(text, errors="replace")
            if self.text in decoded or (bare and bare in decoded):
                return True
        if self.cores and len(text) >= 12:
            data = text.encode("utf-8", "surrogatepass")
            return any(core in data for core in self.cores)
        return False
