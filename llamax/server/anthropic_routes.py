"""Anthropic's Messages API over HTTP: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, thin over :mod:`llamax.anthropic`.

Errors come in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``),
the key is read from ``x-api-key`` as well as ``Authorization``, and a streamed reply is
sent as ``event: NAME`` / ``data: {...}`` pairs. The request is parsed, mapped, rendered
and tokenized in a worker thread, and a client that leaves cancels it (see
:class:`~llamax.server.responses.CompletionResponse`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

import llamax
from llamax.anthropic import REQUEST_FIELDS, amessages, count_tokens
from llamax.anthropic.fields import MESSAGES

from .dialects import ANTHROPIC
from .errors import APIError, anthropic_error_response, from_exception
from .fairness import client_key
from .images import prepare_images
from .schemas import parse_object, without_unknown
from .state import ServerState, admit_completion, run_leased

__all__ = ["anthropic_routes"]

_ENDPOINT = "messages"


def anthropic_routes(state: ServerState) -> APIRouter:
    """The Anthropic routes (they check the API key themselves, to answer in its shape)."""
    router = APIRouter()
    keep = state.config.keep_billing_header

    def parse(raw: bytes) -> dict[str, Any]:
        body = parse_object(raw)
        if state.config.lenient:
            body = without_unknown(body, MESSAGES, "/v1/messages")
        images = state.config.images
        prepare_images(body, "anthropic", images, state.image_fetcher)  # a worker: fetches
        return body

    @router.post("/v1/messages")
    async def messages_route(request: Request) -> Response:
        return await admit_completion(
            state,
            request,
            _ENDPOINT,
            parse,
            _model_of,
            lambda body, ctx: amessages(
                ctx, body, keep_billing_header=keep, fair_key=client_key(request)
            ),
            dialect=ANTHROPIC,
            fields=REQUEST_FIELDS,
            prompt_field="messages",
            stream=lambda body: body.get("stream") is True,  # a non-boolean: refused later
            check_key=True,
            ping_seconds=state.config.stream_ping_seconds,
        )

    @router.post("/v1/messages/count_tokens")
    async def count_tokens_route(request: Request) -> Response:
        def work(body: dict[str, Any], ctx: llamax.Context) -> dict[str, Any]:
            try:
                return count_tokens(ctx, body, keep_billing_header=keep)
            except Exception as exc:
                raise from_exception(exc, REQUEST_FIELDS, "messages") from exc

        try:
            counted = await run_leased(state, request, parse, _model_of, work, check_key=True)
        except APIError as error:
            return anthropic_error_response(error)
        return JSONResponse(counted)

    return router


def _model_of(body: dict[str, Any]) -> object:
    return body.get("model")
