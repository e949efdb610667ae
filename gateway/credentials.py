"""Credentials of the keys file: API keys, JWT signing keys, reserved settings; strict parser.

The file is dotenv-shaped: ``NAME=VALUE`` lines, ``#`` comments, blank lines. Four kinds of line:

- ``KEY_ID=tenant:secret[:expires=TS]``: a plaintext API key typed by hand;
- ``KEY_ID=tenant:sha256:<64 hex>[:created=TS][:expires=TS]``: the hashed form ``keys add`` writes;
- ``JWT_<kid>=hs256:<base64url>`` / ``ed25519:<base64url>`` / ``ed25519-pub:<base64url>``
  (each optionally ``:created=TS``): JWT keys, chosen by ``kid``;
- ``QWEN38_<NAME>=value``: reserved server settings (`KNOWN_SETTINGS`).

Every problem is reported with its line; nothing from a line that failed validation is echoed,
so a secret pasted in the wrong place never reaches a log. Reading and writing the file itself is
`gateway.keys_file`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gateway.config import TENANT_NAME_RULE, valid_tenant_name
from gateway.secret_scan import GENERATED_PREFIX as GENERATED_PREFIX

NAME_RE = re.compile(r"[A-Za-z0-9_]+")
# RFC 6750 section 2.1 b64token: what a Bearer credential may contain.
SECRET_RE = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
HEX64_RE = re.compile(r"[0-9a-f]{64}")
B64URL_RE = re.compile(r"[A-Za-z0-9_-]+=*")
DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
_LINE_RE = re.compile(r"(?:export[ \t]+)?([^=\s]+)[ \t]*=[ \t]*(.*)")
_ATTR_RE = re.compile(r":(created|expires)=(.*?)(?=:(?:created|expires)=|$)")

SIGNING_PREFIX = "JWT_"
SETTING_PREFIX = "QWEN38_"
KNOWN_SETTINGS = frozenset({"QWEN38_CACHE_SALT_SECRET", "QWEN38_METRICS_TOKEN"})
HASH_SCHEME = "sha256"
# Hand-typed keys shorter than this are refused: 16 characters is the floor for a guessing attack
# over the network to be hopeless even with a poor alphabet; generated keys have ~190 bits.
MIN_PLAINTEXT_SECRET = 16
# Keys written by `keys add`: `GENERATED_PREFIX` and `GENERATED_SECRET_CHARS` characters of `BASE62`:
# 32 * log2(62) = 190 bits, beyond any guessing and enough for an unsalted SHA-256 to be a safe
# stored form.
BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
GENERATED_SECRET_CHARS = 32
# RFC 7518 section 3.2: an HS256 key must be at least as long as the hash output (256 bits).
HS256_MIN_BYTES = 32
ED25519_KEY_BYTES = 32
MAX_FILE_BYTES = 16 << 20

Algorithm = Literal["HS256", "EdDSA"]


class KeysFileError(Exception):
    """The keys file cannot be used.

    Attributes:
        problems: one ``"path:line: message"`` (or ``"path: message"``) string per problem.
    """

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ApiKey:
    """One API key line.

    Attributes:
        key_id: the line's name (``[A-Za-z0-9_]+``); safe to log.
        tenant: tenant name (`gateway.config.TENANT_NAME_RE`).
        digest: SHA-256 of the full secret (32 bytes); the lookup key.
        hashed: True for the ``sha256:`` form, False for a plaintext line.
        created: when ``keys add`` wrote it (UTC), or None.
        expires: first instant the key is refused (UTC), or None for never.
        line: 1-based line number in the file.
    """

    key_id: str
    tenant: str
    digest: bytes = field(repr=False)
    hashed: bool
    created: datetime | None
    expires: datetime | None
    line: int

    @property
    def fingerprint(self) -> str:
        """First 8 hex digits of the secret's SHA-256: identifies a key without revealing it."""
        return self.digest.hex()[:8]


