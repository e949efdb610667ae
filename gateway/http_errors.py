"""The web server's own errors in the gateway's envelope: nothing aiohttp writes reaches a client.

aiohttp answers some requests before any middleware runs, with ``text/plain`` pages of its own:
an unparseable request (bad request line, header, chunked encoding: `GatewayRequestHandler.
handle_error`), an ``Expect`` header other than ``100-continue`` on a route without an
``expect_handler`` (a 417 quoting the header, or a 500 when the header holds a byte UTF-8
cannot carry), and anything raised while routing. Here every such answer becomes a JSON error
in the route's API shape (OpenAI's, or Anthropic's under ``/v1/messages``; for a request the
parser refused, the path of its request line as last received decides; OpenAI's when not even
that can be read), with ``x-request-id``, logged once as
an access line, and never quoting the request. Input that no text codec accepts (a lone
surrogate in a URL, a header or a quoted value: `UnicodeError`) is a 400, never a 500 (C28).

`GatewayRunner` is the ``web.AppRunner`` that installs both: its connections use
`GatewayRequestHandler`, and the app's handler is wrapped by `guard` (the outermost layer,
around the router and the middlewares).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest

from gateway.config import UNKNOWN_TENANT
from gateway.dialects import CHAT, Dialect
from gateway.errors import BadRequest, GatewayError, HttpError, MethodNotAllowed, NotFound
from gateway.state import CONTEXT, DIALECTS, METRICS

log = structlog.get_logger("gateway.access")
events = structlog.get_logger("gateway")

RawHandler = Callable[[BaseRequest], Awaitable[web.StreamResponse]]


def error_for(exc: BaseException | None, status: int) -> GatewayError:
    """The client-safe error for what aiohttp raised or would answer with ``status``.

    `UnicodeError` (text no codec accepts) and any 4xx are client errors (400 for the parser's
    own); a ``web.HTTPException`` keeps its status with a fixed message (its text may quote the
    request); anything else is a 500 with a fixed message.
    """
    if isinstance(exc, UnicodeError):
        return BadRequest("The request holds text that is not valid UTF-8.")
    if isinstance(exc, LineTooLong):
        # RFC 9110 section 15.5.15 (414) for the request line, RFC 6585 section 5 (431) for
        # a header: the parser stopped at the line's length limit.
        line = exc.args[0] if exc.args else b""
        start = line.encode("latin-1", "replace") if isinstance(line, str) else bytes(line)
        if _REQUEST_START_RE.match(start):
            return HttpError(414, HTTPStatus(414).phrase)
        return HttpError(431, HTTPStatus(431).phrase)
    if isinstance(exc, web.HTTPException):
        status = exc.status
    if status == 400:
        return BadRequest("Malformed HTTP request.")
    if status == 404:
        return NotFound("Unknown route.")
    if status == 405:
        return MethodNotAllowed("Method not allowed for this route.")
    if 400 <= status < 500:
        return HttpError(status, HTTPStatus(status).phrase)
    error = GatewayError("Internal server error.")
    if 500 <= status < 600:
        error.status = status
    return error


def _dialect(app: web.Application | None, request: BaseRequest, path: str | None = None) -> Dialect:
    """The API of the request's path, or of ``path`` when given (the longest model-route
    prefix), else OpenAI's."""
    if app is None or DIALECTS not in app:
        return CHAT
    if path is None:
        try:
            path = request.path
        except Exception:  # a path yarl could not decode: no route to speak for
            return CHAT
    dialects = app[DIALECTS]
    prefixes = [t for t in dialects if path == t or path.startswith(t + "/")]
    return dialects[max(prefixes, key=len)] if prefixes else CHAT


def _request_id(request: BaseRequest) -> str:
    """The id the middleware gave this request, else a fresh one (the client's is not trusted
    here: the request may not have been read far enough to check it)."""
    context = request.get(CONTEXT)
    return context.request_id if context is not None else uuid.uuid4().hex


