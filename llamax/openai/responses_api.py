"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat layer: the request's
``input`` items are mapped to chat messages, and the chat result back to ``response``
objects and the typed stream events (``response.created``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.completed`` ...).

Supported and not, plainly:

- ``input``: a string, or items: messages (roles ``user``, ``assistant``, ``system`` and
  ``developer``; content a string or ``input_text``/``output_text`` parts),
  ``function_call``, ``function_call_output`` and ``reasoning`` (dropped from the prompt:
  the template sees the text). Images, files, audio and item references are refused
  (:class:`~llamax.InvalidRequestError`).
- Options: ``instructions``, ``tools`` (``function`` tools only; built-in tools such as web
  search are refused), ``tool_choice`` (``auto``, ``none``, ``required`` or one function),
  ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``,
  ``text.format`` (``text``, ``json_object``, ``json_schema``), ``reasoning`` (``effort``
  ``none``/``minimal`` turns thinking off, other efforts on, through the template's
  ``enable_thinking``; ``summary`` returns the thinking as the reasoning item's summary),
  ``truncation`` (``auto`` drops the oldest turns), ``previous_response_id``, ``store``,
  ``metadata``, ``user``, ``stream``. Any other field is refused.
- ``previous_response_id`` needs a :class:`ResponseStore`: the follow-up's conversation is
  the stored one plus its own input (a prefix the cache already holds). The earlier
  response's ``instructions`` are not carried over, as with OpenAI.
- One output per request (no ``n``), no background mode, no ``include``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from ..chat_stream import ChatPart, ContentDelta, ReasoningDelta, ToolCallDelta
from ..errors import InvalidParameterError, InvalidRequestError, NotFoundError
from ..results import Completion, FinishReason
from .api import submit_chat, submit_in_worker
from .options import check_flag
from .requests import OpenAIRequest

if TYPE_CHECKING:
    from .. import Context

__all__ = ["RESPONSE_FIELDS", "ResponseStore", "acreate_response", "create_response"]

MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's bounds on ``metadata``: pairs, and characters of a key and of a value."""
MAX_USER_CHARS = 256
"""Longest ``user`` string (it is echoed in the response, and stored with it)."""

RESPONSE_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "text",
        "reasoning",
        "truncation",
        "previous_response_id",
        "store",
        "metadata",
        "user",
        "stream",
    }
)
"""The Responses request fields this layer takes."""

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True, slots=True)
class _Stored:
    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    size: int


