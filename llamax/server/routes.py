"""The OpenAI endpoints (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``)
and tokenization."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import llamax
from llamax.chat import ChatCall, ChatHandle, TextCall
from llamax.dialects.openai import CHAT, COMPLETIONS
from llamax.dialects.openai_parse import (
    CHAT_TYPES,
    TEXT_TYPES,
    ChatRequest,
    TextRequest,
    parse_chat,
    parse_text,
)
from llamax.openai import OpenAIRequest
from llamax.openai.requests import arespond

from .dialects import OPENAI, OPENAI_LLAMA, Dialect
from .errors import APIError, from_exception
from .fairness import check_num_sequences, client_key
from .images import prepare_images
from .llama import with_llama_extras
from .schemas import (
    DETOKENIZE_FIELDS,
    EMBEDDING_FIELDS,
    TOKENIZE_FIELDS,
    parse_body,
    parse_embedding,
    parse_object,
)
from .serve import add_completion_routes
from .state import ServerState, run_leased

__all__ = ["api_routes", "fim_prompt"]

_CHAT_FIELDS = frozenset(CHAT_TYPES)
_TEXT_FIELDS = frozenset(TEXT_TYPES)
_EMBED_FIELDS = frozenset(EMBEDDING_FIELDS)
_TOKENIZE_FIELDS = frozenset(TOKENIZE_FIELDS)


def api_routes(state: ServerState) -> APIRouter:
    """The routes that need the API key (when one is set)."""

    def require_key(request: Request) -> None:
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    add_completion_routes(router, state, {
        "/v1/chat/completions": OpenAIChat(state, OPENAI),
        "/chat/completions": OpenAIChat(state, OPENAI_LLAMA),  # llama-server's: its errors
        "/v1/completions": OpenAIText(state),
    })  # fmt: skip

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        def parse(raw: bytes) -> dict[str, Any]:
            return parse_embedding(raw, lenient=state.config.lenient)

        def work(body: dict[str, Any], ctx: llamax.Context) -> Response:
            texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
            try:
                vectors = _shortened(ctx.embed(texts), body.get("dimensions"))
                num_tokens = sum(len(ctx.tokenize(text)) for text in texts)
            except Exception as exc:  # too long, empty, model refused: OpenAI's error shape
                raise from_exception(exc, _EMBED_FIELDS, "input") from exc
            encoding = body.get("encoding_format", "float")
            data = [{"object": "embedding", "index": i, "embedding": _encode(v, encoding)}
                    for i, v in enumerate(vectors)]  # fmt: skip
            usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
            model = _echo(state, body.get("model"), ctx)
            return JSONResponse({"object": "list", "data": data, "model": model, "usage": usage})

        return await run_leased(state, request, parse, _model_of, work)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        def work(body: dict[str, Any], ctx: llamax.Context) -> Response:
            special = {"add_special": body.get("add_special", False),
                       "parse_special": body.get("parse_special", True)}  # fmt: skip
            try:
                tokens = ctx.tokenize(body["content"], **special)
            except Exception as exc:
                raise from_exception(exc, _TOKENIZE_FIELDS, "content") from exc
            if not body.get("with_pieces"):
                return JSONResponse({"tokens": tokens})
            pieces = [{"id": t, "piece": ctx.detokenize([t])} for t in tokens]
            return JSONResponse({"tokens": pieces})

        return await _in_worker(state, request, TOKENIZE_FIELDS, "content", work)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        def work(body: dict[str, Any], ctx: llamax.Context) -> Response:
            size, tokens = ctx.n_vocab, body["tokens"]
            bad = [t for t in tokens if not 0 <= t < size]
            if bad:
                raise APIError(400, f"token ids outside the vocabulary [0, {size}): {bad[:8]}",
                               param="tokens", code="invalid_value")  # fmt: skip
            return JSONResponse({"content": ctx.detokenize(tokens)})

        return await _in_worker(state, request, DETOKENIZE_FIELDS, "tokens", work)

    return router


def fim_prompt(ctx: llamax.Context, prompt: str | Sequence[int], suffix: str) -> list[int]:
    """OpenAI's ``suffix`` (insert mode) as a fill-in-the-middle prompt in the model's own
    tokens, in llama.cpp's prefix-suffix-middle order: BOS (when the vocabulary adds one),
    FIM prefix, the prompt, FIM suffix, the suffix, FIM middle; the model then writes what
    goes between. Text is tokenized plainly (special-token text in code is not parsed), as
    llama-server's ``/infill`` does; a prompt of token ids is taken as it is.

    Raises:
        InvalidParameterError: the model lacks a FIM prefix, suffix or middle token.
    """
    fim = ctx.fim_tokens
    if fim.prefix is None or fim.suffix is None or fim.middle is None:
        missing = [n for n, t in (("prefix", fim.prefix), ("suffix", fim.suffix),
                                  ("middle", fim.middle)) if t is None]  # fmt: skip
        raise llamax.InvalidParameterError(
            f"suffix needs a model with fill-in-the-middle tokens, and this one has no FIM "
            f"{', '.join(missing)} token: send the prompt alone, or serve a FIM model",
            param="suffix",
        )

    def plain(text: str) -> list[int]:
        return ctx.tokenize(text, add_special=False, parse_special=False)

    head = ctx.tokenize("", add_special=True)
    before = plain(prompt) if isinstance(prompt, str) else list(prompt)
    return [*head, fim.prefix, *before, fim.suffix, *plain(suffix), fim.middle]


def _check_trailing_assistants(messages: Sequence[Mapping[str, Any]]) -> None:
    """llama-server's rule on its ``/chat/completions``: a last assistant message is the
    start of the reply, so two cannot end the list (OpenAI's ``/v1`` takes them as turns).

    Raises:
        APIError: 400 with llama-server's words.
    """
    roles = [m.get("role") for m in messages[-2:] if isinstance(m, Mapping)]
    if len(roles) == 2 and roles == ["assistant", "assistant"]:
        raise APIError(400, "Cannot have 2 or more assistant messages at the end of the list.",
                       param="messages", code="invalid_value")  # fmt: skip


class _OpenAIRoute:
    """What the chat and text routes (each a :class:`~.route.CompletionRoute`) share: the
    parsed body is the codec's request and the body itself (a chat's ``tools`` as sent,
    for ``verbose``)."""

    check_key = False  # the router's dependency checks it
    ping_seconds = None

    def __init__(self, state: ServerState, dialect: Dialect = OPENAI) -> None:
        self.state, self.dialect = state, dialect

    def model(self, parsed: tuple[ChatRequest | TextRequest, Any]) -> object:
        """The ``model`` the body names."""
        return parsed[0].model

    def stream(self, parsed: tuple[ChatRequest | TextRequest, Any]) -> bool:
        """Whether the reply streams."""
        return parsed[0].stream

    def include_usage(self, parsed: tuple[ChatRequest | TextRequest, Any]) -> bool:
        """Whether the client asked for the usage chunk."""
        return parsed[0].include_usage


class OpenAIChat(_OpenAIRoute):
    """``POST /v1/chat/completions``; with the ``OPENAI_LLAMA`` dialect llama-server's
    ``/chat/completions``: its error shape, and its rule that two assistant messages
    cannot end the list."""

    endpoint, fields, prompt_field = "chat", _CHAT_FIELDS, "messages"

    def parse(self, raw: bytes) -> tuple[ChatRequest, dict[str, Any]]:
        """The body and its call (a worker: images may be fetched, a schema compiled)."""
        state = self.state
        body = parse_object(raw, CHAT, "/v1/chat/completions", lenient=state.config.lenient)
        defaults = _defaults(state)
        if state.config.parse_special_in_content:
            defaults["parse_special_in_content"] = True
        try:
            parsed = parse_chat(body, defaults=defaults)
        except Exception as exc:
            raise from_exception(exc, self.fields, self.prompt_field) from exc
        messages = list(parsed.call.messages)  # the call's own: fetched images land in it
        check_num_sequences(1, parsed.call.params.n, state.config.max_sequences, param="n")
        prepare_images(messages, "openai", state.config.images, state.image_fetcher)
        if self.dialect is OPENAI_LLAMA:
            _check_trailing_assistants(messages)
        return parsed, body

    def start(self, parsed: tuple[ChatRequest, dict[str, Any]], ctx: llamax.Context,
              request: Request) -> Awaitable[Any]:  # fmt: skip
        """Submit the chat (rendered in a worker) and read it as OpenAI's shapes."""
        chat, body = parsed
        call = _named(self.state, chat.model, ctx, chat.call)
        reply = _reply(ctx.asubmit_chat(call, fair_key=client_key(request)), chat.stream)
        if not (chat.timings_per_token or chat.verbose):
            return reply
        return with_llama_extras(ctx, call, body.get("tools"), reply, stream=chat.stream,
                                 timings=chat.timings_per_token, verbose=chat.verbose)  # fmt: skip


