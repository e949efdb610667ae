"""Anthropic Messages request (``POST /v1/messages``) -> chat-completions body.

Field names and block types follow Anthropic's API reference ("Messages", "Count tokens")
and the ``anthropic`` SDK's ``MessageCreateParams``. The mapping:

- ``system`` (string or text blocks) becomes the first ``system`` message; a block starting
  ``x-anthropic-billing-header`` (Claude Code's per-session tag) is removed so the prompt prefix,
  and therefore the engine's prefix cache, is the same across sessions. ``role: "system"``
  messages before the first turn join the system prompt; later ones become ``user`` messages at
  their place (the chat template accepts a system message only first).
- ``text`` blocks become text; ``thinking`` blocks become the assistant's ``reasoning``
  (``redacted_thinking`` is dropped: it cannot be shown to this model); ``tool_use`` blocks
  become ``tool_calls``; ``tool_result`` blocks become ``tool`` messages. ``image`` and
  ``document`` blocks are refused: the deployed model reads text only.
- Custom tools become function tools; Anthropic-hosted tools (``web_search_*``, ``web_fetch_*``,
  ``code_execution_*``, ...) are left out (`Translated.dropped_tools`).
- ``tool_choice`` ``auto``/``any``/``tool``/``none`` become ``auto``/``required``/the named
  function/``none``; ``disable_parallel_tool_use`` becomes ``parallel_tool_calls: false``.
- ``thinking``: ``enabled`` turns thinking on (``budget_tokens`` becomes vLLM's
  ``thinking_token_budget``), ``disabled`` off; ``adaptive`` or absent leave the decision to the
  tenant's default (the gateway's thinking policy). ``output_config.effort`` does not switch
  the mode (Claude Code sends it on every request); ``output_config.format`` becomes
  ``response_format``.
- ``max_tokens`` (required) is clamped to what fits in the context.
- ``metadata``, ``context_management``, ``cache_control``, ``service_tier``, ``container`` and
  any client ``cache_salt``/``priority``/``request_id`` are not forwarded (what each changes:
  nothing in the answer, see gateway/README.md "What the translations leave out").
  ``mcp_servers``, a custom tool without ``input_schema``, and a ``tool_choice`` that needs a
  tool the model cannot call here (``any`` with only hosted tools, a named hosted tool) are
  refused with a 400 naming why, rather than answered without them.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import BadRequest, quotable
from gateway.translate.common import (
    Translated,
    arguments_text,
    expect,
    label,
    number,
    positive_int,
    tool_function,
)

BILLING_PREFIX = "x-anthropic-billing-header"
_UNSUPPORTED_BLOCKS = {"image", "document", "search_result", "container_upload"}


def translate_messages(body: Any, *, count_only: bool = False) -> Translated:
    """Translate a Messages request body.

    Args:
        body: the parsed JSON body.
        count_only: the body is a ``count_tokens`` request (no ``max_tokens``, no ``stream``).

    Raises:
        BadRequest: a missing or ill-typed field, an unknown or unsupported block; the message
            and ``param`` name the field.
    """
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    # An absent model is the served model, as on every API of the gateway (README, "Field
    # checks"): it serves one model, so there is nothing to choose.
    model = body.get("model")
    if model is not None:
        expect(model, str, "model")
    messages = expect(body.get("messages"), list, "messages")
    if body.get("mcp_servers") not in (None, []):
        # Anthropic's MCP connector: the API would call these servers' tools; leaving them
        # out would answer without the tools the request counts on.
        raise BadRequest(
            "mcp_servers: the MCP connector is not available on this server", param="mcp_servers"
        )

    chat: dict[str, Any] = {"model": model} if model is not None else {}
    system_parts = _system_texts(body.get("system"))
    out: list[dict[str, Any]] = []
    seen_turn = False
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        expect(message, dict, where)
        role = message.get("role")
        if role == "system":
            text = _joined_text(message.get("content"), f"{where}.content")
            if text is None:
                continue
            if seen_turn:
                out.append({"role": "user", "content": text})
            else:
                system_parts.append(text)
            continue
        seen_turn = True
        if role in ("user", "ctx", "msg"):  # Claude Code 2.1.154+ also sent "ctx" and "msg"
            out.extend(_user_messages(message.get("content"), where))
        elif role == "assistant":
            out.append(_assistant_message(message.get("content"), where))
        else:
            raise BadRequest(
                f"{where}.role: Input should be 'user' or 'assistant'", param=f"{where}.role"
            )
    if not out and not count_only:
        raise BadRequest(
            "messages: at least one user or assistant message is required"
            + (" (system messages alone are not a conversation)" if system_parts else ""),
            param="messages",
        )
    _metadata(body.get("metadata"))
    if system_parts:
        out.insert(0, {"role": "system", "content": "\n\n".join(system_parts)})
    chat["messages"] = out

    result = Translated(chat=chat, stream=False)
    tools = body.get("tools")
    if tools is not None:
        functions = []
        for index, tool in enumerate(expect(tools, list, "tools")):
            converted = _tool(tool, f"tools.{index}", result.dropped_tools)
            if converted is not None:
                functions.append(converted)
        if functions:
            chat["tools"] = functions
    _tool_choice(body.get("tool_choice"), chat, result.dropped_tools)
    _thinking(body.get("thinking"), chat)
    _output_config(body.get("output_config"), chat)
    if count_only:
        return result

    result.stream = bool(expect(body.get("stream", False) or False, bool, "stream"))
    chat["stream"] = result.stream
    if result.stream:
        chat["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p"):
        value = number(body, name)
        if value is not None:
            if not 0 <= value <= 1:  # Anthropic Messages API reference: both range 0.0-1.0
                raise BadRequest(f"{name}: must be between 0 and 1", param=name)
            chat[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        chat["top_k"] = expect(top_k, int, "top_k")
    stops = body.get("stop_sequences")
    if stops is not None:
        expect(stops, list, "stop_sequences")
        for index, stop in enumerate(stops):
            expect(stop, str, f"stop_sequences.{index}")
        if stops:
            chat["stop"] = stops
    result.requested_output = positive_int(body, "max_tokens", required=True)
    budget = chat.get("thinking_token_budget")
    output = result.requested_output
    if budget is not None and output is not None and budget >= output:
        # Anthropic's own rule ("Extended thinking", max tokens and context window size): the
        # thinking budget is part of max_tokens and must leave room for the answer.
        raise BadRequest(
            "`max_tokens` must be greater than `thinking.budget_tokens`.", param="max_tokens"
        )
    return result


def _system_texts(system: Any) -> list[str]:
    """The top-level ``system`` as texts, without Claude Code's per-session billing block."""
    if system is None:
        return []
    if isinstance(system, str):
        return [system] if system and not system.startswith(BILLING_PREFIX) else []
    texts = []
    for index, block in enumerate(expect(system, (str, list), "system")):
        expect(block, dict, f"system.{index}")
        if block.get("type") != "text":
            raise BadRequest(
                f"system.{index}.type: only 'text' blocks are accepted", param=f"system.{index}"
            )
        text = expect(block.get("text"), str, f"system.{index}.text")
        if text and not text.startswith(BILLING_PREFIX):
            texts.append(text)
    return texts


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    blocks: list[dict[str, Any]] = expect(content, (str, list), where)
    for index, block in enumerate(blocks):
        expect(block, dict, f"{where}.{index}")
        kind = expect(block.get("type"), str, f"{where}.{index}.type")
        if kind in _UNSUPPORTED_BLOCKS:
            raise BadRequest(
                f"{where}.{index}: '{kind}' content is not supported: this model reads text only",
                param=f"{where}.{index}.type",
            )
    return blocks


