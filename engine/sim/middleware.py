"""The simulator's middlewares: the `--record` line, vLLM's API key check, and error bodies."""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from engine.sim.errors import ApiError
from engine.sim.keys import KEY_DIGESTS, RECORDER, TRACE
from engine.sim.record import Trace
from engine.sim.wire import dumps

# vLLM's API key middleware guards only these path prefixes (section 3.2).
PROTECTED_PREFIXES = ("/v1", "/v2", "/inference")


def json_response(
    value: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A compact JSON response, as Starlette's JSONResponse writes it."""
    return web.Response(
        body=dumps(value), status=status, content_type="application/json", headers=headers
    )


def _authorized(header: str | None, digests: Sequence[bytes]) -> bool:
    """vLLM's check: ``Bearer <key>`` (scheme case-insensitive), SHA-256 digests compared in
    constant time against every configured key."""
    if not header:
        return False
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    match = False
    for expected in digests:
        match |= hmac.compare_digest(digest, expected)
    return match


def _body_for_record(trace: Trace, raw: bytes) -> Any:
    if trace.parsed:
        return trace.body
    try:
        return json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        return None


@web.middleware
async def record_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """Outermost: keep the request's `Trace` and write its `--record` line when it ends."""
    trace = Trace()
    TRACE.set(trace)
    recorder = request.app.get(RECORDER)
    raw = await request.read() if recorder is not None and request.can_read_body else b""
    try:
        response: web.StreamResponse = await handler(request)
    except BaseException:
        trace.outcome = trace.outcome or "aborted"
        raise
    else:
        if trace.status is None:
            trace.status = response.status
        if trace.outcome is None:
            trace.outcome = "finished" if response.status < 400 else "error"
        return response
    finally:
        if recorder is not None:
            recorder.write(
                method=request.method,
                path=request.raw_path,
                headers=dict(request.headers),
                body=_body_for_record(trace, raw),
                trace=trace,
            )


@web.middleware
async def auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """vLLM's `--api-key` check: 401 ``{"error":"Unauthorized"}`` on guarded paths only."""
    digests = request.app[KEY_DIGESTS]
    if (
        digests
        and request.method != "OPTIONS"
        and request.path.startswith(PROTECTED_PREFIXES)
        and not _authorized(request.headers.get("Authorization"), digests)
    ):
        return json_response({"error": "Unauthorized"}, 401)
    response: web.StreamResponse = await handler(request)
    return response


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """ApiError as vLLM's error object; unknown path and method as FastAPI's `detail` bodies."""
    try:
        response: web.StreamResponse = await handler(request)
    except ApiError as exc:
        return json_response(exc.body(), exc.status)
    except web.HTTPMethodNotAllowed as exc:
        allow = ", ".join(sorted(exc.allowed_methods))
        return json_response({"detail": "Method Not Allowed"}, 405, {"Allow": allow})
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, 404)
    return response


# Where uvicorn and Starlette put the headers of a vLLM response (observed on vLLM 0.32): first
# uvicorn's own, then the response's, then the middlewares', then the framing uvicorn adds.
_FIRST = ("date", "server")
_LAST = ("vary", "x-request-id", "transfer-encoding", "connection")


async def uvicorn_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Headers as vLLM's server sends them: lowercase names (Starlette and uvicorn write them
    so), `server: uvicorn`, `vary: Origin` (vLLM's CORS middleware), in uvicorn's order.

    Runs last among the response-prepare hooks, after aiohttp has added its own headers.
    """
    headers = response.headers
    items = [(str(name).lower(), value) for name, value in headers.items()]
    values = dict(items)
    values["server"] = "uvicorn"
    values["vary"] = "Origin"
    middle = [(n, v) for n, v in items if n not in _FIRST and n not in _LAST]
    middle.sort(key=lambda item: item[0] != "content-length")  # Starlette sets it first
    ordered = [(n, values[n]) for n in _FIRST if n in values]
    ordered += middle
    ordered += [(n, values[n]) for n in _LAST if n in values]
    headers.clear()
    for name, value in ordered:
        headers.add(name, value)


async def request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    # --enable-request-id-headers: the client's X-Request-Id, else a new one
    response.headers["x-request-id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
