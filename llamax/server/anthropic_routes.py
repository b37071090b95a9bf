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
from llamax.dialects.anthropic import MESSAGES

from .dialects import ANTHROPIC
from .errors import APIError, anthropic_error_response, from_exception
from .fairness import client_key
from .images import prepare_images
from .route import JSONObjectRoute
from .schemas import parse_object
from .serve import add_completion_routes
from .state import ServerState, run_leased

__all__ = ["anthropic_routes"]

_ENDPOINT = "messages"


class AnthropicMessages(JSONObjectRoute):
    """``POST /v1/messages`` (a :class:`~.route.CompletionRoute`): the key checked here, to
    answer a 401 in Anthropic's shape; a quiet stream gets ``ping`` events."""

    endpoint = _ENDPOINT
    dialect = ANTHROPIC
    fields = REQUEST_FIELDS
    prompt_field = "messages"
    check_key = True

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.ping_seconds: float | None = state.config.stream_ping_seconds

    def parse(self, raw: bytes) -> dict[str, Any]:
        """The body as an object, images read (a worker: it may fetch)."""
        return _parse(self.state, raw)

    def start(self, body: dict[str, Any], ctx: llamax.Context, request: Request) -> Any:
        """Map, render and submit the request in a worker; read it as Anthropic's shapes."""
        return amessages(ctx, body, keep_billing_header=self.state.config.keep_billing_header,
                         fair_key=client_key(request))  # fmt: skip


def _parse(state: ServerState, raw: bytes) -> dict[str, Any]:
    body = parse_object(raw, MESSAGES, "/v1/messages", lenient=state.config.lenient)
    prepare_images(body, "anthropic", state.config.images, state.image_fetcher)  # may fetch
    return body


def anthropic_routes(state: ServerState) -> APIRouter:
    """The Anthropic routes (they check the API key themselves, to answer in its shape)."""
    router = APIRouter()
    keep = state.config.keep_billing_header
    add_completion_routes(router, state, {"/v1/messages": AnthropicMessages(state)})

    def parse(raw: bytes) -> dict[str, Any]:
        return _parse(state, raw)

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
