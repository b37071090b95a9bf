"""OpenAI's Responses API (``POST /v1/responses``), the request side: :func:`parse_create`
maps a body onto the :class:`~llamax.chat.ChatCall` it asks for (and what its reply echoes
and stores). Pure: no context, no server; ``previous_response_id`` is read from a
:class:`ResponseStore` (``llamax.openai.ResponseStore`` is one); ``llamax.openai`` submits
the call and shapes the reply. Supported and not, plainly:

- ``input``: a string, or items: messages (roles ``user``, ``assistant``, ``system``,
  ``developer``; content a string or ``input_text``/``output_text`` parts, and in a user
  message ``input_image`` parts with a base64 ``data:`` URL), ``function_call``,
  ``function_call_output`` and ``reasoning`` (dropped: the template sees the text). Images
  by ``file_id`` or remote URL (``llamax serve`` fetches those with
  ``--allow-image-urls``), files, audio and item references are refused.
- Fields: the table :data:`llamax.dialects.openai.RESPONSES` says which are honoured,
  accepted as hints or refused, and why; any other field is refused. ``reasoning.effort``
  ``none``/``minimal`` turns the template's ``enable_thinking`` off, other efforts on.
- ``previous_response_id``: the stored conversation, then this input (a prefix the cache
  holds); the earlier ``instructions`` are not carried over, as with OpenAI.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..chat import ChatCall
from ..chat.options import check_flag, check_text, keeps_prefix
from ..errors import ImageError, InvalidParameterError, InvalidRequestError, NotFoundError
from ..images import Image
from .fields import accept_request, honoured
from .openai import RESPONSES, check_metadata

__all__ = ["REQUEST_FIELDS", "ResponseStore", "ResponsesRequest", "parse_create"]

REQUEST_FIELDS = honoured(RESPONSES)
"""The Responses request fields llamax takes (the honoured ones of :data:`RESPONSES`)."""

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
Messages = list[dict[str, Any]]


class ResponseStore(Protocol):
    """Where :func:`parse_create` reads the responses ``previous_response_id`` names."""

    def follow_up(self, response_id: str) -> tuple[Messages, Messages]:
        """The stored response's conversation (its reply included, not its
        ``instructions``) and items (input, then output); ``LookupError``: no such id."""


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A Responses request, parsed: its call, and what its reply echoes and stores."""

    call: ChatCall
    """``instructions``, the stored conversation, then the input; the request's model."""
    body: Mapping[str, Any]
    """The request without its hints: what the ``response`` object echoes."""
    conversation: tuple[dict[str, Any], ...]
    """What is stored with the reply: the conversation without ``instructions``."""
    earlier_items: tuple[dict[str, Any], ...]
    """The items of the conversation ``previous_response_id`` continues."""
    stream: bool
    store: bool
    """Whether the finished response is kept (not with ``store: false``)."""
    max_output_tokens: int | None
    previous_response_id: str | None
    metadata: Mapping[str, str]


def parse_create(body: Mapping[str, Any], store: ResponseStore | None = None) -> ResponsesRequest:
    """The call a ``POST /v1/responses`` body asks for: its fields checked against
    :data:`RESPONSES`, ``previous_response_id``'s conversation read from ``store``, the
    input items and ``instructions`` mapped onto chat messages, the rest onto options.

    Raises:
        InvalidRequestError: the request is malformed.
        NotFoundError: ``previous_response_id`` names no stored response (or ``store`` is
            ``None``).
    """
    request = accept_request(RESPONSES, body, "responses")
    for flag in ("stream", "store", "parallel_tool_calls"):  # "no" must not mean yes
        check_flag(request.get(flag), flag)
    check_metadata("metadata", request.get("metadata"))
    check_text("user", request.get("user"))
    history: Messages = []
    earlier_items: Messages = []
    param = "previous_response_id"
    previous = request.get(param)
    if previous is not None:
        if not isinstance(previous, str):
            raise InvalidParameterError(f"{param} must be a string", param=param)
        if store is None:
            raise NotFoundError(
                f"{param}: {previous!r} cannot be found: no response store", param=param
            )
        try:
            history, earlier_items = store.follow_up(previous)
        except LookupError as exc:
            raise NotFoundError(f"{param}: {exc}", param=param) from None
    conversation = history + _input(request.get("input"))
    instructions = request.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidParameterError("instructions must be a string", param="instructions")
    chat = [] if instructions is None else [{"role": "system", "content": instructions}]
    options = _options(request)
    call = ChatCall.of(chat + conversation, model=request.get("model"), **options)
    return ResponsesRequest(
        call, request, tuple(conversation), tuple(earlier_items), request.get("stream") is True,
        request.get("store") is not False, options.get("max_tokens"), previous,
        request.get("metadata") or {},
    )  # fmt: skip