class OpenAIText(_OpenAIRoute):
    """``POST /v1/completions``."""

    endpoint, fields, prompt_field = "completions", _TEXT_FIELDS, "prompt"

    def parse(self, raw: bytes) -> tuple[TextRequest, None]:
        """The body's call."""
        state = self.state
        body = parse_object(raw, COMPLETIONS, "/v1/completions", lenient=state.config.lenient)
        try:
            parsed = parse_text(body, defaults=_defaults(state))
        except Exception as exc:
            raise from_exception(exc, self.fields, self.prompt_field) from exc
        check_num_sequences(1, parsed.call.params.n, state.config.max_sequences, param="n")
        return parsed, None

    async def start(self, parsed: tuple[TextRequest, None], ctx: llamax.Context,
                    request: Request) -> Any:  # fmt: skip
        """Submit the text completion (a ``suffix`` as a fill-in-the-middle prompt)."""
        text = parsed[0]
        call = _named(self.state, text.model, ctx, text.call)
        prompt = call.prompt
        if text.suffix:  # tokenized in a worker: the event loop stays free
            fim = await run_in_threadpool(fim_prompt, ctx, prompt, text.suffix)
            call = dataclasses.replace(call, prompt=tuple(fim))
        result = await _reply(ctx.asubmit_text(call, fair_key=client_key(request)), text.stream)
        if not text.echo:
            return result
        return _with_prompt(result, prompt if isinstance(prompt, str) else ctx.detokenize(prompt))


