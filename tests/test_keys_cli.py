"""The keys and token subcommands: add, list, revoke, signing keys, token issue, file safety."""

from __future__ import annotations

import argparse
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.auth import Authenticator
from gateway.errors import InvalidApiKey
from gateway.keys_cli import add_subcommands
from gateway.keys_file import load_keys_file

REPO = Path(__file__).resolve().parent.parent
SECRET_RE = re.compile(r"sk-q38-[0-9A-Za-z]{32}")
PLAIN = "sk-q38-handtypedhandtypedhandtyped"
HEADER = "# production keys\n# owner: ops\n\nhand=acme:" + PLAIN + "   # typed by hand\n"


def run(*argv: str) -> int:
    """Run one subcommand in-process through `add_subcommands`; its exit code."""
    parser = argparse.ArgumentParser(prog="qwen38-gateway")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return int(args.func(args))


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    """A 0600 keys file with comments and one hand-typed key."""
    path = tmp_path / "keys.env"
    path.write_text(HEADER)
    path.chmod(0o600)
    return path


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`run` with captured output."""
    code = run(*argv)
    out, err = capsys.readouterr()
    return code, out, err


def authenticate(path: Path, credential: str) -> str:
    """The key id the file's keys give ``credential``, or the failure reason."""
    try:
        return Authenticator(load_keys_file(path)).authenticate(f"Bearer {credential}").key_id
    except InvalidApiKey as exc:
        return f"refused:{exc.reason}"


def test_add_prints_secret_alone_and_stores_only_a_hash(
    capsys: pytest.CaptureFixture[str], keys_file: Path
) -> None:
    """keys add: the secret is stdout's only line, the file holds its hash, old bytes are kept."""
    code, out, err = cli(capsys, "keys", "add", "--tenant", "acme", "--keys-file", str(keys_file))
    assert code == 0
    secret = out.splitlines()[-1]
    assert out == secret + "\n" and SECRET_RE.fullmatch(secret)
    text = keys_file.read_text()
    assert text.startswith(HEADER)
    assert secret not in text and secret not in err
    key_id = authenticate(keys_file, secret)
    assert key_id.startswith("key_acme_") and key_id in err
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600


def test_add_with_expiry_and_custom_id(capsys: pytest.CaptureFixture[str], keys_file: Path) -> None:
    """--expires is stored as a UTC instant; --id names the key; a taken id is refused."""
    f = str(keys_file)
    code, out, _ = cli(
        capsys,
        "keys",
        "add",
        "--tenant",
        "beta",
        "--id",
        "ci_bot",
        "--expires",
        "2099-01-02T03:04:05+01:00",
        "--keys-file",
        f,
    )
    assert code == 0
    (key,) = [k for k in load_keys_file(keys_file).api_keys if k.key_id == "ci_bot"]
    assert key.expires is not None and key.expires.isoformat() == "2099-01-02T02:04:05+00:00"
    assert ":expires=2099-01-02T02:04:05Z" in keys_file.read_text()
    code, out, err = cli(
        capsys, "keys", "add", "--tenant", "beta", "--id", "ci_bot", "--keys-file", f
    )
    assert (code, out) == (1, "")
    assert "key id ci_bot already exists" in err


def test_add_rejects_bad_arguments(keys_file: Path) -> None:
    """Bad tenant names, past expiries and reserved ids are usage errors; the file is untouched."""
    for argv in (
        ["--tenant", "no spaces"],
        ["--tenant", "acme", "--expires", "2001-01-01"],
        ["--tenant", "acme", "--expires", "whenever"],
        ["--tenant", "acme", "--id", "JWT_x"],
    ):
        with pytest.raises(SystemExit) as caught:
            run("keys", "add", *argv, "--keys-file", str(keys_file))
        assert caught.value.code == 2
    assert keys_file.read_text() == HEADER


