"""The chat page, ``/health``, ``/v1/models`` (and ``/v1/models/{id}``), ``/metrics`` and the
prefix-cache reset."""

from __future__ import annotations

import contextlib
import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

import llamax

from .errors import APIError, error_response, from_exception
from .guard import is_cross_origin, path_free, shown_path
from .models import ModelPool
from .state import ServerState

__all__ = ["info_routes", "public_routes", "shown_models"]

_STARTED = int(time.time())


def public_routes(state: ServerState) -> APIRouter:
    """``/`` (the chat page), ``/favicon.ico`` (204: no icon) and ``/health``: no API key
    needed (a browser sends none for the page and its icon)."""
    router = APIRouter()
    page = resources.files(__package__).joinpath("static/chat.html").read_text("utf-8")

    @router.get("/")
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/favicon.ico")
    async def favicon() -> Response:  # no icon, and no 404 in the browser's console
        return Response(status_code=204, headers={"Cache-Control": "max-age=86400"})

    @router.get("/health")
    @router.get("/v1/health")  # llama-server's alias
    async def health() -> JSONResponse:
        status = state.status()
        return JSONResponse(_health(state, status), status_code=200 if status == "ok" else 503)

    return router


def _health(state: ServerState, status: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "status": status,
        "queue": {"in_flight": state.num_in_flight, "max_queue": state.config.max_queue},
    }
    if state.pool is not None:
        body["models"] = {m.name: m.state.value for m in state.pool.models()}
    ctx = state.loaded()
    if ctx is None:
        return body
    stats = ctx.stats()
    body["model"] = state.model_name(ctx)
    queue = stats.sequences
    body["queue"] |= {"waiting": queue.num_waiting, "running": queue.num_running}
    body["kv"] = {
        "cells_used": stats.kv.cells_used,
        "cells_total": stats.kv.cells_total,
        "retained_sequences": stats.prefix.num_retained,
        "free_seq_ids": stats.kv.num_free_seq_ids,
        "n_seq_max": ctx.n_seq_max,
    }
    return body


def info_routes(state: ServerState) -> APIRouter:
    """``/v1/models``, ``/v1/models/{id}``, ``/metrics`` and ``POST /reset_prefix_cache``
    (vLLM's name; SGLang's ``POST /flush_cache`` is the same), behind the API key when one
    is set."""

    def require_key(request: Request) -> None:
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    @router.get("/v1/models")
    @router.get("/models")  # llama-server's alias
    async def models(request: Request) -> JSONResponse:
        listed = shown_models(_models(state), request.headers)
        body: dict[str, Any] = {"object": "list", "data": listed}
        if state.pool is None:  # llama-server's own list, beside OpenAI's
            body["models"] = [{"name": m["id"], "model": m["id"], "type": "model",
                               "capabilities": m["capabilities"]} for m in listed]  # fmt: skip
        return JSONResponse(body)

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        models = shown_models(_models(state), request.headers)
        for listed in models:
            if listed["id"] == model_id:
                return JSONResponse(listed)
        if state.pool is None and model_id in state.model_names(state.context()):
            return JSONResponse(models[0])  # the GGUF's display name, llamax 0.x's id
        raise APIError(  # OpenAI's words and code for an unknown model
            404, f"The model {model_id!r} does not exist", param="model", code="model_not_found"
        )

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @router.post("/reset_prefix_cache")
    @router.post("/flush_cache")
    async def reset_prefix_cache() -> JSONResponse:
        try:
            if state.pool is not None:  # every loaded model's
                freed = await run_in_threadpool(_clear_pool_caches, state.pool)
            else:
                ctx = state.context()
                freed = await run_in_threadpool(ctx.clear_cache)  # waits for the loop
        except llamax.CacheClearError as exc:  # files stay on disk: not "ok"
            return error_response(from_exception(exc))
        return JSONResponse({"status": "ok", "freed_sequences": freed})

    return router


def _models(state: ServerState) -> list[dict[str, Any]]:
    """What ``/v1/models`` lists: every model of a pool, or the one model.

    Raises:
        APIError: 503 (one model) while it loads or once it is closed.
    """
    if state.pool is not None:
        return _pool_models(state.pool)
    ctx = state.context()
    model = {
        "id": state.model_name(ctx),
        "object": "model",
        "created": _STARTED,
        "owned_by": "llamax",
        "meta": {"n_ctx": ctx.n_ctx, "n_seq_max": ctx.n_seq_max},
        "capabilities": capabilities(ctx),
        "adapters": _adapters(ctx),
    }
    return [model]


def capabilities(ctx: llamax.Context) -> list[str]:
    """What llama-server's model lists say a model does: ``completion``, and
    ``multimodal`` when it reads images."""
    return ["completion", "multimodal"] if ctx.sees_images else ["completion"]


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
            model["capabilities"] = capabilities(ctx)
            model["adapters"] = _adapters(ctx)
        listed.append(model)
    return listed


def _adapters(ctx: llamax.Context) -> list[dict[str, Any]]:
    """A context's LoRA adapters as ``/v1/models`` lists them (``id``: the load order)."""
    return [
        {"id": index, "name": name, "path": path}
        for index, (name, path) in enumerate(ctx.adapters.items())
    ]


def shown_models(listed: list[dict[str, Any]], headers: Headers) -> list[dict[str, Any]]:
    """A model list as a client sees it: another origin's page gets the adapters' file
    names, and load errors, without the server's folders (:mod:`.guard`)."""
    if not is_cross_origin(headers):
        return listed
    for model in listed:
        for adapter in model.get("adapters", ()):
            adapter["path"] = shown_path(headers, adapter["path"])
        if "last_error" in model.get("status", {}):
            model["status"]["last_error"] = path_free(model["status"]["last_error"])
    return listed


def _clear_pool_caches(pool: ModelPool) -> int:
    """Clear both prefix tiers of every model of ``pool`` loaded now; return the KV
    sequences freed in all. A model that closes meanwhile (unloaded) has nothing to clear.

    Raises:
        CacheClearError: a model's disk tier kept files (every model was cleared first).
    """
    freed = 0
    failures: list[str] = []
    for info in pool.models():
        if info.context is not None:
            with contextlib.suppress(llamax.ContextClosedError):
                try:
                    freed += info.context.clear_cache()
                except llamax.CacheClearError as exc:
                    failures.append(f"{info.name}: {exc}")
    if failures:
        raise llamax.CacheClearError("; ".join(failures))
    return freed
