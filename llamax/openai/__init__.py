"""OpenAI-shaped completions on top of the public :class:`llamax.Context` API.

``ctx.chat_completion(...)`` and friends delegate here. The functions take the context as
their first argument; the shapes are ``TypedDict`` s matching OpenAI's responses.
"""

from .api import achat_completion, acompletion, chat_completion, completion
from .options import ChatOptions, CompletionOptions, StreamOptions
from .shapes import ChatCompletion, ChatCompletionChunk, CompletionUsage, TextCompletion

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatOptions",
    "CompletionOptions",
    "CompletionUsage",
    "StreamOptions",
    "TextCompletion",
    "achat_completion",
    "acompletion",
    "chat_completion",
    "completion",
]
