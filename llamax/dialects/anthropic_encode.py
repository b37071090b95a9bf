"""Anthropic's Messages API, encoded: a finished request as the ``message`` object
(:func:`encode_message`), and a request's typed parts (:mod:`llamax.chat_stream`) as the
Messages stream events (:class:`MessageEvents`, an
:class:`~llamax.dialects.openai_encode.Encoder`). Pure: the caller reads the request
(:meth:`llamax.openai.OpenAIRequest.events` drives the encoder over a handle) and frames
what comes out.

Content blocks come in Anthropic's order: ``thinking``, then ``text``, then each
``tool_use``. The whole message is the fold of the parts its stream sends
(:class:`~llamax.chat_stream.ChatReply`), so a client that rebuilds the stream gets it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..chat_stream import (
    ChatPart,
    ChatReply,
    ContentDelta,
    Finished,
    Progress,
    ReasoningDelta,
    ToolCallDelta,
)
from ..results import Completion, FinishReason

__all__ = ["MessageEvents", "MessageIds", "encode_message", "stop_sequence"]

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
"""Anthropic's ``stop_reason`` for a chat reply's finish (a matched stop sequence aside)."""


@dataclass(frozen=True, slots=True)
class MessageIds:
    """What a reply's objects repeat, and what finds the stop sequence it ended at."""

    request_id: str
    """The engine's request id (``req-...``); the message's id is ``msg_...`` of it."""
    model: str
    num_prompt_tokens: int
    """The prompt's tokens, cached ones included (``message_start``'s usage)."""
    stops: tuple[str, ...] = ()
    """The request's ``stop_sequences``."""
    detokenize: Callable[[Sequence[int]], str] = field(default=lambda _: "", compare=False)
    """The model's detokenizer: the reply's tokens past its text spell the stop it met."""

    @property
    def id(self) -> str:
        """``msg_...``, derived from the request id."""
        return "msg_" + self.request_id.removeprefix("req-")


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` id for a chat tool call's ``call_`` id."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_sequence(ids: MessageIds, completion: Completion) -> str | None:
    """The stop sequence the reply ended at, if one did."""
    choice = completion.choices[0]
    if choice.finish_reason is not FinishReason.STOP or not ids.stops:
        return None
    rest = ids.detokenize(choice.token_ids)[len(choice.text) :]
    return next((s for s in ids.stops if rest.startswith(s)), None)


def _usage(completion: Completion) -> dict[str, int]:
    usage = completion.usage
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage.completion_tokens,
    }


def encode_message(ids: MessageIds, completion: Completion, reply: ChatReply) -> dict[str, Any]:
    """The whole ``message``: ``reply`` is the fold of the parts its stream sends
    (:meth:`llamax.chat.ChatHandle.replies`).

    A call that never completed (cut off by ``max_tokens``, as Anthropic's own replies may
    end on an incomplete ``tool_use``) has ``input: {}``; its stream opened the same block.
    """
    content: list[dict[str, Any]] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    for position, call in enumerate(reply.tool_calls):
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call["id"]),
                "name": function["name"],
                "input": {} if position in reply.broken else json.loads(function["arguments"]),
            }
        )
    stop = stop_sequence(ids, completion)
    return {
        "id": ids.id,
        "type": "message",
        "role": "assistant",
        "model": ids.model,
        "content": content,
        "stop_reason": "stop_sequence" if stop else STOP_REASONS[reply.finish],
        "stop_sequence": stop,
        "usage": _usage(completion),
    }


class MessageEvents:
    """A request's parts as Messages stream events, one content block at a time:
    ``thinking``, then ``text``, then each ``tool_use`` (an
    :class:`~llamax.dialects.openai_encode.Encoder`).

    ``message_start`` is sent once the prompt's first chunk is computed (submit the request
    with ``prefill_progress``), so its ``usage`` says truly how many prompt tokens the cache
    held, as Anthropic's does; Claude Code reads its cache counts there."""

    def __init__(self, ids: MessageIds) -> None:
        self._ids = ids
        self._index = -1
        self._open: str | None = None
        self._finish: str | None = None
        self._started = False

    def start(self) -> list[dict[str, Any]]:
        """Nothing yet: ``message_start`` waits for the prompt's first progress part, which
        says how many of its tokens the cache held (:meth:`parts`)."""
        return []

    def _message_start(self, cached: int) -> list[dict[str, Any]]:
        """``message_start`` (usage as Anthropic counts it: ``input_tokens`` are the prompt
        tokens computed, ``cache_read_input_tokens`` those the cache held) and a ping."""
        self._started = True
        ids = self._ids
        usage = {
            "input_tokens": ids.num_prompt_tokens - cached,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": 0,
        }
        message: dict[str, Any] = {
            "id": ids.id,
            "type": "message",
            "role": "assistant",
            "model": ids.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _block(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self._index += 1
        self._open = kind
        events.append({"type": "content_block_start", "index": self._index, "content_block": block})
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._index}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def parts(self, parts: Sequence[ChatPart]) -> list[dict[str, Any]]:
        """One token event's parts as events."""
        events: list[dict[str, Any]] = []
        for part in parts:
            if not self._started:
                cached = part.progress.num_cached_tokens if isinstance(part, Progress) else 0
                events += self._message_start(cached)
            match part:
                case ReasoningDelta(text=text):
                    if self._open != "thinking":
                        events += self._block(
                            "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                        )
                    events.append(self._delta({"type": "thinking_delta", "thinking": text}))
                case ContentDelta(text=text) if text:
                    if self._open != "text":
                        events += self._block("text", {"type": "text", "text": ""})
                    events.append(self._delta({"type": "text_delta", "text": text}))
                case ToolCallDelta(call_id=call_id, name=name, arguments=arguments):
                    if call_id is not None:
                        block = {
                            "type": "tool_use",
                            "id": tool_use_id(call_id),
                            "name": name or "",
                            "input": {},
                        }
                        events += self._block("tool_use", block)
                    if arguments:
                        events.append(
                            self._delta({"type": "input_json_delta", "partial_json": arguments})
                        )
                case Finished(reason=reason):
                    self._finish = reason
                    events += self._close()
        return events

    def end(self, completion: Completion) -> list[dict[str, Any]]:
        """The open block's end, ``message_delta`` (stop reason, final usage) and
        ``message_stop``."""
        stop = stop_sequence(self._ids, completion)
        reason = "stop_sequence" if stop else STOP_REASONS.get(self._finish or "stop", "end_turn")
        begun = [] if self._started else self._message_start(completion.usage.cached_tokens)
        return [
            *begun,
            *self._close(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": stop},
                "usage": _usage(completion),
            },
            {"type": "message_stop"},
        ]
