"""Client for the engine's ``/health``, ``/metrics`` and one warm-up completion (Unix socket)."""

from __future__ import annotations

import asyncio
import errno
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

import aiohttp

HealthState = Literal["up", "dead", "refused", "timeout", "error"]

WARMUP_PROMPT = "Reply with the single word: ready."


@dataclass(frozen=True)
class Health:
    """One ``GET /health`` answer.

    Attributes:
        state: ``up`` (200); ``dead`` (503: the engine reports ``EngineDeadError``,
            vllm-protocol.md section 2); ``refused`` (nothing accepts on the socket yet: the engine
            is loading, or gone); ``timeout`` (connected but no answer in time: hung or stopped);
            ``error`` (anything else, see ``detail``).
        detail: human-readable cause, empty when up.
    """

    state: HealthState
    detail: str = ""

    @property
    def healthy(self) -> bool:
        """True only for a 200."""
        return self.state == "up"


@dataclass(frozen=True)
class WarmUp:
    """The outcome of `EngineClient.warm_up`.

    Attributes:
        ok: the engine answered 200 with a completion.
        duration_s: wall time of the request in seconds.
        status: HTTP status, None when no response came.
        completion_tokens: ``usage.completion_tokens`` of the answer, None if absent.
        detail: failure cause (a short excerpt of the engine's error body), empty when ok.
    """

    ok: bool
    duration_s: float
    status: int | None = None
    completion_tokens: int | None = None
    detail: str = ""


class EngineClient:
    """HTTP over the engine's Unix socket; use as ``async with EngineClient(path) as client``.

    Connections are not pooled: the engine's uvicorn closes idle ones after 5 s
    (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, vllm-protocol.md section 1.4), the probe interval's order.
    """

    def __init__(self, socket_path: str) -> None:
        self._socket_path = socket_path
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineClient:
        connector = aiohttp.UnixConnector(path=self._socket_path, force_close=True)
        self._session = aiohttp.ClientSession(connector=connector)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EngineClient used outside 'async with'")
        return self._session

    async def health(self, timeout_s: float) -> Health:
        """``GET /health``, answered within ``timeout_s`` seconds or ``timeout``."""
        try:
            async with self._http.get(
                "http://engine/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                await response.read()
                if response.status == 200:
                    return Health("up")
                if response.status == 503:
                    return Health("dead", "the engine answers 503 (engine dead)")
                return Health("error", f"/health answered {response.status}")
        except asyncio.TimeoutError:
            return Health("timeout", f"no answer within {timeout_s:g} s")
        except aiohttp.ClientConnectorError as exc:
            if exc.os_error.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return Health("refused", "nothing accepts connections on the socket yet")
            return Health("error", str(exc.os_error))
        except aiohttp.ClientError as exc:
            return Health("error", f"{type(exc).__name__}: {exc}")

    async def metrics(self, timeout_s: float) -> str | None:
        """``GET /metrics`` (Prometheus text, vLLM's ``vllm:*`` series); None on any failure."""
        try:
            async with self._http.get(
                "http://engine/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                body = await response.read()
                if response.status != 200:
                    return None
                return body.decode("utf-8", "replace")
        except (asyncio.TimeoutError, aiohttp.ClientError):
            return None

    async def warm_up(self, model: str, max_tokens: int, timeout_s: float) -> WarmUp:
        """One short non-streaming chat completion with thinking off.

        The first request on a V100 compiles Triton/tilelang kernels for minutes; paying that
        here keeps it off the first user's request. Thinking is switched off explicitly
        (``chat_template_kwargs.enable_thinking``, vllm-protocol.md section 9.2) so ``max_tokens``
        bounds the answer, not a reasoning preamble.
        """
        body = {
            "model": model,
            "messages": [{"role": "user", "content": WARMUP_PROMPT}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": False,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        started = time.monotonic()
        try:
            async with self._http.post(
                "http://engine/v1/chat/completions",
                json=body,
                headers={"X-Request-Id": "launcher-warmup"},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                raw = await response.read()
                took = time.monotonic() - started
                if response.status != 200:
                    excerpt = raw[:300].decode("utf-8", "replace")
                    return WarmUp(False, took, response.status, detail=excerpt)
                try:
                    usage = (await response.json(content_type=None)).get("usage") or {}
                except ValueError:
                    return WarmUp(False, took, 200, detail="the answer is not JSON")
                tokens = usage.get("completion_tokens")
                return WarmUp(True, took, 200, tokens if isinstance(tokens, int) else None)
        except asyncio.TimeoutError:
            return WarmUp(False, time.monotonic() - started, detail=f"no answer in {timeout_s:g} s")
        except aiohttp.ClientError as exc:
            took = time.monotonic() - started
            return WarmUp(False, took, detail=f"{type(exc).__name__}: {exc}")
