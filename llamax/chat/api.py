"""``chat_completion`` / ``completion`` and their async twins, OpenAI-shaped.

Every option has OpenAI's name and default. ``truncate="oldest_messages"`` drops the
oldest whole turns (keeping system messages and the newest turn) when the conversation does
not fit; without it an over-long conversation raises :class:`~llamax.ContextLengthError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from typing_extensions import Unpack

from .completions import Truncate, prepare_chat, prepare_text, sampling_params

if TYPE_CHECKING:
    from ..context import Context

__all__ = ["CompletionOptions", "achat_completion", "acompletion", "chat_completion", "completion"]


class StreamOptions(TypedDict, total=False):
    """OpenAI's ``stream_options``."""

    include_usage: bool


class CompletionOptions(TypedDict, total=False):
    """Options shared by chat and text completions (OpenAI names and defaults)."""

    max_tokens: int | None
    temperature: float
    top_p: float
    stop: str | Sequence[str] | None
    n: int
    seed: int | None
    logit_bias: Mapping[str | int, float] | None
    presence_penalty: float
    frequency_penalty: float
    stream: bool
    stream_options: StreamOptions | None
    model: str | None
    user: str | None
    logprobs: bool | int | None
    top_logprobs: int | None
    response_format: Mapping[str, Any] | None
    top_k: int
    """llama.cpp extension (0, OpenAI's behaviour, disables it)."""
    min_p: float
    """llama.cpp extension (0 disables it)."""
    repeat_penalty: float
    """llama.cpp extension (1 disables it)."""
    grammar: str | None
    """llama.cpp extension: a GBNF grammar constraining the output."""


def _params(options: CompletionOptions, *, chat: bool) -> Any:
    return sampling_params(
        logprobs=_logprobs(options, chat=chat),
        response_format=options.get("response_format"),
        max_tokens=options.get("max_tokens"),
        temperature=options.get("temperature", 1.0),
        top_p=options.get("top_p", 1.0),
        stop=options.get("stop"),
        n=options.get("n", 1),
        seed=options.get("seed"),
        logit_bias=options.get("logit_bias"),
        presence_penalty=options.get("presence_penalty", 0.0),
        frequency_penalty=options.get("frequency_penalty", 0.0),
        top_k=options.get("top_k", 0),
        min_p=options.get("min_p", 0.0),
        repeat_penalty=options.get("repeat_penalty", 1.0),
        grammar=options.get("grammar"),
    )


def _logprobs(options: CompletionOptions, *, chat: bool) -> int | None:
    """Chat: ``logprobs=True`` plus ``top_logprobs=k``; text: ``logprobs=k``."""
    wanted = options.get("logprobs")
    if chat:
        return (options.get("top_logprobs") or 0) if wanted else None
    return None if wanted is None or wanted is False else int(wanted)


def _include_usage(options: CompletionOptions) -> bool:
    return bool((options.get("stream_options") or {}).get("include_usage", False))


def chat_completion(
    ctx: Context,
    messages: Sequence[Mapping[str, Any]],
    *,
    truncate: Truncate = "none",
    **options: Unpack[CompletionOptions],
) -> Any:
    """A ``chat.completion`` dict, or an iterator of ``chat.completion.chunk`` dicts when
    ``stream=True`` (first delta carries the role, the last chunk of each choice its
    ``finish_reason``; ``stream_options={"include_usage": True}`` adds a usage chunk)."""
    request = prepare_chat(ctx, messages, _params(options, chat=True), truncate=truncate)
    if options.get("stream"):
        return request.chunks(_include_usage(options))
    return request.result()


def completion(
    ctx: Context, prompt: str | Sequence[int], **options: Unpack[CompletionOptions]
) -> Any:
    """A ``text_completion`` dict, or an iterator of them when ``stream=True``."""
    request = prepare_text(ctx, prompt, _params(options, chat=False))
    if options.get("stream"):
        return request.chunks(_include_usage(options))
    return request.result()


async def achat_completion(
    ctx: Context,
    messages: Sequence[Mapping[str, Any]],
    *,
    truncate: Truncate = "none",
    **options: Unpack[CompletionOptions],
) -> Any:
    """Async twin of :func:`chat_completion`: awaits the dict, or returns an async iterator."""
    request = prepare_chat(ctx, messages, _params(options, chat=True), truncate=truncate)
    if options.get("stream"):
        return request.achunks(_include_usage(options))
    return await request.aresult()


async def acompletion(
    ctx: Context, prompt: str | Sequence[int], **options: Unpack[CompletionOptions]
) -> Any:
    """Async twin of :func:`completion`."""
    request = prepare_text(ctx, prompt, _params(options, chat=False))
    if options.get("stream"):
        stream: AsyncIterator[Any] = request.achunks(_include_usage(options))
        return stream
    return await request.aresult()
