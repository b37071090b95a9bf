"""A submitted chat or text call: its :class:`~llamax.RequestHandle` and what reading its
reply needs, below the facade and below every API dialect.

``Context.submit_chat(call)`` returns a :class:`ChatHandle`. Its :meth:`~ChatHandle.parts`
are the reply as typed parts (:mod:`llamax.chat_stream`: the thinking split off, tool
calls parsed, the finish reason), the same parts every dialect encodes (OpenAI's chunks,
Anthropic's events, the Responses API's events); :meth:`~ChatHandle.result` is the whole
:class:`~llamax.Completion`, and :meth:`~ChatHandle.replies` its messages: the fold of the
very parts its text streams as (:class:`~llamax.chat_stream.ChatFold`), so a whole reply
says what a stream of it does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Literal

from ..chat_stream import ChatFold, ChatPart, ChatReply, ChatStream
from ..handle import RequestHandle
from ..reasoning import ReasoningFormat
from ..results import Completion, TokenEvent
from ..tools import ToolPlan
from .prepare import ChatModel, Prepared

__all__ = ["ChatHandle"]


@dataclass(frozen=True, slots=True)
class ChatHandle:
    """A submitted chat (or text) call: the request's handle plus what its reply needs."""

    chat_model: ChatModel
    """The model's tokenizer (an encoder counts or reads tokens with it)."""
    handle: RequestHandle
    """The request: a future, a token iterator and an asyncio stream; ``cancel()`` stops it."""
    kind: Literal["chat", "text"]
    model: str
    """The name the reply answers as: the call's own ``model``, else the model's name."""
    created: int
    """When it was submitted, in seconds since the epoch."""
    tools: ToolPlan = field(default_factory=ToolPlan)
    """Tool calling asked for (``mode="none"``: replies are plain text)."""
    reasoning_format: ReasoningFormat = "none"
    """How the reply's thinking is reported (:mod:`llamax.reasoning`; chat only)."""
    thinking_opened: bool = False
    """Whether the rendered prompt left a ``<think>`` open (the reply starts thinking)."""
    num_prompt_tokens: int = 0
    """Positions of the rendered prompt (chat; 0 for a text prompt given as a string)."""
    submitted: float = field(default_factory=time.perf_counter)
    """When it was submitted (``time.perf_counter``): prompt progress counts from there."""

    @classmethod
    def of(cls, handle: RequestHandle, prepared: Prepared, chat_model: ChatModel) -> ChatHandle:
        """The handle of ``prepared`` once submitted as ``handle``."""
        return cls(
            chat_model,
            handle,
            prepared.kind,
            prepared.model or chat_model.facts.model_name,
            int(time.time()),
            prepared.tools,
            prepared.reasoning_format,
            prepared.thinking_opened,
            prepared.num_prompt_tokens,
        )

    @property
    def request_id(self) -> str:
        """The request's id (``req-...``)."""
        return self.handle.request_id

    def named(self, model: object) -> ChatHandle:
        """This handle answering as ``model`` when that is a non-empty str (a request's own
        ``model`` field is echoed, as OpenAI and llama-server do); else unchanged."""
        if isinstance(model, str) and model:
            return dataclasses.replace(self, model=model)
        return self

    @property
    def splits_reasoning(self) -> bool:
        """Whether the reply's thinking is reported apart from its answer."""
        return self.kind == "chat" and self.reasoning_format != "none"

    def chat_stream(self) -> ChatStream:
        """A fresh typed stream of this chat's parts (one per reading)."""
        return ChatStream(self.tools, self.splits_reasoning, self.thinking_opened)

    def parts(self) -> Iterator[ChatPart]:
        """The reply as typed parts, as they are computed (blocking; closing the iterator
        early cancels the request)."""
        stream = self.chat_stream()
        try:
            for event in self.handle:
                yield from stream.parts(event)
        finally:
            if not self.handle.done():
                self.handle.cancel()

    async def aparts(self) -> AsyncIterator[ChatPart]:
        """Async twin of :meth:`parts` (needs the background loop)."""
        stream = self.chat_stream()
        try:
            async for event in self.handle:
                for part in stream.parts(event):
                    yield part
        finally:
            if not self.handle.done():
                self.handle.cancel()

    def result(self) -> Completion:
        """The whole reply (blocking); its messages are :meth:`replies`."""
        return self.handle.result()

    async def aresult(self) -> Completion:
        """Async twin of :meth:`result`."""
        return await self.handle

    def replies(self, completion: Completion) -> list[ChatReply]:
        """Each choice of the finished ``completion`` as a message: the fold of the parts
        its text streams as (one event per choice; the fold does not depend on where the
        events split the text). A text call's replies are its texts, unparsed."""
        stream, folding = self.chat_stream(), ChatFold()
        for choice in completion.choices:
            event = TokenEvent(choice.text, choice.token_ids, choice.index, choice.finish_reason)
            for part in stream.parts(event):
                folding.add(part)
        return folding.replies()

    def cancel(self) -> None:
        """Cancel the request (a no-op once it has finished)."""
        self.handle.cancel()
