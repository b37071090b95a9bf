"""llama-server's native routes: ``/completion`` (and ``/completions``), ``/apply-template``,
``/props``, and the token counts of ``/chat/completions/input_tokens``.

The body is checked and mapped in a worker (:mod:`.request`) and run by
:mod:`.completion`; errors come in llama-server's shape
(``{"error": {"code", "message", "type"}}``, :data:`~.dialects.LLAMA`). A client that
leaves cancels every sequence of its request. The table of routes and fields is in
docs/server.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import llamax
from llamax.chat import chat_prompt_tokens
from llamax.dialects.fields import FieldError
from llamax.dialects.llama_native import (
    FIELDS,
    MEDIA_MARKER,
    NativeRequest,
    default_settings,
    parse_native,
)
from llamax.dialects.openai_parse import CHAT_TYPES, chat_options, parse_chat

from ..dialects import LLAMA
from ..errors import APIError, from_exception, llama_body
from ..fairness import check_num_sequences, client_key
from ..guard import shown_path
from ..images import prepare_images
from ..schemas import parse_object
from ..serve import add_completion_routes
from ..state import ServerState, run_leased
from .chat import with_media_markers
from .completion import start_completion
from .errors import as_llama_error
from .slots import SlotTables

__all__ = ["llama_routes"]

_CHAT_FIELDS = frozenset(CHAT_TYPES)


def llama_routes(state: ServerState, tables: SlotTables) -> APIRouter:
    """llama-server's native routes (behind the API key when one is set); ``/completion``
    with ``id_slot`` runs on the slots of ``tables``."""

    def require_key(request: Request) -> None:
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    completion = NativeCompletion(state, tables)
    add_completion_routes(router, state, {"/completion": completion, "/completions": completion})

    @router.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        def work(raw: dict[str, Any], ctx: llamax.Context) -> Response:
            generation = raw.pop("add_generation_prompt", True)
            if not isinstance(generation, bool):
                raise APIError(400, "add_generation_prompt must be a boolean",
                               param="add_generation_prompt", code="invalid_type")  # fmt: skip
            try:
                _, options = chat_options(raw)
            except Exception as exc:
                raise from_exception(exc, _CHAT_FIELDS) from exc
            messages = options["messages"]
            prepare_images(messages, "openai", state.config.images, state.image_fetcher)
            thinking = options.get("enable_thinking")
            extra = {} if thinking is None else {"enable_thinking": thinking}
            try:
                ctx.chat_prompt_parts(messages)  # checks them as a chat request would
                prompt = ctx.chat_template.render(
                    with_media_markers(messages),
                    add_generation_prompt=generation,
                    tools=options.get("tools"),
                    **extra,
                )
            except Exception as exc:
                raise from_exception(exc, frozenset({"messages"}), "messages") from exc
            return JSONResponse({"prompt": prompt})

        return await _llama_shaped(state, request, work)

    @router.post("/chat/completions/input_tokens")
    @router.post("/v1/chat/completions/input_tokens")
    async def chat_input_tokens(request: Request) -> Response:
        def work(raw: dict[str, Any], ctx: llamax.Context) -> Response:
            try:  # an APIError (images) passes through from_exception as it is
                call = parse_chat(raw).call
                prepare_images(list(call.messages), "openai", state.config.images,
                               state.image_fetcher)  # fmt: skip
                count = ctx.prompt_positions(chat_prompt_tokens(ctx, call))
            except Exception as exc:
                raise from_exception(exc, _CHAT_FIELDS) from exc
            return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

        return await _llama_shaped(state, request, work)

    @router.get("/props")
    async def props(request: Request) -> Response:
        try:
            ctx = state.context()
        except APIError as error:
            return JSONResponse(llama_body(error), status_code=error.status)
        body = _props(state, ctx)
        body["model_path"] = shown_path(request.headers, body["model_path"])
        return JSONResponse(body)

    @router.post("/props")
    async def set_props() -> Response:
        error = APIError(501, "This server does not support changing global properties "
                         "(llamax has no settable properties)", code="not_supported")  # fmt: skip
        return JSONResponse(llama_body(error), status_code=501)

    return router


class NativeCompletion:
    """llama-server's ``POST /completion`` (a :class:`~..route.CompletionRoute`): its
    prompts, on the slot ``id_slot`` names or on any sequence."""

    endpoint = "completion"
    dialect = LLAMA
    fields = FIELDS
    prompt_field = "prompt"
    check_key = False  # the router's dependency checks it
    ping_seconds = None

    def __init__(self, state: ServerState, tables: SlotTables) -> None:
        self.state, self.tables = state, tables

    def parse(self, raw: bytes) -> NativeRequest:
        """The body, checked."""
        config = self.state.config
        try:
            body = parse_native(parse_object(raw), default_n_predict=config.default_max_tokens,
                                default_seed=config.default_seed)  # fmt: skip
        except FieldError as exc:
            raise as_llama_error(exc) from exc
        _check_num_images(body, config.images.max_images)
        n = body.params.n if body.params is not None else 1
        check_num_sequences(len(body.prompts), n, config.max_sequences,
                            param="n_cmpl" if n > 1 else "prompt")  # fmt: skip
        return body

    def model(self, body: NativeRequest) -> object:
        """The ``model`` the body names."""
        return body.model

    def stream(self, body: NativeRequest) -> bool:
        """Whether the reply streams."""
        return body.stream

    def include_usage(self, body: NativeRequest) -> bool:
        """llama-server's last event carries the counts."""
        return False

    def start(self, body: NativeRequest, ctx: llamax.Context, request: Request) -> Any:
        """Submit the prompts (on their slot) and read them as llama-server's events."""
        return start_completion(body, ctx, self.state.model_name(ctx), self.tables,
                                fair_key=client_key(request))  # fmt: skip


def _check_num_images(body: NativeRequest, most: int) -> None:
    """A 400 for a body whose prompts hold more than ``most`` images in all."""
    num = sum(isinstance(p, llamax.Image) for prompt in body.prompts for p in prompt)
    if num > most:
        raise APIError(400, f"the request holds {num} images; at most {most} are allowed per "
                       "request (--max-images-per-request)", param="prompt",
                       code="too_many_images")  # fmt: skip


async def _llama_shaped(
    state: ServerState, request: Request, work: Callable[[dict[str, Any], llamax.Context], Response]
) -> Response:
    """:func:`~.state.run_leased` with the body as a JSON object, errors in llama-server's
    shape."""
    try:
        return await run_leased(state, request, parse_object, lambda b: b.get("model"), work)
    except APIError as error:
        return JSONResponse(llama_body(error), status_code=error.status, headers=error.headers)


def _props(state: ServerState, ctx: llamax.Context) -> dict[str, Any]:
    try:
        template = ctx.chat_template.source
    except llamax.TemplateError:
        template = ""
    return {
        "default_generation_settings": {
            "id": 0, "id_task": -1, "n_ctx": ctx.n_ctx_seq, "speculative": False,
            "is_processing": False, "prompt": "",
            "params": default_settings(state.config.default_max_tokens, state.config.default_seed),
        },
        "total_slots": ctx.n_seq_max,
        "model_alias": state.model_name(ctx),
        "model_path": ctx.config.model_path,
        "chat_template": template,
        "chat_template_caps": {},
        "modalities": {"vision": ctx.sees_images, "audio": False},
        "media_marker": MEDIA_MARKER,
        "build_info": f"llamax {llamax.__version__}",
        "is_sleeping": False,
    }  # fmt: skip
