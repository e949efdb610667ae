"""The ``keys`` and ``token`` subcommands: manage the keys file, issue JWTs."""

from __future__ import annotations

import argparse
import re
import secrets
import sys
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from gateway.auth import issue_token
from gateway.config import TENANT_NAME_RULE, ConfigError, Settings, load_settings, valid_tenant_name
from gateway.credentials import (
    BASE62,
    GENERATED_PREFIX,
    GENERATED_SECRET_CHARS,
    NAME_RE,
    SETTING_PREFIX,
    SIGNING_PREFIX,
    KeySet,
    KeysFileError,
    SigningKey,
    b64url_encode,
    format_timestamp,
    parse_timestamp,
    secret_digest,
)
from gateway.keys_file import append_line, load_keys_file, remove_line, update_keys_file
from gateway.keys_wait import add_wait_options, wait_if_asked

HS256_SECRET_BYTES = 32
DEFAULT_TTL_S = 3600
_DURATION_RE = re.compile(r"(\d+)([dhm])")
_DURATION_UNITS = {"d": "days", "h": "hours", "m": "minutes"}
_RELOAD_NOTE = (
    "The running gateway applies this within 2 s (or at once on SIGHUP); --wait waits for it."
)


def generate_secret() -> str:
    """A new API key: ``sk-q38-`` and 32 base62 characters from `secrets` (190 bits)."""
    return GENERATED_PREFIX + "".join(secrets.choice(BASE62) for _ in range(GENERATED_SECRET_CHARS))


def _tenant(text: str) -> str:
    if not valid_tenant_name(text):
        raise argparse.ArgumentTypeError(f"tenant names are {TENANT_NAME_RULE}")
    return text


def _key_id(text: str) -> str:
    if not NAME_RE.fullmatch(text) or text.startswith((SIGNING_PREFIX, SETTING_PREFIX)):
        raise argparse.ArgumentTypeError(
            f"key ids are letters, digits and '_', not starting with {SIGNING_PREFIX} "
            f"or {SETTING_PREFIX}"
        )
    return text


def _kid(text: str) -> str:
    if not NAME_RE.fullmatch(text):
        raise argparse.ArgumentTypeError("kids are letters, digits and '_'")
    return text


def _expires(text: str) -> datetime:
    """``--expires``: ISO 8601 date/date-time (UTC unless an offset is given) or ``90d``/``12h``."""
    now = datetime.now(timezone.utc)
    duration = _DURATION_RE.fullmatch(text)
    try:
        when = (
            now + timedelta(**{_DURATION_UNITS[duration.group(2)]: int(duration.group(1))})
            if duration
            else parse_timestamp(text)
        )
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            "use an ISO 8601 date or date-time (2026-06-30, 2026-06-30T12:00:00Z) or 90d/12h/30m"
        ) from None
    if when <= now:
        raise argparse.ArgumentTypeError("expiry is in the past")
    return when


def _ttl(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("ttl is a whole number of seconds") from None
    if value < 1:
        raise argparse.ArgumentTypeError("ttl must be at least 1 second")
    return value


def _file_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keys-file",
        metavar="F",
        help="the keys file (default: auth.keys_file of the config)",
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="gateway config (default: $QWEN38_GATEWAY_CONFIG or /etc/qwen38/gateway.toml)",
    )


