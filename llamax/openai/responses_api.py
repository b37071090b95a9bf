"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat layer: the request's
``input`` items are mapped to chat messages, and the chat result back to ``response``
objects and the typed stream events (``response.created``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.completed`` ...).

Supported and not, plainly:

- ``input``: a string, or items: messages (roles ``user``, ``assistant``, ``system`` and
  ``developer``; content a string or ``input_text``/``output_text`` parts, and in a user
  message ``input_image`` parts whose ``image_url`` is a base64 ``data:`` URL),
  ``function_call``, ``function_call_output`` and ``reasoning`` (dropped from the prompt:
  the template sees the text). Image files by ``file_id``, remote image URLs (``llamax
  serve`` fetches those with ``--allow-image-urls``), files, audio and item references
  are refused (:class:`~llamax.InvalidRequestError`).
- Fields: the table :data:`llamax.dialects.openai.RESPONSES` says which are honoured,
  accepted as hints (no effect) or refused, and why; any other field is refused. Built-in
  tools such as web search are refused; ``reasoning.effort`` ``none``/``minimal`` turns
  thinking off, other efforts on, through the template's ``enable_thinking``; ``summary``
  returns the thinking as the reasoning item's summary; ``truncation: auto`` drops the
  oldest turns.
- ``previous_response_id`` needs a :class:`ResponseStore`: the follow-up's conversation is
  the stored one plus its own input (a prefix the cache already holds). The earlier
  response's ``instructions`` are not carried over, as with OpenAI.
- One output per request (no ``n``), no background mode.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from ..chat import CallHost, ChatCall, chat_prompt_tokens, submit_in_worker
from ..chat.options import MAX_USER_CHARS, check_flag, keeps_prefix
from ..dialects.fields import accept_fields, honoured
from ..dialects.openai import RESPONSES, check_metadata
from ..errors import ImageError, InvalidParameterError, InvalidRequestError, NotFoundError
from ..images import Image
from .requests import OpenAIRequest
from .responses_output import ResponseEvents, ResponseJob, ResponseStore

__all__ = [
    "RESPONSE_FIELDS",
    "ResponseStore",
    "acreate_response",
    "create_response",
    "response_input_tokens",
]

RESPONSE_FIELDS = honoured(RESPONSES)
"""The Responses request fields this layer takes (the honoured ones of
:data:`llamax.dialects.openai.RESPONSES`)."""

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def create_response(
    ctx: CallHost,
    request: Mapping[str, Any],
    *,
    store: ResponseStore | None = None,
    stored_input: Any = None,
) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """Answer one Responses request: the ``response`` object, or with ``stream: true`` an
    iterator of its events (closing it cancels the request).

    Args:
        ctx: The context.
        request: A mapping shaped as the ``POST /v1/responses`` body.
        store: Where ``previous_response_id`` is looked up and, unless the request says
            ``store: false``, where the finished response is kept. ``None``: nothing is
            stored, and a ``previous_response_id`` is not found.
        stored_input: What the stored response lists as its input items instead of
            ``request["input"]`` (``None``: that): a server that fetched image URLs into
            ``data:`` URLs passes the input as the client sent it, so the store hands back
            the URLs, never the fetched bytes.

    Raises:
        InvalidRequestError: the request is malformed (nothing was enqueued).
        NotFoundError: ``previous_response_id`` names no stored response.
        ContextLengthError: the conversation does not fit.
    """
    job = _submit(ctx, request, store, stored_input, None)
    if request.get("stream"):
        return job.submitted.events(ResponseEvents(job))
    return job.finish(job.submitted.handle.result())


