"""OpenAI-shaped completions and responses, below the facade.

OpenAI-named options become a :class:`~llamax.chat.ChatCall` (``ChatCall.of``), which the
context submits (``Context.submit_chat``, the one entry); :class:`OpenAIRequest` reads the
submitted call as OpenAI's shapes (``TypedDict`` s matching OpenAI's). The Responses API
(:func:`create_response`) builds its call the same way, on a
:class:`~llamax.chat.CallHost`.
"""

from ..chat.options import ChatOptions, CompletionOptions, StreamOptions
from ..dialects.openai_shapes import (
    ChatCompletion,
    ChatCompletionChunk,
    CompletionUsage,
    TextCompletion,
)
from .requests import EventBuilder, OpenAIRequest
from .response_store import ResponseStore
from .responses_api import (
    RESPONSE_FIELDS,
    acreate_response,
    create_response,
    response_input_tokens,
)

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
    "acreate_response",
    "create_response",
    "response_input_tokens",
]
