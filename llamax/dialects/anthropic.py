# ruff: noqa: E501  (the tables hold one-line docs)
"""Anthropic's Messages dialect, the request side: the ``POST /v1/messages``
:data:`~llamax.dialects.fields.FieldTable` (the mechanism is :mod:`llamax.dialects.fields`),
the check of its ``cache_control``, and :func:`parse_messages`: a body in, the
:class:`~llamax.chat.ChatCall` it asks for out (and what reading its reply needs). Pure: no
context, no server; ``llamax.anthropic`` submits the call and shapes the reply."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..chat import ChatCall
from ..chat.options import check_flag, check_text, one_of
from ..errors import ImageError, InvalidParameterError, InvalidRequestError
from ..images import Image
from .anthropic_volatile import without_billing_header
from .fields import RequestField, Support, accept_request, check_object, honoured, table

__all__ = [
    "MESSAGES",
    "REQUEST_FIELDS",
    "MessagesRequest",
    "check_cache_control",
    "parse_count",
    "parse_messages",
]

H, HINT, R = Support.HONOURED, Support.HINT, Support.REFUSED


def check_cache_control(name: str, value: Any) -> bool:
    """Whether ``value``, a ``cache_control`` (of the request, a block or a tool), asks for
    the prompt to be kept: ``{"type": "ephemeral"}`` (with a ``ttl``) does, null does not.

    Raises:
        InvalidParameterError: any other value.
    """
    if value is None:
        return False
    if not isinstance(value, Mapping) or value.get("type") != "ephemeral":
        raise InvalidParameterError(
            f'{name} must be {{"type": "ephemeral"}} (with a ttl)', param=name
        )
    return True


def _metadata(name: str, value: Any) -> None:
    check_object(name, value)
    for key, item in (value or {}).items():
        if key != "user_id":
            raise InvalidParameterError(f"{name} has unknown field {key!r}", param=name)
        check_text(f"{name}.user_id", item)


MESSAGES = table(
    "model",
    RequestField(
        "messages",
        H,
        "`text`, `tool_use`, `tool_result`, `thinking` and text `document` blocks (docs/anthropic.md)",
    ),
    RequestField("max_tokens", H, "most tokens to generate (required)"),
    RequestField("system", H, "a string or text blocks"),
    RequestField("temperature", H, "in [0, 1]"),
    "top_p",
    RequestField("top_k", H, "top-k sampling"),
    RequestField("stop_sequences", H, "stop strings (`stop_reason: stop_sequence`)"),
    RequestField(
        "tools", H, "custom tools (`input_schema`); server tools such as `web_search` are refused"
    ),
    RequestField("tool_choice", H, "`auto`, `any`, `tool`, `none`; `disable_parallel_tool_use`"),
    RequestField(
        "thinking",
        H,
        "`enabled` and `adaptive` turn the template's thinking switch on, `disabled` off; `budget_tokens` is not enforced",
    ),
    RequestField(
        "output_config",
        H,
        "`format` (`json_schema`) constrains the text by a grammar; `effort` has no effect",
    ),
    RequestField(
        "metadata", HINT, "no effect: not stored (an object; `user_id` a string)", _metadata
    ),
    "stream",
    RequestField(
        "cache_control",
        H,
        "a hint, as on a system block, a message's content block or a tool: the prompt's prefix is kept longer than unhinted ones in KV and the RAM and disk tiers (`SamplingParams.keep_prefix`); every shared prefix is reused with or without it",
    ),
    RequestField(
        "service_tier",
        HINT,
        "no effect: one local server has one tier",
        one_of("auto", "standard_only"),
    ),
    RequestField(
        "inference_geo", HINT, "no effect: the model runs where the server runs", check_text
    ),
    RequestField("speed", HINT, "no effect: there is one speed", one_of("standard", "fast")),
    RequestField(
        "diagnostics", HINT, "no effect: no cache-miss diagnostics are returned", check_object
    ),
    RequestField("user_profile_id", HINT, "no effect: requests are not attributed", check_text),
    RequestField("container", R, "code-execution containers are not supported"),
    RequestField("context_management", R, "server-side context editing is not supported"),
    RequestField(
        "mcp_servers", R, "MCP servers are not run by llamax (run the tools on the client)"
    ),
)
"""The ``POST /v1/messages`` fields."""


REQUEST_FIELDS = honoured(MESSAGES)
"""The Messages request fields llamax takes (the honoured ones of :data:`MESSAGES`)."""


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A Messages request, parsed: the call it asks for and how its reply is read."""

    call: ChatCall
    """The chat call (a trailing assistant turn as its prefill, the request's ``model``)."""
    stops: tuple[str, ...]
    """``stop_sequences``: the reply's ``stop_sequence`` names the one that ended it."""
    stream: bool
    """Whether the reply is streamed as events."""


