"""llama-server's router routes, when ``llamax serve`` serves several models
(``--model NAME=PATH`` ..., ``--models-dir``): ``POST /models/load``, ``POST
/models/unload`` and ``GET /models`` with the router's fields.

llama-server's router runs one child server per model; llamax runs one
:class:`~llamax.Context` per model in one process, in a :class:`~.models.ModelPool` that
loads a model when a request first names it and unloads idle ones to make room. So:

- ``load`` queues the model's load and answers at once (``{"success": true}``), as the
  router does; ``GET /models`` then shows ``status.value`` go ``loading`` -> ``loaded``.
  404 for an unknown model, 400 when it is already loaded or loading.
- ``unload`` closes its context at once when no request holds it; 400 when it is not
  loaded, or (unlike the router, which stops the child and its requests with it) while
  requests hold it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..info import _pool_models, shown_models
from ..models import ModelPool, ModelState
from ..schemas import parse_object
from ..state import ServerState, read_body
from .errors import LlamaError, as_llama_error, llama_error_response

__all__ = ["router_routes"]


def router_routes(state: ServerState) -> APIRouter:
    """The router's routes (none when the app serves one model)."""

    def require_key(request: Request) -> None:  # 401 in OpenAI's shape, as every route
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])
    pool = state.pool
    if pool is None:
        return router
    loads: set[asyncio.Task[None]] = set()

    async def model_named(request: Request) -> str:
        body = parse_object(await read_body(request, state.config.max_body_bytes))
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise LlamaError(400, "model must be a non-empty string")
        if name not in pool.names:
            raise LlamaError(404, "model is not found")
        return name

    @router.post("/models/load")
    async def load(request: Request) -> Response:
        try:
            name = await model_named(request)
            info = next(m for m in pool.models() if m.name == name)
            if info.state is not ModelState.UNLOADED:
                raise LlamaError(400, f"model is already running ({info.state.value})")
            future = pool.acquire(name)
        except Exception as exc:
            return llama_error_response(as_llama_error(exc))
        task = asyncio.create_task(_hold_until_loaded(pool, future))
        loads.add(task)
        task.add_done_callback(loads.discard)
        return JSONResponse({"success": True})

    @router.post("/models/unload")
    async def unload(request: Request) -> Response:
        try:
            name = await model_named(request)
            await run_in_threadpool(pool.unload, name)
        except LlamaError as error:
            if error.status == 404:  # the router says 400 here, 404 on load
                error = LlamaError(400, error.message)
            return llama_error_response(error)
        except Exception as exc:
            return llama_error_response(as_llama_error(exc))
        return JSONResponse({"success": True})

    @router.get("/models")
    async def models(request: Request) -> Response:
        shown = shown_models(_pool_models(pool), request.headers)
        listed = [_router_fields(model) for model in shown]
        return JSONResponse({"object": "list", "data": listed})

    return router


async def _hold_until_loaded(pool: ModelPool, future: Any) -> None:
    """Keep the pin :meth:`ModelPool.acquire` took until the load ends (a load nobody
    holds is withdrawn), then let the model idle like any other."""
    try:
        await asyncio.wrap_future(future)
    except Exception:  # the pool records why (status.last_error)
        pass
    finally:
        pool.release(future)


def _router_fields(model: dict[str, Any]) -> dict[str, Any]:
    """A model of ``/v1/models`` with the router's extra fields."""
    model["status"].setdefault("args", [])
    sees_images = "multimodal" in model.get("capabilities", ())  # known while loaded
    if "last_error" in model["status"]:
        model["status"]["failed"] = True
    return model | {
        "aliases": [],
        "tags": [],
        "architecture": {
            "input_modalities": ["text", "image"] if sees_images else ["text"],
            "output_modalities": ["text"],
        },
        "source": "local",
        "can_remove": False,
    }
