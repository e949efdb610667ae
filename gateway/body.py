"""The request body: read within its size and time limits, parsed as strict JSON (case C16)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from gateway.errors import BadRequest, PayloadTooLarge, RequestTimeout


async def read_body(request: web.Request, limit: int, idle_timeout: float) -> bytes:
    """The request body, reading no further than ``limit`` bytes (case C16).

    Raises:
        PayloadTooLarge: ``Content-Length`` or the bytes received exceed ``limit`` (after any
            ``Content-Encoding`` is undone, so a compression bomb stops at the limit too).
        RequestTimeout: no byte arrived for ``idle_timeout`` seconds.
        BadRequest: the body does not match its ``Content-Encoding``.
    """
    too_large = PayloadTooLarge(f"Request body too large: the limit is {limit} bytes.")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    content = request.content
    while True:
        try:
            if content.is_eof():  # the rest is buffered already: no wait, no timer task
                chunk = await content.readany()
            else:
                chunk = await asyncio.wait_for(content.readany(), idle_timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(
                f"The request body stopped arriving for {idle_timeout:g} s.",
                headers={"Connection": "close"},
            ) from None
        except (HttpProcessingError, RequestPayloadError):
            raise BadRequest(
                "The request body could not be decoded with its Content-Encoding."
            ) from None
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    """``json.loads`` hook: ``NaN`` and ``Infinity`` are not JSON (RFC 8259 section 6)."""
    raise ValueError(f"{name} is not a valid JSON number")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def parse_body(raw: bytes) -> Any:
    """Parse a request body as strict JSON (UTF-8, or UTF-16/32 detected as ``json.loads`` does).

    Raises:
        BadRequest: not JSON, a non-finite number literal, or nested too deeply.
    """
    try:
        return _DECODER.decode(raw.decode(json.detect_encoding(raw)))
    except RecursionError:
        raise BadRequest("The JSON body is nested too deeply.") from None
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(
            "We could not parse the JSON body of your request. "
            "(HINT: This likely means you aren't using your HTTP library correctly.)"
        ) from None
