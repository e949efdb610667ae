"""Request rewriting: alias, thinking mode, sampling defaults, usage, isolation.

`plan_request` turns a client's JSON body into the exact body sent to the engine plus the facts
the rest of the request path needs (stream or not, usage wanted, thinking, token reservation).
Everything the contract does not name passes through untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.ceiling import chat_ceiling, completion_ceiling
from gateway.config import Settings, TenantSettings
from gateway.errors import QUOTABLE_MAX_CHARS, BadRequest, ModelNotFound, PermissionDenied
from gateway.translate.common import Overflow
from gateway.validate import find_unsendable, validate_fields

Kind = Literal["chat", "completions"]

# Qwen3.8-27B model card, "Best Practices".
SAMPLING_THINKING: Mapping[str, float | int] = {
    "temperature": 1.0,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.0,
    "presence_penalty": 0.0,
}
SAMPLING_NON_THINKING: Mapping[str, float | int] = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "min_p": 0.0,
    "presence_penalty": 1.5,
}
# OpenAI API reference, /v1/completions max_tokens: "Defaults to 16" (vLLM's default too).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# The most sequences one request may ask the engine for: prompts x max(n, best_of) of a
# /v1/completions batch. 2,048 is the most inputs OpenAI takes in one array (embeddings API
# reference, ``input``: "any array must be 2048 dimensions or less"); a larger batch is hours of
# a one-sequence engine and an answer past any relay cap, refused before anything is reserved.
MAX_SEQUENCES = 2048
# Per-message template overhead (<|im_start|>role\n ... <|im_end|>\n) in tokens.
_MESSAGE_OVERHEAD_TOKENS = 8


@dataclass(frozen=True)
class RequestPlan:
    """The engine-bound request and what the gateway must remember about it.

    Attributes:
        body: UTF-8 JSON to POST to the engine.
        stream: the client asked for SSE.
        client_wants_usage: the client asked for the usage chunk (``stream_options.include_usage``).
        client_wants_running_usage: the client also asked for usage on every chunk
            (``stream_options.continuous_usage_stats``, which vLLM honours only with
            ``include_usage``). The engine is always asked for both on a stream: the running
            usage is what the gateway charges for a stream cut short (`gateway.sse`).
        thinking: effective thinking mode (None for ``/v1/completions``, which has no template).
        n: choices requested.
        prompt_estimate: prompt tokens estimated from the body (a typical figure, see
            `estimate_prompt_tokens`): sizes the default output budget, stands for the prompt of
            a cut request the engine never counted.
        max_output: output tokens the request may generate per choice.
        reserve_tokens: tokens to reserve against the tenant's budget:
            ``prompt_ceiling + max_output * sequences``, a bound on what the engine can count.
        prompt_ceiling: prompt tokens the engine cannot exceed (`gateway.ceiling`), or its exact
            count once asked (``prompt_exact``).
        prompt_exact: ``prompt_ceiling`` is the engine's own count (``/tokenize``).
        default_output: the engine body's output-budget field when the gateway sized it (the
            client set none, or set one through a translated API, which cuts it to the context
            rather than refuse it; ``max_output`` then came from the prompt estimate), else
            None: `gateway.budget.fit_default_output` makes it fit the context.
        output_cap: the most ``default_output`` may be: the tenant's ``max_tokens``, or the
            budget the translated request asked for.
        held_extra: bytes of memory the request holds beyond what its client body accounts for
            (a stored conversation it continues), counted against ``server.bodies_max_bytes``.
        tokenize_body: `tokenize_ask` of ``body`` built ahead, off the event loop, for a large
            body (``b""`` when it has none), or None to build it when asked.
    """

    body: bytes
    stream: bool
    client_wants_usage: bool
    thinking: bool | None
    n: int
    prompt_estimate: int
    max_output: int
    reserve_tokens: int
    client_wants_running_usage: bool = False
    prompt_ceiling: int = 0
    prompt_exact: bool = False
    default_output: str | None = None
    output_cap: int = 0
    held_extra: int = 0
    tokenize_body: bytes | None = None

    @property
    def output_tokens(self) -> int:
        """Output tokens reserved: ``max_output`` for every sequence the engine generates."""
        return max(0, self.reserve_tokens - self.prompt_ceiling)

    @property
    def prompt_fallback(self) -> int:
        """The prompt charged when the engine never reported a count for it: the engine's exact
        count when asked before admission, else the estimate (never above the ceiling)."""
        if self.prompt_exact:
            return self.prompt_ceiling
        return min(self.prompt_estimate, self.prompt_ceiling)

    def with_prompt_count(self, count: int) -> RequestPlan:
        """This plan reserving the engine's exact prompt ``count`` instead of the ceiling."""
        return dataclasses.replace(
            self,
            prompt_ceiling=count,
            prompt_exact=True,
            reserve_tokens=count + self.output_tokens,
        )

    def with_default_output(self, max_output: int) -> RequestPlan:
        """This plan with another output budget per sequence in its ``default_output`` field.

        `plan_request` writes that field last in the body, so only the body's tail is rewritten:
        a large body is not decoded on the event loop (where this runs) for one number.
        """
        field = self.default_output
        assert field is not None, "only the gateway's own default is rewritten"
        tail = f',"{field}":{self.max_output}}}'.encode()
        if self.body.endswith(tail):
            body = self.body[: -len(tail)] + f',"{field}":{max_output}}}'.encode()
        else:  # a body not shaped by plan_request
            decoded = json.loads(self.body)
            decoded[field] = max_output
            body = json.dumps(decoded, ensure_ascii=False, separators=(",", ":")).encode()
        sequences = self.output_tokens // self.max_output if self.max_output > 0 else 1
        return dataclasses.replace(
            self,
            body=body,
            max_output=max_output,
            reserve_tokens=self.prompt_ceiling + max_output * sequences,
        )

    def tokenize_request(self) -> bytes | None:
        """The body of vLLM's ``POST /tokenize`` for this plan's prompt (`tokenize_ask`): built
        ahead (``tokenize_body``) for a body planned in the worker, else from ``body`` now."""
        if self.tokenize_body is not None:
            return self.tokenize_body or None
        return tokenize_ask(self.body)