def add_subcommands(subparsers: Any) -> None:
    """Add ``keys {add,list,revoke,add-signing-key}`` and ``token issue`` to a CLI.

    Args:
        subparsers: the object ``ArgumentParser.add_subparsers()`` returned. Every leaf sets
            ``func(args) -> int`` (the exit code) with ``set_defaults``.
    """
    keys = subparsers.add_parser(
        "keys",
        help="add, list and revoke API keys and JWT signing keys",
        description="Manage the keys file. Changes reach the running gateway within 2 s.",
    )
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")

    add = keys_sub.add_parser(
        "add",
        help="create an API key; the secret is printed once, alone on stdout",
        description="Create an API key for a tenant. The key is stored hashed; its secret is "
        "printed once, alone on the last line of stdout (details go to stderr).",
    )
    add.add_argument("--tenant", required=True, type=_tenant, help="tenant the key belongs to")
    add.add_argument(
        "--expires",
        type=_expires,
        metavar="DATE",
        help="when the key stops working: ISO 8601 (UTC unless an offset is given; a bare date "
        "means 00:00 UTC that day) or a duration from now such as 90d, 12h, 30m",
    )
    add.add_argument(
        "--id", dest="key_id", type=_key_id, help="key id (default: key_<tenant>_<random>)"
    )
    _file_options(add)
    add_wait_options(add)
    add.set_defaults(func=cmd_keys_add)

    listing = keys_sub.add_parser(
        "list",
        help="list keys: id, tenant, created, expires, fingerprint",
        description="List API keys and signing keys. Never prints a secret.",
    )
    _file_options(listing)
    listing.set_defaults(func=cmd_keys_list)

    revoke = keys_sub.add_parser(
        "revoke",
        help="remove an API key (or a signing key: JWT_<kid>)",
        description="Remove the line of an API key, or of a signing key given as JWT_<kid> "
        "(tokens signed with it stop working). Streams already running finish.",
    )
    revoke.add_argument("key_id", metavar="KEY_ID", help="key id, or JWT_<kid> for a signing key")
    _file_options(revoke)
    add_wait_options(revoke)
    revoke.set_defaults(func=cmd_keys_revoke)

    signing = keys_sub.add_parser(
        "add-signing-key",
        help="add a JWT signing key; new tokens are signed with the newest",
        description="Add a JWT signing key. `token issue` signs with the newest one; tokens "
        "signed with older keys stay valid until those keys are revoked.",
    )
    signing.add_argument("--alg", choices=("HS256", "EdDSA"), default="HS256")
    signing.add_argument("--kid", type=_kid, help="key id in the JWT header (default: generated)")
    _file_options(signing)
    add_wait_options(signing)
    signing.set_defaults(func=cmd_keys_add_signing_key)

    token = subparsers.add_parser(
        "token", help="issue JWTs", description="Issue JWTs signed with the keys file."
    )
    token_sub = token.add_subparsers(dest="token_command", required=True, metavar="COMMAND")
    issue = token_sub.add_parser(
        "issue",
        help="print a signed JWT for a tenant, alone on stdout",
        description="Print a JWT (sub, iat, exp; kid header) for a tenant, signed with the newest "
        "signing key, alone on the last line of stdout. Creates an HS256 signing key first if "
        "there is none.",
    )
    issue.add_argument("--tenant", required=True, type=_tenant, help="tenant (the sub claim)")
    issue.add_argument(
        "--ttl",
        type=_ttl,
        default=DEFAULT_TTL_S,
        metavar="SECONDS",
        help=f"lifetime in seconds (default {DEFAULT_TTL_S}; at most auth.jwt_max_ttl_s)",
    )
    _file_options(issue)
    add_wait_options(issue)
    issue.set_defaults(func=cmd_token_issue)


def _say(*lines: str) -> None:
    """Information for the operator, on stderr so stdout carries only the secret or token."""
    for line in lines:
        print(line, file=sys.stderr)


def _report(problems: Sequence[str]) -> int:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(args.config, named=args.config is not None)


def _keys_path(args: argparse.Namespace) -> str:
    return args.keys_file or _settings(args).auth.keys_file


def _names(keyset: KeySet) -> set[str]:
    names = {key.key_id for key in keyset.api_keys} | set(keyset.settings)
    return names | {SIGNING_PREFIX + key.kid for key in keyset.signing_keys}


