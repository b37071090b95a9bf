"""OpenAI-shaped completions on top of the public :class:`llamax.Context` API.

``ctx.chat_completion(...)`` and friends delegate here. The functions take the context as
their first argument; the shapes are ``TypedDict`` s matching OpenAI's responses.
"""

from .api import (
    achat_completion,
    acompletion,
    chat_completion,
    chat_prompt_tokens,
    completion,
    submit_chat,
    submit_in_worker,
)
from .options import ChatOptions, CompletionOptions, StreamOptions
from .requests import OpenAIRequest
from .shapes import ChatCompletion, ChatCompletionChunk, CompletionUsage, TextCompletion

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatOptions",
    "CompletionOptions",
    "CompletionUsage",
    "OpenAIRequest",
    "StreamOptions",
    "TextCompletion",
    "achat_completion",
    "acompletion",
    "chat_completion",
    "chat_prompt_tokens",
    "completion",
    "submit_chat",
    "submit_in_worker",
]
