"""JSON-lines logging: format, levels, bound request ids, redaction, and the access line."""

from __future__ import annotations

import io
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from structlog.testing import LogCapture, capture_logs

from gateway.app import create_app
from gateway.auth import issue_token
from gateway.config import parse_settings
from gateway.credentials import b64url_encode
from gateway.keys_file import load_keys_file
from gateway.logs import (
    _SECRET_RE,
    REDACTED,
    _holds_secret,
    access_line,
    configure_logging,
    redact_secrets,
    set_level,
)
from gateway.metrics import Metrics
from gateway.upstream import EngineState
from tests.conftest import ALIAS, DEFAULT_KEYS, KEY_A, KEY_C, write_keys
from tests.inprocess import AUTH_A, chat_body, open_stack, sse_data

pytestmark = pytest.mark.fast

JWT = (
    "eyJhbGciOiJIUzI1NiIsImtpZCI6Im9icyJ9"
    ".eyJzdWIiOiJhY21lIiwiZXhwIjoxOTAwMDAwMDAwfQ"
    ".c2lnbmF0dXJlLWJ5dGVzLWhlcmUtMDEyMzQ1Njc4OQ"
)


@pytest.fixture
def output() -> Iterator[io.StringIO]:
    """`configure_logging` into a buffer; structlog and stdlib logging restored afterwards."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    access = logging.getLogger("aiohttp.access")
    access_disabled = access.disabled
    buffer = io.StringIO()
    yield buffer
    structlog.configure(**saved)
    root.handlers, root.level = handlers, level
    access.disabled = access_disabled


def lines(buffer: io.StringIO) -> list[dict[str, Any]]:
    """Every line of ``buffer`` parsed; fails unless each is one JSON object."""
    out = []
    for line in buffer.getvalue().splitlines():
        entry = json.loads(line)
        assert isinstance(entry, dict)
        out.append(entry)
    return out


@pytest.fixture
def captured() -> Iterator[list[MutableMapping[str, Any]]]:
    """Log entries as dicts with the bound context merged in (the request id), at any level."""
    saved = structlog.get_config()
    capture = LogCapture()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, capture],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
    )
    yield capture.entries
    structlog.configure(**saved)


# -------------------------------------------------------------------------------- the format


def test_each_line_is_a_json_object_with_event_level_logger_timestamp(
    output: io.StringIO,
) -> None:
    """A structlog call becomes one JSON line with its fields, level, module name and UTC time."""
    configure_logging("info", output)
    structlog.get_logger("gateway.test").info("something_happened", count=3, ok=True)
    (entry,) = lines(output)
    assert entry["event"] == "something_happened"
    assert (entry["count"], entry["ok"]) == (3, True)
    assert (entry["level"], entry["logger"]) == ("info", "gateway.test")
    assert entry["timestamp"].endswith("Z") and "T" in entry["timestamp"]
    assert output.getvalue().count("\n") == 1


@pytest.mark.parametrize(
    ("level", "shown"),
    [
        ("debug", ["d", "i", "w", "e"]),
        ("info", ["i", "w", "e"]),
        ("warning", ["w", "e"]),
        ("error", ["e"]),
    ],
)
def test_level_drops_lines_below_it(output: io.StringIO, level: str, shown: list[str]) -> None:
    """``[logging] level`` is the threshold: lower lines are dropped."""
    configure_logging(level, output)
    log = structlog.get_logger("gateway.test")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    assert [e["event"] for e in lines(output)] == shown


def test_the_access_line_is_the_line_structlog_would_write(output: io.StringIO) -> None:
    """`access_line` renders the request line itself: the same keys and values as structlog's
    chain (bound context, level, logger, UTC time, secrets masked), at the level's threshold."""
    configure_logging("info", output)
    structlog.contextvars.bind_contextvars(request_id="r-1")
    try:
        fields = {"method": "POST", "status": 200, "subject": f"Bearer {KEY_A}", "ms": 1.5}
        access_line(dict(fields))
        structlog.get_logger("gateway.access").info("request", **fields)
        access_line({"status": 502}, warning=True)
        set_level("warning")
        access_line({"status": 200})
        access_line({"status": 503}, warning=True)
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    ours, theirs, failed, shown = lines(output)
    assert KEY_A not in output.getvalue() and ours["subject"] == REDACTED
    del ours["timestamp"], theirs["timestamp"]
    assert ours == theirs
    assert (ours["event"], ours["logger"], ours["request_id"]) == (
        "request",
        "gateway.access",
        "r-1",
    )
    assert (failed["level"], failed["status"]) == ("warning", 502)
    assert (shown["level"], shown["status"]) == ("warning", 503)


