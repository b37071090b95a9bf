"""Anthropic's Messages API on top of :mod:`llamax.openai`: the request is mapped to a chat
request (system, text, ``tool_use`` and ``tool_result`` blocks, tools, ``thinking``), and
the result back to Anthropic's shapes: content blocks (``thinking``, ``text``,
``tool_use``), ``stop_reason``, ``usage``, and the streamed event sequence.

Supported and not, plainly:

- Content blocks: ``text`` everywhere, ``tool_use`` (assistant) and ``tool_result``
  (user, with text content), text ``document`` blocks (user), ``image`` blocks (user, a
  ``base64`` source; a ``url`` source is fetched by ``llamax serve`` only with
  ``--allow-image-urls``) and ``thinking`` (assistant; dropped from the prompt: the
  template sees the text). Images in tool results and PDF or URL documents are refused
  (:class:`~llamax.InvalidRequestError`).
- Fields: the table :data:`llamax.dialects.anthropic.MESSAGES` says which are honoured,
  accepted as hints (no effect) or refused, and why; any other field is refused.
- ``cache_control`` (the request's, or on any system block, content block or tool) is a
  hint: the prompt's prefix is kept longer than unhinted ones
  (``SamplingParams.keep_prefix``); where the breakpoints sit changes nothing, as every
  shared prefix is reused.
  ``thinking`` (``enabled``, ``adaptive`` or ``disabled``) is passed to templates as
  ``enable_thinking``; ``budget_tokens`` is not enforced.
- One reply per request (Anthropic has no ``n``).
- Claude Code's per-request attribution block (a system text block starting with
  ``x-anthropic-billing-header:``) is left out of the prompt, so the prefix cache keeps
  working from turn to turn (:mod:`llamax.dialects.anthropic_volatile`);
  ``keep_billing_header=True`` renders it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..chat import chat_prompt_tokens, submit_in_worker
from ..chat_stream import (
    ChatPart,
    ContentDelta,
    Finished,
    Progress,
    ReasoningDelta,
    ToolCallDelta,
)
from ..dialects.anthropic import parse_count, parse_messages
from ..openai import OpenAIRequest
from ..results import Completion, FinishReason

if TYPE_CHECKING:
    from .. import Context

__all__ = ["amessages", "count_tokens", "messages"]

"""The Messages request fields this layer takes."""
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def messages(
    ctx: Context, request: Mapping[str, Any], *, keep_billing_header: bool = False
) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """Answer one Messages request: the ``message`` object, or with ``stream: true`` an
    iterator of its events (closing it cancels the request).

    Args:
        ctx: The context.
        request: A mapping shaped as the ``POST /v1/messages`` body.
        keep_billing_header: Render Claude Code's ``x-anthropic-billing-header:`` system
            block; by default it is left out, as it changes on every request and would
            break the prefix cache (:mod:`llamax.dialects.anthropic_volatile`).

    Raises:
        InvalidRequestError: the request is malformed (nothing was enqueued).
        ContextLengthError: the conversation does not fit.
    """
    submitted, stops = _submit(ctx, request, keep_billing_header, None)
    if request.get("stream"):
        return submitted.events(_EventBuilder(submitted, stops))
    return _message(submitted, submitted.handle.result(), stops)


async def amessages(
    ctx: Context,
    request: Mapping[str, Any],
    *,
    keep_billing_header: bool = False,
    fair_key: str | None = None,
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Async twin of :func:`messages` (needs the context's background loop). Mapping,
    rendering and tokenizing run in a worker thread, so the event loop stays free.
    ``fair_key``: the fairness key of the submitted request (``Context.submit_chat``;
    the server passes the client's address), never a field of ``request``."""
    submitted, stops = await submit_in_worker(
        lambda: _submit(ctx, request, keep_billing_header, fair_key), lambda s: s[0].handle
    )
    if request.get("stream"):
        return submitted.aevents(_EventBuilder(submitted, stops))
    return _message(submitted, await submitted.handle, stops)