def tokenize_ask(body: bytes) -> bytes | None:
    """The body of vLLM's ``POST /tokenize`` that counts the prompt of the engine request
    ``body``, or None when it is not one prompt (a list of prompts, not JSON).

    vLLM's tokenizer endpoint takes chat ``messages`` (with ``tools`` and
    ``chat_template_kwargs``, through the chat template with the generation prompt) or a
    completions ``prompt`` string (vLLM docs, "OpenAI-Compatible Server", Tokenizer API).
    """
    try:
        sent = json.loads(body)
    except ValueError:
        return None
    if not isinstance(sent, dict):
        return None
    ask: dict[str, Any] = {"model": sent.get("model")}
    if isinstance(sent.get("messages"), list):
        ask["messages"] = sent["messages"]
        ask["add_generation_prompt"] = True
        for name in ("tools", "chat_template_kwargs"):
            if sent.get(name) is not None:
                ask[name] = sent[name]
    elif isinstance(sent.get("prompt"), str):
        ask["prompt"] = sent["prompt"]
    else:
        return None
    return json.dumps(ask, ensure_ascii=False, separators=(",", ":")).encode()


@functools.lru_cache(maxsize=1024)
def cache_salt(secret: bytes, tenant: str) -> str:
    """Per-tenant prefix-cache salt: hex HMAC-SHA256 of the tenant name under a server secret
    (kept per tenant and secret: every request of the tenant asks).

    Tenants never share cached prefixes (a timing side channel), while one tenant's requests
    still hit its own cache (vLLM docs, "Automatic Prefix Caching", ``cache_salt``).
    """
    return hmac.new(secret, tenant.encode(), hashlib.sha256).hexdigest()


def estimate_prompt_tokens(body: Mapping[str, Any], kind: Kind) -> int:
    """Prompt tokens, over-estimated without a tokenizer: UTF-8 bytes of the text / 3, plus overhead.

    Qwen's BPE averages about 4 bytes a token for English and 3 for CJK (3 UTF-8 bytes, often one
    token each), so bytes/3 rarely under-counts; the reservation is settled to the engine's exact
    usage when the request ends, so over-estimating only delays admission slightly.
    """
    total = 0
    if kind == "chat":
        messages = body.get("messages") or ()
        for message in messages:
            total += _MESSAGE_OVERHEAD_TOKENS
            if isinstance(message, dict):
                total += _text_bytes(message.get("content")) // 3
                for extra in ("reasoning", "reasoning_content", "tool_calls"):
                    if message.get(extra):
                        total += _text_bytes(message[extra]) // 3
        if body.get("tools"):
            # Wrapped so the list is measured whole (as schemas), not as content parts.
            total += _text_bytes({"tools": body["tools"]}) // 3
    else:
        total += _text_bytes(body.get("prompt")) // 3
    return total + 3


