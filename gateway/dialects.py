"""Client API dialects: how one client-facing API maps onto the engine's chat or completions path.

A `Dialect` is the set of decisions the model path leaves to the API the client speaks: how its
body becomes the engine request (`Dialect.plan`), how the engine's stream and JSON answer become
its answer (`Dialect.stream_relay`, `Dialect.json_answer`), and the shape of its errors
(`Dialect.error_body`, `Dialect.error_event`). The model path (`gateway.proxy`) calls these at
its seams and nothing else varies between dialects. `CHAT` and `COMPLETIONS` are OpenAI's two
(OpenAI API reference, "Chat Completions" and "Completions"), which the engine speaks natively.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.config import Settings, TenantSettings
from gateway.errors import GatewayError
from gateway.framing import comment
from gateway.rewrite import Kind, RequestPlan, plan_request
from gateway.sse import RelayState, SseRelay, rewrite_completion_body
from gateway.translate.common import Overflow, PromptTooLong, overflow_of


class StreamRelay(Protocol):
    """What the stream relay drives: engine SSE bytes in, client bytes out, no I/O.

    `gateway.sse.SseRelay` is OpenAI's; a dialect with another event vocabulary provides its
    own. ``state`` is read for accounting (usage, events), ``clean_end`` after the last read.
    """

    state: RelayState

    def feed(self, data: bytes) -> bytes:
        """One engine read in; the bytes for the client now (possibly ``b""``)."""

    def finish(self) -> bytes:
        """Engine EOF: the last bytes for the client."""

    @property
    def clean_end(self) -> bool:
        """True when the engine's stream ended as a complete answer."""


class PromptCounter(Protocol):
    """The engine's own prompt count (`gateway.upstream.Upstream.count_prompt`)."""

    async def count_prompt(self, ask: bytes | None, timeout: float) -> int | None:
        """Prompt tokens of a ``/tokenize`` body (`gateway.rewrite.RequestPlan.tokenize_request`),
        or None when the engine cannot say (or ``ask`` is None)."""


@dataclass(frozen=True)
class PlanInput:
    """What planning a request may read: the parsed body and the request's fixed facts.

    Attributes:
        body: the parsed JSON body (any JSON value; the dialect validates it).
        settings: the request's configuration snapshot.
        tenant: the caller's tenant settings.
        request_id: the gateway's request id (sent to the engine).
        salt_secret: the server secret for the per-tenant prefix-cache salt.
        background: the request is served in the background line
            (`gateway.waiting.background_request`); a Responses answer then shows the
            ``flex`` tier.
    """

    body: Any
    settings: Settings
    tenant: TenantSettings
    request_id: str
    salt_secret: bytes
    background: bool = False


@dataclass(frozen=True)
class Dialect:
    """One client API on the model path.

    Attributes:
        name: short label for logs and records (``chat``, ``completions``).
        engine_path: the engine endpoint the request is sent to.
        plan: validate the client body and build the engine request (`RequestPlan`).
            Raises `gateway.errors.ClientError` subclasses for bad input.
        stream_relay: a fresh `StreamRelay` for one streaming answer, given the request's
            settings and plan.
        json_answer: rewrite the engine's JSON answer (a dict) into the client's, in place or
            new, given the request's settings.
        error_body: an error as the body of a JSON error response.
        error_event: an error as the final event of a stream whose headers went out.
        adapt_error: the error with this API's status and headers (Anthropic answers an
            unavailable engine with 529); identity for OpenAI's APIs.
        keepalive: bytes sent every ``server.sse_keepalive_s`` while the engine is silent
            before its first event (prefill), or None for none. OpenAI's APIs send an SSE
            comment (``: keep-alive``), which SSE clients ignore (WHATWG HTML, "Server-sent
            events": lines starting with a colon are comments).
        api_key_header: a header that may carry the API key instead of ``Authorization``
            (Anthropic's ``x-api-key``), or None.
        limit_headers: the rate-limit headers of an answer in this API's names (Anthropic's
            ``anthropic-ratelimit-*``); identity for OpenAI's ``x-ratelimit-*``.
        store_answer: keeps an answer that `json_answer` would have stored when it ran in the
            worker process (`gateway.answers`): (tenant, response id, response JSON, input
            items JSON); None for dialects that store nothing.
        explain_rejection: the engine's 4xx made exact before this API states it (Anthropic's
            prompt-too-long numbers need the prompt's exact count where the engine gave a lower
            bound), given the engine and the plan; None to pass the engine's error on.
    """

    name: str
    engine_path: str
    plan: Callable[[PlanInput], RequestPlan]
    stream_relay: Callable[[Settings, RequestPlan], StreamRelay]
    json_answer: Callable[[dict[str, Any], Settings, RequestPlan], dict[str, Any]]
    error_body: Callable[[GatewayError], bytes]
    error_event: Callable[[GatewayError], bytes]
    adapt_error: Callable[[GatewayError], GatewayError] = lambda error: error
    keepalive: bytes | None = None
    api_key_header: str | None = None
    limit_headers: Callable[[dict[str, str]], dict[str, str]] = lambda headers: headers
    store_answer: Callable[[str, str, bytes, bytes], object] | None = None
    explain_rejection: (
        Callable[[PromptCounter, RequestPlan, GatewayError], Awaitable[GatewayError]] | None
    ) = None


