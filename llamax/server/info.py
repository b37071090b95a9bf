"""The chat page, ``/health``, ``/v1/models``, ``/metrics`` and the prefix-cache reset."""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from .state import ServerState

__all__ = ["info_routes", "public_routes"]

_STARTED = int(time.time())


def public_routes(state: ServerState) -> APIRouter:
    """``/`` (the chat page) and ``/health``: no API key needed."""
    router = APIRouter()
    page = resources.files(__package__).joinpath("static/chat.html").read_text("utf-8")

    @router.get("/")
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/health")
    async def health() -> JSONResponse:
        status = state.status()
        return JSONResponse(_health(state, status), status_code=200 if status == "ok" else 503)

    return router


def _health(state: ServerState, status: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "status": status,
        "queue": {"in_flight": state.num_in_flight, "max_queue": state.max_queue},
    }
    ctx = state.loaded()
    if ctx is None:
        return body
    stats = ctx.stats()
    body["model"] = ctx.model_name
    body["queue"] |= {"waiting": stats.num_waiting, "running": stats.num_running}
    body["kv"] = {
        "cells_used": stats.kv_cells_used,
        "cells_total": stats.kv_cells_total,
        "retained_sequences": stats.num_retained,
        "free_seq_ids": stats.num_free_seq_ids,
        "n_seq_max": ctx.n_seq_max,
    }
    return body


def info_routes(state: ServerState) -> APIRouter:
    """``/v1/models``, ``/metrics`` and ``POST /reset_prefix_cache`` (vLLM's name; SGLang's
    ``POST /flush_cache`` is the same), behind the API key when one is set."""

    def require_key(request: Request) -> None:
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        ctx = state.context()
        model = {
            "id": ctx.model_name,
            "object": "model",
            "created": _STARTED,
            "owned_by": "llamax",
            "meta": {"n_ctx": ctx.n_ctx, "n_seq_max": ctx.n_seq_max},
            "adapters": [
                {"id": index, "name": name, "path": path}
                for index, (name, path) in enumerate(ctx.adapters.items())
            ],
        }
        return JSONResponse({"object": "list", "data": [model]})

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @router.post("/reset_prefix_cache")
    @router.post("/flush_cache")
    async def reset_prefix_cache() -> JSONResponse:
        ctx = state.context()
        freed = await run_in_threadpool(ctx.clear_cache)  # waits for the loop between steps
        return JSONResponse({"status": "ok", "freed_sequences": freed})

    return router