def parse_messages(
    request: Mapping[str, Any], *, keep_billing_header: bool = False
) -> MessagesRequest:
    """The call a ``POST /v1/messages`` body asks for: its fields checked against
    :data:`MESSAGES`, its system, turns (text, images, documents, tool calls and results)
    and tools mapped onto chat messages and options, a trailing assistant turn as the
    reply's prefill. A stream asks for its prompt's progress (``message_start`` waits for
    the cached count). Claude Code's ``x-anthropic-billing-header:`` system block is left
    out unless ``keep_billing_header`` (:mod:`llamax.dialects.anthropic_volatile`).

    Raises:
        InvalidRequestError: the request is malformed.
    """
    request = accept_request(MESSAGES, request, "messages")
    stream = check_flag(request.get("stream"), "stream")  # "no" must not stream
    chat, options = _chat_request(request, keep_billing_header)
    prefill = ""
    last = chat[-1]
    if last["role"] == "assistant" and not last.get("tool_calls") and len(chat) > 1:
        prefill = (last.get("content") or "").rstrip()  # Anthropic refuses trailing space
        chat = chat[:-1]
    if stream:
        options["return_progress"] = True
    model = request.get("model")
    call = ChatCall.of(chat, prefill=prefill, model=model if isinstance(model, str) else None,
                       **options)  # fmt: skip
    return MessagesRequest(call, tuple(options.get("stop") or ()), stream)


def parse_count(request: Mapping[str, Any], *, keep_billing_header: bool = False) -> ChatCall:
    """The call whose prompt ``POST /v1/messages/count_tokens`` counts: every field
    :func:`parse_messages` takes, checked the same way; those that shape only the reply
    (``max_tokens``, sampling, stops, ``output_config``, ``stream``) change nothing counted.

    Raises:
        InvalidRequestError: the request is malformed.
    """
    request = accept_request(MESSAGES, request, "count_tokens")  # what /v1/messages takes
    check_flag(request.get("stream"), "stream")
    chat, options = _chat_request({"max_tokens": 1, **request}, keep_billing_header)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "stop"):
        options.pop(name, None)  # they shape the reply, not the prompt
    return ChatCall.of(chat, **options)


