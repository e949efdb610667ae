"""The gateway's TOML configuration: defaults, validation naming key and value, tenants."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.auth import issue_token
from gateway.config import (
    DEFAULT_TENANT,
    UNKNOWN_TENANT,
    ConfigError,
    Settings,
    listener_problem,
    load_settings,
    parse_settings,
    valid_tenant_name,
)
from gateway.credentials import KeysFileError, b64url_encode
from gateway.keys_file import load_keys_file

pytestmark = pytest.mark.fast


def test_a_missing_file_means_every_default(tmp_path: Path) -> None:
    """No file at the path: all defaults, no error."""
    settings = load_settings(tmp_path / "absent.toml")
    assert settings.server == Settings().server and settings.engine == Settings().engine


def test_a_file_is_read_and_its_source_kept(tmp_path: Path) -> None:
    """A TOML file's values are applied and the settings remember where they came from."""
    path = tmp_path / "gw.toml"
    path.write_text('[model]\nalias = "q"\n[engine]\nmax_concurrency = 3\n')
    settings = load_settings(path)
    assert settings.model.alias == "q" and settings.engine.max_concurrency == 3
    assert settings.source == str(path)


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    """A file that is not TOML fails with `ConfigError`."""
    path = tmp_path / "gw.toml"
    path.write_text("[engine\n")
    with pytest.raises(ConfigError):
        load_settings(path)


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"nope": {}}, "[nope]"),
        ({"engine": {"sockett": "x"}}, "engine.sockett"),
        ({"engine": {"max_concurrency": "2"}}, "engine.max_concurrency"),
        ({"engine": {"max_concurrency": True}}, "engine.max_concurrency"),
        ({"engine": {"max_concurrency": 0}}, "engine.max_concurrency = 0"),
        ({"engine": {"read_timeout_s": float("nan")}}, "engine.read_timeout_s"),
        ({"tenants": {"acme": {"rpm": -1}}}, "tenants.acme.rpm = -1"),
        ({"tenants": {"bad name": {}}}, "tenants.bad name"),
        ({"tenants": {UNKNOWN_TENANT: {}}}, f"tenants.{UNKNOWN_TENANT}"),
        ({"tenants": {"sk-bratislava": {}}}, "shaped like a credential"),
        ({"tenants": {"x_sk-proj-abcdefgh": {}}}, "tenants.x_sk-proj-abcdefgh"),
        ({"model": {"alias": ""}}, "model.alias"),
    ],
)
def test_a_bad_value_fails_naming_its_key(data: dict[str, object], named: str) -> None:
    """Unknown sections and keys, wrong types, out-of-range values and bad tenant names fail
    at load with a message naming the key (and the value)."""
    with pytest.raises(ConfigError) as caught:
        parse_settings(data)
    assert named in str(caught.value)


@pytest.mark.parametrize(
    "name", ["sk-bratislava", "x_sk-proj-abcdefgh", "eyJa.eyJb", "t.eyJhbGc.eyJzd.x"]
)
def test_tenant_names_shaped_like_credentials_are_refused_everywhere(
    tmp_path: Path, name: str
) -> None:
    """A tenant name a log line would redact (an ``sk-`` key's shape, a JWT's) is refused in
    ``[tenants.*]``, on a keys file line and in a token's claims, so no access line reads
    ``tenant: [redacted]`` for a configured tenant; names that merely contain ``sk-`` pass."""
    assert not valid_tenant_name(name)
    keys = tmp_path / "keys.env"
    signing = f"JWT_k1=hs256:{b64url_encode(b'j' * 32)}\n"
    keys.write_text(f"KEY_X={name}:sk-q38-{'x' * 32}\n{signing}")
    keys.chmod(0o600)
    with pytest.raises(KeysFileError, match="invalid tenant name"):
        load_keys_file(keys)
    keys.write_text(signing)
    with pytest.raises(ValueError, match="invalid tenant name"):
        issue_token(load_keys_file(keys).signing_keys[0], name, 60)
    for fine in ("disk-images", "task-runner-1", "sk-short", "risk-team", "monkeyJobs.eu"):
        assert valid_tenant_name(fine)


def test_tenants_inherit_the_default_table() -> None:
    """A tenant table overrides only what it sets; the rest comes from ``[tenants.default]``."""
    settings = parse_settings({"tenants": {"default": {"rpm": 7, "tpm": 9000}, "acme": {"rpm": 3}}})
    acme = settings.tenant("acme")
    assert (acme.name, acme.rpm, acme.tpm) == ("acme", 3, 9000)


def test_an_unconfigured_tenant_gets_the_default_limits_under_its_own_name() -> None:
    """A tenant named by a key but absent from the config runs with the default limits."""
    settings = parse_settings({"tenants": {"default": {"rpm": 5}}})
    other = settings.tenant("zeta")
    assert (other.name, other.rpm) == ("zeta", 5)


def test_tenant_labels_are_bounded_by_the_config() -> None:
    """Metric labels: configured tenants as is, any other ``default``, none ``unknown``."""
    settings = parse_settings({"tenants": {"acme": {}}})
    assert settings.tenant_label("acme") == "acme"
    assert settings.tenant_label("zeta") == DEFAULT_TENANT
    assert settings.tenant_label(None) == UNKNOWN_TENANT
    assert set(settings.tenant_labels()) == {"acme", DEFAULT_TENANT, UNKNOWN_TENANT}


def test_metrics_never_share_the_public_port() -> None:
    """The metrics listener on the public port is refused."""
    with pytest.raises(ConfigError, match=r"metrics\.port"):
        parse_settings({"server": {"port": 9000}, "metrics": {"port": 9000}})


def test_plain_http_off_loopback_is_a_listener_problem() -> None:
    """A public listener off loopback without TLS needs ``server.plain_http`` to be chosen."""
    exposed = parse_settings({"server": {"host": "0.0.0.0"}})
    assert listener_problem(exposed) is not None
    chosen = parse_settings({"server": {"host": "0.0.0.0", "plain_http": True}})
    assert listener_problem(chosen) is None
    assert listener_problem(parse_settings({"server": {"host": "127.0.0.1"}})) is None
