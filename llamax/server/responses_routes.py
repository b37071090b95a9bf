"""OpenAI's Responses API over HTTP: ``POST /v1/responses``, ``GET /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``DELETE /v1/responses/{id}`` and
``POST /v1/responses/input_tokens``, thin over
:mod:`llamax.openai`'s :func:`acreate_response`.

Responses are kept in the app's bounded :class:`~llamax.openai.ResponseStore` (unless a
request says ``store: false``), so ``previous_response_id`` continues a conversation on a
prefix the KV cache already holds; an id the store does not hold gets a 404. A streamed
reply is sent as ``event: TYPE`` / ``data: {...}`` pairs with no ``[DONE]``. The request is
parsed, mapped, rendered and tokenized in a worker thread, and a client that leaves cancels
it (see :class:`~llamax.server.responses.CompletionResponse`).
``POST /v1/responses/compact`` is answered with a 400 ``unsupported_endpoint`` (no
server-side compaction) rather than a bare 405.
"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse

import llamax
from llamax import InvalidRequestError
from llamax.dialects.openai import RESPONSES as RESPONSE_TABLE
from llamax.dialects.responses_items import page_of_items
from llamax.openai import acreate_response, response_input_tokens

from .dialects import RESPONSES
from .errors import APIError, from_exception
from .fairness import client_key
from .images import count_images, prepare_images
from .llama import timed_response_events
from .route import JSONObjectRoute
from .schemas import parse_object, without_unknown
from .serve import add_completion_routes
from .state import ServerState, run_leased

__all__ = ["responses_routes"]

_FIELDS = frozenset(f.name for f in RESPONSE_TABLE)
"""Every field of the table, so a 400 about a refused one names it in ``param``."""

_ENDPOINT = "responses"


def responses_routes(state: ServerState) -> APIRouter:
    """The Responses routes (behind the API key)."""

    def require_key(request: Request) -> None:
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    parse = partial(_parse, state)
    add_completion_routes(router, state, {
        "/v1/responses": ResponsesCreate(state, llama=False),
        "/responses": ResponsesCreate(state, llama=True),  # llama-server's alias
    })  # fmt: skip

    @router.post("/v1/responses/input_tokens")
    @router.post("/responses/input_tokens")  # llama-server's alias
    async def input_tokens_route(request: Request) -> JSONResponse:
        def work(body: dict[str, Any], ctx: llamax.Context) -> JSONResponse:
            try:
                count = response_input_tokens(ctx, body, store=state.responses)
            except Exception as exc:
                raise from_exception(exc, _FIELDS, "input") from exc
            return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

        return await run_leased(state, request, parse, lambda b: b.get("model"), work)

    @router.post("/v1/responses/compact")
    @router.post("/responses/compact")
    async def compact_route() -> JSONResponse:
        raise APIError(
            400,
            "POST /v1/responses/compact is not supported: llamax does not compact "
            "conversations on the server (OpenAI's compaction returns a model-written "
            "summary as an encrypted item that only its own API reads back). Compact on the "
            "client, or send truncation: 'auto' to drop the oldest turns",
            code="unsupported_endpoint",
        )

    @router.get("/v1/responses/{response_id}")
    async def retrieve_route(response_id: str, request: Request) -> JSONResponse:
        if request.query_params.get("stream", "false").lower() not in ("false", "0", ""):
            raise APIError(  # what the openai client's retrieve(stream=True) sends
                400,
                "stream is not supported on a retrieve: a stored response is complete "
                "(background mode, whose events a retrieve replays, is not supported)",
                param="stream",
                code="unsupported_parameter",
            )
        try:
            return JSONResponse(state.responses.get(response_id))
        except LookupError as exc:
            raise _not_found(response_id) from exc

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items_route(response_id: str, request: Request) -> JSONResponse:
        query = request.query_params
        include = [*query.getlist("include"), *query.getlist("include[]")]  # the client: []
        try:
            items = state.responses.input_items(response_id)
            return JSONResponse(page_of_items(items, query, include))
        except LookupError as exc:
            raise _not_found(response_id) from exc
        except InvalidRequestError as exc:  # a bad query parameter
            raise from_exception(exc, frozenset({"order", "limit", "after", "include"})) from exc

    @router.delete("/v1/responses/{response_id}")
    async def delete_route(response_id: str) -> JSONResponse:
        if not state.responses.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return router


class ResponsesCreate(JSONObjectRoute):
    """``POST /v1/responses`` (a :class:`~.route.CompletionRoute`); with ``llama``,
    llama-server's ``/responses``, whose streams end with ``response.completed``."""

    endpoint = _ENDPOINT
    dialect = RESPONSES
    fields = _FIELDS
    prompt_field = "input"
    check_key = False  # the router's dependency checks it
    ping_seconds = None

    def __init__(self, state: ServerState, *, llama: bool) -> None:
        self.state, self.llama = state, llama

    def parse(self, raw: bytes) -> dict[str, Any]:
        """The body as an object, images read (a worker: it may fetch)."""
        return _parse(self.state, raw)

    def start(self, body: dict[str, Any], ctx: llamax.Context, request: Request) -> Any:
        """Map, render and submit the request; read it as the Responses API's shapes."""
        return _create(self.state, body, ctx, llama=self.llama, fair_key=client_key(request))