def error_response(
    app: web.Application | None,
    request: BaseRequest,
    error: GatewayError,
    reason: str,
    cause: BaseException | None = None,
    path: str | None = None,
) -> web.Response:
    """``error`` in the request's API shape (of ``path`` when given: a request aiohttp could not
    parse has none of its own), with ``x-request-id``; logged as one access line and counted
    (tenant ``unknown``, route ``other``: no middleware ran for it)."""
    dialect = _dialect(app, request, path)
    error = dialect.adapt_error(error)
    request_id = _request_id(request)
    headers = dict(error.headers)
    headers["x-request-id"] = request_id
    response = web.Response(
        status=error.status,
        body=dialect.error_body(error),
        content_type="application/json",
        headers=headers,
    )
    response.force_close()
    try:
        method = request.method
    except Exception:
        method = "?"
    fields = {"method": method, "route": "other", "status": error.status, "reason": reason}
    if cause is not None:
        fields["error"] = type(cause).__name__  # the class only: its text may quote the request
    if error.status >= 500:
        log.warning("request", request_id=request_id, **fields)
    else:
        log.info("request", request_id=request_id, **fields)
    if app is not None and METRICS in app:
        app[METRICS].requests.labels(UNKNOWN_TENANT, "other", str(error.status)).inc()
    return response


def guard(app: web.Application, handler: RawHandler) -> RawHandler:
    """The app's handler with everything that escapes it answered by `error_response`.

    Routing, the ``Expect`` handlers and the middlewares run inside; the middlewares answer
    their own errors, so what arrives here was raised before them or by them. A 5xx here is a
    bug (logged with its traceback as ``unhandled_error``), except that text no codec accepts is
    the client's (400).
    """

    async def guarded(request: BaseRequest) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            return error_response(app, request, error_for(exc, exc.status), "http", exc)
        except Exception as exc:
            if not isinstance(exc, UnicodeError):
                events.exception("unhandled_error")
            reason = "bad_encoding" if isinstance(exc, UnicodeError) else "internal"
            return error_response(app, request, error_for(exc, 500), reason, exc)

    return guarded


_REQUEST_START_RE = re.compile(rb"(?:[A-Z]{3,7} )?/")
"""How a too-long request line or its URL starts (aiohttp's C parser reports the URL alone);
a header line never starts so."""
_REQUEST_LINE_RE = re.compile(rb"(?:^|\n)[A-Z]{3,7} (/[^\x00-\x20\x7f]{0,255}) HTTP/1\.[01]\r?\n")
_KEPT_BYTES = 4096
"""Bytes of a connection's last read kept for `request_line_path` (its request line, headers)."""


def request_line_path(data: bytes) -> str | None:
    """The path (query cut off) of the last HTTP/1.x request line in ``data``, or None; only
    used to choose an error's API shape, never echoed."""
    paths = _REQUEST_LINE_RE.findall(data)
    # Bytes past ASCII (a path no parser accepts) decode one to one: only its prefix matters.
    return paths[-1].split(b"?", 1)[0].decode("latin-1") if paths else None


class GatewayRequestHandler(RequestHandler):
    """aiohttp's connection handler, answering unparseable requests in the gateway's envelope.

    aiohttp's own answer to a malformed request line or header is a text page that quotes the
    offending header, which may hold a credential; this one names no input, and logs one line
    without a traceback (clients on the public port can send garbage at will).
    """

    _received = b""

    def data_received(self, data: bytes) -> None:
        """aiohttp's, keeping the start of the read for `handle_error`: a request aiohttp
        cannot parse reaches it without its path, which its request line in this read still
        names (4 KiB at most is kept: an idle connection holds no more of its last body)."""
        self._received = data if len(data) <= _KEPT_BYTES else data[:_KEPT_BYTES]
        super().data_received(data)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            return super().handle_error(request, status, exc, None)  # raises ConnectionError
        app = getattr(self._manager, "gateway_app", None)
        path = None
        if request.method == "UNKNOWN":  # aiohttp's stand-in for a request it could not parse
            path = request_line_path(self._received)
        self._received = b""
        error = error_for(exc, status)
        return error_response(app, request, error, "malformed_http", exc, path)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp's log of an exception on a connection, quieter for a request body at fault.

        After an answer, aiohttp reads what is left of an unread body before it reuses the
        connection; a body that broke its framing (the 400 went out already) raises
        `RequestPayloadError` there, which aiohttp logs at error level
        with a traceback: one debug line instead, since any client can send one. Anything else
        is logged as aiohttp does.
        """
        if isinstance(kw.get("exc_info"), RequestPayloadError):
            events.debug("request_body_unreadable_after_answer")
            return
        super().log_exception(*args, **kw)


class _Server(web.Server):
    gateway_app: web.Application | None = None

    def __call__(self) -> RequestHandler:
        return GatewayRequestHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` whose connections use `GatewayRequestHandler` and whose app handler is
    wrapped by `guard`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server
        assert isinstance(server, _Server)
        server.gateway_app = self.app
        server.request_handler = guard(self.app, server.request_handler)
        return server
