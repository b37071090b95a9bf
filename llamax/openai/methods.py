"""The OpenAI-shaped methods of :class:`llamax.Context`, typed per ``stream`` value.

A mixin so that the facade stays small: each method delegates to :mod:`llamax.openai.api`,
which uses only the public API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from typing_extensions import Unpack

from .options import ChatOptions, CompletionOptions
from .shapes import ChatCompletion, ChatCompletionChunk, TextCompletion

if TYPE_CHECKING:
    from ..context import Context

__all__ = ["OpenAIMethods"]

Messages = Sequence[Mapping[str, Any]]
Prompt = str | Sequence[int]


class OpenAIMethods:
    """``chat_completion``, ``completion`` and their async twins (see :mod:`llamax.openai`)."""

    __slots__ = ()

    @overload
    def chat_completion(
        self, messages: Messages, *, stream: Literal[False] = False, **options: Unpack[ChatOptions]
    ) -> ChatCompletion: ...
    @overload
    def chat_completion(
        self, messages: Messages, *, stream: Literal[True], **options: Unpack[ChatOptions]
    ) -> Iterator[ChatCompletionChunk]: ...
    def chat_completion(
        self, messages: Messages, *, stream: bool = False, **options: Unpack[ChatOptions]
    ) -> ChatCompletion | Iterator[ChatCompletionChunk]:
        """An OpenAI-shaped ``chat.completion``, or with ``stream=True`` an iterator of
        ``chat.completion.chunk`` dicts (closing it early cancels the request).

        Raises:
            TypeError: an unknown option (the message names the closest valid one).
            InvalidParameterError, InvalidMessageError, ContextLengthError, TemplateError:
                bad values, messages, or a conversation that does not fit.
        """
        from .api import chat_completion

        return chat_completion(_ctx(self), messages, stream=stream, **options)

    @overload
    def completion(
        self,
        prompt: Prompt,
        *,
        stream: Literal[False] = False,
        **options: Unpack[CompletionOptions],
    ) -> TextCompletion: ...
    @overload
    def completion(
        self, prompt: Prompt, *, stream: Literal[True], **options: Unpack[CompletionOptions]
    ) -> Iterator[TextCompletion]: ...
    def completion(
        self, prompt: Prompt, *, stream: bool = False, **options: Unpack[CompletionOptions]
    ) -> TextCompletion | Iterator[TextCompletion]:
        """An OpenAI-shaped ``text_completion``, or a stream of them with ``stream=True``.

        Raises:
            TypeError: an unknown option.
            InvalidParameterError, ContextLengthError: bad values or a prompt that does not fit.
        """
        from .api import completion

        return completion(_ctx(self), prompt, stream=stream, **options)

    @overload
    async def achat_completion(
        self, messages: Messages, *, stream: Literal[False] = False, **options: Unpack[ChatOptions]
    ) -> ChatCompletion: ...
    @overload
    async def achat_completion(
        self, messages: Messages, *, stream: Literal[True], **options: Unpack[ChatOptions]
    ) -> AsyncIterator[ChatCompletionChunk]: ...
    async def achat_completion(
        self, messages: Messages, *, stream: bool = False, **options: Unpack[ChatOptions]
    ) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]:
        """Async twin of :meth:`chat_completion` (needs the background loop)."""
        from .api import achat_completion

        return await achat_completion(_ctx(self), messages, stream=stream, **options)

    @overload
    async def acompletion(
        self,
        prompt: Prompt,
        *,
        stream: Literal[False] = False,
        **options: Unpack[CompletionOptions],
    ) -> TextCompletion: ...
    @overload
    async def acompletion(
        self, prompt: Prompt, *, stream: Literal[True], **options: Unpack[CompletionOptions]
    ) -> AsyncIterator[TextCompletion]: ...
    async def acompletion(
        self, prompt: Prompt, *, stream: bool = False, **options: Unpack[CompletionOptions]
    ) -> TextCompletion | AsyncIterator[TextCompletion]:
        """Async twin of :meth:`completion` (needs the background loop)."""
        from .api import acompletion

        return await acompletion(_ctx(self), prompt, stream=stream, **options)


def _ctx(methods: OpenAIMethods) -> Context:
    return methods  # type: ignore[return-value]
