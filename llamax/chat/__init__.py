"""Chat and text calls below the facade: typed requests in, a typed handle out.

- :class:`ChatCall` / :class:`TextCall` (:mod:`llamax.chat.call`): one request as a frozen,
  checked value; ``ChatCall.of(messages, **options)`` builds one from OpenAI-named options.
- :mod:`llamax.chat.prepare`: a call rendered and fitted on a :class:`ChatModel` (the
  template binding a context hands down) into a :class:`Prepared` request.
- :class:`ChatHandle` (:mod:`llamax.chat.handle`): the submitted call; its reply as typed
  parts (:mod:`llamax.chat_stream`) or whole.
- :func:`submit_in_worker`: run a submission off the event loop, cancel-safe.

``Context.submit_chat(call)`` / ``submit_text(call)`` (and their async twins) are the one
entry; ``Context.chat_completion`` and the server's dialects are built on them.
"""

from .call import ChatCall, TextCall, new_request_id
from .handle import ChatHandle
from .host import CallHost
from .options import ChatOptions, CompletionOptions, StreamOptions, Truncate
from .prepare import ChatModel, Prepared, chat_prompt_tokens, prepare_chat, prepare_text
from .worker import submit_in_worker

__all__ = [
    "CallHost",
    "ChatCall",
    "ChatHandle",
    "ChatModel",
    "ChatOptions",
    "CompletionOptions",
    "Prepared",
    "StreamOptions",
    "TextCall",
    "Truncate",
    "chat_prompt_tokens",
    "new_request_id",
    "prepare_chat",
    "prepare_text",
    "submit_in_worker",
]
