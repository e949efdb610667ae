"""Credential check: a Bearer API key or JWT in, a `Principal` or `InvalidApiKey` out."""

from __future__ import annotations

import binascii
import hmac
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jwt

from gateway.config import valid_tenant_name
from gateway.credentials import (
    GENERATED_PREFIX,
    GENERATED_SECRET_CHARS,
    SECRET_RE,
    ApiKey,
    KeySet,
    SigningKey,
    b64url_decode,
    secret_digest,
)
from gateway.errors import InvalidApiKey

# A JWT ``sub`` as recorded in logs and the usage ledger: at most this many characters, and
# characters outside SUBJECT_CHARS replaced by "_" (never a metric label).
MAX_SUBJECT_CHARS = 128
_SUBJECT_RE = re.compile(r"[^A-Za-z0-9._@:+-]")
# Recently removed API keys (their SHA-256 digests, never the secrets) remembered so that a
# revoked key is counted as ``revoked`` rather than ``unknown``; the oldest are forgotten first.
MAX_REVOKED = 4096
# Recently removed JWT signing key ids, remembered likewise so that a token signed with a
# removed key is counted as ``revoked`` rather than ``unknown_kid``; the oldest are forgotten
# first. Signing keys are few and rotated rarely.
MAX_REVOKED_KIDS = 256
# Longer credentials are refused before hashing or base64-decoding anything: a generated key is
# 39 characters and a gateway JWT a few hundred.
MAX_CREDENTIAL_CHARS = 8192
_BEARER = "bearer"
_BASE62_RUN_RE = re.compile(rf"[0-9A-Za-z]{{{GENERATED_SECRET_CHARS},}}")


@dataclass(frozen=True)
class Principal:
    """Who made a request.

    Attributes:
        tenant: the tenant named by the key line or the JWT ``sub``.
        key_id: the key id, or ``jwt:<kid>``; safe to log (never a secret).
        method: ``key`` or ``jwt``.
        subject: the JWT's ``sub`` as `bounded_subject` leaves it, or None for an API key. Logged
            and recorded in the usage ledger so that several subjects sharing one tenant table
            stay apart; never a metric label.
    """

    tenant: str
    key_id: str
    method: Literal["key", "jwt"]
    subject: str | None = None


class RevokedSet:
    """SHA-256 digests of API keys revoked anywhere in a fleet of gateways, replaced whole by
    `gateway.fleet_sync` (empty for a single gateway). A key in it is refused (``revoked``) even
    while this gateway's keys file still lists it."""

    def __init__(self) -> None:
        self.digests: frozenset[bytes] = frozenset()


def revoked_digests(previous: Authenticator | None, keys: KeySet) -> tuple[bytes, ...]:
    """The digests of API keys revoked so far: ``previous``'s list plus its keys that ``keys``
    no longer has, minus keys ``keys`` has again; oldest first, at most `MAX_REVOKED`."""
    if previous is None:
        return ()
    current = {key.digest for key in keys.api_keys}
    removed = [key.digest for key in previous.keys.api_keys if key.digest not in current]
    kept = [d for d in previous.revoked if d not in current and d not in set(removed)]
    return tuple((kept + removed)[-MAX_REVOKED:])


def revoked_kids(previous: Authenticator | None, keys: KeySet) -> tuple[str, ...]:
    """The ``kid`` of JWT signing keys removed so far: ``previous``'s list plus its signing keys
    that ``keys`` no longer has, minus kids ``keys`` has again; oldest first, at most
    `MAX_REVOKED_KIDS`."""
    if previous is None:
        return ()
    current = {key.kid for key in keys.signing_keys}
    removed = [key.kid for key in previous.keys.signing_keys if key.kid not in current]
    kept = [kid for kid in previous.revoked_kids if kid not in current and kid not in removed]
    return tuple((kept + removed)[-MAX_REVOKED_KIDS:])


def bounded_subject(value: str) -> str:
    """A JWT subject safe to log: at most `MAX_SUBJECT_CHARS`, plain characters only.

    Characters other than letters, digits and ``._@:+-`` become ``_`` (no control characters or
    quotes reach a log line or a report).
    """
    return _SUBJECT_RE.sub("_", value[:MAX_SUBJECT_CHARS])


