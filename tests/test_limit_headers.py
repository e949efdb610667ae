"""Rate-limit headers on every authenticated model answer, errors included, on every dialect."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ALIAS, KEY_A, KEY_C, Gateway, running_stack

OPENAI_HEADERS = [
    f"x-ratelimit-{part}-{kind}"
    for kind in ("requests", "tokens")
    for part in ("limit", "remaining", "reset")
]
ANTHROPIC_HEADERS = [
    f"anthropic-ratelimit-{kind}-{part}"
    for kind in ("requests", "tokens")
    for part in ("limit", "remaining", "reset")
]
MAX_BODY = 8192


def _body(route: str, model: str = ALIAS, **extra: Any) -> dict[str, Any]:
    """A minimal valid body for ``route``."""
    if route == "/v1/completions":
        body: dict[str, Any] = {"model": model, "prompt": "hi", "max_tokens": 4}
    elif route == "/v1/responses":
        body = {"model": model, "input": "hi", "max_output_tokens": 4}
    else:
        body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    body.update(extra)
    return body


ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    """A stack whose bodies are capped at 8 KiB and whose tenant ``carol`` has a tiny ``tpm``."""
    config = {
        "server": {"max_body_bytes": MAX_BODY},
        "tenants": {"carol": {"tpm": 50}},
    }
    with running_stack(config) as gateway:
        yield gateway


def _post(gw: Gateway, route: str, content: bytes, key: str = KEY_A) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(gw.url(route), content=content, headers=headers, timeout=30)


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


CASES = {
    "ok": (200, lambda route: _json(_body(route)), KEY_A),
    "bad_json": (400, lambda route: b"{not json", KEY_A),
    "unknown_model": (404, lambda route: _json(_body(route, model="no-such-model")), KEY_A),
    "too_large": (
        413,
        lambda route: _json(_body(route, metadata={"pad": "x" * (MAX_BODY * 2)})),
        KEY_A,
    ),
    "over_tpm": (
        429,
        lambda route: _json(_body(route, max_tokens=500, max_output_tokens=500)),
        KEY_C,
    ),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", list(CASES))
def test_limit_headers_on_every_answer(gw: Gateway, route: str, case: str) -> None:
    """Success and 400/404/413/429 answers all carry the dialect's six rate-limit headers."""
    status, make, key = CASES[case]
    r = _post(gw, route, make(route), key)
    assert r.status_code == status, r.text
    names = ANTHROPIC_HEADERS if route == "/v1/messages" else OPENAI_HEADERS
    missing = [name for name in names if name not in r.headers]
    assert not missing, (case, route, dict(r.headers))
    other = OPENAI_HEADERS if route == "/v1/messages" else ANTHROPIC_HEADERS
    assert not [name for name in other if name in r.headers]


def test_no_limit_headers_without_a_credential(gw: Gateway) -> None:
    """A 401 names no tenant, so it carries no rate-limit headers."""
    r = httpx.post(gw.url("/v1/chat/completions"), json=_body("/v1/chat/completions"), timeout=30)
    assert r.status_code == 401
    assert not [name for name in r.headers if name.lower().startswith("x-ratelimit-")]
