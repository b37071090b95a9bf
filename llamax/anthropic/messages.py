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

from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..chat import chat_prompt_tokens, submit_in_worker
from ..dialects.anthropic import parse_count, parse_messages
from ..dialects.anthropic_encode import MessageEvents, MessageIds, encode_message
from ..openai import OpenAIRequest

if TYPE_CHECKING:
    from .. import Context

__all__ = ["amessages", "count_tokens", "messages"]


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
    submitted, ids = _submit(ctx, request, keep_billing_header, None)
    if request.get("stream"):
        return submitted.events(MessageEvents(ids))
    completion = submitted.handle.result()
    return encode_message(ids, completion, submitted.chat.replies(completion)[0])


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
    submitted, ids = await submit_in_worker(
        lambda: _submit(ctx, request, keep_billing_header, fair_key), lambda s: s[0].handle
    )
    if request.get("stream"):
        return submitted.aevents(MessageEvents(ids))
    completion = await submitted.handle
    return encode_message(ids, completion, submitted.chat.replies(completion)[0])


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


def _submit(
    ctx: Context, request: Mapping[str, Any], keep_billing_header: bool, fair_key: str | None
) -> tuple[OpenAIRequest, MessageIds]:
    parsed = parse_messages(request, keep_billing_header=keep_billing_header)
    chat = ctx.submit_chat(parsed.call, fair_key=fair_key)
    ids = MessageIds(chat.handle.request_id, chat.model, chat.num_prompt_tokens,
                     tuple(parsed.stops), chat.chat_model.detokenize)  # fmt: skip
    return OpenAIRequest(chat), ids
