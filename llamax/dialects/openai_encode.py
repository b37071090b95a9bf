"""OpenAI's chat and text completions, encoded: a finished request as a
``chat.completion`` / ``text_completion`` (:func:`encode_result`), and a request's typed
parts (:mod:`llamax.chat_stream`) as ``chat.completion.chunk`` / streamed
``text_completion`` objects (:class:`OpenAIChunks`, an :class:`Encoder`). Pure: the
caller reads the request (:class:`llamax.openai.OpenAIRequest` drives any encoder over a
handle) and frames what comes out.

A chat choice's whole message is the fold of the parts its text streams as
(:class:`~llamax.chat_stream.ChatReply`), so what a client rebuilds from the chunks is the
whole reply.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..chat_stream import (
    ChatPart,
    ChatReply,
    ContentDelta,
    Finished,
    Progress,
    ReasoningDelta,
    Started,
    ToolCallDelta,
)
from ..results import Choice, Completion, FinishReason, TokenLogprob, TopLogprob, Usage
from ..tools.parse import ToolCallDelta as OpenAIToolCallDelta
from .llama_native import prompt_progress
from .openai_shapes import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatDelta,
    CompletionUsage,
    OpenAIFinishReason,
    TextCompletion,
)

__all__ = ["Encoder", "OpenAIChunks", "ReplyIds", "encode_result"]


class Encoder(Protocol):
    """Encodes a request's typed stream (:mod:`llamax.chat_stream`) as one API's stream
    events: OpenAI's chunks (:class:`OpenAIChunks`), Anthropic's and the Responses API's
    events. :meth:`llamax.openai.OpenAIRequest.events` drives one over a handle."""

    def start(self) -> list[Any]:
        """The events before the first part."""

    def parts(self, parts: Sequence[ChatPart]) -> list[Any]:
        """The events of one token event's parts."""

    def end(self, completion: Completion) -> list[Any]:
        """The last events, once the request has finished."""


@dataclass(frozen=True, slots=True)
class ReplyIds:
    """What every object of one OpenAI reply repeats."""

    id: str
    """``chatcmpl-...`` or ``cmpl-...``."""
    kind: Literal["chat", "text"]
    created: int
    model: str


def encode_result(
    ids: ReplyIds, completion: Completion, replies: Sequence[ChatReply] = ()
) -> ChatCompletion | TextCompletion:
    """A finished request as OpenAI's whole response; a chat's messages are ``replies``
    (the fold of each choice's parts, :meth:`llamax.chat.ChatHandle.replies`)."""
    if ids.kind == "chat":
        by_index = {r.index: r for r in replies}
        return {
            "id": ids.id,
            "object": "chat.completion",
            "created": ids.created,
            "model": ids.model,
            "choices": [
                {
                    "index": c.index,
                    "message": _message(by_index[c.index]),
                    "finish_reason": by_index[c.index].finish,
                    "logprobs": _chat_logprobs(c),
                }
                for c in completion.choices
            ],
            "usage": _usage(completion.usage),
        }
    return {
        "id": ids.id,
        "object": "text_completion",
        "created": ids.created,
        "model": ids.model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "finish_reason": _finish_reason(c.finish_reason),
                "logprobs": _text_logprobs(c),
            }
            for c in completion.choices
        ],
        "usage": _usage(completion.usage),
    }


