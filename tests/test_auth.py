"""Credential check: API keys (plaintext, hashed, expiry) and JWTs, including every forgery."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from datetime import datetime, timezone
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from gateway.auth import (
    MAX_REVOKED_KIDS,
    MAX_SUBJECT_CHARS,
    Authenticator,
    Principal,
    bounded_subject,
    issue_token,
    revoked_kids,
)
from gateway.credentials import KeySet, b64url_encode, parse_keys
from gateway.errors import InvalidApiKey
from gateway.metrics import AUTH_FAILURE_REASONS

pytestmark = pytest.mark.fast

NOW = 1_800_000_000.0
PLAIN = "sk-q38-plainplainplainplainplainpla"
HASHED = "sk-q38-hashedhashedhashedhashedhash"
EXPIRING = "sk-q38-expiringexpiringexpiringexpi"
HS_RAW = bytes(range(100, 132))
ED_PRIVATE = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
ED_PUBLIC_RAW = ED_PRIVATE.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
ED_SEED = ED_PRIVATE.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def keyset(*extra: str) -> KeySet:
    """A key set with one plaintext key, one hashed key, one expiring key and two signing keys."""
    lines = [
        f"plain=acme:{PLAIN}",
        f"hashed=beta:sha256:{hashlib.sha256(HASHED.encode()).hexdigest()}",
        f"expiring=acme:{EXPIRING}:expires=2027-01-15T08:00:00Z",
        f"JWT_hs=hs256:{b64url_encode(HS_RAW)}",
        f"JWT_ed=ed25519:{b64url_encode(ED_SEED)}",
        *extra,
    ]
    return parse_keys("\n".join(lines).encode(), "k")


def auth(keys: KeySet | None = None, now: float = NOW) -> Authenticator:
    """An authenticator on ``keys`` with a fixed clock at ``now``."""
    return Authenticator(keys or keyset(), leeway_s=30, max_ttl_s=3600, clock=lambda: now)


def reason(authenticator: Authenticator, header: str | None) -> str:
    """The failure reason for ``header``; fails the test if it authenticates."""
    with pytest.raises(InvalidApiKey) as caught:
        authenticator.authenticate(header)
    assert caught.value.reason in AUTH_FAILURE_REASONS
    return caught.value.reason


def b64(data: Any) -> str:
    """Base64url (no padding) of bytes or of compact JSON."""
    if not isinstance(data, bytes):
        data = json.dumps(data, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def claims(**overrides: Any) -> dict[str, Any]:
    """Valid claims for tenant acme at NOW, with ``overrides`` (None removes a claim)."""
    base: dict[str, Any] = {"sub": "acme", "iat": int(NOW), "exp": int(NOW) + 600}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def hs_token(payload: dict[str, Any], *, kid: str = "hs", secret: bytes = HS_RAW) -> str:
    """An HS256 token signed with ``secret``."""
    return jwt.encode(payload, secret, algorithm="HS256", headers={"kid": kid})


def ed_token(payload: dict[str, Any], *, kid: str = "ed", key: Any = ED_PRIVATE) -> str:
    """An EdDSA token signed with ``key``."""
    return jwt.encode(payload, key, algorithm="EdDSA", headers={"kid": kid})


def test_plaintext_and_hashed_keys_authenticate() -> None:
    """Both key forms map to their tenant and key id; the scheme is case-insensitive."""
    checker = auth()
    assert checker.authenticate(f"Bearer {PLAIN}") == Principal("acme", "plain", "key")
    assert checker.authenticate(f"bearer {HASHED}") == Principal("beta", "hashed", "key")
    assert checker.authenticate(f"  BEARER   {HASHED}  ").key_id == "hashed"


def test_key_failures_have_bounded_reasons() -> None:
    """Missing, malformed and unknown credentials each get their own reason."""
    checker = auth()
    assert reason(checker, None) == "missing"
    assert reason(checker, "   ") == "missing"
    assert reason(checker, f"Basic {PLAIN}") == "malformed"
    assert reason(checker, "Bearer") == "malformed"
    assert reason(checker, "Bearer ") == "malformed"
    assert reason(checker, f"Bearer {PLAIN} extra") == "malformed"
    assert reason(checker, "Bearer " + "a" * 9000) == "malformed"
    assert reason(checker, "Bearer sk-q38-nosuchkeynosuchkeynosuchkeyno") == "unknown"
    assert reason(checker, f"Bearer {PLAIN[:-1]}") == "unknown"
    assert reason(checker, "Bearer not.a.jwt") == "unknown"


def test_expired_key_is_refused_from_its_expiry_instant() -> None:
    """A key works until its expires instant and fails with reason expired from then on."""
    expiry = datetime(2027, 1, 15, 8, tzinfo=timezone.utc).timestamp()
    assert auth(now=expiry - 1).authenticate(f"Bearer {EXPIRING}").key_id == "expiring"
    assert reason(auth(now=expiry), f"Bearer {EXPIRING}") == "expired"


def test_every_failure_has_the_same_client_message_and_no_secret() -> None:
    """Whatever the reason, the 401 body is identical and never contains the credential."""
    checker = auth()
    bodies = set()
    for header in (None, "Basic x", f"Bearer {PLAIN}x", f"Bearer {hs_token(claims(exp=1))}"):
        with pytest.raises(InvalidApiKey) as caught:
            checker.authenticate(header)
        body = caught.value.json_bytes().decode()
        assert caught.value.status == 401
        assert PLAIN not in body and "eyJ" not in body
        bodies.add(body)
    assert len(bodies) == 1


def test_hs256_and_eddsa_tokens_authenticate() -> None:
    """Valid tokens map sub to the tenant and the kid to the key id."""
    checker = auth()
    assert checker.authenticate(f"Bearer {hs_token(claims())}") == Principal(
        "acme", "jwt:hs", "jwt", "acme"
    )
    assert checker.authenticate(f"Bearer {ed_token(claims(sub='beta'))}") == Principal(
        "beta", "jwt:ed", "jwt", "beta"
    )


def test_issue_token_round_trip() -> None:
    """Tokens from issue_token (what `token issue` prints) verify with the same key set."""
    keys = keyset()
    for signing in keys.signing_keys:
        token = issue_token(signing, "acme", 600, now=NOW)
        principal = auth(keys).authenticate(f"Bearer {token}")
        assert principal == Principal("acme", f"jwt:{signing.kid}", "jwt", "acme")


def test_forgery_alg_none() -> None:
    """An unsigned token (alg none) is refused, with or without a known kid."""
    for header in ({"alg": "none", "kid": "hs"}, {"alg": "none", "kid": "ed"}, {"alg": "none"}):
        token = f"{b64(header)}.{b64(claims())}."
        assert reason(auth(), f"Bearer {token}") in ("bad_algorithm", "unknown_kid")
    assert reason(auth(), f"Bearer {b64({'alg': 'none', 'kid': 'hs'})}.{b64(claims())}.") == (
        "bad_algorithm"
    )


def test_forgery_swapped_claims() -> None:
    """Changing sub without re-signing breaks the signature (HS256 and EdDSA)."""
    for token in (hs_token(claims()), ed_token(claims())):
        head, _, rest = token.partition(".")
        signature = rest.partition(".")[2]
        forged = f"{head}.{b64(claims(sub='beta'))}.{signature}"
        assert reason(auth(), f"Bearer {forged}") == "bad_signature"


def test_forgery_bad_signature() -> None:
    """Tokens signed with another secret or another Ed25519 key under a known kid are refused."""
    assert reason(auth(), f"Bearer {hs_token(claims(), secret=bytes(32))}") == "bad_signature"
    other = Ed25519PrivateKey.generate()
    assert reason(auth(), f"Bearer {ed_token(claims(), key=other)}") == "bad_signature"


def test_forgery_hs256_signed_with_the_public_key() -> None:
    """HS256 with the Ed25519 public key (raw or PEM) as HMAC secret under the Ed25519 kid fails."""
    pem = ED_PRIVATE.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    for secret in (ED_PUBLIC_RAW, pem):
        signing_input = f"{b64({'alg': 'HS256', 'typ': 'JWT', 'kid': 'ed'})}.{b64(claims())}"
        mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
        assert reason(auth(), f"Bearer {signing_input}.{b64(mac)}") == "bad_algorithm"


def test_forgery_algorithm_other_than_the_keys() -> None:
    """An HS512 or EdDSA header on an HS256 key is refused before any verification."""
    token = jwt.encode(claims(), HS_RAW * 2, algorithm="HS512", headers={"kid": "hs"})
    assert reason(auth(), f"Bearer {token}") == "bad_algorithm"
    assert reason(auth(), f"Bearer {ed_token(claims(), kid='hs')}") == "bad_algorithm"


def test_forgery_unknown_or_missing_kid() -> None:
    """A kid not in the keys file, or none at all, is refused."""
    assert reason(auth(), f"Bearer {hs_token(claims(), kid='gone')}") == "unknown_kid"
    no_kid = jwt.encode(claims(), HS_RAW, algorithm="HS256")
    assert reason(auth(), f"Bearer {no_kid}") == "unknown_kid"


def test_expired_token_with_leeway() -> None:
    """exp in the past fails once beyond the 30 s leeway; within it the token still works."""
    token = hs_token(claims(iat=int(NOW) - 600, exp=int(NOW) - 20))
    assert auth().authenticate(f"Bearer {token}").tenant == "acme"
    expired = hs_token(claims(iat=int(NOW) - 600, exp=int(NOW) - 31))
    assert reason(auth(), f"Bearer {expired}") == "expired"


def test_not_yet_valid_token() -> None:
    """nbf or iat in the future beyond the leeway fails; within it the token works."""
    assert auth().authenticate(f"Bearer {hs_token(claims(nbf=int(NOW) + 20))}")
    assert reason(auth(), f"Bearer {hs_token(claims(nbf=int(NOW) + 60))}") == "bad_claims"
    late = claims(iat=int(NOW) + 60, exp=int(NOW) + 600)
    assert reason(auth(), f"Bearer {hs_token(late)}") == "bad_claims"


def test_required_claims_and_ttl() -> None:
    """exp, iat and sub are required; exp - iat above max_ttl and bad tenant names fail."""
    for bad in (
        claims(exp=None),
        claims(iat=None),
        claims(sub=None),
        claims(exp="tomorrow"),
        claims(exp=True),
        claims(exp=int(NOW) + 3601),
        claims(exp=int(NOW) - 1, iat=int(NOW)),
        claims(sub="no spaces allowed"),
        claims(sub=7),
    ):
        assert reason(auth(), f"Bearer {hs_token(bad)}") in ("bad_claims", "malformed")
    assert reason(auth(), f"Bearer {hs_token(claims(exp=None))}") == "bad_claims"
    assert reason(auth(), f"Bearer {hs_token(claims(exp=int(NOW) + 3601))}") == "bad_claims"
    assert auth().authenticate(f"Bearer {hs_token(claims(exp=int(NOW) + 3600))}")


def test_signing_key_rotation_keeps_old_tokens_until_removed() -> None:
    """After adding a key, tokens of both keys work; removing the old kid ends its tokens."""
    new_raw = bytes(range(200, 232))
    both = keyset(f"JWT_hs2=hs256:{b64url_encode(new_raw)}:created=2030-01-01")
    newest = both.newest_signing_key()
    assert newest is not None and newest.kid == "hs2"
    old_token = hs_token(claims())
    new_token = issue_token(newest, "acme", 600, now=NOW)
    assert auth(both).authenticate(f"Bearer {old_token}").key_id == "jwt:hs"
    assert auth(both).authenticate(f"Bearer {new_token}").key_id == "jwt:hs2"
    without_old = parse_keys(f"JWT_hs2=hs256:{b64url_encode(new_raw)}\n".encode())
    assert reason(auth(without_old), f"Bearer {old_token}") == "unknown_kid"
    assert auth(without_old).authenticate(f"Bearer {new_token}").key_id == "jwt:hs2"


def test_garbage_after_valid_header_is_malformed() -> None:
    """A known kid and right alg with an undecodable payload is malformed, not accepted."""
    header = b64({"alg": "HS256", "kid": "hs"})
    assert reason(auth(), f"Bearer {header}.!!!.sig") == "malformed"
    assert reason(auth(), f"Bearer {header}.e30.c2ln") == "bad_signature"


def test_verify_only_key_cannot_issue() -> None:
    """An ed25519-pub line verifies tokens but issue_token refuses to sign with it."""
    keys = keyset(f"JWT_pub=ed25519-pub:{b64url_encode(ED_PUBLIC_RAW)}")
    public_only = next(k for k in keys.signing_keys if k.kid == "pub")
    with pytest.raises(ValueError, match="verify-only"):
        issue_token(public_only, "acme", 60)
    token = ed_token(claims(), kid="pub")
    assert auth(keys).authenticate(f"Bearer {token}").key_id == "jwt:pub"


def test_reprs_hide_secrets() -> None:
    """Printing a key set or authenticator never shows key material."""
    keys = keyset("QWEN38_METRICS_TOKEN=metrics-secret-value")
    text = repr(keys) + repr(auth(keys).keys)
    for secret in (
        PLAIN,
        hashlib.sha256(HASHED.encode()).hexdigest(),
        b64url_encode(HS_RAW),
        "metrics-secret-value",
    ):
        assert secret not in text


def test_bounded_subject_is_short_and_plain() -> None:
    """A subject is cut to 128 characters and anything but plain characters becomes "_"."""
    assert bounded_subject("customer-42@example.com") == "customer-42@example.com"
    assert bounded_subject('a"b\nc d') == "a_b_c_d"
    assert len(bounded_subject("x" * 1000)) == MAX_SUBJECT_CHARS


def test_removed_signing_key_is_revoked_and_the_list_is_bounded() -> None:
    """A kid removed by a reload is refused as revoked, a kid never loaded as unknown_kid; a kid
    loaded again is forgotten, and at most MAX_REVOKED_KIDS are kept, the oldest dropped."""
    first = auth()
    without_hs = parse_keys(f"JWT_ed=ed25519:{b64url_encode(ED_SEED)}\n".encode(), "k")
    second = Authenticator(
        without_hs, clock=lambda: NOW, revoked_kids=revoked_kids(first, without_hs)
    )
    assert second.revoked_kids == ("hs",)
    assert reason(second, f"Bearer {hs_token(claims())}") == "revoked"
    assert reason(second, f"Bearer {hs_token(claims(), kid='gone')}") == "unknown_kid"
    assert second.authenticate(f"Bearer {ed_token(claims())}").key_id == "jwt:ed"
    again = keyset()
    assert revoked_kids(second, again) == ()
    many = tuple(f"k{n}" for n in range(MAX_REVOKED_KIDS))
    full = Authenticator(keyset(), revoked_kids=many)
    kept = revoked_kids(full, without_hs)
    assert len(kept) == MAX_REVOKED_KIDS and kept[-1] == "hs" and kept[0] == "k1"