def _input(value: Any) -> Messages:
    """The request's ``input`` as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(
            "input must be a string or a non-empty list of items", param="input"
        )
    chat: Messages = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise InvalidRequestError(
                    f"{where}: role must be user, assistant, system or developer",
                    param=f"{where}.role",
                )
            chat.append({"role": role, "content": _content_of(item.get("content"), where, role)})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            arguments = item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise InvalidRequestError(
                    f"{where}: a function_call needs a call_id and a name", param=where
                )
            if not isinstance(arguments, str):
                raise InvalidRequestError(
                    f"{where}: arguments must be a JSON string", param=f"{where}.arguments"
                )
            function = {"name": name, "arguments": arguments}
            call = {"id": call_id, "type": "function", "function": function}
            if chat and chat[-1]["role"] == "assistant":
                chat[-1].setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise InvalidRequestError(
                    f"{where}: a function_call_output needs a call_id", param=f"{where}.call_id"
                )
            output = _text_of(item.get("output", ""), f"{where}.output")
            chat.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":  # reasoning: the template renders the answer, not the thought
            raise InvalidRequestError(
                f"{where}: unsupported input item type {kind!r}", param=f"{where}.type"
            )
    return chat


def _content_of(content: Any, where: str, role: str) -> Any:
    """A message's content as chat content: a string, or (with images, in a user message)
    text parts and :class:`~llamax.Image` s."""
    if role != "user" or not isinstance(content, list):
        return _text_of(content, where)
    if not any(isinstance(p, Mapping) and p.get("type") == "input_image" for p in content):
        return _text_of(content, where)
    parts: list[Any] = []
    for j, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") == "input_image":
            parts.append(_input_image(part, f"{where}.content[{j}]"))
        else:
            parts.append({"type": "text", "text": _text_of([part], where)})
    return parts


def _input_image(part: Mapping[str, Any], where: str) -> Image:
    """An ``input_image`` part's image: its ``image_url`` must be a base64 ``data:`` URL."""
    unknown = sorted(set(part) - {"type", "image_url", "file_id", "detail"})
    if unknown:
        raise InvalidRequestError(
            f"{where}: input_image has unknown field {unknown[0]!r}", param=where
        )
    if part.get("detail") not in (None, "auto", "low", "high"):
        raise InvalidParameterError(
            f"{where}.detail must be 'auto', 'low' or 'high', got {part['detail']!r}",
            param=f"{where}.detail",
        )
    if part.get("file_id") is not None:
        raise InvalidRequestError(
            f"{where}: input_image by file_id is not supported (llamax stores no files); "
            "send image_url as a data: URL",
            param=f"{where}.file_id",
        )
    url = part.get("image_url")
    if not isinstance(url, str):
        raise InvalidRequestError(
            f"{where}: an input_image needs image_url, a data: URL", param=f"{where}.image_url"
        )
    if url.startswith(("http://", "https://")):
        raise InvalidRequestError(
            f"{where}.image_url: remote image URLs are not fetched here; send a data: URL "
            "(llamax serve fetches them with --allow-image-urls)",
            param=f"{where}.image_url",
        )
    try:
        return Image.from_data_url(url)
    except ImageError as exc:
        raise ImageError(f"{where}.image_url of the input_image: {exc}") from None


