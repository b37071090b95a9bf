"""OpenAI-shaped results of a submitted request, below the facade.

A :class:`OpenAIRequest` reads a submitted call (:class:`~llamax.chat.ChatHandle`) and
hands what it reads to an encoder (:class:`~llamax.dialects.openai_encode.Encoder`): the
handle's :class:`~llamax.Completion` becomes a ``chat.completion`` / ``text_completion``
dict (:func:`~llamax.dialects.openai_encode.encode_result`), its events OpenAI's chunks
(:class:`~llamax.dialects.openai_encode.OpenAIChunks`) or another API's events (the
Anthropic and Responses encoders), all through one reader (:meth:`OpenAIRequest.events`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..chat.handle import ChatHandle
from ..chat.options import check_flag
from ..dialects.openai_encode import Encoder, OpenAIChunks, ReplyIds, encode_result
from ..dialects.openai_shapes import ChatCompletion, ChatCompletionChunk, TextCompletion
from ..errors import InvalidParameterError
from ..handle import RequestHandle
from ..results import Completion

__all__ = [
    "AsyncChunkStream",
    "ChunkStream",
    "EventBuilder",
    "OpenAIRequest",
    "arespond",
    "include_usage",
    "respond",
]


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


EventBuilder = Encoder
"""The encoder protocol (:class:`~llamax.dialects.openai_encode.Encoder`), by its former name."""


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

    @property
    def ids(self) -> ReplyIds:
        """What every object of the reply repeats: its id, kind, creation time and model."""
        return ReplyIds(self.response_id, self.chat.kind, self.chat.created, self.chat.model)

    # ------------------------------------------------------------------ whole results
    def response(self, completion: Completion) -> ChatCompletion | TextCompletion:
        """The full response object for a finished request (a chat's messages: the fold of
        each choice's parts)."""
        replies = self.chat.replies(completion) if self.chat.kind == "chat" else ()
        return encode_result(self.ids, completion, replies)

    def result(self) -> ChatCompletion | TextCompletion:
        """Wait (a manual context steps in this thread) and return the full response."""
        return self.response(self.handle.result())

    async def aresult(self) -> ChatCompletion | TextCompletion:
        """Await the full response (needs the background loop)."""
        return self.response(await self.handle)

    # ------------------------------------------------------------------ streams
    def encoder(self, include_usage: bool) -> OpenAIChunks:
        """The encoder of this request's OpenAI chunks (with the usage chunk last when
        ``include_usage``)."""
        tools = self.chat.tools.is_active
        return OpenAIChunks(self.ids, include_usage, tools, self.chat.submitted)

    def chunks(self, include_usage: bool) -> ChunkStream[ChatCompletionChunk | TextCompletion]:
        """Stream chunk objects; the last one carries usage when ``include_usage``.

        Closing the stream early (``close()``) cancels the request, even before its
        first chunk."""
        return ChunkStream(self.events(self.encoder(include_usage)), self.handle)

    def achunks(
        self, include_usage: bool
    ) -> AsyncChunkStream[ChatCompletionChunk | TextCompletion]:
        """Async twin of :meth:`chunks`; ``aclose()`` cancels the request."""
        return AsyncChunkStream(self.aevents(self.encoder(include_usage)), self.handle)

    def events(self, encoder: Encoder) -> Generator[Any, None, None]:
        """The request's stream as ``encoder``'s events (the one reader of every API's
        stream); closing it cancels the request."""
        stream = self.chat.chat_stream()
        try:
            yield from encoder.start()
            for event in self.handle:
                yield from encoder.parts(stream.parts(event))
            yield from encoder.end(self.handle.result())
        finally:
            self.handle.cancel()

    async def aevents(self, encoder: Encoder) -> AsyncGenerator[Any, None]:
        """Async twin of :meth:`events`; ``aclose()`` cancels the request."""
        stream = self.chat.chat_stream()
        try:
            for encoded in encoder.start():
                yield encoded
            async for event in self.handle:
                for encoded in encoder.parts(stream.parts(event)):
                    yield encoded
            for encoded in encoder.end(await self.handle):
                yield encoded
        finally:
            self.handle.cancel()


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
