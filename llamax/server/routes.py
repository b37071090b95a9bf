"""The OpenAI endpoints (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``)
and tokenization."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import APIError, from_exception
from .responses import CompletionJob, CompletionResponse
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    parse_body,
)
from .state import ServerState, admit_parsed, read_body

__all__ = ["api_routes"]

_CHAT_FIELDS = frozenset(ChatCompletionRequest.model_fields)
_TEXT_FIELDS = frozenset(CompletionRequest.model_fields)
_EMBED_FIELDS = frozenset(EmbeddingRequest.model_fields)
_TOKENIZE_FIELDS = frozenset(TokenizeRequest.model_fields)


def api_routes(state: ServerState) -> APIRouter:
    """The routes that need the API key (when one is set)."""

    def require_key(request: Request) -> None:
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        def job(body: ChatCompletionRequest) -> Callable[[], Awaitable[Any]]:
            ctx, options = state.context(), _stream_options(body)
            if state.parse_special_in_content:
                options["parse_special_in_content"] = True
            return lambda: ctx.achat_completion(body.messages, **options)

        return await _admit(state, request, "chat", ChatCompletionRequest, job)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        def job(body: CompletionRequest) -> Callable[[], Awaitable[Any]]:
            ctx, options = state.context(), _stream_options(body)
            return lambda: ctx.acompletion(body.prompt, **options)

        return await _admit(state, request, "completions", CompletionRequest, job)

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        def work(raw: bytes) -> Response:
            body = parse_body(EmbeddingRequest, raw)
            ctx = state.context()
            texts = [body.input] if isinstance(body.input, str) else body.input
            try:
                vectors = ctx.embed(texts)
                num_tokens = sum(len(ctx.tokenize(text)) for text in texts)
            except Exception as exc:  # too long, empty, model refused: OpenAI's error shape
                raise from_exception(exc, _EMBED_FIELDS, "input") from exc
            data = [
                {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                for i, v in enumerate(vectors)
            ]
            usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
            return JSONResponse(
                {"object": "list", "data": data, "model": ctx.model_name, "usage": usage}
            )

        return await _in_worker(state, request, work)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        def work(raw: bytes) -> Response:
            body = parse_body(TokenizeRequest, raw)
            ctx = state.context()
            try:
                tokens = ctx.tokenize(body.content, add_special=body.add_special)
            except Exception as exc:
                raise from_exception(exc, _TOKENIZE_FIELDS, "content") from exc
            if not body.with_pieces:
                return JSONResponse({"tokens": tokens})
            pieces = [{"id": t, "piece": ctx.detokenize([t])} for t in tokens]
            return JSONResponse({"tokens": pieces})

        return await _in_worker(state, request, work)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        def work(raw: bytes) -> Response:
            body = parse_body(DetokenizeRequest, raw)
            ctx = state.context()
            size = ctx.n_vocab
            bad = [t for t in body.tokens if not 0 <= t < size]
            if bad:
                raise APIError(400, f"token ids outside the vocabulary [0, {size}): {bad[:8]}",
                               param="tokens", code="invalid_value")  # fmt: skip
            return JSONResponse({"content": ctx.detokenize(body.tokens)})

        return await _in_worker(state, request, work)

    return router


def _encode(vector: Any, encoding_format: str) -> list[float] | str:
    """An embedding as floats, or as base64 of little-endian float32 (what ``openai`` asks)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return [float(x) for x in vector]


def _stream_options(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The llamax options; a stream always asks for the usage chunk (for the metrics)."""
    options = body.options()
    if body.is_stream:
        options |= {"stream": True, "stream_options": {"include_usage": True}}
    return options


async def _in_worker(
    state: ServerState, request: Request, work: Callable[[bytes], Response]
) -> Response:
    """Read the body, take an admission slot, and run ``work(body)`` (parsing, tokenizing,
    building the response) in a worker thread, so the event loop stays free.

    Raises:
        APIError: 413 for a body too large, 503 when ``max_queue`` requests are in flight,
            or what ``work`` raises.
    """
    raw = await read_body(request, state.max_body_bytes)
    state.admit()
    try:
        return await run_in_threadpool(work, raw)
    finally:
        state.release()


async def _admit(
    state: ServerState,
    request: Request,
    endpoint: str,
    model: type[Any],
    make_start: Callable[[Any], Callable[[], Awaitable[Any]]],
) -> Response:
    """Admit a completion request, parse and check it in a worker, then hand it to its
    ASGI response (which renders and tokenizes in a worker too, see ``achat_completion``).
    The admission slot is held from the moment the body has arrived until the response
    ends, so ``max_queue`` bounds the parsing and rendering as well as the inference."""

    def parse(raw: bytes) -> tuple[Any, Callable[[], Awaitable[Any]]]:
        body = parse_body(model, raw)
        return body, make_start(body)

    body, start = await admit_parsed(state, request, endpoint, parse)
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