@dataclass(frozen=True)
class SigningKey:
    """One ``JWT_<kid>`` line.

    Attributes:
        kid: the JWT ``kid`` header value that selects this key.
        algorithm: the only JWS algorithm accepted with it (``HS256`` or ``EdDSA``).
        verification_key: HMAC secret bytes, or the Ed25519 public key.
        signing_key: HMAC secret bytes, the Ed25519 private key, or None (``ed25519-pub``:
            verify only).
        created: when it was added (UTC), or None.
        line: 1-based line number in the file.
        fingerprint: first 8 hex of SHA-256 of the secret (HS256) or raw public key (EdDSA).
    """

    kid: str
    algorithm: Algorithm
    verification_key: bytes | Ed25519PublicKey = field(repr=False)
    signing_key: bytes | Ed25519PrivateKey | None = field(repr=False)
    created: datetime | None
    line: int
    fingerprint: str


@dataclass(frozen=True)
class KeySet:
    """Everything one keys file holds, validated; build with `load_keys_file` or `parse_keys`.

    Attributes:
        api_keys: API keys in file order.
        signing_keys: JWT keys in file order.
        settings: reserved ``QWEN38_*`` values (masked in repr).
        source: the file it came from, or None.
        version: 16 hex digits of the SHA-256 of the file's bytes (``keys_version`` of
            ``/ready``, what ``--wait`` compares); a hash of the whole file, never a secret.
    """

    api_keys: tuple[ApiKey, ...] = ()
    signing_keys: tuple[SigningKey, ...] = ()
    settings: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    source: str | None = None
    version: str = ""

    @property
    def key_count(self) -> int:
        """Number of API keys (the ``gateway_keys_loaded`` gauge)."""
        return len(self.api_keys)

    def setting(self, name: str) -> str | None:
        """A reserved ``QWEN38_*`` value, e.g. ``QWEN38_METRICS_TOKEN``, or None when absent."""
        return self.settings.get(name)

    def newest_signing_key(self) -> SigningKey | None:
        """The key ``token issue`` signs with: private, latest ``created``, later line on ties."""
        usable = [k for k in self.signing_keys if k.signing_key is not None]
        if not usable:
            return None
        oldest = datetime.min.replace(tzinfo=timezone.utc)
        return max(usable, key=lambda k: (k.created or oldest, k.line))


def parse_timestamp(text: str) -> datetime:
    """Parse an ISO 8601 date or date-time into an aware UTC datetime.

    A bare date (``2026-01-31``) means the start of that day, UTC; a date-time without an offset
    is taken as UTC; ``Z`` is accepted on Python 3.10 too.

    Raises:
        ValueError: not ISO 8601.
    """
    if DATE_RE.fullmatch(text):
        return datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=timezone.utc)
    if text[-1:] in ("Z", "z"):
        text = text[:-1] + "+00:00"
    if not text[:4].isdigit():
        raise ValueError("not ISO 8601")
    parsed = datetime.fromisoformat(text)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.astimezone(timezone.utc)


def format_timestamp(moment: datetime) -> str:
    """``YYYY-MM-DDTHH:MM:SSZ`` in UTC, the form the CLI writes and lists."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def secret_digest(secret: str) -> bytes:
    """SHA-256 of a secret's UTF-8 bytes.

    A plain (unsalted, fast) hash is adequate because generated keys carry ~190 bits of entropy
    and hand-typed ones at least `MIN_PLAINTEXT_SECRET` characters: there is nothing to brute-force,
    and an unsalted hash is what makes the O(1) lookup by hash possible.
    """
    return hashlib.sha256(secret.encode()).digest()


def b64url_decode(text: str) -> bytes:
    """Decode base64url with or without padding.

    Raises:
        ValueError: characters outside the base64url alphabet or a bad length.
    """
    if not B64URL_RE.fullmatch(text):
        raise ValueError("not base64url")
    stripped = text.rstrip("=")
    try:
        return base64.urlsafe_b64decode(stripped + "=" * (-len(stripped) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ValueError("not base64url") from exc


def b64url_encode(data: bytes) -> str:
    """Base64url without padding (RFC 7515 section 2)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class _Problems:
    """Collects ``path:line: message`` strings."""

    source: str
    items: list[str] = field(default_factory=list)

    def add(self, line: int | None, message: str) -> None:
        where = f"{self.source}:{line}" if line is not None else self.source
        self.items.append(f"{where}: {message}")