async def acreate_response(
    ctx: CallHost,
    request: Mapping[str, Any],
    *,
    store: ResponseStore | None = None,
    stored_input: Any = None,
    fair_key: str | None = None,
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Async twin of :func:`create_response` (needs the context's background loop).
    Mapping, rendering and tokenizing run in a worker thread, so the event loop stays
    free. ``fair_key``: the fairness key of the submitted request (``Context.submit_chat``;
    the server passes the client's address), never a field of ``request``."""
    job = await submit_in_worker(
        lambda: _submit(ctx, request, store, stored_input, fair_key), lambda j: j.submitted.handle
    )
    if request.get("stream"):
        return job.submitted.aevents(ResponseEvents(job))
    return job.finish(await job.submitted.handle)


# ---------------------------------------------------------------------- the request
def response_input_tokens(
    ctx: CallHost, request: Mapping[str, Any], *, store: ResponseStore | None = None
) -> int:
    """How many prompt tokens a Responses request would submit (OpenAI's
    ``POST /v1/responses/input_tokens``): its conversation (``previous_response_id``'s
    included), instructions and tools rendered and tokenized, nothing submitted.

    Raises:
        InvalidRequestError: the request is malformed.
        NotFoundError: ``previous_response_id`` names no stored response.
    """
    _, chat, _, options, _ = _conversation(request, store)
    return ctx.prompt_positions(chat_prompt_tokens(ctx, ChatCall.of(chat, **options)))


def _submit(
    ctx: CallHost,
    request: Mapping[str, Any],
    store: ResponseStore | None,
    stored_input: Any,
    fair_key: str | None,
) -> ResponseJob:
    request, chat, turn, options, earlier_items = _conversation(request, store)
    handle = ctx.submit_chat(ChatCall.of(chat, **options), fair_key=fair_key)
    submitted = OpenAIRequest(handle.named(request.get("model")))
    keep = store if request.get("store", True) is not False else None
    kept = dict(request) if stored_input is None else {**request, "input": stored_input}
    return ResponseJob(submitted, kept, turn, keep, options.get("max_tokens"), earlier_items)


def _conversation(
    request: Mapping[str, Any], store: ResponseStore | None
) -> tuple[
    Mapping[str, Any],
    list[dict[str, Any]],
    list[dict[str, Any]],
    dict[str, Any],
    list[dict[str, Any]],
]:
    """A request checked and mapped: the request without its hints, the chat to render,
    the conversation to store (the history and this turn's messages), the chat options,
    and the input items of the responses it follows."""
    if not isinstance(request, Mapping):
        raise InvalidRequestError("a responses request must be an object")
    request = accept_fields(RESPONSES, request)
    unknown = sorted(set(request) - RESPONSE_FIELDS)
    if unknown:
        raise InvalidRequestError(
            f"responses: unsupported field(s): {', '.join(unknown)}", param=unknown[0]
        )
    for flag in ("stream", "store", "parallel_tool_calls"):  # "no" must not mean yes
        check_flag(request.get(flag), flag)
    check_metadata("metadata", request.get("metadata"))
    user = request.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise InvalidParameterError(
            f"user must be a string of at most {MAX_USER_CHARS} characters", param="user"
        )
    history: list[dict[str, Any]] = []
    earlier_items: list[dict[str, Any]] = []
    previous = request.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise InvalidParameterError(
                "previous_response_id must be a string", param="previous_response_id"
            )
        if store is None:
            raise NotFoundError(
                f"previous_response_id: {previous!r} cannot be found: no response store",
                param="previous_response_id",
            )
        try:
            history, earlier_items = store.follow_up(previous)
        except NotFoundError as exc:
            raise NotFoundError(
                f"previous_response_id: {exc}", param="previous_response_id"
            ) from None
    turn = _input(request.get("input"))
    chat = history + turn
    instructions = request.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidParameterError("instructions must be a string", param="instructions")
        chat.insert(0, {"role": "system", "content": instructions})
    return request, chat, history + turn, _options(request), earlier_items


def _input(value: Any) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(
            "input must be a string or a non-empty list of items", param="input"
        )
    chat: list[dict[str, Any]] = []
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
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = chat[-1] if chat else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
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
        elif kind == "reasoning":
            continue  # the template renders what the model answered, not what it thought
        else:
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
    for name in ("temperature", "top_p", "user"):
        if request.get(name) is not None:
            options[name] = request[name]
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
    choice = request.get("tool_choice")
    if choice is not None:
        options["tool_choice"] = _tool_choice(choice)
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
    hints = ("prompt_cache_key", "prompt_cache_retention")
    if keeps_prefix({name: request.get(name) for name in hints}):
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
    function: dict[str, Any] = {"name": tool["name"]}
    for name in ("description", "parameters", "strict"):
        if tool.get(name) is not None:
            function[name] = tool[name]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if (
        isinstance(choice, Mapping)
        and choice.get("type") == "function"
        and isinstance(choice.get("name"), str)
    ):
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
        assert isinstance(fmt, Mapping)
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
