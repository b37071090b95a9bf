"""OpenAI-shaped results. These dicts exist only at the OpenAI boundary."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from typing_extensions import NotRequired

from ..tools.parse import ToolCall, ToolCallDelta
from .llama_native import PromptProgress

__all__ = [
    "ChatCompletion",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionChunkChoice",
    "ChatCompletionMessage",
    "ChatDelta",
    "CompletionUsage",
    "PromptProgress",
    "TextCompletion",
    "TextCompletionChoice",
]

OpenAIFinishReason = Literal["stop", "length", "tool_calls"]


class CompletionUsage(TypedDict):
    """Token counts, as OpenAI reports them."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: NotRequired[dict[str, int]]
    completion_tokens_details: NotRequired[dict[str, int]]
    """With speculative decoding: ``accepted_prediction_tokens`` and
    ``rejected_prediction_tokens`` (draft tokens kept and thrown away)."""


class ChatCompletionMessage(TypedDict):
    """The assistant's reply (``content`` is None when it only calls tools)."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: NotRequired[list[ToolCall]]
    reasoning_content: NotRequired[str]
    """The reply's thinking (``<think>…</think>``), when it thought (llamax.reasoning)."""


class ChatCompletionChoice(TypedDict):
    """One choice of a ``chat.completion``."""

    index: int
    message: ChatCompletionMessage
    finish_reason: OpenAIFinishReason
    logprobs: Any


class ChatCompletion(TypedDict):
    """An OpenAI ``chat.completion`` object."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage


class ChatDelta(TypedDict, total=False):
    """What a streamed chunk adds to a choice."""

    role: Literal["assistant"]
    content: str
    tool_calls: list[ToolCallDelta]
    reasoning_content: str


class ChatCompletionChunkChoice(TypedDict):
    """One choice of a ``chat.completion.chunk``."""

    index: int
    delta: ChatDelta
    finish_reason: OpenAIFinishReason | None
    logprobs: Any


class ChatCompletionChunk(TypedDict):
    """An OpenAI ``chat.completion.chunk`` object."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: NotRequired[CompletionUsage | None]
    prompt_progress: NotRequired[PromptProgress]
    """llama-server's extension (``return_progress``): how far the prompt is computed."""


class TextCompletionChoice(TypedDict):
    """One choice of a ``text_completion``."""

    index: int
    text: str
    finish_reason: OpenAIFinishReason | None
    logprobs: Any


class TextCompletion(TypedDict):
    """An OpenAI ``text_completion`` object (also each streamed chunk)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextCompletionChoice]
    usage: NotRequired[CompletionUsage | None]