def _chars(value: Any) -> int:
    """The characters of a stored object (its strings, keys included, nested; 8 for any
    other leaf), counted without serializing it: a store on the server's event loop stays
    cheap."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_chars(k) + _chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    return 8


class ResponseStore:
    """A bounded, thread-safe store of recent responses, for ``previous_response_id``.

    Least recently used entries go first once there are more than ``max_responses`` or
    they hold more than ``max_chars`` characters. An entry is counted whole: its
    ``response`` object (``metadata``, ``user``, ``instructions``, ``tools`` ... as echoed)
    and its conversation (each entry keeps its whole conversation, so a long chain costs
    what its longest member holds); every string counts its characters, keys too, and any
    other value 8.

    Args:
        max_responses: Most responses kept.
        max_chars: Most characters kept, over all stored responses and conversations.

    Raises:
        ValueError: a bound is not positive.
    """

    def __init__(self, max_responses: int = 1024, max_chars: int = 64 << 20) -> None:
        if max_responses < 1 or max_chars < 1:
            raise ValueError("max_responses and max_chars must be >= 1")
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def num_chars(self) -> int:
        """The characters counted over every stored entry (at most ``max_chars``)."""
        with self._lock:
            return self._chars

    def get(self, response_id: str) -> dict[str, Any]:
        """The stored ``response`` object.

        Raises:
            NotFoundError: no response has that id (never stored, deleted or evicted).
        """
        return dict(self._entry(response_id).response)

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The chat messages up to and including the response's output (without its
        ``instructions``).

        Raises:
            NotFoundError: no response has that id.
        """
        return [dict(m) for m in self._entry(response_id).conversation]

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was there."""
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._chars -= entry.size
            return entry is not None

    def put(self, response: Mapping[str, Any], conversation: Sequence[Mapping[str, Any]]) -> None:
        """Keep ``response`` (by its ``id``) with its conversation, evicting the least
        recently used entries past the bounds. An entry larger than ``max_chars`` alone is
        not kept."""
        kept = dict(response)
        frozen = tuple(dict(m) for m in conversation)
        size = _chars(kept) + sum(_chars(m) for m in frozen)
        if size > self.max_chars:
            return
        with self._lock:
            old = self._entries.pop(str(response["id"]), None)
            if old is not None:
                self._chars -= old.size
            self._entries[str(response["id"])] = _Stored(kept, frozen, size)
            self._chars += size
            while len(self._entries) > self.max_responses or self._chars > self.max_chars:
                _, evicted = self._entries.popitem(last=False)
                self._chars -= evicted.size

    def _entry(self, response_id: str) -> _Stored:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                raise NotFoundError(
                    f"previous_response_id: no stored response has id {response_id!r} "
                    "(it was never stored, was deleted, or the store evicted it)"
                )
            self._entries.move_to_end(response_id)
            return entry


def create_response(
    ctx: Context, request: Mapping[str, Any], *, store: ResponseStore | None = None
) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """Answer one Responses request: the ``response`` object, or with ``stream: true`` an
    iterator of its events (closing it cancels the request).

    Args:
        ctx: The context.
        request: A mapping shaped as the ``POST /v1/responses`` body.
        store: Where ``previous_response_id`` is looked up and, unless the request says
            ``store: false``, where the finished response is kept. ``None``: nothing is
            stored, and a ``previous_response_id`` is not found.

    Raises:
        InvalidRequestError: the request is malformed (nothing was enqueued).
        NotFoundError: ``previous_response_id`` names no stored response.
        ContextLengthError: the conversation does not fit.
    """
    job = _submit(ctx, request, store)
    if request.get("stream"):
        return job.submitted.events(_EventBuilder(job))
    return job.finish(job.submitted.handle.result())


async def acreate_response(
    ctx: Context, request: Mapping[str, Any], *, store: ResponseStore | None = None
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Async twin of :func:`create_response` (needs the context's background loop).
    Mapping, rendering and tokenizing run in a worker thread, so the event loop stays
    free."""
    job = await submit_in_worker(lambda: _submit(ctx, request, store), lambda j: j.submitted)
    if request.get("stream"):
        return job.submitted.aevents(_EventBuilder(job))
    return job.finish(await job.submitted.handle)


# ---------------------------------------------------------------------- the request
def _submit(ctx: Context, request: Mapping[str, Any], store: ResponseStore | None) -> _Job:
    if not isinstance(request, Mapping):
        raise InvalidRequestError("a responses request must be an object")
    unknown = sorted(set(request) - RESPONSE_FIELDS)
    if unknown:
        raise InvalidRequestError(f"responses: unsupported field(s): {', '.join(unknown)}")
    for flag in ("stream", "store", "parallel_tool_calls"):  # "no" must not mean yes
        check_flag(request.get(flag), flag)
    _check_metadata(request.get("metadata"))
    user = request.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise InvalidParameterError(f"user must be a string of at most {MAX_USER_CHARS} characters")
    history: list[dict[str, Any]] = []
    previous = request.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise InvalidParameterError("previous_response_id must be a string")
        if store is None:
            raise NotFoundError(
                f"previous_response_id: {previous!r} cannot be found: no response store"
            )
        history = store.conversation(previous)
    turn = _input(request.get("input"))
    chat = history + turn
    instructions = request.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidParameterError("instructions must be a string")
        chat.insert(0, {"role": "system", "content": instructions})
    options = _options(request)
    submitted = submit_chat(ctx, chat, **options).named(request.get("model"))
    keep = store if request.get("store", True) is not False else None
    return _Job(submitted, dict(request), history + turn, keep, options.get("max_tokens"))


