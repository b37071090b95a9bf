"""The Responses API's answer, encoded: the ``response`` object and its output items
(``reasoning``, ``message``, ``function_call``) from a finished request
(:meth:`ResponseJob.finish`), and a request's typed parts (:mod:`llamax.chat_stream`) as
the typed stream events (:class:`ResponseEvents`, an
:class:`~llamax.dialects.openai_encode.Encoder`: ``response.created``,
``response.output_text.delta``, ``response.function_call_arguments.delta``,
``response.completed`` ...). Pure: the caller submits the request, reads it
(:meth:`llamax.openai.OpenAIRequest.events` drives the encoder) and frames what comes out;
a finished response is handed to a :class:`ResponseSink` (``llamax.openai.ResponseStore``),
which ``previous_response_id`` reads later.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from ..chat_stream import ChatPart, ChatReply, ContentDelta, Progress, ReasoningDelta, ToolCallDelta
from ..results import Completion, FinishReason
from .llama_native import prompt_progress
from .responses_items import input_items

__all__ = ["ResponseEvents", "ResponseIds", "ResponseJob", "ResponseSink"]


class ResponseSink(Protocol):
    """Where a finished response is kept (``llamax.openai.ResponseStore``)."""

    def put(
        self,
        response: Mapping[str, Any],
        conversation: Sequence[Mapping[str, Any]],
        items: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Keep ``response`` with its conversation and input items."""


@dataclass(frozen=True, slots=True)
class ResponseIds:
    """What a response's objects repeat, and what counts its reasoning tokens."""

    request_id: str
    """The engine's request id (``req-...``); the response's id is ``resp_...`` of it."""
    created: int
    model: str
    submitted: float = 0.0
    """When the request was submitted (``time.perf_counter``), for ``prompt_progress``."""
    tokenize: Callable[..., Sequence[int]] = field(default=lambda *_, **__: (), compare=False)
    """The model's tokenizer (``tokenize(text, add_special=False)``): the reasoning's
    tokens are counted in ``output_tokens_details``."""


class ResponseJob:
    """A submitted Responses request, encoded: builds its ``response`` object and stream
    events, and hands the finished response to its sink."""

    def __init__(
        self,
        ids: ResponseIds,
        request: dict[str, Any],
        conversation: list[dict[str, Any]],
        store: ResponseSink | None,
        max_output_tokens: int | None,
        earlier_items: list[dict[str, Any]] | None = None,
    ) -> None:
        self.ids, self.request = ids, request
        self.conversation, self.store = conversation, store
        self.earlier_items = earlier_items or []
        """The items of the conversation ``previous_response_id`` continues."""
        self.max_output_tokens = max_output_tokens
        self.id = "resp_" + ids.request_id.removeprefix("req-")
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
            "created_at": self.ids.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": request.get("instructions"),
            "max_output_tokens": self.max_output_tokens,
            "model": self.ids.model,
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
        thought = len(self.ids.tokenize(reasoning, add_special=False)) if reasoning else 0
        return {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(thought, usage.completion_tokens)},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }

    # -- a finished request
    def finish(self, completion: Completion, reply: ChatReply) -> dict[str, Any]:
        """The whole ``response`` object (stored, unless the request said not to); ``reply``
        is the fold of the stream's parts (:meth:`llamax.chat.ChatHandle.replies`)."""
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
                            prompt_progress=prompt_progress(progress, job.ids.submitted),
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