def test_list_shows_fingerprints_never_secrets(
    capsys: pytest.CaptureFixture[str], keys_file: Path
) -> None:
    """keys list: id, tenant, created, expires, fingerprint for both forms; no secret or hash."""
    _, out, _ = cli(
        capsys, "keys", "add", "--tenant", "beta", "--expires", "90d", "--keys-file", str(keys_file)
    )
    secret = out.strip()
    code, listing, _ = cli(capsys, "keys", "list", "--keys-file", str(keys_file))
    assert code == 0
    keys = load_keys_file(keys_file).api_keys
    rows = listing.splitlines()
    assert rows[0].split() == ["ID", "TENANT", "CREATED", "EXPIRES", "FINGERPRINT", "FORM", "STATE"]
    assert rows[1].split() == [
        "hand",
        "acme",
        "-",
        "never",
        keys[0].fingerprint,
        "plaintext",
        "active",
    ]
    assert rows[2].split()[1] == "beta" and keys[1].fingerprint in rows[2]
    assert PLAIN not in listing and secret not in listing and keys[1].digest.hex() not in listing


def test_revoke_removes_only_that_line(capsys: pytest.CaptureFixture[str], keys_file: Path) -> None:
    """keys revoke: the key stops authenticating; every other byte of the file stays."""
    _, out, _ = cli(capsys, "keys", "add", "--tenant", "acme", "--keys-file", str(keys_file))
    secret = out.strip()
    before = keys_file.read_text()
    assert cli(capsys, "keys", "revoke", "hand", "--keys-file", str(keys_file))[0] == 0
    assert keys_file.read_text() == before.replace(f"hand=acme:{PLAIN}   # typed by hand\n", "")
    assert authenticate(keys_file, PLAIN) == "refused:unknown"
    assert authenticate(keys_file, secret).startswith("key_acme_")
    code, _, err = cli(capsys, "keys", "revoke", "hand", "--keys-file", str(keys_file))
    assert code == 1 and "no key hand" in err


def test_writes_refuse_a_group_readable_file(
    capsys: pytest.CaptureFixture[str], keys_file: Path
) -> None:
    """A keys file with group/other access is not written to; the message says how to fix it."""
    keys_file.chmod(0o644)
    for argv in (
        ["keys", "add", "--tenant", "acme"],
        ["keys", "revoke", "hand"],
        ["token", "issue", "--tenant", "acme"],
    ):
        code, out, err = cli(capsys, *argv, "--keys-file", str(keys_file))
        assert (code, out) == (1, "")
        assert f"chmod 600 {keys_file}" in err
    assert keys_file.read_text() == HEADER


def test_token_issue_creates_a_signing_key_when_none(
    capsys: pytest.CaptureFixture[str], keys_file: Path
) -> None:
    """token issue: with no signing key one is created (said on stderr); the token verifies."""
    code, out, err = cli(
        capsys, "token", "issue", "--tenant", "acme", "--ttl", "600", "--keys-file", str(keys_file)
    )
    assert code == 0 and "created HS256 key" in err
    token = out.strip()
    assert out == token + "\n" and token.count(".") == 2 and token not in err
    keys = load_keys_file(keys_file)
    assert len(keys.signing_keys) == 1
    principal = Authenticator(keys).authenticate(f"Bearer {token}")
    assert (principal.tenant, principal.key_id) == ("acme", f"jwt:{keys.signing_keys[0].kid}")
    _, _, err = cli(capsys, "token", "issue", "--tenant", "acme", "--keys-file", str(keys_file))
    assert "created" not in err


def test_token_ttl_is_capped_by_config(
    capsys: pytest.CaptureFixture[str], keys_file: Path, tmp_path: Path
) -> None:
    """A --ttl above auth.jwt_max_ttl_s is refused (the gateway would reject the token)."""
    config = tmp_path / "gateway.toml"
    config.write_text(f'[auth]\nkeys_file = "{keys_file}"\njwt_max_ttl_s = 60\n')
    code, out, err = cli(
        capsys, "token", "issue", "--tenant", "acme", "--ttl", "61", "--config", str(config)
    )
    assert (code, out) == (1, "") and "jwt_max_ttl_s" in err
    code, out, _ = cli(
        capsys, "token", "issue", "--tenant", "acme", "--ttl", "60", "--config", str(config)
    )
    assert code == 0 and out.count(".") == 2


