"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat layer: the request
is parsed by :func:`llamax.dialects.responses.parse_create` (what is supported and not is
listed there), its call submitted, and the chat result read back as ``response`` objects
and the typed stream events (``response.created``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.completed`` ...).

``previous_response_id`` needs a :class:`ResponseStore`: the follow-up's conversation is the
stored one plus its own input (a prefix the cache already holds).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from ..chat import CallHost, chat_prompt_tokens, submit_in_worker
from ..dialects.responses import REQUEST_FIELDS as RESPONSE_FIELDS
from ..dialects.responses import parse_create
from ..dialects.responses_encode import ResponseEvents, ResponseIds, ResponseJob
from .requests import OpenAIRequest
from .response_store import ResponseStore

__all__ = [
    "RESPONSE_FIELDS",
    "ResponseStore",
    "acreate_response",
    "create_response",
    "response_input_tokens",
]


def create_response(
    ctx: CallHost,
    request: Mapping[str, Any],
    *,
    store: ResponseStore | None = None,
    stored_input: Any = None,
) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """Answer one Responses request: the ``response`` object, or with ``stream: true`` an
    iterator of its events (closing it cancels the request).

    Args:
        ctx: The context.
        request: A mapping shaped as the ``POST /v1/responses`` body.
        store: Where ``previous_response_id`` is looked up and, unless the request says
            ``store: false``, where the finished response is kept. ``None``: nothing is
            stored, and a ``previous_response_id`` is not found.
        stored_input: What the stored response lists as its input items instead of
            ``request["input"]`` (``None``: that): a server that fetched image URLs into
            ``data:`` URLs passes the input as the client sent it, so the store hands back
            the URLs, never the fetched bytes.

    Raises:
        InvalidRequestError: the request is malformed (nothing was enqueued).
        NotFoundError: ``previous_response_id`` names no stored response.
        ContextLengthError: the conversation does not fit.
    """
    submitted, job = _submit(ctx, request, store, stored_input, None)
    if request.get("stream"):
        return submitted.events(ResponseEvents(job))
    completion = submitted.handle.result()
    return job.finish(completion, submitted.chat.replies(completion)[0])


async def acreate_response(
    ctx: CallHost,
    request: Mapping[str, Any],
    *,
    store: ResponseStore | None = None,
    stored_input: Any = None,
    fair_key: str | None = None,
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """Async twin of :func:`create_response` (needs the context's background loop).
    Mapping, rendering and tokenizing run in a worker thread, so the event loop stays
    free. ``fair_key``: the fairness key of the submitted request (``Context.submit_chat``;
    the server passes the client's address), never a field of ``request``."""
    submitted, job = await submit_in_worker(
        lambda: _submit(ctx, request, store, stored_input, fair_key), lambda s: s[0].handle
    )
    if request.get("stream"):
        return submitted.aevents(ResponseEvents(job))
    completion = await submitted.handle
    return job.finish(completion, submitted.chat.replies(completion)[0])


# ---------------------------------------------------------------------- the request
def response_input_tokens(
    ctx: CallHost, request: Mapping[str, Any], *, store: ResponseStore | None = None
) -> int:
    """How many prompt tokens a Responses request would submit (OpenAI's
    ``POST /v1/responses/input_tokens``): its conversation (``previous_response_id``'s
    included), instructions and tools rendered and tokenized, nothing submitted.

    Raises:
        InvalidRequestError: the request is malformed.
        NotFoundError: ``previous_response_id`` names no stored response.
    """
    return ctx.prompt_positions(chat_prompt_tokens(ctx, parse_create(request, store).call))


def _submit(
    ctx: CallHost, request: Mapping[str, Any], store: ResponseStore | None, stored_input: Any,
    fair_key: str | None,
) -> tuple[OpenAIRequest, ResponseJob]:  # fmt: skip
    parsed = parse_create(request, store)
    chat = ctx.submit_chat(parsed.call, fair_key=fair_key)
    ids = ResponseIds(chat.handle.request_id, chat.created, chat.model, chat.submitted,
                      chat.chat_model.tokenize)  # fmt: skip
    body = parsed.body if stored_input is None else {**parsed.body, "input": stored_input}
    job = ResponseJob(ids, dict(body), list(parsed.conversation),
                      store if parsed.store else None, parsed.max_output_tokens,
                      list(parsed.earlier_items))  # fmt: skip
    return OpenAIRequest(chat), job
