"""The request body: read within its size and time limits, parsed as strict JSON (case C16),
and checked whole before any dialect reads it (case C28, C29): nothing in it that JSON cannot
carry back to the client or on to the engine, and not the request's own credential."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable
from types import TracebackType
from typing import Any

import structlog
from aiohttp import compression_utils, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from gateway.errors import (
    BadRequest,
    GatewayError,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedContentEncoding,
)
from gateway.secret_scan import OwnCredential
from gateway.validate import MAX_INT_DIGITS, find_unsendable

log = structlog.get_logger("gateway")

DECODED_CODINGS: tuple[str, ...] = (
    "gzip",
    "deflate",
    *(("br",) if compression_utils.HAS_BROTLI else ()),
    *(("zstd",) if getattr(compression_utils, "HAS_ZSTD", False) else ()),
)
"""The request ``Content-Encoding`` values `read_body` undoes (one coding), with the decoders of
aiohttp's ``compression_utils``. aiohttp's server is told not to decode bodies itself
(``auto_decompress=False``, `gateway.app`): it would decode a body as it arrives, before the
request is authenticated, and decode all of an unread one to keep the connection: a 1.6 KB
brotli body of 1 GiB sent without a key held ``/health`` 1.4 s, and a hundred at once took
the gateway's memory from 75 to 729 MiB (measured on a 2-core machine)."""
Decoder = (
    compression_utils.ZLibDecompressor
    | compression_utils.BrotliDecompressor
    | compression_utils.ZSTDDecompressor
)
"""aiohttp's decoder of one coding, as `read_body` uses it."""
STEP_BYTES = 1 << 20
"""The most of a body one stretch of the event loop works on: bytes one call of a decoder makes
(`read_body`), or of a body estimated (`gateway.body_memory.held_estimate_in_steps`) or hashed
(`gateway.retries.body_digest`). Other requests run after each step, so work over a body up to
its limit never holds the event loop for long (a step takes about a millisecond)."""


ALIASES = {"x-gzip": "gzip"}
"""Other names of `DECODED_CODINGS`: RFC 9110 section 8.4.1.3 asks a recipient to take
``x-gzip`` as ``gzip``."""


def check_content_encoding(request: web.BaseRequest) -> None:
    """Refuse a body whose ``Content-Encoding`` would not be undone: anything but none,
    ``identity``, one of `DECODED_CODINGS` or of their `ALIASES` (ASCII, any case, in one
    header line, as aiohttp reads it; two lines are a list of codings, RFC 9110 section 5.3).

    Raises:
        UnsupportedContentEncoding: 415 with ``Accept-Encoding`` naming `DECODED_CODINGS`; the
            value is never quoted (a client value, C29).
    """
    lines = request.headers.getall("Content-Encoding", ())
    if not lines:
        return
    coding = lines[0].strip(" \t")  # only HTTP's own whitespace (RFC 9110 section 5.6.3)
    if len(lines) == 1 and coding.isascii():
        coding = coding.lower()
        if coding in ("", "identity") or ALIASES.get(coding, coding) in DECODED_CODINGS:
            return
    raise unsupported_content_encoding()


def unsupported_content_encoding() -> UnsupportedContentEncoding:
    """The 415 of a body in a ``Content-Encoding`` not undone (see `check_content_encoding`;
    aiohttp's parser refuses ``br`` or ``zstd`` itself when their library is missing)."""
    accepted = ", ".join(DECODED_CODINGS)
    return UnsupportedContentEncoding(
        f"The request body's Content-Encoding is not supported: send it as is, or with one "
        f"of {accepted}.",
        headers={"Accept-Encoding": accepted, "Connection": "close"},
    )


def _decoder(coding: str, first: bytes) -> Decoder:
    """The decoder of ``coding`` (one of `DECODED_CODINGS`), chosen by the body's ``first``
    bytes for ``deflate``: RFC 9110 means the zlib format, and some clients send raw deflate
    (as aiohttp's client reads it too)."""
    if coding == "br":
        return compression_utils.BrotliDecompressor()
    if coding == "zstd":
        return compression_utils.ZSTDDecompressor()
    raw_deflate = coding == "deflate" and first[0] & 0x0F != 8
    return compression_utils.ZLibDecompressor(encoding=coding, suppress_deflate_header=raw_deflate)


def _coding(request: web.BaseRequest) -> str:
    """The body's ``Content-Encoding`` as `check_content_encoding` accepted it, lower case, an
    alias by its name (`ALIASES`); ``""`` for none or ``identity``."""
    coding = request.headers.get("Content-Encoding", "").strip(" \t").lower()
    return "" if coding == "identity" else ALIASES.get(coding, coding)


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body too large: the limit is {limit} bytes.")


def _undecodable() -> BadRequest:
    return BadRequest("The request body could not be decoded with its Content-Encoding.")