def _split_attrs(rest: str, line: int, problems: _Problems) -> dict[str, datetime] | None:
    """Parse ``:created=TS:expires=TS`` into datetimes; None (and problems) when malformed."""
    attrs: dict[str, datetime] = {}
    pos = 0
    ok = True
    while pos < len(rest):
        match = _ATTR_RE.match(rest, pos)
        if match is None:
            problems.add(
                line,
                "unexpected text after the key; only :created=... and :expires=...",
            )
            return None
        name, value = match.group(1), match.group(2)
        if name in attrs:
            problems.add(line, f"{name} given twice")
            ok = False
        try:
            attrs[name] = parse_timestamp(value)
        except ValueError:
            problems.add(line, f"{name}: not an ISO 8601 date or date-time")
            ok = False
        pos = match.end()
    return attrs if ok else None


def _parse_api_key(name: str, value: str, line: int, problems: _Problems) -> ApiKey | None:
    """``tenant:sha256:<hex>[attrs]`` or ``tenant:secret[attrs]``."""
    tenant, sep, rest = value.partition(":")
    if not sep or not rest:
        problems.add(line, f"{name}: expected tenant:secret or tenant:sha256:<hex>")
        return None
    if not valid_tenant_name(tenant):
        problems.add(line, f"{name}: invalid tenant name ({TENANT_NAME_RULE})")
        return None
    if rest.startswith(HASH_SCHEME + ":"):
        rest = rest[len(HASH_SCHEME) + 1 :]
        hex_digest = rest.partition(":")[0]
        if not HEX64_RE.fullmatch(hex_digest):
            problems.add(line, f"{name}: sha256 needs 64 lowercase hex digits")
            return None
        digest, hashed, attr_text = (
            bytes.fromhex(hex_digest),
            True,
            rest[len(hex_digest) :],
        )
    else:
        secret = rest.partition(":")[0]
        if not SECRET_RE.fullmatch(secret):
            problems.add(line, f"{name}: secret has characters outside A-Z a-z 0-9 - . _ ~ + / =")
            return None
        if len(secret) < MIN_PLAINTEXT_SECRET:
            problems.add(line, f"{name}: secret shorter than {MIN_PLAINTEXT_SECRET} characters")
            return None
        digest, hashed, attr_text = secret_digest(secret), False, rest[len(secret) :]
    attrs = _split_attrs(attr_text, line, problems)
    if attrs is None:
        return None
    return ApiKey(
        key_id=name,
        tenant=tenant,
        digest=digest,
        hashed=hashed,
        created=attrs.get("created"),
        expires=attrs.get("expires"),
        line=line,
    )


def _parse_signing_key(name: str, value: str, line: int, problems: _Problems) -> SigningKey | None:
    """``hs256:<b64url>``, ``ed25519:<b64url seed>`` or ``ed25519-pub:<b64url>``, then attrs."""
    kid = name[len(SIGNING_PREFIX) :]
    if not kid:
        problems.add(line, f"{name}: empty kid")
        return None
    kind, _, rest = value.partition(":")
    material, _, _ = rest.partition(":")
    attrs = _split_attrs(rest[len(material) :], line, problems)
    try:
        raw = b64url_decode(material)
    except ValueError:
        problems.add(line, f"{name}: key material is not base64url")
        return None
    if attrs is None:
        return None
    created = attrs.get("created")
    if "expires" in attrs:
        problems.add(line, f"{name}: signing keys take no expires; remove the line to retire one")
        return None
    if kind == "hs256":
        if len(raw) < HS256_MIN_BYTES:
            problems.add(line, f"{name}: hs256 secret shorter than {HS256_MIN_BYTES} bytes")
            return None
        fingerprint = hashlib.sha256(raw).hexdigest()[:8]
        return SigningKey(kid, "HS256", raw, raw, created, line, fingerprint)
    if kind in ("ed25519", "ed25519-pub"):
        if len(raw) != ED25519_KEY_BYTES:
            problems.add(line, f"{name}: {kind} key must be {ED25519_KEY_BYTES} bytes")
            return None
        private: Ed25519PrivateKey | None = None
        if kind == "ed25519":
            private = Ed25519PrivateKey.from_private_bytes(raw)
            public = private.public_key()
        else:
            public = Ed25519PublicKey.from_public_bytes(raw)
        public_raw = public.public_bytes(Encoding.Raw, PublicFormat.Raw)
        fingerprint = hashlib.sha256(public_raw).hexdigest()[:8]
        return SigningKey(kid, "EdDSA", public, private, created, line, fingerprint)
    problems.add(line, f"{name}: expected hs256:, ed25519: or ed25519-pub:")
    return None