def _defaults(state: ServerState) -> dict[str, Any]:
    """The server's default ``max_tokens`` and ``seed``, as call options."""
    defaults: dict[str, Any] = {}
    state.with_defaults(defaults)
    return defaults


CallT = TypeVar("CallT", ChatCall, TextCall)


def _named(state: ServerState, model: str | None, ctx: llamax.Context, call: CallT) -> CallT:
    """``call`` naming the model as :func:`_echo` says the response does."""
    name = _echo(state, model, ctx)
    return dataclasses.replace(call, model=name or None)


async def _reply(submitted: Awaitable[ChatHandle], stream: bool) -> Any:
    """A submitted call read as OpenAI's shapes; a stream always asks for the usage chunk
    (for the metrics)."""
    return await arespond(OpenAIRequest(await submitted), stream, True)


def _model_of(body: dict[str, Any]) -> object:
    """The ``model`` a parsed body names (``None``: the default)."""
    return body.get("model")


def _echo(state: ServerState, model: str | None, ctx: llamax.Context) -> str:
    """The name a response gives the model: the request's ``model`` (as OpenAI and
    llama-server echo it); with several models, a request naming none gets the
    default model's name, and with one model the name ``/v1/models`` lists (the alias, or
    the file's name)."""
    if model is None and state.pool is not None:
        model = state.pool.default
    if model is None:
        model = state.model_name(ctx)
    return model


def _shortened(vectors: Any, dimensions: int | None) -> Any:
    """The first ``dimensions`` components of each vector, renormalised to length 1 (how
    Matryoshka-trained models are shortened; OpenAI's ``dimensions``).

    Raises:
        APIError: 400 for more dimensions than the model's.
    """
    if dimensions is None:
        return vectors
    size = len(vectors[0]) if len(vectors) else 0
    if dimensions > size:
        raise APIError(400, f"dimensions must be at most {size} (the model's), got {dimensions}",
                       param="dimensions", code="invalid_value")  # fmt: skip
    shortened = []
    for vector in vectors:
        kept = np.asarray(vector[:dimensions], dtype=np.float32)
        norm = float(np.linalg.norm(kept))
        shortened.append(kept / norm if norm > 0 else kept)
    return shortened


def _with_prompt(result: Any, prompt: str) -> Any:
    """A text completion (or its stream) with ``prompt`` before each choice's text
    (``echo``)."""
    if isinstance(result, dict):
        for choice in result["choices"]:
            choice["text"] = prompt + choice["text"]
        return result
    return _echoed_stream(result, prompt)


async def _echoed_stream(chunks: AsyncIterator[Any], prompt: str) -> AsyncIterator[Any]:
    started: set[int] = set()
    try:
        async for chunk in chunks:
            for choice in chunk["choices"]:
                if choice["index"] not in started:
                    started.add(choice["index"])
                    choice["text"] = prompt + choice["text"]
            yield chunk
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


def _encode(vector: Any, encoding_format: str) -> list[float] | str:
    """An embedding as floats, or as base64 of little-endian float32 (what ``openai`` asks)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return [float(x) for x in vector]


async def _in_worker(
    state: ServerState,
    request: Request,
    fields: dict[str, Any],
    required: str,
    work: Callable[[dict[str, Any], llamax.Context], Response],
) -> Response:
    """Read the body, take an admission slot, parse it in a worker (its ``fields``, strictly:
    :func:`~.schemas.parse_body`), wait for the model it names, and run ``work(body, ctx)``
    (tokenizing, building the response) in a worker thread, so the event loop stays free.

    Raises:
        APIError: 413 for a body too large, 503 when ``max_queue`` requests are in flight,
            404 for an unknown model, or what ``work`` raises.
    """

    def parse(raw: bytes) -> dict[str, Any]:
        return parse_body(raw, fields, required)

    return await run_leased(state, request, parse, _model_of, work)