class Authenticator:
    """Checks ``Authorization`` headers against one `KeySet`; build one per loaded set.

    Lookup tables are built here, so `authenticate` does one dict lookup by SHA-256 and one
    constant-time compare for an API key, or one signature check for a JWT, and no I/O.

    Args:
        keys: the loaded keys file.
        leeway_s: clock skew allowed on ``exp``, ``nbf`` and ``iat`` (``auth.jwt_leeway_s``).
        max_ttl_s: longest accepted ``exp - iat`` (``auth.jwt_max_ttl_s``).
        clock: seconds since the epoch; injected by tests.
        revoked: SHA-256 digests of keys removed from the file (`revoked_digests`); such a key
            is refused with reason ``revoked`` instead of ``unknown``.
        fleet_revoked: keys revoked by another gateway of the fleet (`RevokedSet`), refused
            here before this gateway's own keys file changes.
        revoked_kids: ids of JWT signing keys removed from the file (`revoked_kids`); a token
            naming one is refused with reason ``revoked`` instead of ``unknown_kid``.
    """

    def __init__(
        self,
        keys: KeySet,
        *,
        leeway_s: float = 30.0,
        max_ttl_s: float = 86_400.0,
        clock: Callable[[], float] = time.time,
        revoked: tuple[bytes, ...] = (),
        fleet_revoked: RevokedSet | None = None,
        revoked_kids: tuple[str, ...] = (),
    ) -> None:
        self.keys = keys
        self.revoked_kids = revoked_kids
        self._revoked_kids = frozenset(revoked_kids)
        self.fleet_revoked = fleet_revoked if fleet_revoked is not None else RevokedSet()
        self.revoked = revoked
        self._revoked = frozenset(revoked)
        self._by_digest: dict[bytes, ApiKey] = {key.digest: key for key in keys.api_keys}
        self._by_kid: dict[str, SigningKey] = {key.kid: key for key in keys.signing_keys}
        self._expiry: dict[bytes, float] = {
            key.digest: key.expires.timestamp() for key in keys.api_keys if key.expires
        }
        self._leeway_s = leeway_s
        self._max_ttl_s = max_ttl_s
        self._clock = clock

    def is_api_key(self, text: str) -> bool:
        """True when ``text`` is one of the loaded API keys (by its SHA-256; for refusing to
        echo or log a key a client put where an id belongs)."""
        return secret_digest(text) in self._by_digest

    def holds_api_key(self, text: str) -> bool:
        """True when ``text`` is a loaded API key, or holds the secret of a loaded key that
        ``keys add`` wrote (`GENERATED_PREFIX` and `GENERATED_SECRET_CHARS` base62 characters)
        anywhere, with or without its prefix: each run of that many base62 characters is
        looked up by its digest as such a key. For a short client value (an ``X-Request-Id``,
        128 characters at most: at most 97 lookups, about 170 µs for a 128-character run; ids of
        ordinary shapes, a UUID or 32 hex digits, take 0 or 1).

        A hand-written key of another length is found only whole: its length is not known."""
        if self.is_api_key(text):
            return True
        size = GENERATED_SECRET_CHARS
        for run in _BASE62_RUN_RE.findall(text):
            for start in range(len(run) - size + 1):
                if self.is_api_key(GENERATED_PREFIX + run[start : start + size]):
                    return True
        return False

    def authenticate(self, authorization: str | None) -> Principal:
        """Check one ``Authorization`` header value (``Bearer <key or JWT>``, scheme any case).

        A credential with two dots whose first segment decodes as a JSON object with ``alg`` is
        a JWT; anything else is an API key.

        Raises:
            InvalidApiKey: with ``reason`` one of ``missing``, ``malformed``, ``unknown``,
                ``revoked``, ``expired``, ``bad_signature``, ``bad_claims``, ``unknown_kid``, ``bad_algorithm``
                (`gateway.metrics.AUTH_FAILURE_REASONS`).
        """
        if authorization is None or not authorization.strip():
            raise InvalidApiKey("missing")
        scheme, _, credential = authorization.strip().partition(" ")
        credential = credential.strip()
        if scheme.lower() != _BEARER or not credential:
            raise InvalidApiKey("malformed")
        if len(credential) > MAX_CREDENTIAL_CHARS or not SECRET_RE.fullmatch(credential):
            raise InvalidApiKey("malformed")
        if credential.count(".") == 2:
            header = _jwt_header(credential)
            if header is not None:
                return self._check_jwt(credential, header)
        return self._check_key(credential)

    def _check_key(self, secret: str) -> Principal:
        digest = secret_digest(secret)
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found.digest, digest):
            raise InvalidApiKey("revoked" if digest in self._revoked else "unknown")
        if digest in self.fleet_revoked.digests:
            raise InvalidApiKey("revoked")
        expires = self._expiry.get(digest)
        if expires is not None and self._clock() >= expires:
            raise InvalidApiKey("expired")
        return Principal(found.tenant, found.key_id, "key")

    def _check_jwt(self, token: str, header: dict[str, Any]) -> Principal:
        kid = header.get("kid")
        key = self._by_kid.get(kid) if isinstance(kid, str) else None
        if key is None:
            raise InvalidApiKey("revoked" if kid in self._revoked_kids else "unknown_kid")
        # The key decides the algorithm, never the token: this is what rules out "none" and
        # HS256-signed-with-a-public-key confusion.
        if header.get("alg") != key.algorithm:
            raise InvalidApiKey("bad_algorithm")
        try:
            claims = jwt.decode(
                token,
                key.verification_key,
                algorithms=[key.algorithm],
                options={
                    "require": ["exp", "iat", "sub"],
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                },
            )
        except jwt.InvalidSignatureError:
            raise InvalidApiKey("bad_signature") from None
        except jwt.InvalidAlgorithmError:
            raise InvalidApiKey("bad_algorithm") from None
        except (jwt.DecodeError, RecursionError):
            raise InvalidApiKey("malformed") from None
        except jwt.InvalidTokenError:
            raise InvalidApiKey("bad_claims") from None
        tenant = self._check_claims(claims)
        return Principal(tenant, f"jwt:{key.kid}", "jwt", bounded_subject(tenant))

    def _check_claims(self, claims: dict[str, Any]) -> str:
        """Check time claims on the injected clock (pyjwt's is not injectable); return ``sub``."""
        exp, iat, nbf = _number(claims, "exp"), _number(claims, "iat"), _number(claims, "nbf", 0)
        now = self._clock()
        if exp <= now - self._leeway_s:
            raise InvalidApiKey("expired")
        if iat > now + self._leeway_s or nbf > now + self._leeway_s:
            raise InvalidApiKey("bad_claims")
        if exp - iat > self._max_ttl_s or exp <= iat:
            raise InvalidApiKey("bad_claims")
        tenant = claims.get("sub")
        if not isinstance(tenant, str) or not valid_tenant_name(tenant):
            raise InvalidApiKey("bad_claims")
        return tenant


