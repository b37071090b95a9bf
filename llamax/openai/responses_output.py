"""The Responses API's answer (``POST /v1/responses``): the ``response`` object, its
output items (``reasoning``, ``message``, ``function_call``) and its typed stream events,
encoded from a submitted chat request's result and typed stream; and the
:class:`ResponseStore` that ``previous_response_id`` reads. The request's side is
:mod:`llamax.openai.responses_api`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..chat_stream import ChatPart, ContentDelta, Progress, ReasoningDelta, ToolCallDelta
from ..dialects.llama_native import prompt_progress
from ..errors import NotFoundError
from ..images import Image
from ..results import Completion, FinishReason
from .requests import OpenAIRequest
from .responses_items import input_items

__all__ = ["ResponseEvents", "ResponseJob", "ResponseStore"]


@dataclass(frozen=True, slots=True)
class _Stored:
    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    items: tuple[dict[str, Any], ...]
    size: int


def _chars(value: Any) -> int:
    """The characters of a stored object (its strings, keys included, nested; an image's
    bytes; 8 for any other leaf), counted without serializing it: a store on the server's
    event loop stays cheap."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_chars(k) + _chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    if isinstance(value, Image):  # an input image in a stored conversation
        return value.num_bytes
    return 8


class ResponseStore:
    """A bounded, thread-safe store of recent responses, for ``previous_response_id``.

    Least recently used entries go first once there are more than ``max_responses`` or
    they hold more than ``max_chars`` characters. An entry is counted whole: its
    ``response`` object (``metadata``, ``user``, ``instructions``, ``tools`` ... as echoed),
    its conversation and its input items (each entry keeps its whole conversation, so a long
    chain costs what its longest member holds); every string counts its characters, keys
    too, and any other value 8.

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

    def input_items(self, response_id: str) -> list[dict[str, Any]]:
        """The response's input items (``GET /v1/responses/{id}/input_items``), oldest
        first: those of the conversation it continued, its outputs, then its own input.

        Raises:
            NotFoundError: no response has that id.
        """
        return [dict(item) for item in self._entry(response_id).items]

    def follow_up(self, response_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """What a follow-up of the response starts with, read at once: its conversation
        (as :meth:`conversation`) and its items (its input items, then its output).

        Raises:
            NotFoundError: no response has that id.
        """
        entry = self._entry(response_id)
        items = [dict(item) for item in (*entry.items, *entry.response["output"])]
        return [dict(m) for m in entry.conversation], items

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was there."""
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._chars -= entry.size
            return entry is not None

    def put(
        self,
        response: Mapping[str, Any],
        conversation: Sequence[Mapping[str, Any]],
        items: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Keep ``response`` (by its ``id``) with its conversation and input items, evicting
        the least recently used entries past the bounds. An entry larger than ``max_chars``
        alone is not kept."""
        kept = dict(response)
        frozen = tuple(dict(m) for m in conversation)
        frozen_items = tuple(dict(item) for item in items)
        size = _chars(kept) + sum(_chars(m) for m in (*frozen, *frozen_items))
        if size > self.max_chars:
            return
        with self._lock:
            old = self._entries.pop(str(response["id"]), None)
            if old is not None:
                self._chars -= old.size
            self._entries[str(response["id"])] = _Stored(kept, frozen, frozen_items, size)
            self._chars += size
            while len(self._entries) > self.max_responses or self._chars > self.max_chars:
                _, evicted = self._entries.popitem(last=False)
                self._chars -= evicted.size

    def _entry(self, response_id: str) -> _Stored:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                raise NotFoundError(
                    f"no stored response has id {response_id!r} "
                    "(it was never stored, was deleted, or the store evicted it)"
                )
            self._entries.move_to_end(response_id)
            return entry


class ResponseJob:
    """A submitted Responses request: builds its ``response`` object and stream events,
    and stores the finished response."""

    def __init__(
        self,
        submitted: OpenAIRequest,
        request: dict[str, Any],
        conversation: list[dict[str, Any]],
        store: ResponseStore | None,
        max_output_tokens: int | None,
        earlier_items: list[dict[str, Any]] | None = None,
    ) -> None:
        self.submitted, self.request = submitted, request
        self.conversation, self.store = conversation, store
        self.earlier_items = earlier_items or []
        """The items of the conversation ``previous_response_id`` continues."""
        self.max_output_tokens = max_output_tokens
        self.id = "resp_" + submitted.handle.request_id.removeprefix("req-")
        self._sequence = 0

    # -- shapes
    @property
    def _prefix(self) -> str:
        return self.id.removeprefix("resp_")

    def _item_id(self, kind: str, index: int) -> str:
        return f"{kind}_{self._prefix}_{index}"

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
            "created_at": self.submitted.chat.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.get("instructions"),
            "max_output_tokens": self.max_output_tokens,
            "model": self.submitted.chat.model,
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
        tokenize = self.submitted.chat.chat_model.tokenize
        thought = len(tokenize(reasoning, add_special=False)) if reasoning else 0
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
        reply = self.submitted.chat.replies(completion)[0]  # the fold of the stream's parts
        status = _status(completion)
        done = "incomplete" if status == "incomplete" else "completed"
        output: list[dict[str, Any]] = []
        reasoning = reply.reasoning or ""
        if reasoning:
            output.append(self.reasoning_item(len(output), reasoning, done))
        calls = reply.tool_calls
        if reply.content or not calls:
            output.append(self.message_item(len(output), reply.content or "", done))
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
            items = [*self.earlier_items, *input_items(self.request["input"], self._prefix)]
            self.store.put(response, [*self.conversation, reply], items)
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


class ResponseEvents:
    """Turns a chat request's chunks into Responses stream events, one output item at a
    time: ``reasoning``, then the ``message``, then each ``function_call``."""

    def __init__(self, job: ResponseJob) -> None:
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
                case Progress(progress=progress):  # llama-server's, with return_progress
                    events.append(
                        job.event(
                            "response.in_progress",
                            response=job.response("in_progress", [], None),
                            prompt_progress=prompt_progress(progress, job.submitted.chat.submitted),
                        )
                    )
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
