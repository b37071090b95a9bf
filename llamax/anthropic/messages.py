"""Anthropic's Messages API on top of :mod:`llamax.openai`: the request is mapped to a chat
request (system, text, ``tool_use`` and ``tool_result`` blocks, tools, ``thinking``), and
the result back to Anthropic's shapes: content blocks (``thinking``, ``text``,
``tool_use``), ``stop_reason``, ``usage``, and the streamed event sequence.

Supported and not, plainly:

- Content blocks: ``text`` everywhere, ``tool_use`` (assistant) and ``tool_result``
  (user, with text content), text ``document`` blocks (user), ``image`` blocks (user, a
  ``base64`` source; a ``url`` source is fetched by ``llamax serve`` only with
  ``--allow-image-urls``) and ``thinking`` (assistant; dropped from the prompt: the
  template sees the text). Images in tool results and PDF or URL documents are refused
  (:class:`~llamax.InvalidRequestError`).
- Fields: the table :data:`llamax.dialects.anthropic.MESSAGES` says which are honoured,
  accepted as hints (no effect) or refused, and why; any other field is refused.
- ``cache_control`` (the request's, or on any system block, content block or tool) is a
  hint: the prompt's prefix is kept longer than unhinted ones
  (``SamplingParams.keep_prefix``); where the breakpoints sit changes nothing, as every
  shared prefix is reused.
  ``thinking`` (``enabled``, ``adaptive`` or ``disabled``) is passed to templates as
  ``enable_thinking``; ``budget_tokens`` is not enforced.
- One reply per request (Anthropic has no ``n``).
- Claude Code's per-request attribution block (a system text block starting with
  ``x-anthropic-billing-header:``) is left out of the prompt, so the prefix cache keeps
  working from turn to turn (:mod:`llamax.anthropic.volatile`); ``keep_billing_header=True``
  renders it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..chat import ChatCall, chat_prompt_tokens, submit_in_worker
from ..chat.options import check_flag
from ..chat_stream import (
    ChatPart,
    ContentDelta,
    Finished,
    Progress,
    ReasoningDelta,
    ToolCallDelta,
)
from ..dialects.anthropic import MESSAGES, check_cache_control
from ..dialects.fields import accept_fields, honoured
from ..errors import ImageError, InvalidParameterError, InvalidRequestError
from ..images import Image
from ..openai import OpenAIRequest
from ..results import Completion, FinishReason
from .volatile import without_billing_header

if TYPE_CHECKING:
    from .. import Context

__all__ = ["amessages", "count_tokens", "messages"]

REQUEST_FIELDS = honoured(MESSAGES)
"""The Messages request fields this layer takes."""
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def messages(
    ctx: Context, request: Mapping[str, Any], *, keep_billing_header: bool = False
) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """Answer one Messages request: the ``message`` object, or with ``stream: true`` an
    iterator of its events (closing it cancels the request).

    Args:
        ctx: The context.
        request: A mapping shaped as the ``POST /v1/messages`` body.
        keep_billing_header: Render Claude Code's ``x-anthropic-billing-header:`` system
            block; by default it is left out, as it changes on every request and would
            break the prefix cache (:mod:`llamax.anthropic.volatile`).

    Raises:
        InvalidRequestError: the request is malformed (nothing was enqueued).
        ContextLengthError: the conversation does not fit.
    """
    submitted, stops = _submit(ctx, request, keep_billing_header, None)
    if request.get("stream"):
        return submitted.events(_EventBuilder(submitted, stops))
    return _message(submitted, submitted.handle.result(), stops)


async def amessages(
    ctx: Context,
    request: Mapping[str, Any],
    *,
    keep_billing_header: bool = False,
    fair_key: str | None = None,
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Async twin of :func:`messages` (needs the context's background loop). Mapping,
    rendering and tokenizing run in a worker thread, so the event loop stays free.
    ``fair_key``: the fairness key of the submitted request (``Context.submit_chat``;
    the server passes the client's address), never a field of ``request``."""
    submitted, stops = await submit_in_worker(
        lambda: _submit(ctx, request, keep_billing_header, fair_key), lambda s: s[0].handle
    )
    if request.get("stream"):
        return submitted.aevents(_EventBuilder(submitted, stops))
    return _message(submitted, await submitted.handle, stops)