def _number(claims: dict[str, Any], name: str, default: float | None = None) -> float:
    """A NumericDate claim (RFC 7519 section 2); ``bad_claims`` when absent or not a number."""
    value = claims.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidApiKey("bad_claims")
    return value


def _jwt_header(token: str) -> dict[str, Any] | None:
    """The decoded JOSE header of a compact JWS, or None when it does not look like one."""
    try:
        header = json.loads(b64url_decode(token.partition(".")[0]))
    except (ValueError, binascii.Error, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(header, dict) or not isinstance(header.get("alg"), str):
        return None
    return header


def issue_token(key: SigningKey, tenant: str, ttl_s: int, *, now: float | None = None) -> str:
    """A JWT for ``tenant``: claims ``sub``, ``iat``, ``exp`` (whole seconds), header ``kid``.

    Raises:
        ValueError: ``key`` has no private part, or ``tenant`` breaks the tenant name rule.
    """
    if key.signing_key is None:
        raise ValueError(f"signing key {key.kid} is verify-only (ed25519-pub)")
    if not valid_tenant_name(tenant):
        raise ValueError("invalid tenant name")
    issued = int(time.time() if now is None else now)
    claims = {"sub": tenant, "iat": issued, "exp": issued + int(ttl_s)}
    return jwt.encode(
        claims,
        key.signing_key,
        algorithm=key.algorithm,
        headers={"kid": key.kid},
    )