def _chat_request(
    request: Mapping[str, Any], keep_billing_header: bool = False
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The chat messages and options of a Messages request."""
    max_tokens = request.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidParameterError(
            f"max_tokens is required, a positive integer: {max_tokens!r}", param="max_tokens"
        )
    chat: list[dict[str, Any]] = []
    system = request.get("system")
    if not keep_billing_header:
        system = without_billing_header(system)
    if system is not None:
        chat.append({"role": "system", "content": _text_of(system, "system")})
    turns = request.get("messages")
    if not isinstance(turns, list) or not turns:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, turn in enumerate(turns):
        chat += _turn(turn, i)
    options: dict[str, Any] = {"max_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if request.get(name) is not None:
            options[name] = request[name]
    temperature = options.get("temperature")
    if isinstance(temperature, (int, float)) and not 0 <= temperature <= 1:
        raise InvalidParameterError(
            f"temperature must be in [0, 1], got {temperature}", param="temperature"
        )
    stops = request.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise InvalidParameterError(
                "stop_sequences must be a list of non-empty strings", param="stop_sequences"
            )
        options["stop"] = stops
    if request.get("tools"):
        tools = _list(request["tools"], "tools")
        options["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    if request.get("tool_choice") is not None:
        options.update(_tool_choice(request["tool_choice"]))
    thinking = request.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, Mapping) else None
        if kind not in ("enabled", "adaptive", "disabled"):
            raise InvalidParameterError(
                "thinking.type must be 'enabled', 'adaptive' or 'disabled'", param="thinking.type"
            )
        options["enable_thinking"] = kind != "disabled"
    options.update(_output_config(request.get("output_config")))
    if _asks_to_cache(request):
        options["keep_prefix"] = True  # the prefix is kept longer than unhinted ones
    return chat, options


def _asks_to_cache(request: Mapping[str, Any]) -> bool:
    """Whether any ``cache_control`` is set: the request's own (automatic caching), or on
    a system block, a message's content block (a tool result's blocks included) or a tool.
    Each is checked, all are read: a hint anywhere keeps the prompt's prefix longer.

    Raises:
        InvalidParameterError: a ``cache_control`` that is not ``{"type": "ephemeral"}``.
    """
    found = check_cache_control("cache_control", request.get("cache_control"))

    def blocks(items: Any, where: str) -> None:
        nonlocal found
        if not isinstance(items, list):
            return
        for j, block in enumerate(items):
            if isinstance(block, Mapping):
                at = f"{where}[{j}]"
                found |= check_cache_control(f"{at}.cache_control", block.get("cache_control"))
                blocks(block.get("content"), f"{at}.content")  # a tool result's blocks

    blocks(request.get("system"), "system")
    for i, turn in enumerate(request.get("messages") or ()):
        if isinstance(turn, Mapping):
            blocks(turn.get("content"), f"messages[{i}].content")
    blocks(request.get("tools"), "tools")
    return found


def _output_config(config: Any) -> dict[str, Any]:
    """``output_config``: ``format`` as a JSON-schema ``response_format``; ``effort`` checked
    and otherwise without effect."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise InvalidParameterError("output_config must be an object", param="output_config")
    unknown = sorted(set(config) - {"effort", "format"})
    if unknown:
        raise InvalidParameterError(
            f"output_config has unknown field {unknown[0]!r}", param="output_config"
        )
    if config.get("effort") not in (None, "low", "medium", "high", "max"):
        raise InvalidParameterError(
            f"output_config.effort must be low, medium, high or max, got {config['effort']!r}",
            param="output_config.effort",
        )
    fmt = config.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        raise InvalidParameterError(
            "output_config.format must be {'type': 'json_schema', ...}",
            param="output_config.format",
        )
    schema = fmt.get("schema")
    if not isinstance(schema, Mapping):
        raise InvalidParameterError(
            "output_config.format needs a 'schema' object", param="output_config.format.schema"
        )
    wrapper = {"name": "output", "schema": dict(schema)}
    return {"response_format": {"type": "json_schema", "json_schema": wrapper}}


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be a list", param=where)
    return value


def _text_of(content: Any, where: str) -> str:
    """A string, or the joined text of a list of ``text`` blocks."""
    if isinstance(content, str):
        return content
    parts = []
    for block in _list(content, where):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise InvalidRequestError(f"{where}: only text blocks are supported here", param=where)
        if not isinstance(block.get("text"), str):
            raise InvalidRequestError(f"{where}: a text block needs a string 'text'", param=where)
        parts.append(block["text"])
    return "".join(parts)


