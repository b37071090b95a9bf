"""``chat_completion`` / ``completion`` and their async twins, OpenAI-shaped.

Every option has OpenAI's name and default (see :class:`~llamax.openai.options.ChatOptions`);
an unknown option raises ``TypeError``. ``truncate="oldest_messages"`` drops the oldest whole
turns (keeping system messages and the newest turn) when the conversation does not fit;
without it an over-long conversation raises :class:`~llamax.ContextLengthError`.

The functions take the context first (any :class:`ChatHost`: its chat model and its
``add_request``); :class:`llamax.Context`'s methods of the same names prepare and submit
the same way, on the template binding they hold. :func:`respond` and :func:`arespond`
shape a submitted request's result for both.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from ..errors import InvalidParameterError
from ..handle import RequestHandle
from ..images import Image
from ..params import SamplingParams
from . import prepare
from .options import check_flag
from .prepare import ChatModel, Prepared
from .requests import OpenAIRequest
from .shapes import ChatCompletion, ChatCompletionChunk, TextCompletion

T = TypeVar("T")

__all__ = [
    "ChatHost",
    "achat_completion",
    "acompletion",
    "arespond",
    "chat_completion",
    "chat_prompt_tokens",
    "completion",
    "respond",
    "submit_chat",
    "submit_in_worker",
]


class ChatHost(ChatModel, Protocol):
    """What the context-first functions need: a :class:`~llamax.openai.prepare.ChatModel`
    that takes requests (a :class:`llamax.Context`)."""

    def add_request(
        self,
        prompt: str | Sequence[int] | Sequence[int | Image],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        request_id: str | None = None,
        fair_key: str | None = None,
    ) -> RequestHandle:
        """Submit a prompt; returns its handle at once."""


def _submitted(ctx: ChatHost, prepared: Prepared, fair_key: str | None = None) -> OpenAIRequest:
    handle = ctx.add_request(
        prepared.prompt, prepared.params, request_id=prepared.request_id, fair_key=fair_key
    )
    return OpenAIRequest.of(handle, prepared, ctx)


def submit_chat(
    ctx: ChatHost,
    messages: Sequence[Mapping[str, Any]],
    *,
    prefill: str = "",
    fair_key: str | None = None,
    **options: Any,
) -> OpenAIRequest:
    """The submitted request behind :func:`chat_completion`: its handle, and the methods
    that shape its results. For layers that build other shapes on it (``llamax.anthropic``).
    ``stream`` and ``stream_options`` are not options here (the caller chooses).

    Args:
        ctx: The context.
        messages: The conversation.
        prefill: The start of the reply (Anthropic's assistant prefill): put after the
            opened assistant turn as plain text, so the model continues it; the result
            holds only what follows it.
        fair_key: The fairness key the request's sequences share with other requests of
            that key (``Context.add_request``; the server passes the client's address).
            A keyword of the call, never an option, so a request body cannot set it.
        **options: Chat options.

    Raises:
        InvalidRequestError: an option or a message is invalid (nothing was enqueued).
        ContextLengthError: the conversation does not fit.
    """
    prepared = prepare.prepare_chat(ctx, messages, options)
    if prefill:
        tail = ctx.tokenize(prefill, add_special=False, parse_special=False)
        num = None if prepared.num_positions is None else prepared.num_positions + len(tail)
        prepared = dataclasses.replace(
            prepared, prompt=[*prepared.prompt, *tail], num_positions=num
        )
    return _submitted(ctx, prepared, fair_key)


def chat_prompt_tokens(
    ctx: ChatModel, messages: Sequence[Mapping[str, Any]], **options: Any
) -> list[int | Image]:
    """The prompt tokens :func:`chat_completion` would submit for ``messages`` (tools and
    ``enable_thinking`` included; an image where each image sits), without submitting
    anything: for token counting (``ctx.prompt_positions(tokens)`` counts an image's
    positions too).

    Raises:
        InvalidRequestError: an option or a message is invalid.
    """
    return prepare.chat_prompt_tokens(ctx, messages, options)


def _include_usage(options: Mapping[str, Any]) -> bool:
    stream_options = options.get("stream_options") or {}
    if not isinstance(stream_options, Mapping):
        raise InvalidParameterError(
            f"stream_options must be an object, got {type(stream_options).__name__}",
            param="stream_options",
        )
    return check_flag(stream_options.get("include_usage"), "stream_options.include_usage")


def respond(
    request: OpenAIRequest, stream: bool, options: Mapping[str, Any]
) -> ChatCompletion | TextCompletion | Iterator[ChatCompletionChunk | TextCompletion]:
    """A submitted request's whole response, or with ``stream`` its chunks (with a usage
    chunk when ``options["stream_options"]`` asks)."""
    if stream:
        return request.chunks(_include_usage(options))
    return request.result()


async def arespond(
    request: OpenAIRequest, stream: bool, options: Mapping[str, Any]
) -> ChatCompletion | TextCompletion | AsyncIterator[ChatCompletionChunk | TextCompletion]:
    """Async twin of :func:`respond`."""
    if stream:
        return request.achunks(_include_usage(options))
    return await request.aresult()


def chat_completion(
    ctx: ChatHost,
    messages: Sequence[Mapping[str, Any]],
    *,
    stream: bool = False,
    fair_key: str | None = None,
    **options: Any,
) -> ChatCompletion | Iterator[ChatCompletionChunk]:
    """A ``chat.completion`` dict, or an iterator of ``chat.completion.chunk`` dicts when
    ``stream=True`` (first delta carries the role, the last chunk of each choice its
    ``finish_reason``; ``stream_options={"include_usage": True}`` adds a usage chunk).
    Closing the iterator early cancels the request. ``fair_key``: see :func:`submit_chat`."""
    stream = check_flag(stream, "stream")
    request = submit_chat(ctx, messages, fair_key=fair_key, **options)
    return respond(request, stream, options)  # type: ignore[return-value]


def completion(
    ctx: ChatHost,
    prompt: str | Sequence[int],
    *,
    stream: bool = False,
    fair_key: str | None = None,
    **options: Any,
) -> TextCompletion | Iterator[TextCompletion]:
    """A ``text_completion`` dict, or an iterator of them when ``stream=True``
    (``fair_key``: see :func:`submit_chat`)."""
    stream = check_flag(stream, "stream")
    request = _submitted(ctx, prepare.prepare_text(prompt, options), fair_key)
    return respond(request, stream, options)  # type: ignore[return-value]


async def achat_completion(
    ctx: ChatHost,
    messages: Sequence[Mapping[str, Any]],
    *,
    stream: bool = False,
    fair_key: str | None = None,
    **options: Any,
) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]:
    """Async twin of :func:`chat_completion` (needs the background loop); ``aclose()`` on the
    returned iterator cancels the request. Rendering, truncation and tokenizing run in a
    worker thread, so the event loop stays free."""
    stream = check_flag(stream, "stream")
    request = await _off_the_loop(lambda: submit_chat(ctx, messages, fair_key=fair_key, **options))
    return await arespond(request, stream, options)  # type: ignore[return-value]


async def acompletion(
    ctx: ChatHost,
    prompt: str | Sequence[int],
    *,
    stream: bool = False,
    fair_key: str | None = None,
    **options: Any,
) -> TextCompletion | AsyncIterator[TextCompletion]:
    """Async twin of :func:`completion`; tokenizing runs in a worker thread."""
    stream = check_flag(stream, "stream")
    request = await _off_the_loop(
        lambda: _submitted(ctx, prepare.prepare_text(prompt, options), fair_key)
    )
    return await arespond(request, stream, options)  # type: ignore[return-value]


async def _off_the_loop(submit: Callable[[], OpenAIRequest]) -> OpenAIRequest:
    return await submit_in_worker(submit, lambda request: request)


async def submit_in_worker(prepare: Callable[[], T], request_of: Callable[[T], OpenAIRequest]) -> T:
    """Run ``prepare`` (render, tokenize, submit) in the loop's default executor, so the
    event loop stays free; ``request_of`` finds the submitted request in its result.

    Cancelling the caller does not stop the worker; the request it submits is cancelled
    as soon as it exists, so nothing runs for a caller that has gone.
    """
    future = asyncio.get_running_loop().run_in_executor(None, prepare)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(lambda done: _cancel_submitted(done, request_of))
        raise


def _cancel_submitted(future: asyncio.Future[T], request_of: Callable[[T], OpenAIRequest]) -> None:
    if not future.cancelled() and future.exception() is None:
        request_of(future.result()).handle.cancel()
