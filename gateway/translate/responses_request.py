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
  ``user``, ``safety_identifier`` and any client ``cache_salt``/``priority``/``request_id`` are
  not forwarded. ``background``, ``conversation`` and ``prompt`` templates are refused.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import BadRequest
from gateway.translate.common import (
    Translated,
    arguments_text,
    clamp_output,
    expect,
    number,
    positive_int,
    tool_function,
)

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


def translate_responses(
    body: Any, *, max_model_len: int, history: list[Any] | None = None
) -> Translated:
    """Translate a Responses request body.

    Args:
        body: the parsed JSON body.
        max_model_len: the engine's context length in tokens (for the clamp).
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
        items.extend(expect(raw_input, list, "input"))
    chat["messages"] = _messages(items, system_parts)

    namespaces: dict[str, str] = {}
    tools = body.get("tools")
    if tools is not None:
        functions: list[dict[str, Any]] = []
        for index, tool in enumerate(expect(tools, list, "tools")):
            _tool(tool, f"tools[{index}]", functions, namespaces, result.dropped_tools)
        if functions:
            chat["tools"] = functions
            _tool_choice(body.get("tool_choice"), chat)
            parallel = body.get("parallel_tool_calls")
            if parallel is not None:
                chat["parallel_tool_calls"] = expect(parallel, bool, "parallel_tool_calls")

    reasoning = body.get("reasoning")
    if reasoning is not None:
        expect(reasoning, dict, "reasoning")
        effort = reasoning.get("effort")
        if effort is not None:
            chat["reasoning_effort"] = expect(effort, str, "reasoning.effort")
    _text_format(body.get("text"), chat)

    result.stream = bool(expect(body.get("stream", False) or False, bool, "stream"))
    chat["stream"] = result.stream
    if result.stream:
        chat["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p"):
        value = number(body, name)
        if value is not None:
            chat[name] = value
    result.requested_output = positive_int(body, "max_output_tokens")
    clamp_output(chat, result.requested_output, max_model_len)
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
    }
    return result


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
        f"'{where}': '{kind}' content is not supported: this model reads text only.",
        param=where,
    )


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = expect(content, list, where)
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
                raise BadRequest(f"Invalid value for '{where}.role': {role!r}.", param=where)
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
                    "content": _content_text(output if output is not None else "", where),
                }
            )
        else:
            raise BadRequest(
                f"Input items of type '{kind}' are not supported by this server.",
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
        functions.append(tool_function(name, tool.get("description"), tool.get("parameters")))
    elif kind == "namespace":
        group = expect(tool.get("name"), str, f"{where}.name")
        for index, inner in enumerate(expect(tool.get("tools") or [], list, f"{where}.tools")):
            before = len(functions)
            _tool(inner, f"{where}.tools[{index}]", functions, namespaces, dropped)
            for function in functions[before:]:
                namespaces[function["function"]["name"]] = group
    elif isinstance(kind, str) and (kind in HOSTED_TOOLS or kind.startswith("web_search")):
        dropped.append(str(tool.get("name") or kind))
    else:
        raise BadRequest(f"Tools of type '{kind}' are not supported.", param=f"{where}.type")


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if choice is None:
        return
    if choice in ("auto", "none", "required"):
        chat["tool_choice"] = choice
        return
    expect(choice, dict, "tool_choice")
    if choice.get("type") == "function":
        name = expect(choice.get("name"), str, "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat["tool_choice"] = "auto"  # hosted-tool and allowed_tools choices: let the model pick


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
        spec: dict[str, Any] = {"name": fmt.get("name") or "output", "schema": schema}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind != "text":
        raise BadRequest(f"Invalid value for 'text.format.type': {kind!r}.", param="text.format")