def _check_metadata(metadata: Any) -> None:
    """Refuse ``metadata`` that OpenAI refuses: it is echoed in the response and stored.

    Raises:
        InvalidParameterError: not an object of at most 16 string pairs, with keys of at
            most 64 characters and values of at most 512.
    """
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise InvalidParameterError(
            f"metadata must be an object of string pairs, got {type(metadata).__name__}"
        )
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidParameterError(
            f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidParameterError(
                f"metadata keys must be strings of at most {MAX_METADATA_KEY_CHARS} characters"
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidParameterError(
                f"metadata[{key!r}] must be a string of at most {MAX_METADATA_VALUE_CHARS} "
                "characters"
            )


def _input(value: Any) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input must be a string or a non-empty list of items")
    chat: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidRequestError(f"{where} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise InvalidRequestError(
                    f"{where}: role must be user, assistant, system or developer"
                )
            chat.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            arguments = item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise InvalidRequestError(f"{where}: a function_call needs a call_id and a name")
            if not isinstance(arguments, str):
                raise InvalidRequestError(f"{where}: arguments must be a JSON string")
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
                raise InvalidRequestError(f"{where}: a function_call_output needs a call_id")
            output = _text_of(item.get("output", ""), f"{where}.output")
            chat.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # the template renders what the model answered, not what it thought
        else:
            raise InvalidRequestError(f"{where}: unsupported input item type {kind!r}")
    return chat


def _text_of(content: Any, where: str) -> str:
    """A string, or the joined text of ``input_text``/``output_text`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}: content must be a string or a list of parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        else:
            raise InvalidRequestError(
                f"{where}.content[{j}]: unsupported content part {kind!r} (text only)"
            )
    return "".join(parts)


def _options(request: Mapping[str, Any]) -> dict[str, Any]:
    """The chat options of a Responses request."""
    options: dict[str, Any] = {}
    limit = request.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise InvalidParameterError(f"max_output_tokens must be a positive integer: {limit!r}")
        options["max_tokens"] = limit
    for name in ("temperature", "top_p", "user", "parallel_tool_calls"):
        if request.get(name) is not None:
            options[name] = request[name]
    if request.get("tools"):
        tools = request["tools"]
        if not isinstance(tools, list):
            raise InvalidRequestError("tools must be a list")
        options["tools"] = [_tool(t) for t in tools]
    choice = request.get("tool_choice")
    if choice is not None:
        options["tool_choice"] = _tool_choice(choice)
    text = request.get("text")
    if text is not None:
        if not isinstance(text, Mapping) or set(text) - {"format", "verbosity"}:
            raise InvalidParameterError("text must be an object with a 'format'")
        response_format = _format(text.get("format"))
        if response_format is not None:
            options["response_format"] = response_format
    reasoning = request.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, Mapping):
            raise InvalidParameterError("reasoning must be an object")
        effort = reasoning.get("effort")
        if effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh"):
            raise InvalidParameterError(f"reasoning.effort is not an effort: {effort!r}")
        if effort is not None:
            options["enable_thinking"] = effort not in ("none", "minimal")
    truncation = request.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise InvalidParameterError("truncation must be 'auto' or 'disabled'")
    if truncation == "auto":
        options["truncate"] = "oldest_messages"
    return options


def _tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        raise InvalidRequestError(f"tools: only function tools are supported, not {kind!r}")
    if not isinstance(tool.get("name"), str):
        raise InvalidRequestError("tools: a function tool needs a 'name'")
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
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}"
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
            raise InvalidParameterError("text.format json_schema needs a 'schema' object")
        wrapper = {"name": fmt.get("name", "response"), "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            wrapper["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": wrapper}
    raise InvalidParameterError(
        f"text.format type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
    )


# ---------------------------------------------------------------------- the response
class _Job:
    """A submitted Responses request: builds its ``response`` object and stream events,
    and stores the finished response."""

    def __init__(
        self,
        submitted: OpenAIRequest,
        request: dict[str, Any],
        conversation: list[dict[str, Any]],
        store: ResponseStore | None,
        max_output_tokens: int | None,
    ) -> None:
        self.submitted, self.request = submitted, request
        self.conversation, self.store = conversation, store
        self.max_output_tokens = max_output_tokens
        self.id = "resp_" + submitted.handle.request_id.removeprefix("req-")
        self._sequence = 0

    # -- shapes
    def _item_id(self, kind: str, index: int) -> str:
        return f"{kind}_{self.id.removeprefix('resp_')}_{index}"

    def _summary_wanted(self) -> bool:
        reasoning = self.request.get("reasoning")
        return isinstance(reasoning, Mapping) and reasoning.get("summary") is not None

    def reasoning_item(self, index: int, text: str, status: str) -> dict[str, Any]:
        summary = [{"type": "summary_text", "text": text}] if self._summary_wanted() else []
        content = [_part("reasoning", text)] if text else []
        return {
            "type": "reasoning",
            "id": self._item_id("rs", index),
            "summary": summary,
            "content": content,
            "status": status,
        }

    def message_item(self, index: int, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [_text_part(text)]
        return {
            "type": "message",
            "id": self._item_id("msg", index),
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def call_item(self, index: int, call: Mapping[str, Any], status: str) -> dict[str, Any]:
        function = call.get("function", {})
        return {
            "type": "function_call",
            "id": self._item_id("fc", index),
            "call_id": call.get("id", ""),
            "name": function.get("name", ""),
            "arguments": function.get("arguments", ""),
            "status": status,
        }

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        request = self.request
        text = _mapping(request.get("text"))
        reasoning = _mapping(request.get("reasoning"))
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.submitted.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.get("instructions"),
            "max_output_tokens": self.max_output_tokens,
            "model": self.submitted.model,
            "output": output,
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "previous_response_id": request.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": self.store is not None,
            "temperature": request.get("temperature", 1.0),
            "text": {"format": dict(text.get("format") or {"type": "text"})},
            "tool_choice": request.get("tool_choice", "auto"),
            "tools": list(request.get("tools") or []),
            "top_p": request.get("top_p", 1.0),
            "truncation": request.get("truncation", "disabled"),
            "usage": usage,
            "user": request.get("user"),
            "metadata": dict(request.get("metadata") or {}),
        }

    def usage(self, completion: Completion, reasoning: str) -> dict[str, Any]:
        usage = completion.usage
        thought = len(self.submitted.ctx.tokenize(reasoning, add_special=False)) if reasoning else 0
        return {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(thought, usage.completion_tokens)},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }

    # -- a finished request
    def finish(self, completion: Completion) -> dict[str, Any]:
        """The whole ``response`` object (stored, unless the request said not to)."""
        choice = self.submitted.response(completion)["choices"][0]
        message: Any = choice["message"]  # type: ignore[typeddict-item]
        status = _status(completion)
        done = "incomplete" if status == "incomplete" else "completed"
        output: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content") or ""
        if reasoning:
            output.append(self.reasoning_item(len(output), reasoning, done))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            output.append(self.message_item(len(output), message.get("content") or "", done))
        for call in calls:
            output.append(self.call_item(len(output), call, "completed"))
        return self.done(self.response(status, output, self.usage(completion, reasoning)))

    def done(self, response: dict[str, Any]) -> dict[str, Any]:
        """Store a finished ``response`` with its conversation, then return it."""
        if self.store is not None:
            reply: dict[str, Any] = {"role": "assistant", "content": None}
            calls = []
            for item in response["output"]:
                if item["type"] == "message":
                    reply["content"] = "".join(part["text"] for part in item["content"])
                elif item["type"] == "function_call":
                    function = {"name": item["name"], "arguments": item["arguments"]}
                    calls.append({"id": item["call_id"], "type": "function", "function": function})
            if calls:
                reply["tool_calls"] = calls
            self.store.put(response, [*self.conversation, reply])
        return response

    # -- events
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """One stream event, numbered."""
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _part(kind: str, text: str) -> dict[str, Any] | None:
    """The content part an output item of ``kind`` streams into (a function call has none)."""
    if kind == "message":
        return _text_part(text)
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return None


def _status(completion: Completion) -> str:
    reason = completion.choices[0].finish_reason
    return "incomplete" if reason is FinishReason.LENGTH else "completed"


class _EventBuilder:
    """Turns a chat request's chunks into Responses stream events, one output item at a
    time: ``reasoning``, then the ``message``, then each ``function_call``."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text = ""
        self._reasoning = ""

    def start(self) -> list[dict[str, Any]]:
        job = self.job
        response = job.response("in_progress", [], None)
        return [
            job.event("response.created", response=response),
            job.event("response.in_progress", response=response),
        ]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output)}

    def _begin(self, make: Callable[[int], dict[str, Any]]) -> list[dict[str, Any]]:
        """Close the open item, then open ``make(index)`` (its id follows its index)."""
        events = self._close("completed")
        index = len(self.output)
        item = make(index)
        self._open, self._text = item, ""
        events.append(self.job.event("response.output_item.added", output_index=index, item=item))
        part = _part(item["type"], "")
        if part is not None:
            events.append(
                self.job.event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        job, where, text = self.job, self._where(), self._text
        events = []
        kind = item["type"]
        if kind == "message":
            item = job.message_item(len(self.output), text, status)
            events.append(
                job.event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            )
        elif kind == "reasoning":
            item = job.reasoning_item(len(self.output), text, status)
            events.append(
                job.event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        else:
            item = {**item, "arguments": text, "status": "completed"}
            events.append(
                job.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=text,
                )
            )
        part = _part(kind, text)
        if part is not None:
            events.append(
                job.event("response.content_part.done", **where, content_index=0, part=part)
            )
        events.append(
            job.event("response.output_item.done", output_index=len(self.output), item=item)
        )
        self.output.append(item)
        self._open = None
        return events

    def parts(self, parts: Sequence[ChatPart]) -> list[dict[str, Any]]:
        job, events = self.job, []
        for part in parts:
            match part:
                case ReasoningDelta(text=text):
                    if self._open is None or self._open["type"] != "reasoning":
                        events += self._begin(lambda i: job.reasoning_item(i, "", "in_progress"))
                    self._text += text
                    self._reasoning += text
                    events.append(
                        job.event(
                            "response.reasoning_text.delta",
                            **self._where(),
                            content_index=0,
                            delta=text,
                        )
                    )
                case ContentDelta(text=text) if text:
                    if self._open is None or self._open["type"] != "message":
                        events += self._begin(lambda i: job.message_item(i, None, "in_progress"))
                    self._text += text
                    events.append(
                        job.event(
                            "response.output_text.delta",
                            **self._where(),
                            content_index=0,
                            delta=text,
                            logprobs=[],
                        )
                    )
                case ToolCallDelta(call_id=call_id, name=name, arguments=arguments):
                    if call_id is not None:
                        opened = {
                            "index": part.position,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name or "", "arguments": ""},
                        }
                        events += self._begin(
                            partial(job.call_item, call=opened, status="in_progress")
                        )
                    if arguments and self._open is not None:
                        self._text += arguments
                        events.append(
                            job.event(
                                "response.function_call_arguments.delta",
                                **self._where(),
                                delta=arguments,
                            )
                        )
        return events

    def end(self, completion: Completion) -> list[dict[str, Any]]:
        job = self.job
        status = _status(completion)
        events = self._close("incomplete" if status == "incomplete" else "completed")
        if not any(item["type"] != "reasoning" for item in self.output):
            # a reply with no text and no call (all thinking, or nothing) still has a message
            events += self._begin(lambda i: job.message_item(i, None, "in_progress"))
            events += self._close("completed")
        usage = job.usage(completion, self._reasoning)
        response = job.done(job.response(status, self.output, usage))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, job.event(kind, response=response)]