def _text_of(content: Any, where: str) -> str:
    """A string, or the joined text of ``input_text``/``output_text`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{where}: content must be a string or a list of parts", param=where
        )
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        else:
            raise InvalidRequestError(
                f"{where}.content[{j}]: unsupported content part {kind!r} (text only)",
                param=f"{where}.content[{j}]",
            )
    return "".join(parts)


def _options(request: Mapping[str, Any]) -> dict[str, Any]:
    """The chat options of a Responses request."""
    options: dict[str, Any] = {}
    limit = request.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise InvalidParameterError(
                f"max_output_tokens must be a positive integer: {limit!r}",
                param="max_output_tokens",
            )
        options["max_tokens"] = limit
    named = ("temperature", "top_p", "user")
    options.update({name: request[name] for name in named if request.get(name) is not None})
    temperature = options.get("temperature")
    if isinstance(temperature, (int, float)) and not 0 <= temperature <= 2:
        raise InvalidParameterError(
            f"temperature must be in [0, 2], got {temperature}", param="temperature"
        )
    if request.get("tools"):
        if request.get("parallel_tool_calls") is not None:
            options["parallel_tool_calls"] = request["parallel_tool_calls"]
        tools = request["tools"]
        if not isinstance(tools, list):
            raise InvalidRequestError("tools must be a list", param="tools")
        options["tools"] = [_tool(t) for t in tools]
    if request.get("tool_choice") is not None:
        options["tool_choice"] = _tool_choice(request["tool_choice"])
    text = request.get("text")
    if text is not None:
        if not isinstance(text, Mapping) or set(text) - {"format", "verbosity"}:
            raise InvalidParameterError("text must be an object with a 'format'", param="text")
        response_format = _format(text.get("format"))
        if response_format is not None:
            options["response_format"] = response_format
    reasoning = request.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, Mapping):
            raise InvalidParameterError("reasoning must be an object", param="reasoning")
        effort = reasoning.get("effort")
        if effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh"):
            raise InvalidParameterError(
                f"reasoning.effort is not an effort: {effort!r}", param="reasoning.effort"
            )
        if effort is not None:
            options["enable_thinking"] = effort not in ("none", "minimal")
    if check_flag(request.get("return_progress"), "return_progress"):
        options["return_progress"] = True
    if keeps_prefix(request):  # prompt_cache_key, prompt_cache_retention
        options["keep_prefix"] = True  # the prefix is kept longer
    check_flag(request.get("timings_per_token"), "timings_per_token")  # the server's
    truncation = request.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise InvalidParameterError("truncation must be 'auto' or 'disabled'", param="truncation")
    if truncation == "auto":
        options["truncate"] = "oldest_messages"
    return options


def _tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        raise InvalidRequestError(
            f"tools: only function tools are supported, not {kind!r}", param="tools"
        )
    if not isinstance(tool.get("name"), str):
        raise InvalidRequestError("tools: a function tool needs a 'name'", param="tools")
    function = {name: tool[name] for name in ("name", "description", "parameters", "strict")
                if tool.get(name) is not None}  # fmt: skip
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    function = isinstance(choice, Mapping) and choice.get("type") == "function"
    if function and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidParameterError(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def _format(fmt: Any) -> dict[str, Any] | None:
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), Mapping):
            raise InvalidParameterError(
                "text.format json_schema needs a 'schema' object", param="text.format"
            )
        wrapper = {"name": fmt.get("name", "response"), "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            wrapper["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": wrapper}
    raise InvalidParameterError(
        f"text.format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="text.format.type",
    )