def _parse(state: ServerState, raw: bytes) -> dict[str, Any]:
    body = parse_object(raw)
    if state.config.lenient:
        body = without_unknown(body, RESPONSE_TABLE, "/v1/responses")
    own, urls = count_images(body, "responses")
    _check_chain_images(body, state, own)  # before a fetch: what the stored turns hold counts
    sent = copy.deepcopy(body["input"]) if urls else None
    prepare_images(body, "responses", state.config.images, state.image_fetcher)  # may fetch
    return body if sent is None else _Fetched(body, input_as_sent=sent)


def _check_chain_images(body: dict[str, Any], state: ServerState, own: int) -> None:
    """Refuse a follow-up whose prompt would hold more images than a request may: the
    images of the conversation stored under ``previous_response_id`` (decoded again for
    every turn) and the request's own (``own``). An id the store does not hold is left to
    the 404.

    Raises:
        APIError: 400 (``too_many_images``) naming both counts.
    """
    previous = body.get("previous_response_id")
    if not isinstance(previous, str):
        return
    try:
        history = state.responses.conversation(previous)
    except LookupError:
        return
    contents = [m["content"] for m in history if isinstance(m.get("content"), list)]
    stored = sum(isinstance(part, llamax.Image) for content in contents for part in content)
    most = state.config.images.max_images
    if stored + own > most:
        raise APIError(
            400,
            f"the conversation holds {stored + own} images ({stored} in the responses it "
            f"follows, {own} in this request); at most {most} are allowed per request "
            "(--max-images-per-request): start a new conversation",
            param="previous_response_id" if stored > most else "input",
            code="too_many_images",
        )


class _Fetched(dict[str, Any]):
    """A body whose image URLs were fetched into ``data:`` URLs, with its ``input`` as the
    client sent it: what the store lists as the response's input items (the URLs, so
    ``input_items`` never hands back what the server fetched from an address the client
    may not reach)."""

    def __init__(self, body: dict[str, Any], *, input_as_sent: Any) -> None:
        super().__init__(body)
        self.input_as_sent = input_as_sent


def _not_found(response_id: str) -> APIError:
    """The 404 for an id the store does not hold, about the id (OpenAI's says "Response
    with id ... not found")."""
    return APIError(
        404,
        f"no stored response has id {response_id!r} (it was never stored, was deleted, or "
        "the store evicted it)",
        code="not_found",
    )


async def _create(
    state: ServerState, body: dict[str, Any], ctx: llamax.Context, *, llama: bool,
    fair_key: str | None,
) -> Any:  # fmt: skip
    """:func:`acreate_response` (the server's default reply length where the body sets
    none); a stream with llama-server's ``timings`` where the request
    asks for ``timings_per_token``, and on llama-server's alias (``llama``) ended by
    ``response.completed`` as llama-server ends every stream (it sends no
    ``response.incomplete``; the response's ``status`` still says ``incomplete``). The
    request holds its client's share (``fair_key``)."""
    started, sent = time.perf_counter(), getattr(body, "input_as_sent", None)
    if state.config.default_max_tokens is not None and body.get("max_output_tokens") is None:
        body = body | {"max_output_tokens": state.config.default_max_tokens}
    reply = await acreate_response(ctx, body, store=state.responses, stored_input=sent,
                                   fair_key=fair_key)  # fmt: skip
    if isinstance(reply, dict) or body.get("stream") is not True:
        return reply
    if llama:
        reply = _completed_at_the_end(reply)
    if body.get("timings_per_token") is True:
        return timed_response_events(reply, started)
    return reply


async def _completed_at_the_end(
    events: AsyncIterator[dict[str, Any]],
) -> AsyncIterator[dict[str, Any]]:
    """``events`` with ``response.incomplete`` named ``response.completed``; closing it
    closes ``events`` (which cancels the request)."""
    try:
        async for event in events:
            if event.get("type") == "response.incomplete":
                event = event | {"type": "response.completed"}
            yield event
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