def _text_bytes(value: Any) -> int:
    """UTF-8 size of the text in a content value (string, parts list, or any JSON).

    In a parts list only the ``text`` of each part counts (an image URL is not prompt text);
    other objects (tool schemas) count their keys and values. Iterative, so any nesting the
    JSON parser accepted is measured without recursion.
    """
    total = 0
    stack: list[tuple[Any, bool]] = [(value, True)]
    while stack:
        item, parts = stack.pop()
        if isinstance(item, str):
            total += len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, list):
            for part in item:
                if parts and isinstance(part, dict):
                    stack.append((part.get("text"), False))
                else:
                    stack.append((part, False))
        elif isinstance(item, dict):
            for key, inner in item.items():
                total += len(key)
                stack.append((inner, False))
        elif item is not None:
            total += len(str(item))
    return total


def resolve_thinking(body: Mapping[str, Any], settings: Settings, tenant: TenantSettings) -> bool:
    """The effective thinking mode, first decider wins.

    Order: ``chat_template_kwargs.enable_thinking``, top-level ``enable_thinking``,
    ``reasoning_effort`` (``"none"`` is off, any other value on), the tenant's default, the
    ``[thinking] default``. A tenant with ``thinking_allowed = false`` is always off.

    Raises:
        BadRequest: a decider of the wrong type.
        PermissionDenied: the client asked for thinking and its tenant may not use it.
    """
    explicit: bool | None = None
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is not None:
        explicit = _bool_field(kwargs["enable_thinking"], "chat_template_kwargs.enable_thinking")
    elif body.get("enable_thinking") is not None:
        explicit = _bool_field(body["enable_thinking"], "enable_thinking")
    elif body.get("reasoning_effort") is not None:
        effort = body["reasoning_effort"]
        if not isinstance(effort, str):
            raise BadRequest("'reasoning_effort' must be a string.", param="reasoning_effort")
        explicit = effort != "none"
    if not tenant.thinking_allowed:
        if explicit:
            raise PermissionDenied(
                "Thinking mode is not enabled for this API key's tenant.",
                param="chat_template_kwargs.enable_thinking",
            )
        return False
    if explicit is not None:
        return explicit
    if tenant.thinking_default is not None:
        return tenant.thinking_default
    return settings.thinking.default


