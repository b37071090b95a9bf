"""What the layers that build calls need of a context: the one entry, and the chat model
to count tokens with."""

from __future__ import annotations

from typing import Protocol

from .call import ChatCall
from .handle import ChatHandle
from .prepare import ChatModel

__all__ = ["CallHost"]


class CallHost(ChatModel, Protocol):
    """A :class:`~llamax.chat.prepare.ChatModel` that takes calls (a
    :class:`llamax.Context`): what ``llamax.openai``'s Responses API and
    ``llamax.anthropic`` work on, so they name no context."""

    def submit_chat(self, call: ChatCall, *, fair_key: str | None = None) -> ChatHandle:
        """Render, fit and submit ``call``."""