def _turn(turn: Any, i: int) -> list[dict[str, Any]]:
    """One Messages turn as chat messages (a user turn with tool results becomes ``tool``
    messages, then the user's text, if any)."""
    where = f"messages[{i}]"
    if not isinstance(turn, Mapping) or turn.get("role") not in ("user", "assistant"):
        raise InvalidRequestError(
            f"{where}: role must be 'user' or 'assistant'", param=f"{where}.role"
        )
    role, content = turn["role"], turn.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts: list[str | Image] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(_list(content, f"{where}.content")):
        kind = block.get("type") if isinstance(block, Mapping) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "document" and role == "user":
            texts.append(_document(block, at))
        elif kind == "image" and role == "user":
            texts.append(_image(block, at))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                raise InvalidRequestError(
                    f"{at}: a tool_use block needs an id and a name", param=at
                )
            arguments = json.dumps(block.get("input", {}))
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequestError(
                    f"{at}: a tool_result block needs a tool_use_id", param=at
                )
            text = _text_of(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # the template renders what the model answered, not what it thought
        else:
            raise InvalidRequestError(
                f"{at}: unsupported content block {kind!r} for {role}", param=at
            )
    if role == "assistant":
        text = "".join(t for t in texts if isinstance(t, str))
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return [message]
    if not any(isinstance(t, Image) for t in texts):
        text = "".join(t for t in texts if isinstance(t, str))
        return results + ([{"role": "user", "content": text}] if texts else [])
    parts = [t if isinstance(t, Image) else {"type": "text", "text": t} for t in texts]
    return [*results, {"role": "user", "content": parts}]


def _image(block: Mapping[str, Any], where: str) -> Image:
    """An ``image`` block's image (a ``base64`` source)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind == "url":
        raise InvalidRequestError(
            f"{where}.source: image URLs are not fetched here; send a base64 source "
            "(llamax serve fetches them with --allow-image-urls)",
            param=f"{where}.source",
        )
    if kind != "base64" or not isinstance(source, Mapping):
        raise InvalidRequestError(
            f"{where}.source.type must be 'base64' or 'url', got {kind!r}",
            param=f"{where}.source.type",
        )
    if not isinstance(source.get("data"), str) or not isinstance(source.get("media_type"), str):
        raise InvalidRequestError(
            f"{where}.source needs a media_type and base64 data", param=f"{where}.source"
        )
    try:
        return Image.from_base64(source["data"], source["media_type"])
    except ImageError as exc:
        raise ImageError(f"{where}.source: {exc}") from None


def _document(block: Mapping[str, Any], where: str) -> str:
    """A text ``document`` block's text (its title, when it has one, on the line before);
    PDF, image and URL sources are refused."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind == "text" and isinstance(source, Mapping) and isinstance(source.get("data"), str):
        text = source["data"]
    elif kind == "content" and isinstance(source, Mapping):
        text = _text_of(source.get("content"), f"{where}.source.content")
    else:
        raise InvalidRequestError(
            f"{where}: only text documents are supported (source type 'text' or 'content'), "
            f"not {kind!r}",
            param=where,
        )
    title = block.get("title")
    return f"{title}\n{text}" if isinstance(title, str) and title else text


def _tool(tool: Any, index: int) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    if kind not in (None, "custom"):
        raise InvalidRequestError(
            f"tools[{index}]: server tool {kind!r} is not supported (llamax runs no server "
            "tools; declare a custom tool with an input_schema and run it yourself)",
            param=f"tools[{index}]",
        )
    if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
        raise InvalidRequestError(
            "a tool needs a 'name' and an 'input_schema'", param=f"tools[{index}]"
        )
    schema = tool.get("input_schema")
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(
            f"tool {tool['name']!r}: input_schema must be an object",
            param=f"tools[{index}].input_schema",
        )
    function: dict[str, Any] = {"name": tool["name"], "parameters": dict(schema)}
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    mapped: dict[str, Any]
    if kind == "auto":
        mapped = {"tool_choice": "auto"}
    elif kind == "any":
        mapped = {"tool_choice": "required"}
    elif kind == "none":
        mapped = {"tool_choice": "none"}
    elif kind == "tool" and isinstance(choice.get("name"), str):
        mapped = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    else:
        raise InvalidParameterError(
            "tool_choice.type must be auto, any, tool (with a name) or none",
            param="tool_choice.type",
        )
    disable = check_flag(choice.get("disable_parallel_tool_use"), "disable_parallel_tool_use")
    if disable and kind != "none":
        mapped["parallel_tool_calls"] = False
    return mapped
