"""Keys file: parsing both key forms, signing keys, settings, every problem with its line, writes."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest

from gateway.credentials import KeysFileError, b64url_encode, parse_keys, parse_timestamp
from gateway.keys_file import (
    append_line,
    check_keys_file,
    load_keys_file,
    remove_line,
    update_keys_file,
)

pytestmark = pytest.mark.fast

PLAIN = "sk-q38-handtypedhandtypedhandtyped"
HASHED_SECRET = "sk-q38-0123456789abcdefghijABCDEFGHIJ"
HASHED_HEX = hashlib.sha256(HASHED_SECRET.encode()).hexdigest()
HS_SECRET = b64url_encode(bytes(range(32)))
ED_SEED = b64url_encode(bytes(range(32, 64)))


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    """Write ``text`` to ``path`` with ``mode``."""
    path.write_text(text)
    path.chmod(mode)
    return path


def problems_of(text: str) -> list[str]:
    """The problems `parse_keys` reports for ``text`` (source ``k``)."""
    with pytest.raises(KeysFileError) as caught:
        parse_keys(text.encode(), "k")
    return caught.value.problems


def test_plaintext_and_hashed_forms_parse() -> None:
    """Both line forms yield keys with tenant, digest, created and expiry."""
    keys = parse_keys(
        (
            "# operators' keys\n"
            "\n"
            f"alice=acme:{PLAIN}\n"
            f"bob=beta:sha256:{HASHED_HEX}:created=2025-01-02T03:04:05Z:expires=2030-01-01\n"
            f'carol = "acme:{PLAIN}x:expires=2031-05-06T07:08:09+02:00"  # quoted, comment\n'
        ).encode(),
        "k",
    )
    alice, bob, carol = keys.api_keys
    assert (alice.key_id, alice.tenant, alice.hashed, alice.line) == ("alice", "acme", False, 3)
    assert alice.digest == hashlib.sha256(PLAIN.encode()).digest()
    assert alice.expires is None and alice.created is None
    assert (bob.tenant, bob.hashed, bob.digest.hex()) == ("beta", True, HASHED_HEX)
    assert bob.created == datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert bob.expires == datetime(2030, 1, 1, tzinfo=timezone.utc)
    assert carol.expires == datetime(2031, 5, 6, 5, 8, 9, tzinfo=timezone.utc)
    assert bob.fingerprint == HASHED_HEX[:8]
    assert keys.key_count == 3


def test_signing_keys_and_settings_parse() -> None:
    """JWT_<kid> lines become signing keys; QWEN38_* lines become settings."""
    pub = "ed25519-pub:" + b64url_encode(bytes(32))
    keys = parse_keys(
        (
            f"JWT_old=hs256:{HS_SECRET}:created=2025-01-01\n"
            f"JWT_new=ed25519:{ED_SEED}:created=2025-06-01\n"
            f"JWT_partner={pub}:created=2026-01-01\n"
            "QWEN38_METRICS_TOKEN=scrape-token\n"
        ).encode(),
        "k",
    )
    assert [(k.kid, k.algorithm) for k in keys.signing_keys] == [
        ("old", "HS256"),
        ("new", "EdDSA"),
        ("partner", "EdDSA"),
    ]
    assert keys.signing_keys[2].signing_key is None
    newest = keys.newest_signing_key()
    assert newest is not None and newest.kid == "new"
    assert keys.setting("QWEN38_METRICS_TOKEN") == "scrape-token"
    assert keys.setting("QWEN38_CACHE_SALT_SECRET") is None
    assert keys.key_count == 0


def test_newest_signing_key_without_created_is_the_last_line() -> None:
    """Without created stamps, the later line is the newer key."""
    keys = parse_keys(f"JWT_a=hs256:{HS_SECRET}\nJWT_b=ed25519:{ED_SEED}\n".encode())
    newest = keys.newest_signing_key()
    assert newest is not None and newest.kid == "b"


def test_every_problem_is_reported_with_its_line() -> None:
    """Each bad line yields one problem naming its line; good lines do not."""
    text = "\n".join(
        [
            "# header",  # 1
            "just-a-secret-pasted-alone",  # 2
            "bad-name=acme:" + PLAIN,  # 3
            "k1=acme",  # 4
            "k2=not a tenant:" + PLAIN,  # 5
            "k3=acme:short",  # 6
            "k4=acme:sha256:abc",  # 7
            f"k5=acme:{PLAIN}:expires=tomorrow",  # 8
            f"k6=acme:{PLAIN}:colour=blue",  # 9
            f"k7=acme:{PLAIN}",  # 10 same secret as nothing before: fine
            f"k8=acme:{PLAIN}",  # 11 same secret as line 10
            f"k7=beta:{HASHED_SECRET}",  # 12 duplicate name
            "JWT_a=hs256:c2hvcnQ",  # 13 too short for HS256
            "JWT_b=rsa:abc",  # 14 unknown kind
            "JWT_c=ed25519:!!!",  # 15 not base64url
            "QWEN38_METRICS_TOKN=x",  # 16 unknown setting
            'k9="acme:' + PLAIN,  # 17 unbalanced quote
            "k10=",  # 18 empty
            f"k11=acme:{PLAIN}:expires=2030-01-01:expires=2031-01-01",  # 19
            f"JWT_d=hs256:{HS_SECRET}:expires=2030-01-01",  # 20
        ]
    )
    found = problems_of(text)
    lines = [int(p.split(":")[1]) for p in found]
    assert lines == [2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert all(p.startswith("k:") for p in found)
    assert "same secret as line 10" in found[8]
    assert "duplicate name k7 (first at line 10)" in found[9]


def test_problems_never_echo_secrets_or_rejected_text() -> None:
    """A secret in the wrong place (name, tenant, lone line) never appears in a problem."""
    secret = "sk-q38-LEAKLEAKLEAKLEAKLEAKLEAKLEAKLEAK"
    text = f"{secret}\n{secret}=acme:x\nk={secret}:acme\nk2=acme:sha256:{secret}\n"
    found = problems_of(text)
    assert len(found) == 4
    assert not any("LEAK" in p for p in found)


def test_crlf_bom_and_export_prefix_are_accepted() -> None:
    """Files saved on Windows or written for a shell still parse."""
    keys = parse_keys(f"\ufeffexport alice=acme:{PLAIN}\r\n# c\r\n".encode())
    assert keys.api_keys[0].key_id == "alice"


def test_invalid_utf8_is_a_problem() -> None:
    """Bytes that are not UTF-8 are reported on their line."""
    with pytest.raises(KeysFileError) as caught:
        parse_keys(b"# ok\nk=acme:\xff\xfe\n", "k")
    assert caught.value.problems == ["k:2: not valid UTF-8"]


def test_timestamps() -> None:
    """Bare dates are 00:00 UTC, naive times are UTC, offsets are converted."""
    assert parse_timestamp("2026-02-03") == datetime(2026, 2, 3, tzinfo=timezone.utc)
    assert parse_timestamp("2026-02-03T04:05:06") == datetime(
        2026, 2, 3, 4, 5, 6, tzinfo=timezone.utc
    )
    assert parse_timestamp("2026-02-03T04:05:06-01:00").hour == 5
    with pytest.raises(ValueError):
        parse_timestamp("soon")


def test_load_refuses_group_or_world_access(tmp_path: Path) -> None:
    """A keys file with any group/other bit fails with a chmod hint; 0600 and 0400 load."""
    path = write(tmp_path / "keys.env", f"alice=acme:{PLAIN}\n", 0o640)
    with pytest.raises(KeysFileError) as caught:
        load_keys_file(path)
    assert caught.value.problems == [
        f"{path}: mode 0640 gives group/others access; run: chmod 600 {path}"
    ]
    assert check_keys_file(path) == caught.value.problems
    assert load_keys_file(path, check_mode=False).key_count == 1
    path.chmod(0o400)
    assert load_keys_file(path).key_count == 1
    assert check_keys_file(path) == []


def test_load_missing_file(tmp_path: Path) -> None:
    """A missing keys file is a problem naming the path."""
    missing = tmp_path / "nope.env"
    assert check_keys_file(missing) == [f"{missing}: no such file"]


def test_load_reports_source_path_in_problems(tmp_path: Path) -> None:
    """Problems from a file carry its path and line number."""
    path = write(tmp_path / "keys.env", "# c\nbroken\n")
    assert check_keys_file(path) == [f"{path}:2: expected NAME=VALUE"]


def test_update_keeps_other_bytes_mode_and_replaces_by_rename(tmp_path: Path) -> None:
    """A write keeps comments/odd spacing byte for byte, stays 0600 and swaps the inode."""
    original = (
        "# keys for prod\n\n"
        f"alice = acme:{PLAIN}   # Alice's laptop\n"
        f"bob=beta:sha256:{HASHED_HEX}\n"
        "   # indented comment, no final newline"
    )
    path = write(tmp_path / "keys.env", original)
    inode = path.stat().st_ino
    new_line = f"carol=acme:{PLAIN}zz"
    updated = update_keys_file(path, lambda raw, _keys: append_line(raw, new_line))
    assert path.read_text() == original + "\n" + new_line + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_ino != inode
    assert updated.key_count == 3
    update_keys_file(path, lambda raw, keys: remove_line(raw, keys.api_keys[1].line))
    assert path.read_text() == original.replace(f"bob=beta:sha256:{HASHED_HEX}\n", "") + (
        "\n" + new_line + "\n"
    )
    assert sorted(os.listdir(tmp_path)) == ["keys.env"]


def test_update_creates_missing_file_0600(tmp_path: Path) -> None:
    """With create=True a missing file is made with mode 0600 before writing."""
    path = tmp_path / "new.env"
    previous = os.umask(0o002)
    try:
        update_keys_file(path, lambda raw, _k: append_line(raw, f"a=acme:{PLAIN}"), create=True)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == f"a=acme:{PLAIN}\n"


def test_update_refuses_loose_mode_and_invalid_results(tmp_path: Path) -> None:
    """A group-readable file is not written; a change producing a bad file is not written."""
    path = write(tmp_path / "keys.env", f"a=acme:{PLAIN}\n", 0o644)
    with pytest.raises(KeysFileError, match="chmod 600"):
        update_keys_file(path, lambda raw, _k: raw + b"b=x\n")
    assert path.read_text() == f"a=acme:{PLAIN}\n"
    path.chmod(0o600)
    with pytest.raises(KeysFileError, match=":2: expected NAME=VALUE"):
        update_keys_file(path, lambda raw, _k: raw + b"garbage\n")
    assert path.read_text() == f"a=acme:{PLAIN}\n"
    assert sorted(os.listdir(tmp_path)) == ["keys.env"]


def test_update_refuses_a_broken_file(tmp_path: Path) -> None:
    """An existing invalid file is reported, not rewritten."""
    path = write(tmp_path / "keys.env", "garbage\n")
    with pytest.raises(KeysFileError, match=":1: expected NAME=VALUE"):
        update_keys_file(path, lambda raw, _k: raw)


def test_concurrent_updates_lose_nothing(tmp_path: Path) -> None:
    """Writers in parallel threads all land: the lock follows the renamed file."""
    path = write(tmp_path / "keys.env", "# start\n")
    errors: list[BaseException] = []

    def add(index: int) -> None:
        try:
            secret = f"sk-q38-concurrent-writer-{index:04d}"
            update_keys_file(path, lambda raw, _k: append_line(raw, f"k{index}=acme:{secret}"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert load_keys_file(path).key_count == 12