_PIECES = st.sampled_from(
    ["sk-", "sk-q38-", "eyJ", ".", "Bearer", "bearer", " ", "\t", "\n", "\0", "=", "/", "-", "_"]
)
_TEXT = st.lists(
    st.one_of(_PIECES, st.text(alphabet="abcXYZ019+~", min_size=1, max_size=12)), max_size=8
).map("".join)


@given(
    st.dictionaries(
        st.text(max_size=5),
        st.one_of(_TEXT, st.integers(), st.lists(st.one_of(_TEXT, st.integers()), max_size=3)),
        max_size=6,
    )
)
def test_the_access_lines_one_search_finds_what_a_search_of_each_value_finds(
    fields: dict[str, Any],
) -> None:
    """The access line searches its values joined, once, before redacting them one by one: it
    must find a credential shape exactly when one of the values holds one, pieces of shapes
    across two values (``sk-`` ending one, a key's rest starting the next) included."""
    values = [
        item
        for value in fields.values()
        for item in (value if isinstance(value, list) else [value])
        if isinstance(item, str)
    ]
    assert _holds_secret(fields) == any(_SECRET_RE.search(value) for value in values)


def test_set_level_changes_only_the_threshold(output: io.StringIO) -> None:
    """A reload's new level applies to the next line; format and destination stay."""
    configure_logging("warning", output)
    log = structlog.get_logger("gateway.test")
    log.info("hidden")
    set_level("debug")
    log.debug("shown")
    logging.getLogger("asyncio").debug("library detail")
    set_level("error")
    log.warning("hidden too")
    logging.getLogger("asyncio").warning("hidden as well")
    assert [(e["event"], e["logger"]) for e in lines(output)] == [
        ("shown", "gateway.test"),
        ("library detail", "asyncio"),
    ]


def test_bound_request_id_is_on_every_line_until_unbound(output: io.StringIO) -> None:
    """A request id bound in the context is merged into each line, and gone once unbound."""
    configure_logging("info", output)
    log = structlog.get_logger("gateway.test")
    structlog.contextvars.bind_contextvars(request_id="req-1")
    try:
        log.info("first")
        logging.getLogger("aiohttp.server").warning("from the standard library")
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    log.info("after")
    first, stdlib, after = lines(output)
    assert first["request_id"] == stdlib["request_id"] == "req-1"
    assert "request_id" not in after


def test_standard_library_records_become_json_lines(output: io.StringIO) -> None:
    """aiohttp's and asyncio's records are JSON lines too; their info lines stay quiet at info."""
    configure_logging("info", output)
    server = logging.getLogger("aiohttp.server")
    server.info("chatty")
    try:
        raise ConnectionResetError("peer went away")
    except ConnectionResetError:
        server.exception("Error handling request")
    logging.getLogger("asyncio").warning("slow callback %s", "x")
    error, warning = lines(output)
    assert (error["event"], error["level"], error["logger"]) == (
        "Error handling request",
        "error",
        "aiohttp.server",
    )
    assert "ConnectionResetError: peer went away" in error["exception"]
    assert (warning["event"], warning["logger"]) == ("slow callback x", "asyncio")