def _bool_field(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean.", param=name)
    return value


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(f"'{name}' must be a positive integer.", param=name)
    return value


def plan_request(
    body: Any,
    kind: Kind,
    *,
    settings: Settings,
    tenant: TenantSettings,
    request_id: str,
    salt_secret: bytes,
    output_cap: int | None = None,
) -> RequestPlan:
    """Validate a client body and build the engine request.

    With no output budget in ``body``, the gateway sizes one (``default_output``): at most
    ``output_cap`` (default: the tenant's ``max_tokens``), cut to the room the prompt estimate
    leaves in the context, and never absent, so the engine's own default (all the context
    left, vLLM's ``get_max_tokens``) never passes what was reserved; when the estimate leaves
    no room, ``min(cap, max_model_len)`` stands until the engine's count sizes it
    (`gateway.budget.fit_default_output`).

    Args:
        body: the parsed JSON body.
        kind: ``chat`` for ``/v1/chat/completions``, ``completions`` for ``/v1/completions``.
        settings: current configuration.
        tenant: the caller's tenant settings.
        request_id: the gateway's request id (replaces any client ``request_id``).
        salt_secret: server secret for `cache_salt`.
        output_cap: the budget a translated request asked for (Anthropic ``max_tokens``,
            Responses ``max_output_tokens``), cut to the context like the default instead of
            refused; ``body`` then carries none.

    Raises:
        BadRequest: not an object, missing ``messages``/``prompt``, a field of the wrong type or
            out of range (`gateway.validate.validate_fields`), an output limit over the context,
            or a value JSON cannot carry to the engine.
        ModelNotFound: ``model`` is neither absent nor the alias.
        PermissionDenied: thinking requested by a tenant that may not use it.
    """
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not (isinstance(model, str) and settings.model.accepts(model)):
        raise ModelNotFound(model)
    validate_fields(body, kind)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array.", param="messages")
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise BadRequest(f"'messages[{index}]' must be an object.", param="messages")
    elif body.get("prompt") is None:
        raise BadRequest("'prompt' is required.", param="prompt")

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean.", param="stream")
    n = _positive_int(body, "n") or 1
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object.", param="stream_options")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object.", param="chat_template_kwargs")

    out = dict(body)
    out["model"] = settings.engine.model

    client_wants_usage = False
    client_wants_running_usage = False
    out.pop("stream_options", None)
    if stream:
        # Usage on every chunk (vLLM docs, "OpenAI-Compatible Server", stream_options): what a
        # stream cut short streamed, exactly, however the engine merged tokens into events.
        options = dict(stream_options or {})
        client_wants_usage = options.get("include_usage") is True
        client_wants_running_usage = (
            client_wants_usage and options.get("continuous_usage_stats") is True
        )
        options["include_usage"] = True
        options["continuous_usage_stats"] = True
        out["stream_options"] = options

    thinking: bool | None = None
    if kind == "chat":
        thinking = resolve_thinking(body, settings, tenant)
        out.pop("enable_thinking", None)
        out["chat_template_kwargs"] = {**(kwargs or {}), "enable_thinking": thinking}
        defaults = SAMPLING_THINKING if thinking else SAMPLING_NON_THINKING
        for name, value in defaults.items():
            if out.get(name) is None:
                out[name] = value
        normalised: list[Any] = []
        for message in body["messages"]:
            normalised.append(_normalise_message(message))
        out["messages"] = normalised

    prompts = prompt_lengths(body["prompt"]) if kind == "completions" else None
    prompt_estimate = estimate_prompt_tokens(body, kind) if prompts is None else sum(prompts)
    ceilings = [chat_ceiling(out)] if prompts is None else prompt_ceilings(body["prompt"])
    max_fields = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    requested = None
    for name in max_fields:
        requested = _positive_int(body, name)
        if requested is not None:
            break
    context = settings.engine.max_model_len
    if requested is None and kind == "completions":
        # The OpenAI API's and vLLM's default for /v1/completions (API reference: max_tokens
        # "Defaults to 16"); sent explicitly so the reservation matches what the engine does.
        requested = min(COMPLETIONS_DEFAULT_MAX_TOKENS, context)
        out["max_tokens"] = requested
    default_output = None
    cap = tenant.max_tokens if output_cap is None else output_cap
    if requested is None:
        room = context - prompt_estimate
        max_output = min(cap, room) if room >= 1 else min(cap, context)
        # A translated budget goes as the chat API's max_tokens, as the client named it.
        default_output = max_fields[0] if output_cap is None else "max_tokens"
        out[default_output] = max_output
    else:
        max_output = requested
        _check_context(body, max_fields, requested, context, prompts)
    choices = n
    if kind == "completions":
        # vLLM generates best_of sequences per prompt and returns n of them.
        best_of = body.get("best_of")
        choices = max(n, best_of if isinstance(best_of, int) else 1)
    sequences = choices * (len(prompts) if prompts is not None else 1)
    if sequences > MAX_SEQUENCES:
        raise BadRequest(
            f"This request asks for {sequences} sequences ({len(prompts or ())} prompts, "
            f"{choices} each); one request may generate at most {MAX_SEQUENCES}: send the "
            f"prompts in several requests.",
            param="prompt",
        )
    returned = n * (len(prompts) if prompts is not None else 1)
    # The charged prompt is the engine's usage, which counts each prompt once whatever n is.
    prompt_ceiling = sum(ceilings)

    out.pop("priority", None)
    out["request_id"] = request_id
    out["cache_salt"] = cache_salt(salt_secret, tenant.name)
    if default_output is not None:
        # Last, so `with_default_output` rewrites the body's tail instead of decoding it.
        out[default_output] = out.pop(default_output)

    return RequestPlan(
        body=_dumps(out),
        stream=stream,
        client_wants_usage=client_wants_usage,
        client_wants_running_usage=client_wants_running_usage,
        thinking=thinking,
        n=returned,
        prompt_estimate=prompt_estimate,
        max_output=max_output,
        reserve_tokens=prompt_ceiling + max_output * sequences,
        prompt_ceiling=prompt_ceiling,
        default_output=default_output,
        output_cap=cap,
    )


