"""The chat page, ``/health``, ``/v1/models`` and ``/metrics``."""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from .models import ModelPool
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
    if state.pool is not None:
        body["models"] = {m.name: m.state.value for m in state.pool.models()}
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
    """``/v1/models`` and ``/metrics``, behind the API key when one is set."""

    def require_key(request: Request) -> None:
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        if state.pool is not None:
            return JSONResponse({"object": "list", "data": _pool_models(state.pool)})
        ctx = state.context()
        model = {
            "id": ctx.model_name,
            "object": "model",
            "created": _STARTED,
            "owned_by": "llamax",
            "meta": {"n_ctx": ctx.n_ctx, "n_seq_max": ctx.n_seq_max},
        }
        return JSONResponse({"object": "list", "data": [model]})

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return router


def _pool_models(pool: ModelPool) -> list[dict[str, Any]]:
    """Every model of a pool, with ``status.value`` ``loaded``, ``loading``, ``unloading``
    or ``unloaded`` (llama-server's router says it so), and ``meta`` while loaded."""
    listed = []
    for info in pool.models():
        model: dict[str, Any] = {
            "id": info.name,
            "object": "model",
            "created": _STARTED,
            "owned_by": "llamax",
            "status": {"value": info.state.value},
        }
        if info.last_error is not None:
            model["status"]["last_error"] = info.last_error
        if info.context is not None:
            ctx = info.context
            model["meta"] = {"n_ctx": ctx.n_ctx, "n_seq_max": ctx.n_seq_max,
                             "model_name": ctx.model_name}  # fmt: skip
        listed.append(model)
    return listed