async def read_body(
    request: web.Request,
    limit: int,
    idle_timeout: float,
    received: Callable[[int], None] | None = None,
) -> bytes:
    """The request body, reading and decoding no further than ``limit`` bytes (case C16).

    A body in one of `DECODED_CODINGS` is decoded here, after the request was authenticated, at
    most `STEP_BYTES` at a time with other requests run between steps; its compressed
    bytes count toward ``limit`` as well, so a stream that decodes to nothing cannot run on.
    ``received`` is called with the bytes received so far (decoded) each time a read adds to
    them, before they are kept; what it raises ends the read.

    Raises:
        UnsupportedContentEncoding: a ``Content-Encoding`` that is not undone
            (`check_content_encoding`), before any byte is read.
        PayloadTooLarge: ``Content-Length``, the bytes received or the bytes decoded exceed
            ``limit`` (a compression bomb stops at the limit too).
        RequestTimeout: no byte arrived for ``idle_timeout`` seconds.
        BadRequest: the body does not match its ``Content-Encoding``, or its framing broke.
    """
    check_content_encoding(request)
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    coding = _coding(request)
    decoder: Decoder | None = None
    chunks: list[bytes] = []
    size = wire = 0

    def keep(piece: bytes) -> None:
        nonlocal size
        if not piece:
            return
        size += len(piece)
        if size > limit:
            raise _too_large(limit)
        if received is not None:
            received(size)
        chunks.append(piece)

    content = request.content
    try:
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
                    "The request body's framing is broken.",
                    headers={"Connection": "close"},  # aiohttp's parser is broken: it closes
                ) from None
            if not chunk:
                break
            wire += len(chunk)
            if wire > limit:
                raise _too_large(limit)
            if not coding:
                keep(chunk)
            else:
                if decoder is None:
                    decoder = _decoder(coding, chunk)
                await _decode(decoder, chunk, keep)
            if content.at_eof():  # read whole (the usual body, in one read): no further call
                break
        if decoder is not None:
            _finish(decoder, coding, keep)
    except BaseException:
        # A refused body's traceback holds this frame until the cycle collector runs: the
        # bytes read so far go now, as the hold that counted them does.
        chunks.clear()
        raise
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _decode(
    decoder: Decoder,
    chunk: bytes,
    keep: Callable[[bytes], None],
) -> None:
    """Decode ``chunk`` and all it makes, `STEP_BYTES` a call, to ``keep``; yield to
    the event loop between calls."""
    try:
        keep(decoder.decompress_sync(chunk, STEP_BYTES))
        while decoder.data_available:
            await asyncio.sleep(0)
            keep(decoder.decompress_sync(b"", STEP_BYTES))
    except GatewayError:
        raise
    except Exception:  # zlib.error, brotli.error, ZstdError, too many members
        raise _undecodable() from None


def _finish(decoder: Decoder, coding: str, keep: Callable[[bytes], None]) -> None:
    """The body ended: what the decoder still holds, and a ``deflate`` stream must be whole
    (aiohttp's own check; a gzip body cut after its last whole block still decodes)."""
    try:
        keep(decoder.flush())
    except GatewayError:
        raise
    except Exception:
        raise _undecodable() from None
    if coding == "deflate" and not getattr(decoder, "eof", True):
        raise _undecodable()


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


MAX_DEPTH = 128
"""The deepest nesting of arrays and objects a body may have (the top-level object is depth 1):
serde_json's default recursion limit. Every later walk of the body (checks, translation,
pickling to the worker process) then stays far inside Python's recursion limit wherever it
runs, so a body is refused or served the same, planned in the event loop or in the worker."""


def too_deeply_nested() -> BadRequest:
    """The 400 of a body nested past `MAX_DEPTH`."""
    return BadRequest(f"The JSON body is nested more than {MAX_DEPTH} levels deep.")


def nested_past(value: Any, limit: int) -> bool:
    """True when ``value`` (decoded JSON) nests arrays and objects more than ``limit`` deep;
    walked with a list, not recursion, visiting containers only."""
    if not isinstance(value, (dict, list)):
        return False
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        container, depth = pending.pop()
        if depth > limit:
            return True
        for child in container.values() if isinstance(container, dict) else container:
            if isinstance(child, (dict, list)):
                pending.append((child, depth + 1))
    return False