def _run(args: argparse.Namespace, body: Any) -> int:
    """Run ``body(path)``, turning file and config problems into messages and exit code 1; then
    ``--wait`` for the running gateway to load the file (`gateway.keys_wait`)."""
    try:
        path = _keys_path(args)
        code = int(body(path))
        return code or wait_if_asked(args, path, lambda: _settings(args))
    except KeysFileError as exc:
        return _report(exc.problems)
    except (ConfigError, OSError) as exc:
        return _report([str(exc)])


def cmd_keys_add(args: argparse.Namespace) -> int:
    """``keys add``: append a hashed key line; print the secret alone on stdout's last line."""
    secret = generate_secret()
    digest = secret_digest(secret)
    created = datetime.now(timezone.utc)
    chosen: list[str] = []

    def change(raw: bytes, keyset: KeySet) -> bytes:
        taken = _names(keyset)
        if args.key_id is not None:
            if args.key_id in taken:
                raise KeysFileError([f"key id {args.key_id} already exists"])
            key_id = args.key_id
        else:
            stem = re.sub(r"[^A-Za-z0-9_]", "_", args.tenant)
            key_id = f"key_{stem}_{secrets.token_hex(4)}"
            while key_id in taken:
                key_id = f"key_{stem}_{secrets.token_hex(4)}"
        chosen.append(key_id)
        value = f"{args.tenant}:sha256:{digest.hex()}:created={format_timestamp(created)}"
        if args.expires is not None:
            value += f":expires={format_timestamp(args.expires)}"
        return append_line(raw, f"{key_id}={value}")

    def body(path: str) -> int:
        update_keys_file(path, change, create=True)
        expires = format_timestamp(args.expires) if args.expires else "never"
        _say(
            f"added key {chosen[0]} for tenant {args.tenant} to {path}",
            f"fingerprint {digest.hex()[:8]}, expires {expires}",
            _RELOAD_NOTE,
            "The secret is shown once, below; it is stored only as a hash.",
        )
        print(secret, flush=True)
        return 0

    return _run(args, body)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def cmd_keys_list(args: argparse.Namespace) -> int:
    """``keys list``: API keys then signing keys, one line each; never a secret."""

    def body(path: str) -> int:
        keyset = load_keys_file(path)
        now = datetime.now(timezone.utc)
        rows: list[tuple[str, ...]] = [
            ("ID", "TENANT", "CREATED", "EXPIRES", "FINGERPRINT", "FORM", "STATE")
        ]
        for key in keyset.api_keys:
            state = "expired" if key.expires is not None and key.expires <= now else "active"
            rows.append(
                (
                    key.key_id,
                    key.tenant,
                    format_timestamp(key.created) if key.created else "-",
                    format_timestamp(key.expires) if key.expires else "never",
                    key.fingerprint,
                    "hashed" if key.hashed else "plaintext",
                    state,
                )
            )
        print("\n".join(_table(rows)))
        if keyset.signing_keys:
            newest = keyset.newest_signing_key()
            rows = [("SIGNING KEY", "ALG", "CREATED", "FINGERPRINT", "USE")]
            for signing in keyset.signing_keys:
                use = "verify" if signing.signing_key is None else "sign+verify"
                rows.append(
                    (
                        SIGNING_PREFIX + signing.kid,
                        signing.algorithm,
                        format_timestamp(signing.created) if signing.created else "-",
                        signing.fingerprint,
                        use + (" (newest)" if signing is newest else ""),
                    )
                )
            print()
            print("\n".join(_table(rows)))
        return 0

    return _run(args, body)


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    """``keys revoke KEY_ID``: remove that line (API key, or ``JWT_<kid>`` signing key)."""
    removed: list[str] = []

    def change(raw: bytes, keyset: KeySet) -> bytes:
        for key in keyset.api_keys:
            if key.key_id == args.key_id:
                removed.append(f"key {key.key_id} (tenant {key.tenant}, {key.fingerprint})")
                return remove_line(raw, key.line)
        for signing in keyset.signing_keys:
            if SIGNING_PREFIX + signing.kid == args.key_id:
                removed.append(f"signing key {signing.kid} ({signing.fingerprint})")
                return remove_line(raw, signing.line)
        raise KeysFileError([f"no key {args.key_id} in {keyset.source}"])

    def body(path: str) -> int:
        update_keys_file(path, change)
        _say(f"revoked {removed[0]}", _RELOAD_NOTE)
        return 0

    return _run(args, body)


