"""``create_app``: the whole server as one ASGI application built from a ``Context``."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import llamax
from llamax.openai import ResponseStore

from .anthropic_routes import anthropic_routes
from .cors import LlamaCors
from .errors import APIError, anthropic_body, error_response, handle_api_error
from .fairness import DEFAULT_MAX_SEQUENCES
from .guard import SiteGuard, SitePolicy
from .images import ImagePolicy
from .info import info_routes, public_routes
from .llama import infill_routes, llama_routes, router_routes, slot_routes, slot_tables
from .llama.slots import SlotPolicy
from .models import ModelPool
from .responses_routes import responses_routes
from .routes import api_routes
from .shutdown import CUT_TAIL_KEY, CutTail, shutdown_error
from .state import ServerState

__all__ = ["create_app"]

logger = logging.getLogger("llamax.server")


def create_app(
    ctx: llamax.Context | Future[llamax.Context] | ModelPool,
    *,
    api_key: str | None = None,
    max_queue: int = 256,
    max_body_bytes: int = 8 << 20,
    cors_origins: Sequence[str] | None = None,
    native_cors: bool = True,
    retry_after_seconds: int = 1,
    parse_special_in_content: bool = False,
    max_stored_responses: int = 1024,
    stream_ping_seconds: float = 10.0,
    slot_save_path: str | os.PathLike[str] | None = None,
    slot_idle_seconds: float = 300.0,
    lenient: bool = False,
    default_max_tokens: int | None = None,
    default_seed: int | None = None,
    model_alias: str | None = None,
    images: ImagePolicy | None = None,
    allowed_hosts: Sequence[str] | None = None,

    max_sequences: int = DEFAULT_MAX_SEQUENCES,
    keep_billing_header: bool = False,
) -> FastAPI:
    """Build the OpenAI-compatible server for ``ctx``.

    Mount it in your own ASGI app or run it with uvicorn. The app never closes ``ctx``:
    whoever made the context closes it (``llamax serve`` does, after a graceful shutdown).

    Args:
        ctx: The context to serve, or a future that will hold it once it has loaded (the
            server answers ``/health`` with ``loading`` and inference with 503 until then),
            or a :class:`~llamax.server.ModelPool` of named models: each request's
            ``model`` picks one (docs/models.md). The app closes neither.
        api_key: When set, every endpoint but ``/`` and ``/health`` needs
            ``Authorization: Bearer <api_key>`` (else 401).
        max_queue: Most requests in flight at once (completions, embeddings, tokenize and
            detokenize, from the moment their body has arrived); more get 503 +
            Retry-After.
        max_body_bytes: Largest request body accepted (else 413).
        cors_origins: Origins allowed by CORS on every route (``["*"]`` for any); ``None``:
            only ``native_cors``.
        native_cors: Without ``cors_origins``, answer any origin on llama-server's own
            inference and information routes (``/completion``, ``/infill``, ``/props`` ...),
            as llama-server does by default; every other route keeps CORS off
            (:mod:`llamax.server.cors` lists them and says why). ``False``: CORS off
            everywhere.
        retry_after_seconds: The ``Retry-After`` sent with a 503.
        parse_special_in_content: Let special-token text in chat message content act as
            special tokens (llama-server's way; lets a user forge turns and roles). Off by
            default: content is plain text, only the template's markers are special.
        max_stored_responses: Most responses the Responses API keeps for
            ``previous_response_id`` (least recently used go first; their conversations
            are also bounded to 64 MiB of text).
        stream_ping_seconds: An Anthropic Messages stream that has sent nothing for this
            long (a long prefill, a slow step) gets a ``ping`` event, as Anthropic's API
            sends, so that idle timeouts along the way do not cut it.
        slot_save_path: The folder where llama-server's ``POST /slots/{id}?action=save``
            writes and ``restore`` reads (file names only, no paths); ``None``: those
            actions are refused with 501, as llama-server does without ``--slot-save-path``.
        slot_idle_seconds: A slot of the native routes (``id_slot``) whose session has run
            nothing for this long is closed, its KV freed (an idle slot also yields its
            sequence to any request that needs it before then).
        lenient: On the OpenAI and Anthropic routes, a top-level request field that is in
            neither API's reference (no field table names it) is dropped and logged as a
            warning instead of refused with a 400. Off by default: a typo must not be
            silently ignored. Refused fields stay refused and hints stay checked.
        default_max_tokens: The reply length of a request that sets none, on every API
            that lets a request leave it out (llama-server's ``-n``: a request may ask for
            more); ``None``: each API's own default (until the end of generation or of the
            context; 16 on ``/v1/completions``, as OpenAI).
        default_seed: The seed of a request that sets none (llama-server's ``--seed``);
            ``None``: a random one.
        model_alias: The name the model is served under (``/v1/models``, ``/props``, the
            ``model`` of a response that names none; llama-server's ``--alias``); ``None``:
            the GGUF's name. Not with a pool (its models have names).
        images: How many images one request may send (default 16), and whether remote
            image URLs are fetched, within what size and time (default: refused with a
            400); see :class:`~llamax.server.images.ImagePolicy` and docs/images.md.
        allowed_hosts: ``Host`` names answered beside localhost names, IP literals, this
            machine's name and the address the ASGI server listens on (``*.example.com``
            for a domain's names, ``["*"]``: any Host); every other Host gets 403, which
            stops DNS rebinding. Cross-origin writes that CORS would not allow are refused
            too (:mod:`llamax.server.guard`).
        max_sequences: Most sequences one request may queue: its prompts times its
            choices (``n``, ``n_cmpl``); more get 400 (default 64; docs/server.md).
        keep_billing_header: Render Claude Code's per-request ``x-anthropic-billing-header:``
            system block on ``/v1/messages``; by default it is left out of the prompt, as
            it changes every request and would break the prefix cache (docs/anthropic.md).

    Returns:
        A FastAPI application.

    Raises:
        ValueError: ``max_queue``, ``max_body_bytes``, ``retry_after_seconds``,
            ``max_stored_responses``, ``max_sequences`` or ``stream_ping_seconds`` is not
            positive,
            ``api_key`` is empty, ``slot_save_path`` is not a folder,
            ``default_max_tokens`` is below 1, ``default_seed`` is not in [0, 2**32),
            ``model_alias`` is empty or given with a
            pool, ``allowed_hosts`` holds something that is not a host name.
    """
    for name, value in (("max_queue", max_queue), ("max_body_bytes", max_body_bytes),
                        ("retry_after_seconds", retry_after_seconds),
                        ("max_stored_responses", max_stored_responses),
                        ("max_sequences", max_sequences)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not stream_ping_seconds > 0:
        raise ValueError(f"stream_ping_seconds must be > 0, got {stream_ping_seconds}")
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty (pass None for no key)")
    if default_max_tokens is not None and default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
    if default_seed is not None:
        llamax.SamplingParams(seed=default_seed)  # InvalidParameterError (a ValueError)
    if model_alias is not None and (not model_alias or isinstance(ctx, ModelPool)):
        raise ValueError("model_alias must be a non-empty name, and a pool's models have "
                         "their own names")  # fmt: skip
    if slot_save_path is not None and not Path(slot_save_path).is_dir():
        raise ValueError(f"slot_save_path must be an existing folder, got {slot_save_path!r}")
    site = SitePolicy.of(allowed_hosts, cors_origins, native_cors)
    state = ServerState(
        source=ctx,
        api_key=api_key,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        retry_after_seconds=retry_after_seconds,
        parse_special_in_content=parse_special_in_content,
        responses=ResponseStore(max_stored_responses),
        stream_ping_seconds=stream_ping_seconds,
        lenient=lenient,
        default_max_tokens=default_max_tokens,
        default_seed=default_seed,
        model_alias=model_alias,
        images=images or ImagePolicy(),
        max_sequences=max_sequences,
        keep_billing_header=keep_billing_header,
    )
    app = FastAPI(title="llamax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.llamax = state
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_left)
    app.add_exception_handler(Exception, _internal_error)
    slots = slot_tables(SlotPolicy(slot_idle_seconds))  # llama-server's native routes
    save_path = None if slot_save_path is None else Path(slot_save_path)
    routers = (
        public_routes(state),
        router_routes(state),  # first: with several models its GET /models is the router's
        info_routes(state),
        api_routes(state),
        anthropic_routes(state),
        responses_routes(state),
        infill_routes(state, slots),
        slot_routes(state, slots, save_path),
        llama_routes(state, slots),
    )
    for router in routers:
        app.include_router(router)
    app.add_middleware(_AnswerCutRequests)
    if not cors_origins and native_cors:
        app.add_middleware(LlamaCors)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
        )
    app.add_middleware(SiteGuard, policy=site)  # outermost: before CORS answers anything
    return app


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (404, 405 ...) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers))


async def _client_left(request: Request, exc: Exception) -> Response:
    """A client that leaves before sending its whole body is a normal event, not a bug:
    one debug line, no traceback. Nobody reads the response."""
    logger.debug("client left before sending its body: %s %s", request.method, request.url.path)
    return Response(status_code=400)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(APIError(500, f"internal error: {type(exc).__name__}"))


class _AnswerCutRequests:
    """Answer a request that the server's shutdown timeout cuts short with a 503 in its
    API's error shape (Anthropic's on ``/v1/messages``), rather than uvicorn's plain-text
    500 and a logged traceback.

    uvicorn cancels the tasks still running when ``timeout_graceful_shutdown`` ends (its
    only use of ``Task.cancel``; a client that leaves is noticed otherwise). Cancelling the
    task also cancels the llamax request it awaits, which frees its KV cells. A response
    already started (a stream) ends with the :class:`~.shutdown.CutTail` it left in the
    scope (its dialect's error event), then the end of its body (:mod:`.shutdown`).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, ended, cut = False, False, CutTail()
        scope[CUT_TAIL_KEY] = cut

        async def watched(message: Message) -> None:
            nonlocal started, ended
            started = started or message["type"] == "http.response.start"
            ended = message["type"] == "http.response.body" and not message.get("more_body")
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # answered: the cut is handled here
            logger.info("cut by the shutdown: %s %s", scope["method"], scope["path"])
            if ended:
                return
            if started:
                tail = b"" if cut.render is None else cut.render()
                await send({"type": "http.response.body", "body": tail})
                return
            error = shutdown_error()
            anthropic = scope["path"].rstrip("/").endswith(("/v1/messages", "/count_tokens"))
            body = anthropic_body(error) if anthropic else error.body()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": json.dumps(body).encode()})
