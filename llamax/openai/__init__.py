"""OpenAI-shaped completions and responses on top of the public :class:`llamax.Context` API.

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
from .requests import EventBuilder, OpenAIRequest
from .responses_api import RESPONSE_FIELDS, ResponseStore, acreate_response, create_response
from .shapes import ChatCompletion, ChatCompletionChunk, CompletionUsage, TextCompletion

__all__ = [
    "RESPONSE_FIELDS",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatOptions",
    "CompletionOptions",
    "CompletionUsage",
    "EventBuilder",
    "OpenAIRequest",
    "ResponseStore",
    "StreamOptions",
    "TextCompletion",
    "achat_completion",
    "acompletion",
    "acreate_response",
    "chat_completion",
    "chat_prompt_tokens",
    "completion",
    "create_response",
    "submit_chat",
    "submit_in_worker",
]