@dataclass(slots=True)
class OpenAIChunks:
    """A request's parts as OpenAI's stream objects (an :class:`Encoder`).

    Args:
        ids: The reply's id, kind, creation time and model.
        include_usage: End with the usage chunk (``stream_options.include_usage``).
        tools_active: A chat with tool calling on: a chunk per part.
        submitted: When the request was submitted (``time.perf_counter``), for
            ``prompt_progress``.
    """

    ids: ReplyIds
    include_usage: bool = False
    tools_active: bool = False
    submitted: float = 0.0

    def start(self) -> list[ChatCompletionChunk | TextCompletion]:
        """Nothing: OpenAI's first chunk is the role's (a :class:`Started` part)."""
        return []

    def parts(self, parts: Sequence[ChatPart]) -> list[ChatCompletionChunk | TextCompletion]:
        """One token event's parts as chunks."""
        if self.ids.kind == "text":
            return list(self._text(parts))
        return list(self._chat(parts))

    def end(self, completion: Completion) -> list[ChatCompletionChunk | TextCompletion]:
        """The usage chunk, when asked for."""
        if not self.include_usage:
            return []
        chunk: Any = (
            self._chat_chunk([]) if self.ids.kind == "chat" else self._text_chunk(0, "", None)
        )
        chunk["choices"] = []
        chunk["usage"] = _usage(completion.usage)
        return [chunk]

    def _text(self, parts: Sequence[ChatPart]) -> Iterator[TextCompletion]:
        """A text event as one chunk: its text, its tokens' logprobs and its finish."""
        text, logprobs, finish, index = "", None, None, None
        for part in parts:
            if isinstance(part, ContentDelta):
                text, index = part.text, part.index
                logprobs = part.logprobs
            elif isinstance(part, Finished):
                finish, index = part.reason, part.index
        if index is None:
            return
        chunk = self._text_chunk(index, text, finish)
        if logprobs:
            choice = Choice(index, text, (), FinishReason.STOP, logprobs)
            chunk["choices"][0]["logprobs"] = _text_logprobs(choice)
        yield chunk

    def _chat(self, parts: Sequence[ChatPart]) -> Iterator[ChatCompletionChunk]:
        """One event's parts as ``chat.completion.chunk`` objects: with tools on, a chunk
        per part; else the role in a chunk of its own (as OpenAI and llama-server send it
        first), one delta (thinking, content and logprobs together), then the finish. A
        progress part is a chunk of its own, with an empty delta and ``prompt_progress``."""
        if parts and isinstance(parts[0], Progress):
            chunk = self._delta_chunk(parts[0].index, {})
            chunk["prompt_progress"] = prompt_progress(parts[0].progress, self.submitted)
            yield chunk
            return
        if self.tools_active:
            for part in parts:
                if isinstance(part, Finished):
                    yield self._finish_chunk(part)
                elif not isinstance(part, Progress):
                    yield self._delta_chunk(part.index, _delta(part))
            return
        delta: ChatDelta = {}
        logprobs: dict[str, Any] | None = None
        for part in parts:
            if isinstance(part, Started):
                yield self._delta_chunk(part.index, _delta(part))
            elif isinstance(part, ContentDelta) and part.logprobs:
                logprobs = {"content": [_chat_token(lp, lp.top_logprobs) for lp in part.logprobs]}
            if not isinstance(part, Finished | Started | Progress):
                delta.update(_delta(part))
        if delta or logprobs:  # held-back text still reports its tokens' logprobs
            index = parts[0].index
            yield self._chat_chunk(
                [{"index": index, "delta": delta, "finish_reason": None, "logprobs": logprobs}]
            )
        for part in parts:
            if isinstance(part, Finished):
                yield self._finish_chunk(part)

    def _finish_chunk(self, part: Finished) -> ChatCompletionChunk:
        return self._chat_chunk(
            [{"index": part.index, "delta": {}, "finish_reason": part.reason, "logprobs": None}]
        )

    def _delta_chunk(self, index: int, delta: ChatDelta) -> ChatCompletionChunk:
        return self._chat_chunk(
            [{"index": index, "delta": delta, "finish_reason": None, "logprobs": None}]
        )

    def _chat_chunk(self, choices: list[ChatCompletionChunkChoice]) -> ChatCompletionChunk:
        ids = self.ids
        return {"id": ids.id, "object": "chat.completion.chunk", "created": ids.created,
                "model": ids.model, "choices": choices}  # fmt: skip

    def _text_chunk(
        self, index: int, text: str, finish: OpenAIFinishReason | None
    ) -> TextCompletion:
        ids = self.ids
        return {"id": ids.id, "object": "text_completion", "created": ids.created,
                "model": ids.model,
                "choices": [{"index": index, "text": text, "finish_reason": finish,
                             "logprobs": None}]}  # fmt: skip


def _chat_logprobs(choice: Choice) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    return {
        "content": [_chat_token(lp, lp.top_logprobs) for lp in choice.logprobs],
        "refusal": None,
    }


def _chat_token(lp: TokenLogprob | TopLogprob, top: Sequence[TopLogprob]) -> dict[str, Any]:
    entry: dict[str, Any] = {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.bytes)}
    entry["top_logprobs"] = [
        {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in top
    ]
    return entry


def _text_logprobs(choice: Choice) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    offsets, at = [], 0
    for lp in choice.logprobs:
        offsets.append(at)
        at += len(lp.token)
    return {
        "tokens": [lp.token for lp in choice.logprobs],
        "token_logprobs": [lp.logprob for lp in choice.logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in choice.logprobs],
        "text_offset": offsets,
    }


def _finish_reason(reason: FinishReason | None) -> OpenAIFinishReason | None:
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"


def _usage(usage: Usage) -> CompletionUsage:
    shape: CompletionUsage = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.drafted_tokens:  # OpenAI's names for predicted-output tokens
        shape["completion_tokens_details"] = {
            "accepted_prediction_tokens": usage.accepted_tokens,
            "rejected_prediction_tokens": usage.drafted_tokens - usage.accepted_tokens,
        }
    return shape


def _message(reply: ChatReply) -> ChatCompletionMessage:
    """A choice's whole reply (the fold of its parts) as OpenAI's assistant message."""
    message: ChatCompletionMessage = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = list(reply.tool_calls)
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    return message


def _delta(part: Started | ReasoningDelta | ContentDelta | ToolCallDelta) -> ChatDelta:
    """A part as what an OpenAI chunk's ``delta`` adds."""
    if isinstance(part, Started):
        return {"role": "assistant"}
    if isinstance(part, ReasoningDelta):
        return {"reasoning_content": part.text}
    if isinstance(part, ContentDelta):
        return {"content": part.text} if part.text else {}
    return {"tool_calls": [_call_delta(part)]}


def _call_delta(part: ToolCallDelta) -> OpenAIToolCallDelta:
    """A tool call part as an entry of OpenAI's ``delta.tool_calls``."""
    if part.call_id is None:
        return {"index": part.position, "function": {"arguments": part.arguments}}
    return {
        "index": part.position,
        "id": part.call_id,
        "type": "function",
        "function": {"name": part.name or "", "arguments": part.arguments},
    }
