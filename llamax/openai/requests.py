"""OpenAI-shaped results of a submitted request, below the facade.

A :class:`OpenAIRequest` reads a submitted call (:class:`~llamax.chat.ChatHandle`): it
turns the handle's :class:`~llamax.Completion` into a ``chat.completion`` /
``text_completion`` dict, and its events into chunks (or, through an
:class:`EventBuilder`, another API's events). A chat choice's whole message is the fold of
the parts its text streams as (:meth:`ChatHandle.replies`), so what a client rebuilds
from the chunks is the whole reply.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..chat.handle import ChatHandle
from ..chat.options import check_flag
from ..chat_stream import (
    ChatPart,
    ChatReply,
    ChatStream,
    ContentDelta,
    Finished,
    Progress,
    ReasoningDelta,
    Started,
    ToolCallDelta,
)
from ..dialects.llama_native import prompt_progress
from ..errors import InvalidParameterError
from ..handle import RequestHandle
from ..results import (
    Choice,
    Completion,
    FinishReason,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from ..tools.parse import ToolCallDelta as OpenAIToolCallDelta
from .shapes import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatDelta,
    CompletionUsage,
    OpenAIFinishReason,
    TextCompletion,
)

__all__ = [
    "AsyncChunkStream",
    "ChunkStream",
    "EventBuilder",
    "OpenAIRequest",
    "arespond",
    "include_usage",
    "respond",
]


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


T = TypeVar("T")


class ChunkStream(Iterator[T]):
    """An iterator of response chunks; ``close()`` cancels the request at any point."""

    def __init__(self, chunks: Generator[T, None, None], handle: RequestHandle) -> None:
        self._chunks, self._handle = chunks, handle

    def __next__(self) -> T:
        return next(self._chunks)

    def close(self) -> None:
        """Stop the stream and cancel the request (a no-op once it has ended)."""
        self._handle.cancel()
        self._chunks.close()


class AsyncChunkStream(AsyncIterator[T]):
    """An async iterator of response chunks; ``aclose()`` cancels the request at any point."""

    def __init__(self, chunks: AsyncGenerator[T, None], handle: RequestHandle) -> None:
        self._chunks, self._handle = chunks, handle

    async def __anext__(self) -> T:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        """Stop the stream and cancel the request (a no-op once it has ended)."""
        self._handle.cancel()
        await self._chunks.aclose()


class EventBuilder(Protocol):
    """Encodes a chat request's typed stream (:mod:`llamax.chat_stream`) as another API's
    stream events (Anthropic's, Responses'): see :meth:`OpenAIRequest.events`."""

    def start(self) -> list[dict[str, Any]]:
        """The events before the first part."""

    def parts(self, parts: Sequence[ChatPart]) -> list[dict[str, Any]]:
        """The events of one token event's parts."""

    def end(self, completion: Completion) -> list[dict[str, Any]]:
        """The last events, once the request has finished."""


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A submitted chat or text call (:class:`~llamax.chat.ChatHandle`) read as OpenAI's
    shapes: a ``chat.completion`` / ``text_completion``, or their chunks; or, through an
    :class:`EventBuilder`, another API's events."""

    chat: ChatHandle

    @property
    def handle(self) -> RequestHandle:
        """The request's handle."""
        return self.chat.handle

    def named(self, model: object) -> OpenAIRequest:
        """This request answering as ``model`` (:meth:`ChatHandle.named`)."""
        return OpenAIRequest(self.chat.named(model))

    @property
    def response_id(self) -> str:
        """``chatcmpl-...`` or ``cmpl-...``, derived from the request id."""
        prefix = "chatcmpl" if self.chat.kind == "chat" else "cmpl"
        return f"{prefix}-{self.handle.request_id.removeprefix('req-')}"

    # ------------------------------------------------------------------ whole results
    def response(self, completion: Completion) -> ChatCompletion | TextCompletion:
        """The full response object for a finished request."""
        if self.chat.kind == "chat":
            replies = {r.index: r for r in self.chat.replies(completion)}
            return {
                "id": self.response_id,
                "object": "chat.completion",
                "created": self.chat.created,
                "model": self.chat.model,
                "choices": [
                    {
                        "index": c.index,
                        "message": _message(replies[c.index]),
                        "finish_reason": replies[c.index].finish,
                        "logprobs": _chat_logprobs(c),
                    }
                    for c in completion.choices
                ],
                "usage": _usage(completion.usage),
            }
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.chat.created,
            "model": self.chat.model,
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

    def result(self) -> ChatCompletion | TextCompletion:
        """Wait (a manual context steps in this thread) and return the full response."""
        return self.response(self.handle.result())

    async def aresult(self) -> ChatCompletion | TextCompletion:
        """Await the full response (needs the background loop)."""
        return self.response(await self.handle)

    # ------------------------------------------------------------------ streams
    def chunks(self, include_usage: bool) -> ChunkStream[ChatCompletionChunk | TextCompletion]:
        """Stream chunk objects; the last one carries usage when ``include_usage``.

        Closing the stream early (``close()``) cancels the request, even before its
        first chunk."""
        return ChunkStream(self._chunks(include_usage), self.handle)

    def achunks(
        self, include_usage: bool
    ) -> AsyncChunkStream[ChatCompletionChunk | TextCompletion]:
        """Async twin of :meth:`chunks`; ``aclose()`` cancels the request."""
        return AsyncChunkStream(self._achunks(include_usage), self.handle)

    def events(self, builder: EventBuilder) -> Iterator[dict[str, Any]]:
        """A chat request's stream as ``builder``'s events; closing it cancels the request."""
        stream = self.chat.chat_stream()
        try:
            yield from builder.start()
            for event in self.handle:
                yield from builder.parts(stream.parts(event))
            yield from builder.end(self.handle.result())
        finally:
            self.handle.cancel()

    async def aevents(self, builder: EventBuilder) -> AsyncIterator[dict[str, Any]]:
        """Async twin of :meth:`events`; ``aclose()`` cancels the request."""
        stream = self.chat.chat_stream()
        try:
            for encoded in builder.start():
                yield encoded
            async for event in self.handle:
                for encoded in builder.parts(stream.parts(event)):
                    yield encoded
            for encoded in builder.end(await self.handle):
                yield encoded
        finally:
            self.handle.cancel()

    def _chunks(
        self, include_usage: bool
    ) -> Generator[ChatCompletionChunk | TextCompletion, None, None]:
        stream = self.chat.chat_stream()
        try:
            for event in self.handle:
                yield from self._event_chunks(event, stream)
            if include_usage:
                yield self._usage_chunk(self.handle.result())
        finally:
            self.handle.cancel()

    async def _achunks(
        self, include_usage: bool
    ) -> AsyncGenerator[ChatCompletionChunk | TextCompletion, None]:
        stream = self.chat.chat_stream()
        try:
            async for event in self.handle:
                for chunk in self._event_chunks(event, stream):
                    yield chunk
            if include_usage:
                yield self._usage_chunk(await self.handle)
        finally:
            self.handle.cancel()

    def _event_chunks(
        self, event: TokenEvent, stream: ChatStream
    ) -> Iterator[ChatCompletionChunk | TextCompletion]:
        if self.chat.kind == "chat":
            yield from self._encode(stream.parts(event))
            return
        finish = _finish_reason(event.finish_reason)
        if event.text or event.logprobs or finish:
            chunk = self._text_chunk(event.index, event.text, finish)
            if event.logprobs:
                choice = Choice(
                    event.index, event.text, event.token_ids, FinishReason.STOP, event.logprobs
                )
                chunk["choices"][0]["logprobs"] = _text_logprobs(choice)
            yield chunk

    def _encode(self, parts: Sequence[ChatPart]) -> Iterator[ChatCompletionChunk]:
        """One event's parts as ``chat.completion.chunk`` objects: with tools on, a chunk
        per part; else the role in a chunk of its own (as OpenAI and llama-server send it
        first), one delta (thinking, content and logprobs together), then the finish. A
        progress part is a chunk of its own, with an empty delta and ``prompt_progress``."""
        if parts and isinstance(parts[0], Progress):
            yield self._progress_chunk(parts[0])
            return
        if self.chat.tools.is_active:
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

    def _progress_chunk(self, part: Progress) -> ChatCompletionChunk:
        chunk = self._delta_chunk(part.index, {})
        chunk["prompt_progress"] = prompt_progress(part.progress, self.chat.submitted)
        return chunk

    def _finish_chunk(self, part: Finished) -> ChatCompletionChunk:
        return self._chat_chunk(
            [{"index": part.index, "delta": {}, "finish_reason": part.reason, "logprobs": None}]
        )

    def _delta_chunk(self, index: int, delta: ChatDelta) -> ChatCompletionChunk:
        return self._chat_chunk(
            [{"index": index, "delta": delta, "finish_reason": None, "logprobs": None}]
        )

    def _chat_chunk(self, choices: list[ChatCompletionChunkChoice]) -> ChatCompletionChunk:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self.chat.created,
            "model": self.chat.model,
            "choices": choices,
        }

    def _text_chunk(
        self, index: int, text: str, finish: OpenAIFinishReason | None
    ) -> TextCompletion:
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.chat.created,
            "model": self.chat.model,
            "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": None}],
        }

    def _usage_chunk(self, completion: Completion) -> ChatCompletionChunk | TextCompletion:
        chunk: Any = (
            self._chat_chunk([]) if self.chat.kind == "chat" else self._text_chunk(0, "", None)
        )
        if self.chat.kind == "text":
            chunk["choices"] = []
        chunk["usage"] = _usage(completion.usage)
        return chunk  # type: ignore[no-any-return]


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


def include_usage(stream_options: object) -> bool:
    """Whether OpenAI's ``stream_options`` asks for a usage chunk.

    Raises:
        InvalidParameterError: ``stream_options`` is not an object, or its
            ``include_usage`` not a boolean.
    """
    if stream_options is None:
        return False
    if not isinstance(stream_options, Mapping):
        raise InvalidParameterError(
            f"stream_options must be an object, got {type(stream_options).__name__}",
            param="stream_options",
        )
    return check_flag(stream_options.get("include_usage"), "stream_options.include_usage")


def respond(
    request: OpenAIRequest, stream: bool, include_usage: bool
) -> ChatCompletion | TextCompletion | Iterator[ChatCompletionChunk | TextCompletion]:
    """A submitted request's whole response, or with ``stream`` its chunks (with a usage
    chunk when ``include_usage``)."""
    return request.chunks(include_usage) if stream else request.result()


async def arespond(
    request: OpenAIRequest, stream: bool, include_usage: bool
) -> ChatCompletion | TextCompletion | AsyncIterator[ChatCompletionChunk | TextCompletion]:
    """Async twin of :func:`respond`."""
    return request.achunks(include_usage) if stream else await request.aresult()