def _unquote(raw_value: str) -> str | None:
    """Strip matching quotes or a trailing `` # comment``; None when a quote is unbalanced."""
    if raw_value[:1] in ("'", '"'):
        end = raw_value.find(raw_value[0], 1)
        after = raw_value[end + 1 :].strip() if end > 0 else ""
        if end < 0 or (after and not after.startswith("#")):
            return None
        return raw_value[1:end]
    return re.sub(r"[ \t]+#.*$", "", raw_value).strip()


def split_lines(raw: bytes) -> list[bytes]:
    """The file's lines as the parser and the writer number them (``\\n``-separated, 1-based)."""
    return raw.split(b"\n")


def parse_keys(raw: bytes, source: str = "<keys>") -> KeySet:
    """Parse and validate a whole keys file.

    Args:
        raw: the file's bytes (UTF-8, LF or CRLF line ends).
        source: the path used in problem messages and `KeySet.source`.

    Raises:
        KeysFileError: with every problem found, each naming its line.
    """
    problems = _Problems(source)
    if len(raw) > MAX_FILE_BYTES:
        raise KeysFileError([f"{source}: larger than {MAX_FILE_BYTES} bytes"])
    api_keys: list[ApiKey] = []
    signing: list[SigningKey] = []
    settings: dict[str, str] = {}
    first_line_of: dict[str, int] = {}
    digest_line: dict[bytes, int] = {}
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    for number, chunk in enumerate(split_lines(raw), start=1):
        try:
            text = chunk.decode("utf-8").removesuffix("\r").strip()
        except UnicodeDecodeError:
            problems.add(number, "not valid UTF-8")
            continue
        if not text or text.startswith("#"):
            continue
        match = _LINE_RE.fullmatch(text)
        if match is None:
            problems.add(number, "expected NAME=VALUE")
            continue
        name = match.group(1)
        if not NAME_RE.fullmatch(name):
            problems.add(number, "invalid name (letters, digits and _ only)")
            continue
        value = _unquote(match.group(2))
        if value is None:
            problems.add(number, f"{name}: unbalanced quote")
            continue
        if not value:
            problems.add(number, f"{name}: empty value")
            continue
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            problems.add(number, f"{name}: control character in value")
            continue
        if name in first_line_of:
            problems.add(number, f"duplicate name {name} (first at line {first_line_of[name]})")
            continue
        first_line_of[name] = number
        if name.startswith(SETTING_PREFIX):
            if name not in KNOWN_SETTINGS:
                known = ", ".join(sorted(KNOWN_SETTINGS))
                problems.add(number, f"unknown reserved setting {name} (known: {known})")
                continue
            settings[name] = value
        elif name.startswith(SIGNING_PREFIX):
            key = _parse_signing_key(name, value, number, problems)
            if key is not None:
                signing.append(key)
        else:
            api_key = _parse_api_key(name, value, number, problems)
            if api_key is None:
                continue
            earlier = digest_line.get(api_key.digest)
            if earlier is not None:
                problems.add(number, f"{name}: same secret as line {earlier}")
                continue
            digest_line[api_key.digest] = number
            api_keys.append(api_key)
    if problems.items:
        raise KeysFileError(problems.items)
    version = hashlib.sha256(raw).hexdigest()[:16]
    return KeySet(tuple(api_keys), tuple(signing), MappingProxyType(settings), source, version)