def count_tokens(
    ctx: Context, request: Mapping[str, Any], *, keep_billing_header: bool = False
) -> dict[str, int]:
    """``POST /v1/messages/count_tokens``: the prompt tokens of the request's conversation
    (system, messages and tools), as :func:`messages` would render them (with the same
    ``keep_billing_header``). It takes every field :func:`messages` takes, checked the
    same way: those that shape only the reply (``max_tokens``, sampling, stops,
    ``output_config``, ``stream``) change nothing counted."""
    if not isinstance(request, Mapping):
        raise InvalidRequestError("a count_tokens request must be an object")
    request = accept_fields(MESSAGES, request)  # hints such as metadata change nothing
    _check_fields(request, REQUEST_FIELDS, "count_tokens")  # what /v1/messages takes
    check_flag(request.get("stream"), "stream")
    chat, options = _chat_request({"max_tokens": 1, **request}, keep_billing_header)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "stop"):
        options.pop(name, None)  # they shape the reply, not the prompt
    call = ChatCall.of(chat, **options)
    return {"input_tokens": ctx.prompt_positions(chat_prompt_tokens(ctx, call))}


# ---------------------------------------------------------------------- the request
def _check_fields(request: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    if not isinstance(request, Mapping):
        raise InvalidRequestError(f"a {where} request must be an object")
    unknown = sorted(set(request) - allowed)
    if unknown:
        raise InvalidRequestError(
            f"{where}: unsupported field(s): {', '.join(unknown)}", param=unknown[0]
        )


def _submit(
    ctx: Context, request: Mapping[str, Any], keep_billing_header: bool, fair_key: str | None
) -> tuple[OpenAIRequest, list[str]]:
    if not isinstance(request, Mapping):
        raise InvalidRequestError("a messages request must be an object")
    request = accept_fields(MESSAGES, request)
    _check_fields(request, REQUEST_FIELDS, "messages")
    check_flag(request.get("stream"), "stream")  # "no" must not stream
    chat, options = _chat_request(request, keep_billing_header)
    prefill = ""
    last = chat[-1]
    if last["role"] == "assistant" and not last.get("tool_calls") and len(chat) > 1:
        prefill = (last.get("content") or "").rstrip()  # Anthropic refuses trailing space
        chat = chat[:-1]
    if request.get("stream") is True:  # message_start waits for the cached count
        options["return_progress"] = True
    handle = ctx.submit_chat(ChatCall.of(chat, prefill=prefill, **options), fair_key=fair_key)
    submitted = OpenAIRequest(handle.named(request.get("model")))
    return submitted, list(options.get("stop") or [])


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


# ---------------------------------------------------------------------- the response
def _tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` id for a chat tool call's ``call_`` id."""
    return "toolu_" + call_id.removeprefix("call_")


def _message_id(submitted: OpenAIRequest) -> str:
    return "msg_" + submitted.handle.request_id.removeprefix("req-")


def _stop(submitted: OpenAIRequest, completion: Completion, stops: Sequence[str]) -> str | None:
    """The stop sequence the reply ended at, if one did."""
    choice = completion.choices[0]
    if choice.finish_reason is not FinishReason.STOP or not stops:
        return None
    rest = submitted.chat.chat_model.detokenize(choice.token_ids)[len(choice.text) :]
    return next((s for s in stops if rest.startswith(s)), None)


def _usage(completion: Completion, output_tokens: int | None = None) -> dict[str, int]:
    usage = completion.usage
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage.completion_tokens if output_tokens is None else output_tokens,
    }


def _message(
    submitted: OpenAIRequest, completion: Completion, stops: Sequence[str]
) -> dict[str, Any]:
    choice = submitted.response(completion)["choices"][0]
    message: Any = choice["message"]  # type: ignore[typeddict-item]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls", []):
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": _tool_use_id(call["id"]),
                "name": function["name"],
                "input": json.loads(function["arguments"]),
            }
        )
    stop_sequence = _stop(submitted, completion, stops)
    return {
        "id": _message_id(submitted),
        "type": "message",
        "role": "assistant",
        "model": submitted.chat.model,
        "content": content,
        "stop_reason": "stop_sequence"
        if stop_sequence
        else _STOP_REASONS.get(str(choice["finish_reason"]), "end_turn"),
        "stop_sequence": stop_sequence,
        "usage": _usage(completion),
    }


class _EventBuilder:
    """Encodes a chat request's typed stream as Messages stream events, one content block
    at a time: ``thinking``, then ``text``, then each ``tool_use``.

    ``message_start`` is sent once the prompt's first chunk is computed (the request is
    submitted with ``prefill_progress``), so its ``usage`` says truly how many prompt
    tokens the cache held, as Anthropic's does; Claude Code reads its cache counts there."""

    def __init__(self, submitted: OpenAIRequest, stops: Sequence[str]) -> None:
        self._submitted, self._stops = submitted, stops
        self._index = -1
        self._open: str | None = None
        self._finish: str | None = None
        self._started = False

    def start(self) -> list[dict[str, Any]]:
        """Nothing yet: ``message_start`` waits for the prompt's first progress part, which
        says how many of its tokens the cache held (:meth:`parts`)."""
        return []

    def _message_start(self, cached: int) -> list[dict[str, Any]]:
        """``message_start`` (usage as Anthropic counts it: ``input_tokens`` are the prompt
        tokens computed, ``cache_read_input_tokens`` those the cache held) and a ping."""
        self._started = True
        submitted = self._submitted
        usage = {
            "input_tokens": submitted.chat.num_prompt_tokens - cached,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": 0,
        }
        message: dict[str, Any] = {
            "id": _message_id(submitted),
            "type": "message",
            "role": "assistant",
            "model": submitted.chat.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _block(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self._index += 1
        self._open = kind
        events.append({"type": "content_block_start", "index": self._index, "content_block": block})
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._index}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def parts(self, parts: Sequence[ChatPart]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for part in parts:
            if not self._started:
                cached = part.progress.num_cached_tokens if isinstance(part, Progress) else 0
                events += self._message_start(cached)
            match part:
                case ReasoningDelta(text=text):
                    if self._open != "thinking":
                        events += self._block(
                            "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                        )
                    events.append(self._delta({"type": "thinking_delta", "thinking": text}))
                case ContentDelta(text=text) if text:
                    if self._open != "text":
                        events += self._block("text", {"type": "text", "text": ""})
                    events.append(self._delta({"type": "text_delta", "text": text}))
                case ToolCallDelta(call_id=call_id, name=name, arguments=arguments):
                    if call_id is not None:
                        block = {
                            "type": "tool_use",
                            "id": _tool_use_id(call_id),
                            "name": name or "",
                            "input": {},
                        }
                        events += self._block("tool_use", block)
                    if arguments:
                        events.append(
                            self._delta({"type": "input_json_delta", "partial_json": arguments})
                        )
                case Finished(reason=reason):
                    self._finish = reason
                    events += self._close()
        return events

    def end(self, completion: Completion) -> list[dict[str, Any]]:
        stop_sequence = _stop(self._submitted, completion, self._stops)
        reason = (
            "stop_sequence"
            if stop_sequence
            else _STOP_REASONS.get(self._finish or "stop", "end_turn")
        )
        usage = _usage(completion)
        begun = [] if self._started else self._message_start(completion.usage.cached_tokens)
        return [
            *begun,
            *self._close(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                "usage": usage,
            },
            {"type": "message_stop"},
        ]