OVERFLOW_COUNT_TIMEOUT_S = 5.0
"""Seconds the engine's ``/tokenize`` may take to make an overflow's "at least N" exact."""


async def exact_overflow(
    counter: PromptCounter, plan: RequestPlan, error: GatewayError
) -> Overflow | None:
    """The engine's prompt-too-long 400 as an `Overflow` with true numbers, None for another
    error: where the engine gave a lower bound ("at least N", its tokenizer stopped past the
    limit), the prompt's exact count from the engine's ``/tokenize``; the output budget the
    engine was asked for (case C31)."""
    overflow = overflow_of(error)
    if overflow is None:
        return None
    prompt, at_least = overflow.prompt, overflow.at_least
    output = overflow.output or plan.max_output
    if at_least:
        counted = await counter.count_prompt(plan.tokenize_request(), OVERFLOW_COUNT_TIMEOUT_S)
        # A count that says the request fits contradicts the engine's refusal: keep its bound.
        if counted is not None and counted >= prompt and counted + output > overflow.context:
            prompt, at_least = counted, False
    return Overflow(prompt, at_least, output, overflow.context)


async def explain_sized_overflow(
    counter: PromptCounter, plan: RequestPlan, error: GatewayError
) -> GatewayError:
    """An OpenAI-shaped route's prompt-too-long 400 with true numbers. When this server sized
    the output budget (`RequestPlan.default_output`) vLLM's message would say the client
    "requested" that budget, so it is restated (`Overflow.openai_message`). An overflow of the
    client's own ``max_tokens`` keeps the engine's words when they state the prompt's count;
    where they state a lower bound ("at least N": vLLM's tokenizer stopped past the limit,
    possibly far below the prompt's size) it is restated with the exact count
    (`Overflow.requested_message`), and a prompt over the context alone says that fewer
    output tokens cannot help."""
    if plan.default_output is None:
        overflow = overflow_of(error)
        if overflow is None or (not overflow.at_least and overflow.prompt <= overflow.context):
            return error  # the engine's words state true numbers and a remedy that helps
    exact = await exact_overflow(counter, plan, error)
    if exact is None:
        return error
    restated = PromptTooLong(error, exact)
    if plan.default_output is None:
        if exact.at_least:  # the count did not come: the engine's words stand
            return error
        restated.message = exact.requested_message()
    else:
        restated.message = exact.openai_message()
    return restated


def _openai_planner(kind: Kind) -> Callable[[PlanInput], RequestPlan]:
    def plan(given: PlanInput) -> RequestPlan:
        return plan_request(
            given.body,
            kind,
            settings=given.settings,
            tenant=given.tenant,
            request_id=given.request_id,
            salt_secret=given.salt_secret,
        )

    return plan


def _openai_relay(settings: Settings, plan: RequestPlan) -> StreamRelay:
    return SseRelay(
        settings.engine.model,
        settings.model.alias,
        client_wants_usage=plan.client_wants_usage,
        client_wants_running_usage=plan.client_wants_running_usage,
        n=plan.n,
        max_event_bytes=settings.engine.max_event_bytes,
    )


def _openai_json(body: dict[str, Any], settings: Settings, plan: RequestPlan) -> dict[str, Any]:
    return rewrite_completion_body(body, settings.model.alias)


OPENAI_KEEPALIVE = comment("keep-alive")


def openai_error_body(error: GatewayError) -> bytes:
    """OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, as JSON."""
    return error.json_bytes()


def openai_error_event(error: GatewayError) -> bytes:
    """OpenAI's error object as one SSE ``data:`` event."""
    return error.sse_event()


CHAT = Dialect(
    name="chat",
    engine_path="/v1/chat/completions",
    plan=_openai_planner("chat"),
    stream_relay=_openai_relay,
    json_answer=_openai_json,
    error_body=openai_error_body,
    error_event=openai_error_event,
    keepalive=OPENAI_KEEPALIVE,
    explain_rejection=explain_sized_overflow,
)
COMPLETIONS = Dialect(
    name="completions",
    engine_path="/v1/completions",
    plan=_openai_planner("completions"),
    stream_relay=_openai_relay,
    json_answer=_openai_json,
    error_body=openai_error_body,
    error_event=openai_error_event,
    keepalive=OPENAI_KEEPALIVE,
    explain_rejection=explain_sized_overflow,
)