def _normalise_message(message: dict[str, Any]) -> dict[str, Any]:
    """Accept assistant history under either reasoning name; the engine reads ``reasoning``."""
    if "reasoning_content" in message and "reasoning" not in message:
        message = dict(message)
        message["reasoning"] = message.pop("reasoning_content")
    return message


_ENGINE_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
"""The engine body's encoder, made once (`json.dumps` with these options makes one a call)."""


def _dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON for the engine.

    Raises:
        BadRequest: the body holds what JSON cannot carry to the engine (a non-finite number,
            an integer too long to print, a lone UTF-16 surrogate), naming where
            (`gateway.validate.find_unsendable`); never a non-JSON literal such as ``Infinity``.
    """
    try:
        return _ENGINE_JSON.encode(obj).encode()
    except (ValueError, UnicodeEncodeError):
        found = find_unsendable(obj)
        where, why = found if found is not None else ("body", "a value JSON cannot carry")
        top = where.split(".", 1)[0].split("[", 1)[0]
        raise BadRequest(f"'{where}' holds {why}.", param=top) from None


def prompt_lengths(prompt: Any) -> list[int]:
    """Estimated tokens of each prompt of a ``/v1/completions`` ``prompt`` (validated shape).

    A string is one prompt (UTF-8 bytes / 3, see `estimate_prompt_tokens`, plus 3); an array of
    strings is one prompt each; an array of token ids is one prompt of exactly that many tokens;
    an array of such arrays is one prompt each (OpenAI API reference, ``prompt``).
    """
    if isinstance(prompt, str):
        return [_text_bytes(prompt) // 3 + 3]
    if prompt and all(isinstance(p, list) for p in prompt):
        return [len(ids) for ids in prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [len(prompt)]
    return [_text_bytes(p) // 3 + 3 for p in prompt]


def prompt_ceilings(prompt: Any) -> list[int]:
    """Prompt tokens of each prompt of a ``/v1/completions`` ``prompt``, at most: a text prompt
    its NFD UTF-8 bytes plus the special tokens (`gateway.ceiling.completion_ceiling`), a
    token-id prompt its exact length."""
    if isinstance(prompt, str):
        return [completion_ceiling(prompt)]
    if prompt and all(isinstance(p, list) for p in prompt):
        return [len(ids) for ids in prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [len(prompt)]
    return [completion_ceiling(p) if isinstance(p, str) else len(str(p)) for p in prompt]


def _named_limit(body: Mapping[str, Any], max_fields: tuple[str, ...]) -> str:
    """The output-limit field the body set (the first of ``max_fields``), else the last."""
    return next((f for f in max_fields if body.get(f) is not None), max_fields[-1])


def _check_context(
    body: Mapping[str, Any],
    max_fields: tuple[str, ...],
    requested: int,
    context: int,
    prompts: list[int] | None,
) -> None:
    """Refuse an output limit the context cannot hold, before any slot or token is taken.

    ``max_tokens`` above ``max_model_len`` can never be served; with token-id prompts the
    prompt length is exact, so prompt plus output over ``max_model_len`` is refused too (vLLM
    answers both with a 400 after the request used the tenant's budget).
    """
    if requested > context:
        name = _named_limit(body, max_fields)
        # The value is quoted only when short: errors quote at most QUOTABLE_MAX_CHARS
        # characters of a client value (case C29), a 35-digit number included.
        shown = str(requested)
        value = f" {shown}," if len(shown) <= QUOTABLE_MAX_CHARS else ""
        raise BadRequest(
            f"'{name}' is{value} more than this model's context of {context} tokens.",
            param=name,
        )
    exact = prompts is not None and isinstance(body.get("prompt"), list)
    if exact and prompts and all(isinstance(p, (int, list)) for p in body["prompt"]):
        longest = max(prompts)
        if longest + requested > context:
            name = _named_limit(body, max_fields)
            # vLLM's wording with the exact count; a prompt over the context alone says that
            # fewer output tokens cannot help (case C31).
            overflow = Overflow(longest, False, requested, context)
            raise BadRequest(overflow.requested_message(), param=name)