def count_tokens(
    ctx: Context, request: Mapping[str, Any], *, keep_billing_header: bool = False
) -> dict[str, int]:
    """``POST /v1/messages/count_tokens``: the prompt tokens of the request's conversation
    (system, messages and tools), as :func:`messages` would render them (with the same
    ``keep_billing_header``). It takes every field :func:`messages` takes, checked the
    same way: those that shape only the reply (``max_tokens``, sampling, stops,
    ``output_config``, ``stream``) change nothing counted."""
    call = parse_count(request, keep_billing_header=keep_billing_header)
    return {"input_tokens": ctx.prompt_positions(chat_prompt_tokens(ctx, call))}


# ---------------------------------------------------------------------- the request
def _submit(
    ctx: Context, request: Mapping[str, Any], keep_billing_header: bool, fair_key: str | None
) -> tuple[OpenAIRequest, list[str]]:
    parsed = parse_messages(request, keep_billing_header=keep_billing_header)
    handle = ctx.submit_chat(parsed.call, fair_key=fair_key)
    return OpenAIRequest(handle), list(parsed.stops)


def _tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` id for a chat tool call's ``call_`` id."""
    return "toolu_" + call_id.removeprefix("call_")


def _message_id(submitted: OpenAIRequest) -> str:
    return "msg_" + submitted.handle.request_id.removeprefix("req-")


def _stop(submitted: OpenAIRequest, completion: Completion, stops: Sequence[str]) -> str | None:
    """The stop sequence the reply ended at, if one did."""
    choice = completion.choices[0]
    if choice.finish_reason is not FinishReason.STOP or not stops:
        return None
    rest = submitted.chat.chat_model.detokenize(choice.token_ids)[len(choice.text) :]
    return next((s for s in stops if rest.startswith(s)), None)


def _usage(completion: Completion, output_tokens: int | None = None) -> dict[str, int]:
    usage = completion.usage
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage.completion_tokens if output_tokens is None else output_tokens,
    }


def _message(
    submitted: OpenAIRequest, completion: Completion, stops: Sequence[str]
) -> dict[str, Any]:
    """The whole reply: the fold of the parts its stream sends (:meth:`ChatHandle.replies`).

    A call that never completed (cut off by ``max_tokens``, as Anthropic's own replies may
    end on an incomplete ``tool_use``) has ``input: {}``; its stream opened the same block.
    """
    reply = submitted.chat.replies(completion)[0]
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
                "id": _tool_use_id(call["id"]),
                "name": function["name"],
                "input": {} if position in reply.broken else json.loads(function["arguments"]),
            }
        )
    stop_sequence = _stop(submitted, completion, stops)
    return {
        "id": _message_id(submitted),
        "type": "message",
        "role": "assistant",
        "model": submitted.chat.model,
        "content": content,
        "stop_reason": "stop_sequence" if stop_sequence else _STOP_REASONS[reply.finish],
        "stop_sequence": stop_sequence,
        "usage": _usage(completion),
    }


class _EventBuilder:
    """Encodes a chat request's typed stream as Messages stream events, one content block
    at a time: ``thinking``, then ``text``, then each ``tool_use``.

    ``message_start`` is sent once the prompt's first chunk is computed (the request is
    submitted with ``prefill_progress``), so its ``usage`` says truly how many prompt
    tokens the cache held, as Anthropic's does; Claude Code reads its cache counts there."""

    def __init__(self, submitted: OpenAIRequest, stops: Sequence[str]) -> None:
        self._submitted, self._stops = submitted, stops
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
        submitted = self._submitted
        usage = {
            "input_tokens": submitted.chat.num_prompt_tokens - cached,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": 0,
        }
        message: dict[str, Any] = {
            "id": _message_id(submitted),
            "type": "message",
            "role": "assistant",
            "model": submitted.chat.model,
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
                            "id": _tool_use_id(call_id),
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
        stop_sequence = _stop(self._submitted, completion, self._stops)
        reason = (
            "stop_sequence"
            if stop_sequence
            else _STOP_REASONS.get(self._finish or "stop", "end_turn")
        )
        usage = _usage(completion)
        begun = [] if self._started else self._message_start(completion.usage.cached_tokens)
        return [
            *begun,
            *self._close(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                "usage": usage,
            },
            {"type": "message_stop"},
        ]
