"""OpenAI Responses request (``POST /v1/responses``) -> chat-completions body.

Field names follow OpenAI's API reference ("Responses", "Create a model response") and the
``openai`` SDK's ``ResponseCreateParams``. The mapping:

- ``instructions`` and the ``developer``/``system`` messages before the first turn form the
  system prompt; later ones become ``user`` messages at their place (the chat template accepts
  a system message only first).
- ``input`` (a string, or items): ``message`` items (``input_text``/``output_text`` parts) become
  chat messages; ``function_call`` items become the assistant's ``tool_calls`` (consecutive calls
  join one assistant message); ``function_call_output`` items become ``tool`` messages;
  replayed ``reasoning`` items (``content`` ``reasoning_text``, else ``summary``) become the next
  assistant message's ``reasoning``. Image and file parts are refused: the model reads text only.
- ``function`` tools become chat functions; a ``namespace`` group (Codex) is flattened into its
  functions (their names are remembered so calls come back with the ``namespace``); built-in
  tools (``web_search``, ``file_search``, ``code_interpreter``, ``computer_use``, ``mcp``,
  ``image_generation``, ``local_shell``, ``custom``) cannot run here and are left out
  (`Translated.dropped_tools`).
- ``reasoning.effort``: ``"none"`` turns thinking off, another effort on; absent, the tenant's
  default decides. ``max_output_tokens`` is clamped to what fits in the context.
- ``text.format`` ``json_schema``/``json_object`` becomes ``response_format``.
- ``include``, ``prompt_cache_key``, ``client_metadata``, ``service_tier``, ``truncation``,
  ``user``, ``safety_identifier``, ``max_tool_calls``, ``text.verbosity``, ``reasoning.summary``
  and any client ``cache_salt``/``priority``/``request_id`` are not forwarded (checked, and
  echoed as the API echoes them, `_echoed_values`; why leaving each out changes nothing the
  client relies on: gateway/README.md "What the translations leave out"). ``truncation:
  "auto"`` drops no input item here: a prompt over the context is the same 400 as without it,
  saying so (`NO_TRUNCATION`). ``background``,
  ``conversation``, ``prompt`` templates, ``top_logprobs`` above 0, an ``include`` asking for
  log probabilities, and a ``tool_choice`` that needs a tool the model cannot call here are
  refused with a 400 naming why.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import BadRequest, quotable
from gateway.translate.common import (
    BACKGROUND_TIERS,
    Translated,
    arguments_text,
    expect,
    label,
    number,
    one_of,
    positive_int,
    tool_function,
)
from gateway.validate import MAX_TOP_LOGPROBS, SERVICE_TIERS, integer

HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "file_search",
        "code_interpreter",
        "computer_use",
        "computer_use_preview",
        "mcp",
        "image_generation",
        "local_shell",
        "shell",
        "apply_patch",
        "custom",
    }
)
_REFUSED_FIELDS = ("background", "conversation", "prompt")
# OpenAI API reference, "Create a model response": the documented values of the echoed enums.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = ("auto", "concise", "detailed")
VERBOSITIES = ("low", "medium", "high")
TRUNCATIONS = ("auto", "disabled")
NO_TRUNCATION = (
    " 'truncation' is 'auto', but this server does not truncate input automatically: shorten "
    "the conversation (the items of 'input', or the stored responses 'previous_response_id' "
    "continues) and send the request again."
)
"""Added to the prompt-too-long 400 of a request with ``truncation: "auto"``: OpenAI would drop
items from the start of the conversation until it fits; this server drops nothing."""
# ``include`` values this server honours (the reasoning's encrypted content is always null) or
# that name output items it never produces (built-in tools, image inputs); any other value
# (``message.output_text.logprobs``) asks for data it cannot give and is refused.
INCLUDES = frozenset(
    {
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
# OpenAI API reference, ``metadata``: up to 16 pairs, keys up to 64 and values up to 512 chars.
METADATA_MAX_PAIRS, METADATA_KEY_MAX, METADATA_VALUE_MAX = 16, 64, 512


def translate_responses(body: Any, *, history: list[Any] | None = None) -> Translated:
    """Translate a Responses request body.

    Args:
        body: the parsed JSON body.
        history: input and output items of the ``previous_response_id`` chain, already
            resolved by the caller (stored responses), placed before ``input``.

    Returns a `Translated` whose ``extra`` holds ``namespaces`` (function name -> namespace),
    ``tools`` (the request's tools, echoed in the response), and the echoed scalars.

    Raises:
        BadRequest: a missing or ill-typed field or an unsupported item; ``param`` names it.
    """
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    for name in _REFUSED_FIELDS:
        if body.get(name) not in (None, False):
            raise BadRequest(f"'{name}' is not supported by this server.", param=name)
    model = body.get("model")
    if model is not None:
        expect(model, str, "model")
    chat: dict[str, Any] = {"model": model} if model is not None else {}
    result = Translated(chat=chat, stream=False)

    system_parts: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None and instructions != "":
        system_parts.append(expect(instructions, str, "instructions"))
    raw_input = body.get("input")
    if raw_input is None:
        raise BadRequest("Missing required parameter: 'input'.", param="input")
    items: list[Any] = list(history or [])
    if isinstance(raw_input, str):
        items.append({"type": "message", "role": "user", "content": raw_input})
    else:
        items.extend(expect(raw_input, (str, list), "input"))  # a string is handled above
    chat["messages"] = _messages(items, system_parts)

    namespaces: dict[str, str] = {}
    tools = body.get("tools")
    functions: list[dict[str, Any]] = []
    if tools is not None:
        for index, tool in enumerate(expect(tools, list, "tools")):
            _tool(tool, f"tools[{index}]", functions, namespaces, result.dropped_tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        expect(parallel, bool, "parallel_tool_calls")
    if functions:
        chat["tools"] = functions
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    _tool_choice(body.get("tool_choice"), chat, result.dropped_tools)

    reasoning = body.get("reasoning")
    if reasoning is not None:
        expect(reasoning, dict, "reasoning")
        effort = reasoning.get("effort")
        if effort is not None:
            chat["reasoning_effort"] = one_of(effort, EFFORTS, "reasoning.effort")
        for name in ("summary", "generate_summary"):
            if reasoning.get(name) is not None:
                one_of(reasoning[name], SUMMARIES, f"reasoning.{name}")
    _text_format(body.get("text"), chat)
    _echoed_fields(body)

    result.stream = bool(expect(body.get("stream", False) or False, bool, "stream"))
    chat["stream"] = result.stream
    if result.stream:
        chat["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p"):
        value = number(body, name)
        if value is not None:
            chat[name] = value
    result.requested_output = positive_int(body, "max_output_tokens")
    result.extra = {
        "namespaces": namespaces,
        "tools": tools if isinstance(tools, list) else [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "instructions": instructions,
        "metadata": body.get("metadata"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": result.requested_output,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": reasoning,
        "store": body.get("store", True) is not False,
        "text": body.get("text"),
        **_echoed_values(body),
    }
    return result


def _echoed_values(body: dict[str, Any]) -> dict[str, Any]:
    """The values a ``Response`` echoes of the fields this server honours without sending them
    to the engine (checked by `_echoed_fields`): ``truncation`` as asked (``disabled`` by
    default; with ``auto`` nothing is dropped, see `NO_TRUNCATION`), ``max_tool_calls`` (it
    bounds built-in tool calls, of which none run here), ``top_logprobs``, ``user``,
    ``safety_identifier``, ``prompt_cache_key``; ``service_tier`` the tier that served it
    (`_served_tier`: the API reference says a response shows the tier used, which may differ
    from the one asked)."""
    return {
        "truncation": body.get("truncation") or "disabled",
        "max_tool_calls": body.get("max_tool_calls"),
        "top_logprobs": body.get("top_logprobs"),
        "user": body.get("user"),
        "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "service_tier": _served_tier(body.get("service_tier")),
    }


def _served_tier(asked: Any) -> str | None:
    """The ``service_tier`` a response shows: ``flex`` for a request served in the background
    line (`gateway.translate.common.BACKGROUND_TIERS`), else ``default`` (``auto``, ``default``,
    ``scale`` and ``priority`` are all served the same way here); None when none was asked."""
    if asked is None:
        return None
    return asked if asked in BACKGROUND_TIERS else "default"


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    expect(part, dict, where)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
        return str(expect(part.get("text"), str, f"{where}.text"))
    if kind == "refusal":
        return str(part.get("refusal") or "")
    raise BadRequest(
        f"'{where}': '{quotable(kind)}' content is not supported: this model reads text only.",
        param=where,
    )


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: must be a string or an array", param=where)
    parts = content
    return "".join(_part_text(part, f"{where}[{i}]") for i, part in enumerate(parts))


def _messages(items: list[Any], system_parts: list[str]) -> list[dict[str, Any]]:
    """Input items in order as chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    seen_turn = False
    for index, item in enumerate(items):
        where = f"input[{index}]"
        expect(item, dict, where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            text = _content_text(item.get("content"), f"{where}.content")
            if role in ("system", "developer"):
                if seen_turn:
                    out.append({"role": "user", "content": text})
                else:
                    system_parts.append(text)
                continue
            if role not in ("user", "assistant"):
                raise BadRequest(
                    f"Invalid value for '{where}.role': '{quotable(role)}'.", param=f"{where}.role"
                )
            seen_turn = True
            message: dict[str, Any] = {"role": role, "content": text}
            if role == "assistant" and reasoning:
                message["reasoning"] = "".join(reasoning)
                reasoning = []
            out.append(message)
        elif kind == "reasoning":
            texts = item.get("content") or item.get("summary") or []
            reasoning.append(_content_text(texts, f"{where}.content"))
        elif kind == "function_call":
            seen_turn = True
            call = {
                "id": expect(item.get("call_id"), str, f"{where}.call_id"),
                "type": "function",
                "function": {
                    "name": expect(item.get("name"), str, f"{where}.name"),
                    "arguments": arguments_text(item.get("arguments")),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    message["reasoning"] = "".join(reasoning)
                    reasoning = []
                out.append(message)
        elif kind == "function_call_output":
            seen_turn = True
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": expect(item.get("call_id"), str, f"{where}.call_id"),
                    "content": _content_text(
                        output if output is not None else "", f"{where}.output"
                    ),
                }
            )
        else:
            raise BadRequest(
                f"Input items of type '{quotable(kind)}' are not supported by this server.",
                param=f"{where}.type",
            )
    if system_parts:
        out.insert(0, {"role": "system", "content": "\n\n".join(system_parts)})
    if not any(m["role"] != "system" for m in out):
        raise BadRequest("'input' must contain at least one message.", param="input")
    return out


def _tool(
    tool: Any,
    where: str,
    functions: list[dict[str, Any]],
    namespaces: dict[str, str],
    dropped: list[str],
) -> None:
    expect(tool, dict, where)
    kind = tool.get("type")
    if kind == "function":
        name = expect(tool.get("name"), str, f"{where}.name")
        description = tool.get("description")
        if description is not None:
            expect(description, str, f"{where}.description")
        parameters = tool.get("parameters")
        if parameters is not None:
            expect(parameters, dict, f"{where}.parameters")
        if tool.get("strict") is not None:
            expect(tool["strict"], bool, f"{where}.strict")
        functions.append(tool_function(name, description, parameters))
    elif kind == "namespace":
        group = expect(tool.get("name"), str, f"{where}.name")
        for index, inner in enumerate(expect(tool.get("tools") or [], list, f"{where}.tools")):
            before = len(functions)
            _tool(inner, f"{where}.tools[{index}]", functions, namespaces, dropped)
            for function in functions[before:]:
                namespaces[function["function"]["name"]] = group
    elif isinstance(kind, str) and (kind in HOSTED_TOOLS or kind.startswith("web_search")):
        dropped.append(label(kind))
    else:
        raise BadRequest(f"Tools of type '{label(kind)}' are not supported.", param=f"{where}.type")


def _tool_choice(choice: Any, chat: dict[str, Any], dropped: list[str]) -> None:
    """``tool_choice`` onto the chat route, or a 400 when it cannot be honoured as asked.

    ``auto`` and ``none`` always can. ``required``, a named function and ``allowed_tools`` in
    ``required`` mode need a function the model can call: with only built-in tools (which this
    server leaves out, `HOSTED_TOOLS`) the answer would be text, against the request (case
    C31). A choice of a built-in tool (``{"type": "web_search"}``, ``mcp``, ``custom``) is
    refused for the same reason. ``allowed_tools`` keeps the listed functions only.
    """
    if choice is None or choice in ("auto", "none"):
        if choice is not None and "tools" in chat:
            chat["tool_choice"] = choice
        return
    functions = chat.get("tools") or []
    names = {tool["function"]["name"] for tool in functions}
    unavailable = (
        f" (this server cannot run the built-in tools {', '.join(sorted(set(dropped)))})"
        if dropped
        else ""
    )
    if choice == "required":
        if not functions:
            raise BadRequest(
                f"tool_choice 'required' needs at least one function tool in 'tools'{unavailable}.",
                param="tool_choice",
            )
        chat["tool_choice"] = "required"
        return
    if not isinstance(choice, dict):
        raise BadRequest(
            "tool_choice: must be 'none', 'auto', 'required' or an object.",
            param="tool_choice",
        )
    kind = choice.get("type")
    if kind == "function":
        name = expect(choice.get("name"), str, "tool_choice.name")
        if name not in names:
            raise BadRequest(
                f"tool_choice names the function '{label(name)}', which is not in 'tools'.",
                param="tool_choice.name",
            )
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind == "allowed_tools":
        mode = one_of(choice.get("mode"), ("auto", "required"), "tool_choice.mode")
        allowed = expect(choice.get("tools"), list, "tool_choice.tools")
        wanted = set()
        for index, tool in enumerate(allowed):
            expect(tool, dict, f"tool_choice.tools[{index}]")
            if tool.get("type") == "function":
                wanted.add(expect(tool.get("name"), str, f"tool_choice.tools[{index}].name"))
        kept = [tool for tool in functions if tool["function"]["name"] in wanted]
        if mode == "required" and not kept:
            raise BadRequest(
                "tool_choice 'allowed_tools' in 'required' mode needs at least one function "
                f"tool of 'tools' in its list{unavailable}.",
                param="tool_choice.tools",
            )
        if kept:
            chat["tools"] = kept
            chat["tool_choice"] = mode
        else:
            chat.pop("tools", None)
            chat.pop("parallel_tool_calls", None)
    else:
        raise BadRequest(
            f"tool_choice of type '{label(kind)}' cannot be honoured: this server runs "
            "function tools only.",
            param="tool_choice.type",
        )


def _echoed_fields(body: dict[str, Any]) -> None:
    """The fields a response echoes or that change nothing here, checked against the API
    reference before the engine is asked (an answer must never fail to echo them): ``metadata``
    (up to 16 string pairs), ``store``, ``truncation``, ``include``, ``text.verbosity``,
    ``top_logprobs`` (0 only: no log probabilities here), ``max_tool_calls``, and the plain
    strings ``user``, ``safety_identifier``, ``prompt_cache_key``, ``service_tier``."""
    metadata = body.get("metadata")
    if metadata is not None:
        expect(metadata, dict, "metadata")
        if len(metadata) > METADATA_MAX_PAIRS:
            raise BadRequest(
                f"metadata: at most {METADATA_MAX_PAIRS} key-value pairs", param="metadata"
            )
        for key, value in metadata.items():
            if len(key) > METADATA_KEY_MAX:
                raise BadRequest(
                    f"metadata: keys are at most {METADATA_KEY_MAX} characters", param="metadata"
                )
            if not isinstance(value, str) or len(value) > METADATA_VALUE_MAX:
                raise BadRequest(
                    f"metadata: values are strings of at most {METADATA_VALUE_MAX} characters",
                    param="metadata",
                )
    if body.get("store") is not None:
        expect(body["store"], bool, "store")
    if body.get("truncation") is not None:
        one_of(body["truncation"], TRUNCATIONS, "truncation")
    include = body.get("include")
    if include is not None:
        for index, item in enumerate(expect(include, list, "include")):
            expect(item, str, f"include[{index}]")
            if item not in INCLUDES:
                raise BadRequest(
                    f"include[{index}]: '{quotable(item)}' is not available on this server.",
                    param="include",
                )
    text = body.get("text")
    if isinstance(text, dict) and text.get("verbosity") is not None:
        one_of(text["verbosity"], VERBOSITIES, "text.verbosity")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None:
        integer(0, MAX_TOP_LOGPROBS)(top_logprobs, "top_logprobs")  # OpenAI's range first
        if top_logprobs != 0:
            raise BadRequest(
                "top_logprobs: log probabilities are not available on /v1/responses here.",
                param="top_logprobs",
            )
    if body.get("max_tool_calls") is not None:
        positive_int(body, "max_tool_calls")
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None:
            expect(body[name], str, name)
    if body.get("service_tier") is not None:
        one_of(body["service_tier"], SERVICE_TIERS, "service_tier")


def _text_format(text: Any, chat: dict[str, Any]) -> None:
    if text is None:
        return
    expect(text, dict, "text")
    fmt = text.get("format")
    if fmt is None:
        return
    expect(fmt, dict, "text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = expect(fmt.get("schema"), dict, "text.format.schema")
        name = fmt.get("name")
        if name is not None:
            expect(name, str, "text.format.name")
        spec: dict[str, Any] = {"name": name or "output", "schema": schema}
        if fmt.get("strict") is not None:
            spec["strict"] = expect(fmt["strict"], bool, "text.format.strict")
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind != "text":
        raise BadRequest(
            f"Invalid value for 'text.format.type': '{quotable(kind)}'.", param="text.format"
        )