def signing_key_line(kid: str, algorithm: str, created: datetime) -> str:
    """A new ``JWT_<kid>=...`` line with fresh key material from `secrets` / `cryptography`."""
    stamp = f":created={format_timestamp(created)}"
    if algorithm == "HS256":
        return f"{SIGNING_PREFIX}{kid}=hs256:{b64url_encode(secrets.token_bytes(32))}{stamp}"
    seed = Ed25519PrivateKey.generate().private_bytes(
        Encoding.Raw, PrivateFormat.Raw, NoEncryption()
    )
    return f"{SIGNING_PREFIX}{kid}=ed25519:{b64url_encode(seed)}{stamp}"


def _add_signing_key(path: str, algorithm: str, kid: str | None) -> SigningKey:
    """Append a signing key under the file lock; the new `SigningKey`."""
    created = datetime.now(timezone.utc)
    chosen: list[str] = []

    def change(raw: bytes, keyset: KeySet) -> bytes:
        taken = _names(keyset)
        name = kid or f"{created:%Y%m%d}_{secrets.token_hex(3)}"
        while kid is None and SIGNING_PREFIX + name in taken:
            name = f"{created:%Y%m%d}_{secrets.token_hex(3)}"
        if SIGNING_PREFIX + name in taken:
            raise KeysFileError([f"signing key {SIGNING_PREFIX}{name} already exists"])
        chosen.append(name)
        return append_line(raw, signing_key_line(name, algorithm, created))

    updated = update_keys_file(path, change, create=True)
    return next(k for k in updated.signing_keys if k.kid == chosen[0])


def cmd_keys_add_signing_key(args: argparse.Namespace) -> int:
    """``keys add-signing-key``: append a JWT key; for EdDSA also print its public half."""

    def body(path: str) -> int:
        key = _add_signing_key(path, args.alg, args.kid)
        _say(
            f"added {key.algorithm} signing key {SIGNING_PREFIX}{key.kid} "
            f"(fingerprint {key.fingerprint}) to {path}; `token issue` now signs with it",
            _RELOAD_NOTE,
        )
        if key.algorithm == "EdDSA":
            public = key.verification_key.public_bytes(  # type: ignore[union-attr]
                Encoding.Raw, PublicFormat.Raw
            )
            _say(
                "Verify-only line for other gateways: "
                f"{SIGNING_PREFIX}{key.kid}=ed25519-pub:{b64url_encode(public)}"
            )
        return 0

    return _run(args, body)


def cmd_token_issue(args: argparse.Namespace) -> int:
    """``token issue``: a JWT for ``--tenant`` signed with the newest signing key."""

    def body(path: str) -> int:
        max_ttl = _settings(args).auth.jwt_max_ttl_s
        if args.ttl > max_ttl:
            return _report([f"--ttl {args.ttl} exceeds auth.jwt_max_ttl_s ({max_ttl:g} s)"])
        key = load_keys_file(path).newest_signing_key()
        if key is None:
            key = _add_signing_key(path, "HS256", None)
            _say(
                f"no signing key in {path}; created HS256 key {SIGNING_PREFIX}{key.kid} "
                f"(fingerprint {key.fingerprint})",
                "The running gateway accepts tokens signed with it within 2 s.",
            )
        token = issue_token(key, args.tenant, args.ttl)
        expires = datetime.now(timezone.utc) + timedelta(seconds=args.ttl)
        _say(f"token for tenant {args.tenant}, kid {key.kid}, expires {format_timestamp(expires)}")
        print(token, flush=True)
        return 0

    return _run(args, body)
