"""OpenAI-shaped completions and responses, below the facade.

A request is prepared (:mod:`~llamax.openai.prepare`: options and messages to prompt
tokens and :class:`~llamax.SamplingParams`) on a chat model the context hands down, never
on the context; the context submits it and :class:`OpenAIRequest` shapes the result. The
functions here take the context first (a :class:`~llamax.openai.api.ChatHost`) and do the
same through its public ``add_request``; the shapes are ``TypedDict`` s matching OpenAI's.
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
from .responses_api import (
    RESPONSE_FIELDS,
    acreate_response,
    create_response,
    response_input_tokens,
)
from .responses_output import ResponseStore
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
    "response_input_tokens",
    "submit_chat",
    "submit_in_worker",
]