def test_aiohttp_access_log_is_off(output: io.StringIO) -> None:
    """aiohttp's own access logger writes nothing: the gateway writes its own access line."""
    configure_logging("debug", output)
    logging.getLogger("aiohttp.access").info('127.0.0.1 "GET / HTTP/1.1" 200')
    assert output.getvalue() == ""


# ---------------------------------------------------------------------------------- redaction


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        (KEY_A, KEY_A),
        (f"key {KEY_A} rejected", KEY_A),
        ("sk-proj-abcdefghijklmnopqrstuvwxyz012345", "abcdefghijklmnopqrstuvwxyz012345"),
        (JWT, JWT),
        (f"Authorization: Bearer {JWT}", JWT),
        ("bearer plain-hand-typed-secret-1234", "plain-hand-typed-secret-1234"),
        ("trace_sk-proj-abcdefghijklmnopqrstuvwx", "abcdefghijklmnopqrstuvwx"),
        ("x_sk-q38-0123456789abcdef", "0123456789abcdef"),
        ("a1eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln", "eyJzdWIiOiIxIn0"),
    ],
)
def test_redact_secrets_masks_credential_shapes(text: str, secret: str) -> None:
    """Keys, JWTs and Bearer values inside any string field become ``[redacted]``."""
    entry = redact_secrets(None, "info", {"event": "x", "detail": text, "list": [text, 1]})
    for value in (entry["detail"], entry["list"][0]):
        assert secret not in value
        assert REDACTED in value
    assert entry["list"][1] == 1


@pytest.mark.parametrize(
    "text",
    [
        "task-1234567890",
        "request",
        "0d8c1f2e9a",
        "sk-short",
        "/v1/chat/completions",
        "KEY_A",
        "disk-images-2024",
        "risk-assessment",
        "surveyJob.123",
        "/srv/monkeyJungle.toml",
    ],
)
def test_redact_secrets_leaves_ordinary_text(text: str) -> None:
    """Request ids, key ids, routes and words are not mistaken for secrets."""
    assert redact_secrets(None, "info", {"event": text})["event"] == text


def test_redaction_covers_exception_tracebacks(output: io.StringIO) -> None:
    """A secret quoted by an exception message is masked in the rendered traceback."""
    configure_logging("info", output)
    try:
        raise ValueError(f"unexpected credential {KEY_C}")
    except ValueError:
        structlog.get_logger("gateway").exception("unhandled_error")
    (entry,) = lines(output)
    assert KEY_C not in output.getvalue()
    assert REDACTED in entry["exception"]


# ---------------------------------------------------------------------------- lifecycle lines


def test_engine_transitions_log_engine_up_and_down() -> None:
    """EngineState logs engine_up on ready and engine_down on failure, once per transition."""
    state = EngineState(Metrics(CollectorRegistry()))
    with capture_logs() as entries:
        state.set("ready")
        state.set("ready")
        state.set("down", "connection refused")
    assert [(e["event"], e["log_level"]) for e in entries] == [
        ("engine_up", "info"),
        ("engine_down", "warning"),
    ]
    assert entries[0]["previous"] == "starting"
    assert entries[1]["error"] == "connection refused"


# ------------------------------------------------------------------ the access line in-process


@pytest.fixture
async def client(aiohttp_client: Any) -> Any:
    """A gateway app in-process (tenant acme configured) whose engine socket does not exist."""
    directory = Path(tempfile.mkdtemp(prefix="q38l-", dir="/tmp"))
    keys_file = directory / "keys.env"
    write_keys(keys_file, DEFAULT_KEYS)
    settings = parse_settings(
        {
            "engine": {"socket": str(directory / "absent.sock"), "health_interval_s": 0.05},
            "auth": {"keys_file": str(keys_file)},
            "ledger": {"path": str(directory / "usage.sqlite3")},
            "tenants": {"acme": {}},
        }
    )
    yield await aiohttp_client(create_app(settings, keys=load_keys_file(keys_file)))
    shutil.rmtree(directory, ignore_errors=True)


