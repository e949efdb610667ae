"""The request body: read within its size and time limits, parsed as strict JSON (case C16)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from gateway.errors import BadRequest, PayloadTooLarge, RequestTimeout
from gateway.validate import MAX_INT_DIGITS, find_unsendable


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


def _long_int(text: str) -> Any:
    """``parse_int`` hook of the second pass: an integer too long to convert stands out as
    infinity, which `find_unsendable` then locates by path (any other integer as ``int``)."""
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return math.inf
    return int(text)


_LOCATING_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_int=_long_int)


def parse_body(raw: bytes) -> Any:
    """Parse a request body as strict JSON (UTF-8, or UTF-16/32 detected as ``json.loads`` does).

    Numbers JSON cannot carry are not refused here but located later with their path
    (`gateway.validate.find_unsendable`): ``1e400`` parses as infinity; an integer of more than
    4,300 digits (Python's conversion limit) fails the fast parse, and a second pass names it.

    Raises:
        BadRequest: not JSON, a non-finite number literal, nested too deeply, or an integer too
            long to convert (``param`` names its top-level field).
    """
    try:
        text = raw.decode(json.detect_encoding(raw))
        return _DECODER.decode(text)
    except RecursionError:
        raise BadRequest("The JSON body is nested too deeply.") from None
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, ValueError) and "digits" in str(exc):
            _locate_long_int(text)
        raise BadRequest(
            "We could not parse the JSON body of your request. "
            "(HINT: This likely means you aren't using your HTTP library correctly.)"
        ) from None


def _locate_long_int(text: str) -> None:
    """Raise a 400 naming where an over-long integer is, when the second pass finds it."""
    try:
        body = _LOCATING_DECODER.decode(text)
    except (ValueError, RecursionError):
        return
    found = find_unsendable(body)
    if found is not None:
        where, _ = found
        top = where.split(".", 1)[0].split("[", 1)[0]
        raise BadRequest(f"'{where}' holds an integer too large.", param=top)
