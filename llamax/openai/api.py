"""``chat_completion`` / ``completion`` and their async twins, OpenAI-shaped.

Every option has OpenAI's name and default (see :class:`~llamax.openai.options.ChatOptions`);
an unknown option raises ``TypeError``. ``truncate="oldest_messages"`` drops the oldest whole
turns (keeping system messages and the newest turn) when the conversation does not fit;
without it an over-long conversation raises :class:`~llamax.ContextLengthError`.
Built only on the public API of :class:`~llamax.Context` and its handles.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import InvalidParameterError
from ..tools import prepare_tools, tool_prompt_tokens
from .options import (
    CHAT_OPTIONS,
    COMPLETION_OPTIONS,
    ChatOptions,
    CompletionOptions,
    check_flag,
    check_option_names,
    sampling_params,
)
from .requests import OpenAIRequest, prepare_chat, prepare_text, prepare_tool_chat
from .shapes import ChatCompletion, ChatCompletionChunk, TextCompletion

if TYPE_CHECKING:
    from .. import Context

T = TypeVar("T")

__all__ = [
    "achat_completion",
    "acompletion",
    "chat_completion",
    "chat_prompt_tokens",
    "completion",
    "submit_chat",
    "submit_in_worker",
]


def submit_chat(
    ctx: Context, messages: Sequence[Mapping[str, Any]], **options: Any
) -> OpenAIRequest:
    """The submitted request behind :func:`chat_completion`: its handle, and the methods
    that shape its results. For layers that build other shapes on it (``llamax.anthropic``).
    ``stream`` and ``stream_options`` are not options here (the caller chooses).

    Raises:
        InvalidRequestError: an option or a message is invalid (nothing was enqueued).
        ContextLengthError: the conversation does not fit.
    """
    return _chat(ctx, messages, options)


def chat_prompt_tokens(
    ctx: Context, messages: Sequence[Mapping[str, Any]], **options: Any
) -> list[int]:
    """The prompt tokens :func:`chat_completion` would submit for ``messages`` (tools and
    ``enable_thinking`` included), without submitting anything: for token counting.

    Raises:
        InvalidRequestError: an option or a message is invalid.
    """
    check_option_names(options, CHAT_OPTIONS, "chat_prompt_tokens")
    plan = prepare_tools(
        options.get("tools"), options.get("tool_choice"), options.get("parallel_tool_calls")
    )
    thinking = options.get("enable_thinking")
    template_vars = {} if thinking is None else {"enable_thinking": thinking}
    if plan.is_active or _mentions_tools(messages):
        return tool_prompt_tokens(ctx, messages, plan, **template_vars)
    return ctx.chat_prompt(messages, **template_vars)


def _chat(
    ctx: Context, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any]
) -> OpenAIRequest:
    return _submit_chat(ctx, messages, options).named(options.get("model"))


def _submit_chat(
    ctx: Context, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any]
) -> OpenAIRequest:
    check_option_names(options, CHAT_OPTIONS, "chat_completion")
    opts: ChatOptions = options  # type: ignore[assignment]
    params = sampling_params(opts, chat=True)
    plan = prepare_tools(
        opts.get("tools"), opts.get("tool_choice"), opts.get("parallel_tool_calls")
    )
    if plan.is_active or _mentions_tools(messages):
        if opts.get("truncate", "none") != "none":
            raise InvalidParameterError("truncate is not supported together with tools")
        return prepare_tool_chat(
            ctx,
            messages,
            params,
            plan,
            reasoning_format=opts.get("reasoning_format", "auto"),
            enable_thinking=opts.get("enable_thinking"),
        )
    return prepare_chat(
        ctx,
        messages,
        params,
        truncate=opts.get("truncate", "none"),
        parse_special_in_content=opts.get("parse_special_in_content", False),
        reasoning_format=opts.get("reasoning_format", "auto"),
        enable_thinking=opts.get("enable_thinking"),
    )


def _mentions_tools(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the conversation carries tool calls or tool results to render."""
    return any(
        isinstance(m, Mapping) and (m.get("role") == "tool" or m.get("tool_calls"))
        for m in messages
    )


def _text(ctx: Context, prompt: str | Sequence[int], options: Mapping[str, Any]) -> OpenAIRequest:
    check_option_names(options, COMPLETION_OPTIONS, "completion")
    opts: CompletionOptions = options  # type: ignore[assignment]
    request = prepare_text(ctx, prompt, sampling_params(opts, chat=False))
    return request.named(opts.get("model"))


def _include_usage(options: Mapping[str, Any]) -> bool:
    stream_options = options.get("stream_options") or {}
    if not isinstance(stream_options, Mapping):
        raise InvalidParameterError(
            f"stream_options must be an object, got {type(stream_options).__name__}"
        )
    return check_flag(stream_options.get("include_usage"), "stream_options.include_usage")


def chat_completion(
    ctx: Context, messages: Sequence[Mapping[str, Any]], *, stream: bool = False, **options: Any
) -> ChatCompletion | Iterator[ChatCompletionChunk]:
    """A ``chat.completion`` dict, or an iterator of ``chat.completion.chunk`` dicts when
    ``stream=True`` (first delta carries the role, the last chunk of each choice its
    ``finish_reason``; ``stream_options={"include_usage": True}`` adds a usage chunk).
    Closing the iterator early cancels the request."""
    stream = check_flag(stream, "stream")
    request = _chat(ctx, messages, options)
    if stream:
        return request.chunks(_include_usage(options))  # type: ignore[return-value]
    return request.result()  # type: ignore[return-value]


def completion(
    ctx: Context, prompt: str | Sequence[int], *, stream: bool = False, **options: Any
) -> TextCompletion | Iterator[TextCompletion]:
    """A ``text_completion`` dict, or an iterator of them when ``stream=True``."""
    stream = check_flag(stream, "stream")
    request = _text(ctx, prompt, options)
    if stream:
        return request.chunks(_include_usage(options))  # type: ignore[return-value]
    return request.result()  # type: ignore[return-value]


async def achat_completion(
    ctx: Context, messages: Sequence[Mapping[str, Any]], *, stream: bool = False, **options: Any
) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]:
    """Async twin of :func:`chat_completion` (needs the background loop); ``aclose()`` on the
    returned iterator cancels the request. Rendering, truncation and tokenizing run in a
    worker thread, so the event loop stays free."""
    stream = check_flag(stream, "stream")
    request = await _off_the_loop(lambda: _chat(ctx, messages, options))
    if stream:
        return request.achunks(_include_usage(options))  # type: ignore[return-value]
    return await request.aresult()  # type: ignore[return-value]


async def acompletion(
    ctx: Context, prompt: str | Sequence[int], *, stream: bool = False, **options: Any
) -> TextCompletion | AsyncIterator[TextCompletion]:
    """Async twin of :func:`completion`; tokenizing runs in a worker thread."""
    stream = check_flag(stream, "stream")
    request = await _off_the_loop(lambda: _text(ctx, prompt, options))
    if stream:
        return request.achunks(_include_usage(options))  # type: ignore[return-value]
    return await request.aresult()  # type: ignore[return-value]


async def _off_the_loop(prepare: Callable[[], OpenAIRequest]) -> OpenAIRequest:
    return await submit_in_worker(prepare, lambda request: request)


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