def _joined_text(content: Any, where: str) -> str | None:
    """The text blocks of ``content`` joined with blank lines; None when there is no text."""
    texts = []
    for index, block in enumerate(_blocks(content, where)):
        if block.get("type") != "text":
            raise BadRequest(
                f"{where}.{index}.type: only 'text' blocks are accepted here",
                param=f"{where}.{index}.type",
            )
        texts.append(expect(block.get("text"), str, f"{where}.{index}.text"))
    return "\n\n".join(texts) if texts else None


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: ``tool`` messages for its tool results first, then one user message."""
    tools: list[dict[str, Any]] = []
    texts: list[str] = []
    for index, block in enumerate(_blocks(content, f"{where}.content")):
        at = f"{where}.content.{index}"
        kind = block.get("type")
        if kind == "text":
            texts.append(expect(block.get("text"), str, f"{at}.text"))
        elif kind == "tool_result":
            call_id = expect(block.get("tool_use_id"), str, f"{at}.tool_use_id")
            text = _tool_result_text(block.get("content"), f"{at}.content")
            if block.get("is_error") is True and not text.startswith("Error"):
                text = "Error: " + text
            tools.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise BadRequest(
                f"{at}.type: '{quotable(kind)}' is not a user content block", param=f"{at}.type"
            )
    out = tools
    if texts or not tools:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _tool_result_text(content: Any, where: str) -> str:
    """A ``tool_result``'s content (string or blocks) as text; ``tool_reference`` blocks name
    the tool they load."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for index, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text":
            texts.append(expect(block.get("text"), str, f"{where}.{index}.text"))
        elif kind == "tool_reference":
            name = expect(block.get("tool_name", ""), str, f"{where}.{index}.tool_name")
            texts.append(f"Tool loaded: {name}")
        else:
            raise BadRequest(
                f"{where}.{index}.type: '{quotable(kind)}' is not supported in a tool result",
                param=f"{where}.{index}.type",
            )
    return "\n\n".join(texts)


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    """An assistant turn: text, ``reasoning`` from thinking blocks, ``tool_calls``."""
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(_blocks(content, f"{where}.content")):
        at = f"{where}.content.{index}"
        kind = block.get("type")
        if kind == "text":
            texts.append(expect(block.get("text"), str, f"{at}.text"))
        elif kind == "thinking":
            reasoning.append(expect(block.get("thinking", ""), str, f"{at}.thinking"))
        elif kind == "redacted_thinking":
            continue
        elif kind in ("tool_use", "server_tool_use"):
            name = expect(block.get("name"), str, f"{at}.name")
            call_id = expect(block.get("id"), str, f"{at}.id")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments_text(block.get("input"))},
                }
            )
        else:
            raise BadRequest(
                f"{at}.type: '{quotable(kind)}' is not an assistant content block",
                param=f"{at}.type",
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool(tool: Any, where: str, dropped: list[str]) -> dict[str, Any] | None:
    """A custom tool as a chat function; an Anthropic-hosted tool (a versioned ``type`` such as
    ``web_search_20250305``) is left out (None, its name in ``dropped``).

    Raises:
        BadRequest: a custom tool without ``input_schema`` (Anthropic requires it; leaving the
            tool out would change the request), or a field of the wrong type.
    """
    expect(tool, dict, where)
    kind = tool.get("type")
    name = tool.get("name")
    if kind is not None:
        expect(kind, str, f"{where}.type")
    if kind not in (None, "custom"):
        dropped.append(label(name if isinstance(name, str) else kind))
        return None
    expect(name, str, f"{where}.name")
    if "input_schema" not in tool:
        raise BadRequest(f"{where}.input_schema: Field required", param=f"{where}.input_schema")
    schema = expect(tool.get("input_schema"), dict, f"{where}.input_schema")
    description = tool.get("description")
    if description is not None:
        expect(description, str, f"{where}.description")
    return tool_function(name, description, schema)


def _tool_choice(choice: Any, chat: dict[str, Any], dropped: list[str]) -> None:
    """``tool_choice`` onto the chat route, or a 400 when it cannot be honoured as asked.

    ``any`` and a named ``tool`` need a custom tool the model can call: with only hosted tools
    (which this server leaves out) the answer would be text, against the request (case C31);
    a named tool must be one of the request's custom tools.
    """
    if choice is None:
        return
    expect(choice, dict, "tool_choice")
    kind = choice.get("type")
    names = {tool["function"]["name"] for tool in chat.get("tools") or []}
    unavailable = (
        f" (this server cannot run the hosted tools {', '.join(sorted(set(dropped)))})"
        if dropped
        else ""
    )
    if kind == "auto":
        value: Any = "auto"
    elif kind == "any":
        if not names:
            raise BadRequest(
                f"tool_choice.type: 'any' needs at least one custom tool in tools{unavailable}",
                param="tool_choice.type",
            )
        value = "required"
    elif kind == "none":
        value = "none"
    elif kind == "tool":
        name = expect(choice.get("name"), str, "tool_choice.name")
        if name not in names:
            raise BadRequest(
                f"tool_choice.name: '{label(name)}' is not one of the custom tools in "
                f"tools{unavailable}",
                param="tool_choice.name",
            )
        value = {"type": "function", "function": {"name": name}}
    else:
        raise BadRequest(
            "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'",
            param="tool_choice.type",
        )
    disable_parallel = choice.get("disable_parallel_tool_use")
    if disable_parallel is not None:
        expect(disable_parallel, bool, "tool_choice.disable_parallel_tool_use")
    if "tools" in chat:
        chat["tool_choice"] = value
        if disable_parallel is True:
            chat["parallel_tool_calls"] = False


def _thinking(thinking: Any, chat: dict[str, Any]) -> None:
    """Anthropic ``thinking`` onto the chat template switch; absent/adaptive decide nothing."""
    if thinking is None:
        return
    expect(thinking, dict, "thinking")
    kind = thinking.get("type")
    if kind == "enabled":
        chat["chat_template_kwargs"] = {"enable_thinking": True}
        budget = positive_int(thinking, "budget_tokens")
        if budget is not None:
            chat["thinking_token_budget"] = budget
    elif kind == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    elif kind != "adaptive":
        raise BadRequest(
            "thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'",
            param="thinking.type",
        )


def _output_config(config: Any, chat: dict[str, Any]) -> None:
    """``output_config.format`` (JSON schema) becomes ``response_format``; ``effort`` is noted
    only (it tunes how much to think, which this model cannot take as a level)."""
    if config is None:
        return
    expect(config, dict, "output_config")
    fmt = config.get("format")
    if fmt is None:
        return
    expect(fmt, dict, "output_config.format")
    if fmt.get("type") != "json_schema":
        raise BadRequest(
            "output_config.format.type: Input should be 'json_schema'",
            param="output_config.format.type",
        )
    schema = expect(fmt.get("schema"), dict, "output_config.format.schema")
    chat["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


def _metadata(metadata: Any) -> None:
    """Check Anthropic's ``metadata`` (an object whose ``user_id``, when set, is a string:
    Messages API reference) before the engine is asked; its content is not sent on."""
    if metadata is None:
        return
    expect(metadata, dict, "metadata")
    user_id = metadata.get("user_id")
    if user_id is not None:
        expect(user_id, str, "metadata.user_id")