def access(entries: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    """The access lines among captured entries."""
    return [e for e in entries if e["event"] == "request"]


async def test_access_line_of_a_public_route(
    client: Any, captured: list[MutableMapping[str, Any]]
) -> None:
    """/health logs method, route, status, tenant unknown, duration and the echoed request id."""
    r = await client.get("/health", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    (line,) = access(captured)
    assert line["request_id"] == "abc-123"
    assert (line["method"], line["route"], line["status"]) == ("GET", "/health", 200)
    assert line["tenant"] == "unknown" and line["log_level"] == "info"
    assert isinstance(line["duration_ms"], float) and line["duration_ms"] >= 0
    assert not {"key_id", "stream", "thinking", "ttft_ms", "reason"} & set(line)


async def test_access_line_of_an_auth_failure(
    client: Any, captured: list[MutableMapping[str, Any]]
) -> None:
    """A 401 logs its bounded reason, tenant unknown, and neither key nor key id."""
    r = await client.post("/v1/chat/completions", json={"model": KEY_A})
    assert r.status == 401
    r = await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY_A}x"})
    assert r.status == 401
    missing, unknown = access(captured)
    assert (missing["status"], missing["reason"], missing["tenant"]) == (401, "missing", "unknown")
    assert (unknown["reason"], unknown["route"]) == ("unknown", "/v1/models")
    assert "key_id" not in unknown
    assert KEY_A not in json.dumps(captured)


async def test_access_line_of_an_unknown_route(
    client: Any, captured: list[MutableMapping[str, Any]]
) -> None:
    """An unknown path is route ``other`` (never the path itself) with the caller's tenant."""
    headers = {"Authorization": f"Bearer {KEY_A}"}
    r = await client.get("/v1/secret-path-zz9", headers=headers)
    assert r.status == 404
    (line,) = access(captured)
    assert (line["route"], line["tenant"], line["key_id"]) == ("other", "acme", "KEY_A")
    assert "secret-path-zz9" not in json.dumps(captured)


async def test_access_line_of_a_model_request_while_the_engine_starts(
    client: Any, captured: list[MutableMapping[str, Any]]
) -> None:
    """A 503 is a warning with reason, stream and thinking; an unconfigured tenant is ``default``."""
    body = {
        "model": "qwen3.8-27b",
        "stream": True,
        "messages": [{"role": "user", "content": "prompt-marker-77"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    r = await client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_C}"}
    )
    assert r.status == 503
    (line,) = access(captured)
    assert (line["status"], line["reason"], line["log_level"]) == (
        503,
        "engine_unavailable",
        "warning",
    )
    assert (line["tenant"], line["stream"], line["thinking"]) == ("default", True, False)
    assert "prompt-marker-77" not in json.dumps(captured)


async def test_unusable_request_ids_are_replaced(
    client: Any, captured: list[MutableMapping[str, Any]]
) -> None:
    """An id with spaces or over 128 characters is replaced by a generated one, logged and echoed."""
    for supplied in ("has space", "x" * 129, ""):
        r = await client.get("/health", headers={"X-Request-Id": supplied})
        generated = r.headers["x-request-id"]
        assert generated != supplied and len(generated) == 32
        assert access(captured)[-1]["request_id"] == generated
    assert len({e["request_id"] for e in access(captured)}) == 3


# ------------------------------------------------------- request ids carrying the caller's key

# KEY_A without its ``sk-q38-`` prefix, and a run of it as long as the shortest credential.
SECRET_A = KEY_A.removeprefix("sk-q38-")
RUN_A = SECRET_A[5:21]


@pytest.mark.parametrize(
    "supplied",
    [SECRET_A, f"trace-{SECRET_A}-1", f"trace.{RUN_A}", KEY_A.replace("sk-", "x-")],
)
async def test_a_request_id_holding_the_callers_key_is_replaced_end_to_end(
    aiohttp_client: Any, output: io.StringIO, supplied: str
) -> None:
    """An ``X-Request-Id`` holding the caller's own key secret (whole or a 16-character run)
    is replaced by a generated id: the secret is in no header, body or log line."""
    configure_logging("debug", output)
    async with open_stack(aiohttp_client) as stack:
        headers = {**AUTH_A, "X-Request-Id": supplied}
        r = await stack.client.post("/v1/chat/completions", json=chat_body(), headers=headers)
        assert r.status == 200
        body = await r.text()
        s = await stack.client.post(
            "/v1/chat/completions", json=chat_body(stream=True), headers=headers
        )
        assert s.status == 200
        stream = await s.text()
        m = await stack.client.post(
            "/v1/messages",
            json={"model": ALIAS, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": KEY_A, "X-Request-Id": supplied},
        )
        assert m.status == 200
        messages = await m.text()
        records = stack.sim.model_records() if stack.sim else []
    for response in (r, s, m):
        generated = response.headers["x-request-id"]
        assert len(generated) == 32 and generated != supplied
        assert all(RUN_A not in f"{k}: {v}" for k, v in response.headers.items())
    for text in (body, stream, messages, output.getvalue(), json.dumps(records)):
        assert RUN_A not in text
    assert sse_data(stream.encode())[-1] == "[DONE]"
    assert any(
        json.loads(line).get("event") == "request" for line in output.getvalue().splitlines()
    )


async def test_a_clients_own_trace_id_is_kept(aiohttp_client: Any, output: io.StringIO) -> None:
    """An ordinary trace id (sharing the key's ``sk-q38-test`` start only) is echoed and logged."""
    configure_logging("info", output)
    supplied = "trace-q38-test-0123456789abcdef"
    async with open_stack(aiohttp_client) as stack:
        r = await stack.client.post(
            "/v1/chat/completions", json=chat_body(), headers={**AUTH_A, "X-Request-Id": supplied}
        )
        assert r.status == 200
        body = await r.json()
    assert r.headers["x-request-id"] == supplied
    assert supplied in body["id"]
    access = [json.loads(line) for line in output.getvalue().splitlines()]
    assert any(e.get("event") == "request" and e["request_id"] == supplied for e in access)


async def test_a_request_id_holding_a_piece_of_the_callers_jwt_is_replaced(
    aiohttp_client: Any, output: io.StringIO
) -> None:
    """A request id carrying a run of the Bearer JWT (its signature) is replaced; logs clean."""
    directory = Path(tempfile.mkdtemp(prefix="q38j-", dir="/tmp"))
    keys_file = directory / "keys.env"
    write_keys(keys_file, DEFAULT_KEYS, f"JWT_k1=hs256:{b64url_encode(b'j' * 32)}\n")
    settings = parse_settings(
        {
            "engine": {"socket": str(directory / "absent.sock"), "health_interval_s": 0.05},
            "auth": {"keys_file": str(keys_file)},
            "ledger": {"path": str(directory / "usage.sqlite3")},
            "tenants": {"acme": {}},
        }
    )
    keys = load_keys_file(keys_file)
    token = issue_token(keys.signing_keys[0], "acme", 600)
    piece = token.rsplit(".", 1)[1][:20]
    configure_logging("debug", output)
    try:
        client = await aiohttp_client(create_app(settings, keys=keys))
        r = await client.get(
            "/v1/models",
            headers={"Authorization": f"Bearer {token}", "X-Request-Id": f"t-{piece}"},
        )
        assert r.status == 200
        text = await r.text()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert len(r.headers["x-request-id"]) == 32
    assert all(piece not in v for v in r.headers.values())
    assert piece not in text and piece not in output.getvalue()
    assert '"event": "request"' in output.getvalue() or '"event":"request"' in output.getvalue()
