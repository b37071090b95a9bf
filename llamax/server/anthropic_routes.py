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
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from llamax.anthropic import REQUEST_FIELDS, amessages, count_tokens

from .errors import APIError, anthropic_error_response, from_exception
from .responses import CompletionJob, CompletionResponse
from .schemas import parse_object
from .state import ServerState, admit_parsed, read_body

__all__ = ["anthropic_routes"]

_ENDPOINT = "messages"


def anthropic_routes(state: ServerState) -> APIRouter:
    """The Anthropic routes (they check the API key themselves, to answer in its shape)."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages_route(request: Request) -> Response:
        try:
            body, ctx = await admit_parsed(
                state, request, _ENDPOINT, lambda raw: (parse_object(raw), state.context()),
                check_key=True,
            )  # fmt: skip
        except APIError as error:
            return anthropic_error_response(error)
        job = CompletionJob(
            endpoint=_ENDPOINT,
            start=lambda: amessages(ctx, body),
            metrics=state.metrics,
            release=state.release,
            stream=bool(body.get("stream")),
            fields=REQUEST_FIELDS,
            prompt_field="messages",
            flavour="anthropic",
            ping_seconds=state.stream_ping_seconds,
        )
        return CompletionResponse(job)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens_route(request: Request) -> Response:
        def work(raw: bytes) -> dict[str, Any]:
            try:
                return count_tokens(state.context(), parse_object(raw))
            except Exception as exc:
                raise from_exception(exc, REQUEST_FIELDS, "messages") from exc

        try:
            state.check_api_key(request)
            raw = await read_body(request, state.max_body_bytes)
            state.admit()
        except APIError as error:
            return anthropic_error_response(error)
        try:
            return JSONResponse(await run_in_threadpool(work, raw))
        except APIError as error:
            return anthropic_error_response(error)
        finally:
            state.release()

    return router