def parse_body(raw: bytes) -> Any:
    """Parse a request body as strict JSON (UTF-8, or UTF-16/32 detected as ``json.loads`` does).

    Numbers JSON cannot carry are not refused here but located later with their path
    (`gateway.validate.find_unsendable`): ``1e400`` parses as infinity; an integer of more than
    4,300 digits (Python's conversion limit) fails the fast parse, and a second pass names it.

    Raises:
        BadRequest: not JSON, a non-finite number literal, nested past `MAX_DEPTH`, or an
            integer too long to convert (``param`` names its top-level field).
    """
    try:
        text = raw.decode(json.detect_encoding(raw))
        body = _DECODER.decode(text)
    except RecursionError:
        raise too_deeply_nested() from None
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, ValueError) and "digits" in str(exc):
            _locate_long_int(text)
        raise BadRequest(
            "We could not parse the JSON body of your request. "
            "(HINT: This likely means you aren't using your HTTP library correctly.)"
        ) from None
    if text.count("[") + text.count("{") > MAX_DEPTH and nested_past(body, MAX_DEPTH):
        raise too_deeply_nested()
    return body


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


# What can make a UTF-8 JSON text hold a value JSON cannot carry on: a ``\\uD800``-``\\uDFFF``
# escape (a lone surrogate), an exponent of three digits or more, or a run of 300+ digits (a
# float that parses as infinity). Bodies without any of these skip the walk. The escape is a
# regular expression with a literal start (found at memchr speed); the two number shapes are
# plain substrings of the bytes with every digit mapped to ``0``, ``E`` to ``e`` and ``-`` to
# ``+`` by `bytes.translate` (no other byte becomes one of these), a window of `_SCAN_STEP`
# bytes at a time. One regular expression for all three took about 1 microsecond per byte of
# digit-rich text (``\d{300}`` is tried at every digit): an 8 MB body of 299-digit runs held the
# event loop 4.7 s, so a 32 MiB one about 20 s.
_SURROGATE_ESCAPE_RE = re.compile(rb"\\u[dD][89a-fA-F]")
_NUMBER_CLASSES = bytes.maketrans(b"0123456789eE+-", b"0000000000ee++")
_LONG_DIGITS = b"0" * 300
_SCAN_STEP = 1 << 20  # bytes mapped at once: the copy `bytes.translate` makes stays this small


def _suspect(raw: bytes, step: int = _SCAN_STEP) -> bool:
    """True when ``raw`` may hold a lone surrogate escape, an exponent of three or more digits
    (``[eE][+-]?\\d{3}``) or a run of 300 digits; windows of ``step`` bytes overlap by 300, so
    a run across two of them is whole in the first."""
    if _SURROGATE_ESCAPE_RE.search(raw) is not None:
        return True
    for start in range(0, len(raw), step):
        mapped = raw[start : start + step + len(_LONG_DIGITS)].translate(_NUMBER_CLASSES)
        if b"e000" in mapped or b"e+000" in mapped or _LONG_DIGITS in mapped:
            return True
    return False


def client_body(raw: bytes, authorization: str | None) -> Any:
    """The parsed body of a model request, checked whole before any dialect reads a field.

    Every value a response may echo (metadata, tool definitions, ids, stop sequences,
    ``reasoning``, ...) comes from here, so checking the whole body once means no answer can
    fail to serialise after the engine ran and the tenant was charged (case C28).

    Args:
        raw: the body's bytes.
        authorization: the request's ``Authorization`` value (or the dialect's key header as
            ``Bearer <key>``), to refuse a body that carries it.

    Raises:
        BadRequest: not JSON (`parse_body`); the request's own API key or token anywhere in it,
            as sent, JSON-escaped, percent-encoded or base64-encoded (not echoed); a lone UTF-16
            surrogate, a non-finite number or an integer too long to print anywhere, named by
            its path (`gateway.validate.find_unsendable`).
    """
    body = parse_body(raw)
    own = OwnCredential.of(authorization)
    if own is not None and own.found_in(raw, body):
        raise BadRequest(
            "The request body contains this request's own API key or token; remove it "
            "(it would be sent to the model)."
        )
    if json.detect_encoding(raw) not in ("utf-8", "utf-8-sig") or _suspect(raw):
        found = find_unsendable(body)
        if found is not None:
            where, why = found
            top = where.split(".", 1)[0].split("[", 1)[0]
            raise BadRequest(f"'{where}' holds {why}.", param=top)
    return body


def unplannable_as_400() -> _Unplannable:
    """Planning a client body (a context manager): a `GatewayError` passes; nesting the checks
    cannot walk is a 400; any other exception is a check that met a shape it did not expect (a
    bug, logged with its traceback as ``plan_failed``) and still a 400, since nothing was
    reserved or sent yet and the body is what caused it (case C28: no 5xx from client input)."""
    return _UNPLANNABLE


class _Unplannable:
    """`unplannable_as_400`'s context manager: one object, no state (every request enters it)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None or not issubclass(kind, Exception) or issubclass(kind, GatewayError):
            return  # no error, a cancellation or exit, or a refusal: as it is
        if issubclass(kind, RecursionError):
            raise too_deeply_nested() from None
        log.exception("plan_failed", exc_info=exc)
        raise BadRequest(
            "The request body holds a value of a type or shape this server cannot process."
        ) from None


_UNPLANNABLE = _Unplannable()
