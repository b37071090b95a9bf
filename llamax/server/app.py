"""``create_app``: the whole server as one ASGI application built from a ``Context``."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Unpack

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import llamax

from .anthropic_routes import anthropic_routes
from .config import ServerConfig, ServerSettings
from .cors import LlamaCors
from .errors import APIError, anthropic_body, error_response, handle_api_error
from .guard import SiteGuard
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
    config: ServerConfig | None = None,
    **settings: Unpack[ServerSettings],
) -> FastAPI:
    """Build the OpenAI-compatible server for ``ctx``.

    Mount it in your own ASGI app or run it with uvicorn. The app never closes ``ctx``:
    whoever made the context closes it (``llamax serve`` does, after a graceful shutdown).

    ``create_app(ctx, ServerConfig(api_key="k", max_queue=64))`` and
    ``create_app(ctx, api_key="k", max_queue=64)`` build the same app: keyword settings are
    the fields of :class:`~llamax.server.ServerConfig` (where each is documented), applied
    over ``config`` (:meth:`ServerConfig.from_options`; ``images`` may also be a mapping
    of some of :class:`~llamax.server.ImagePolicy`'s fields).

    Args:
        ctx: The context to serve, or a future that will hold it once it has loaded (the
            server answers ``/health`` with ``loading`` and inference with 503 until then),
            or a :class:`~llamax.server.ModelPool` of named models: each request's
            ``model`` picks one (docs/models.md). The app closes neither.
        config: The server's settings (default: :class:`~llamax.server.ServerConfig`'s
            defaults).
        **settings: Fields of :class:`~llamax.server.ServerConfig` to set over ``config``.

    Returns:
        A FastAPI application.

    Raises:
        TypeError: a keyword that is no setting (naming the closest one), or a ``config``
            that is not a :class:`~llamax.server.ServerConfig`.
        InvalidParameterError: a bad setting (a ``ValueError``; see
            :class:`~llamax.server.ServerConfig`), ``slot_save_path`` is not an existing
            folder, or ``model_alias`` is given with a pool (its models have names).
    """
    if config is not None and not isinstance(config, ServerConfig):
        raise TypeError(f"config must be a ServerConfig, got {type(config).__name__}")
    if settings or config is None:
        config = ServerConfig.from_options(settings, base=config)
    if config.model_alias is not None and isinstance(ctx, ModelPool):
        raise llamax.InvalidParameterError("model_alias names a single model; a pool's models have "
                                    "their own names", param="model_alias")  # fmt: skip
    save_path = None if config.slot_save_path is None else Path(config.slot_save_path)
    if save_path is not None and not save_path.is_dir():
        raise llamax.InvalidParameterError(
            f"slot_save_path must be an existing folder, got {config.slot_save_path!r}",
            param="slot_save_path",
        )
    state = ServerState(source=ctx, config=config)
    app = FastAPI(title="llamax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.llamax = state
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_left)
    app.add_exception_handler(Exception, _internal_error)
    slots = slot_tables(SlotPolicy(config.slot_idle_seconds))  # llama-server's native routes
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
    if not config.cors_origins and config.native_cors:
        app.add_middleware(LlamaCors)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
        )
    app.add_middleware(SiteGuard, policy=config.site)  # outermost: before CORS answers anything
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