def test_signing_key_rotation(capsys: pytest.CaptureFixture[str], keys_file: Path) -> None:
    """New tokens use the newest key; old tokens work until their key is revoked."""
    f = str(keys_file)
    assert cli(capsys, "keys", "add-signing-key", "--kid", "first", "--keys-file", f)[0] == 0
    old = cli(capsys, "token", "issue", "--tenant", "acme", "--keys-file", f)[1].strip()
    code, _, err = cli(
        capsys, "keys", "add-signing-key", "--alg", "EdDSA", "--kid", "second", "--keys-file", f
    )
    assert code == 0 and "JWT_second=ed25519-pub:" in err
    new = cli(capsys, "token", "issue", "--tenant", "acme", "--keys-file", f)[1].strip()
    assert authenticate(keys_file, old) == "jwt:first"
    assert authenticate(keys_file, new) == "jwt:second"
    assert cli(capsys, "keys", "revoke", "JWT_first", "--keys-file", f)[0] == 0
    assert authenticate(keys_file, old) == "refused:unknown_kid"
    assert authenticate(keys_file, new) == "jwt:second"
    code, _, err = cli(capsys, "keys", "add-signing-key", "--kid", "second", "--keys-file", f)
    assert code == 1 and "already exists" in err


def test_keys_file_comes_from_the_config(
    capsys: pytest.CaptureFixture[str],
    keys_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without --keys-file, --config (or $QWEN38_GATEWAY_CONFIG) names the keys file."""
    config = tmp_path / "gateway.toml"
    config.write_text(f'[auth]\nkeys_file = "{keys_file}"\n')
    assert cli(capsys, "keys", "add", "--tenant", "acme", "--config", str(config))[0] == 0
    monkeypatch.setenv("QWEN38_GATEWAY_CONFIG", str(config))
    assert cli(capsys, "keys", "add", "--tenant", "beta")[0] == 0
    assert [k.tenant for k in load_keys_file(keys_file).api_keys] == ["acme", "acme", "beta"]


def test_new_file_is_created_0600(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """keys add on a missing file creates it with mode 0600 whatever the umask."""
    path = tmp_path / "fresh.env"
    previous = os.umask(0)
    try:
        assert cli(capsys, "keys", "add", "--tenant", "acme", "--keys-file", str(path))[0] == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_broken_file_is_reported_not_rewritten(
    capsys: pytest.CaptureFixture[str], keys_file: Path
) -> None:
    """Commands on an invalid file print each problem with its line and exit 1."""
    keys_file.write_text(HEADER + "oops\n")
    for argv in (["keys", "list"], ["keys", "add", "--tenant", "acme"], ["keys", "revoke", "hand"]):
        code, out, err = cli(capsys, *argv, "--keys-file", str(keys_file))
        assert (code, out) == (1, "")
        assert f"error: {keys_file}:5: expected NAME=VALUE" in err
    assert keys_file.read_text() == HEADER + "oops\n"


def test_round_trip_through_python_m_gateway(tmp_path: Path) -> None:
    """`python -m gateway`: add, list, token issue, revoke; secrets only on stdout's last line."""

    def gateway(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway", *argv, "--keys-file", str(tmp_path / "k.env")],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            check=False,
        )

    added = gateway("keys", "add", "--tenant", "acme", "--expires", "30d")
    assert added.returncode == 0, added.stderr
    secret = added.stdout.splitlines()[-1]
    assert SECRET_RE.fullmatch(secret) and secret not in added.stderr
    key_id = authenticate(tmp_path / "k.env", secret)
    listed = gateway("keys", "list")
    assert listed.returncode == 0 and key_id in listed.stdout and secret not in listed.stdout
    issued = gateway("token", "issue", "--tenant", "beta", "--ttl", "120")
    assert issued.returncode == 0 and "no signing key" in issued.stderr
    assert authenticate(tmp_path / "k.env", issued.stdout.splitlines()[-1]).startswith("jwt:")
    revoked = gateway("keys", "revoke", key_id)
    assert revoked.returncode == 0
    assert authenticate(tmp_path / "k.env", secret) == "refused:unknown"
    assert stat.S_IMODE((tmp_path / "k.env").stat().st_mode) == 0o600
