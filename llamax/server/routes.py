"""The OpenAI endpoints (``/v1/chat/completions``, ``/v1/completions``) and tokenization."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import APIError
from .responses import CompletionJob, CompletionResponse, outcome_of
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from .state import ServerState, read_body

__all__ = ["api_routes"]

_CHAT_FIELDS = frozenset(ChatCompletionRequest.model_fields)
_TEXT_FIELDS = frozenset(CompletionRequest.model_fields)


def api_routes(state: ServerState) -> APIRouter:
    """The routes that need the API key (when one is set)."""

    def require_key(request: Request) -> None:
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        def job(body: ChatCompletionRequest) -> Callable[[], Awaitable[Any]]:
            ctx, options = state.context(), _stream_options(body)
            return lambda: ctx.achat_completion(body.messages, **options)

        return await _admit(state, request, "chat", ChatCompletionRequest, job)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        def job(body: CompletionRequest) -> Callable[[], Awaitable[Any]]:
            ctx, options = state.context(), _stream_options(body)
            return lambda: ctx.acompletion(body.prompt, **options)

        return await _admit(state, request, "completions", CompletionRequest, job)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = parse_body(TokenizeRequest, await read_body(request, state.max_body_bytes))
        ctx = state.context()
        tokens = ctx.tokenize(body.content, add_special=body.add_special)
        if not body.with_pieces:
            return JSONResponse({"tokens": tokens})
        pieces = [{"id": t, "piece": ctx.detokenize([t])} for t in tokens]
        return JSONResponse({"tokens": pieces})

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = parse_body(DetokenizeRequest, await read_body(request, state.max_body_bytes))
        ctx = state.context()
        size = state.vocab_size(ctx)
        bad = [t for t in body.tokens if not 0 <= t < size]
        if bad:
            raise APIError(400, f"token ids outside the vocabulary [0, {size}): {bad[:8]}",
                           param="tokens", code="invalid_value")  # fmt: skip
        return JSONResponse({"content": ctx.detokenize(body.tokens)})

    return router


def _stream_options(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The llamax options; a stream always asks for the usage chunk (for the metrics)."""
    options = body.options()
    if body.is_stream:
        options |= {"stream": True, "stream_options": {"include_usage": True}}
    return options


async def _admit(
    state: ServerState,
    request: Request,
    endpoint: str,
    model: type[Any],
    make_start: Callable[[Any], Callable[[], Awaitable[Any]]],
) -> Response:
    """Parse, check and admit a completion request, then hand it to its ASGI response."""
    try:
        body = parse_body(model, await read_body(request, state.max_body_bytes))
        start = make_start(body)
        state.admit()
    except APIError as error:
        state.metrics.requests.labels(endpoint, outcome_of(error.status)).inc()
        raise
    job = CompletionJob(
        endpoint=endpoint,
        start=start,
        metrics=state.metrics,
        release=state.release,
        stream=body.is_stream,
        include_usage=body.include_usage,
        fields=_CHAT_FIELDS if endpoint == "chat" else _TEXT_FIELDS,
        prompt_field="messages" if endpoint == "chat" else "prompt",
    )
    return CompletionResponse(job)
