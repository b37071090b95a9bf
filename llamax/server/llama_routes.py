"""llama-server's native routes: ``/completion`` (and ``/completions``), ``/apply-template``,
``/props``, and the token counts of ``/chat/completions/input_tokens``.

The body is checked and mapped in a worker (:mod:`.llama_native`), the prompts are
tokenized and submitted through the public ``add_request`` in a worker too, and the
results are shaped as llama-server shapes them; errors come in llama-server's shape
(``{"error": {"code", "message", "type"}}``, :data:`~.dialects.LLAMA`). A client that
leaves cancels every sequence of its request. The table of routes and fields is in
docs/server.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import llamax
from llamax.openai import chat_prompt_tokens

from .dialects import LLAMA
from .errors import APIError, from_exception, llama_body
from .images import prepare_images
from .llama_native import (
    FIELDS,
    MEDIA_MARKER,
    NativePrompt,
    NativeRequest,
    Timings,
    default_settings,
    final_result,
    parse_native,
    partial_result,
    stop_of,
)
from .schemas import ChatCompletionRequest, parse_body, parse_object
from .state import ServerState, admit_completion, run_leased

__all__ = ["llama_routes"]


def llama_routes(state: ServerState) -> APIRouter:
    """llama-server's native routes (behind the API key when one is set)."""

    def require_key(request: Request) -> None:
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    @router.post("/completion")
    @router.post("/completions")
    async def completion(request: Request) -> Response:
        def parse(raw: bytes) -> NativeRequest:
            body = parse_native(parse_object(raw), default_n_predict=state.default_max_tokens,
                                default_seed=state.default_seed)  # fmt: skip
            _check_num_images(body, state.images.max_images)
            return body

        return await admit_completion(
            state,
            request,
            "completion",
            parse,
            lambda body: body.model,
            lambda body, ctx: _start(body, ctx, state.model_name(ctx)),
            dialect=LLAMA,
            fields=FIELDS,
            prompt_field="prompt",
            stream=lambda body: body.stream,
        )

    @router.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        def work(raw: dict[str, Any], ctx: llamax.Context) -> Response:
            generation = raw.pop("add_generation_prompt", True)
            if not isinstance(generation, bool):
                raise APIError(400, "add_generation_prompt must be a boolean",
                               param="add_generation_prompt", code="invalid_type")  # fmt: skip
            body = parse_body(ChatCompletionRequest, _dumps(raw))
            prepare_images(body.messages, "openai", state.images)
            thinking = body.options().get("enable_thinking")
            extra = {} if thinking is None else {"enable_thinking": thinking}
            try:
                ctx.chat_prompt_parts(body.messages)  # checks them as a chat request would
                prompt = ctx.chat_template.render(
                    _media_markers(body.messages),
                    add_generation_prompt=generation,
                    tools=body.tools,
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
            body = parse_body(ChatCompletionRequest, _dumps(raw))
            prepare_images(body.messages, "openai", state.images)
            try:
                tokens = chat_prompt_tokens(ctx, body.messages, **body.options())
                count = ctx.prompt_positions(tokens)
            except Exception as exc:
                raise from_exception(exc, frozenset(ChatCompletionRequest.model_fields)) from exc
            return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

        return await _llama_shaped(state, request, work)

    @router.get("/props")
    async def props() -> Response:
        try:
            ctx = state.context()
        except APIError as error:
            return JSONResponse(llama_body(error), status_code=error.status)
        return JSONResponse(_props(state, ctx))

    @router.post("/props")
    async def set_props() -> Response:
        error = APIError(501, "This server does not support changing global properties "
                         "(llamax has no settable properties)", code="not_supported")  # fmt: skip
        return JSONResponse(llama_body(error), status_code=501)

    return router


def _media_markers(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(Checked) ``messages`` with each list of content parts as one string, an image as
    llama-server's media marker, as its ``/apply-template`` shows them."""
    marked = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") if p.get("type") == "text" else MEDIA_MARKER
                     for p in content]  # fmt: skip
            message = {**message, "content": "".join(texts)}
        marked.append(message)
    return marked


def _check_num_images(body: NativeRequest, most: int) -> None:
    """A 400 for a body whose prompts hold more than ``most`` images in all."""
    num = sum(isinstance(p, llamax.Image) for prompt in body.prompts for p in prompt)
    if num > most:
        raise APIError(400, f"the request holds {num} images; at most {most} are allowed per "
                       "request (--max-images-per-request)", param="prompt",
                       code="too_many_images")  # fmt: skip


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


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
            "params": default_settings(state.default_max_tokens, state.default_seed),
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


def _prompt_tokens(ctx: llamax.Context, prompt: NativePrompt) -> list[int | llamax.Image]:
    """A prompt's tokens: text tokenized with BOS (when the model adds one) and special
    tokens parsed, as llama-server does; in a mixed list only a leading text gets BOS. An
    image stays in its place (``add_request`` reads and encodes it)."""
    if isinstance(prompt, str):
        return list(ctx.tokenize(prompt))
    tokens: list[int | llamax.Image] = []
    for i, piece in enumerate(prompt):
        if isinstance(piece, str):
            tokens += ctx.tokenize(piece, add_special=i == 0)
        else:
            tokens.append(piece)
    return tokens


def _prompt_text(ctx: llamax.Context, prompt: list[int | llamax.Image]) -> str:
    """A prompt as text, each image as the media marker."""
    text, run = "", []
    for piece in [*prompt, None]:
        if isinstance(piece, int):
            run.append(piece)
            continue
        text += ctx.detokenize(run) + (MEDIA_MARKER if piece is not None else "")
        run = []
    return text


def _submit(
    ctx: llamax.Context, request: NativeRequest
) -> tuple[list[list[int | llamax.Image]], list[int], list[llamax.RequestHandle]]:
    """Tokenize every prompt, count its positions (reading its images) and submit it (none
    when ``n_predict`` is 0); if one is refused, the ones already submitted are cancelled."""
    prompts = [_prompt_tokens(ctx, p) for p in request.prompts]
    sizes = [_num_positions(ctx, p) for p in prompts]
    handles: list[llamax.RequestHandle] = []
    if request.params is None:
        for tokens in prompts:
            if not tokens:
                raise llamax.EmptyPromptError("the prompt is empty (it tokenized to zero tokens)")
        return prompts, sizes, handles
    params = request.params
    if request.text_bias:
        bias = dict(params.logit_bias)
        for text, number in request.text_bias:
            bias |= dict.fromkeys(ctx.tokenize(text, add_special=False), number)
        params = dataclasses.replace(params, logit_bias=bias)
    try:
        for tokens in prompts:
            handles.append(ctx.add_request(tokens, params))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return prompts, sizes, handles


class _Run:
    """One ``/completion`` request's sequences: their clocks and how each result reads."""

    def __init__(
        self,
        ctx: llamax.Context,
        request: NativeRequest,
        prompts: list[list[int | llamax.Image]],
        sizes: list[int],
        model: str,
    ) -> None:
        self.ctx, self.request, self.prompts = ctx, request, prompts
        self.n = request.params.n if request.params is not None else 1
        self.model = request.model or model
        now = time.perf_counter()
        self.timings = [Timings(now, num_prompt=size) for size in sizes for _ in range(self.n)]

    def final(
        self, i: int, choice: llamax.Choice | None, usage: llamax.Usage | None
    ) -> dict[str, Any]:
        index = i * self.n + (choice.index if choice else 0)
        timings = self.timings[index]
        stops = self.request.params.stop if self.request.params is not None else ()
        ids: tuple[int, ...]
        logprobs: tuple[llamax.TokenLogprob, ...] | None
        stop, text, ids, logprobs = ("limit", ""), "", (), None  # n_predict 0: no choice
        if choice is not None:
            full = self.ctx.detokenize(choice.token_ids)
            stop, text, ids, logprobs = stop_of(choice, full, stops), choice.text, (), None
            ids, logprobs = choice.token_ids, choice.logprobs
            timings.num_predicted = len(choice.token_ids)
        if usage is not None:
            timings.num_cached = usage.cached_tokens
        return final_result(
            self.request, index=index, text=text, token_ids=ids,
            prompt=_prompt_text(self.ctx, self.prompts[i]), stop=stop, model=self.model,
            n_ctx=self.ctx.n_ctx_seq, timings=timings, now=time.perf_counter(), logprobs=logprobs,
        )  # fmt: skip


def _num_positions(ctx: llamax.Context, prompt: list[int | llamax.Image]) -> int:
    """A prompt's positions (reading its images, kept for ``add_request``: a bad one is
    refused here)."""
    if not any(isinstance(p, llamax.Image) for p in prompt):
        return len(prompt)
    return ctx.prompt_positions(prompt)


async def _start(request: NativeRequest, ctx: llamax.Context, model: str) -> Any:
    prompts, sizes, handles = await run_in_threadpool(_submit, ctx, request)
    run = _Run(ctx, request, prompts, sizes, model)
    if request.stream:
        return _stream(run, handles)
    try:
        if not handles:
            results = [run.final(i, None, None) for i in range(len(prompts))]
        else:
            completions = await asyncio.gather(
                *(_watch(run, i, h, None) for i, h in enumerate(handles))
            )
            results = [run.final(i, c, done.usage) for i, done in enumerate(completions)
                       for c in done.choices]  # fmt: skip
    finally:
        for handle in handles:
            handle.cancel()  # a no-op once finished; frees the KV of a client that left
    return results[0] if len(results) == 1 else results


async def _watch(
    run: _Run, i: int, handle: llamax.RequestHandle,
    queue: asyncio.Queue[tuple[int, object]] | None,
) -> llamax.Completion:  # fmt: skip
    """Follow one prompt's events (timing each choice's first token; passing them on to
    ``queue`` when streaming) and return its completion."""
    async for event in handle:
        timings = run.timings[i * run.n + event.index]
        if timings.first_token is None and event.token_ids:
            timings.first_token = time.perf_counter()
        timings.num_predicted += len(event.token_ids)
        if queue is not None:
            await queue.put((i, event))
    done = await handle
    if queue is not None:
        await queue.put((i, done))
    return done


async def _feed(
    run: _Run, i: int, handle: llamax.RequestHandle, queue: asyncio.Queue[tuple[int, object]]
) -> None:
    """:func:`_watch` for a stream: its failure goes to ``queue`` too."""
    try:
        await _watch(run, i, handle, queue)
    except Exception as exc:
        await queue.put((i, exc))


async def _stream(run: _Run, handles: list[llamax.RequestHandle]) -> AsyncIterator[dict[str, Any]]:
    """The events of every sequence as they come, each sequence's last with ``stop: true``."""
    if not handles:
        for i in range(len(run.prompts)):
            yield run.final(i, None, None)
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_feed(run, i, h, queue)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, llamax.Completion):
                remaining -= 1
                for choice in item.choices:
                    yield run.final(i, choice, item.usage)
            elif isinstance(item, llamax.TokenEvent) and (item.text or item.token_ids):
                index = i * run.n + item.index
                timings = run.timings[index]
                yield partial_result(
                    run.request, item, index, timings.num_prompt, timings.num_predicted,
                    timings, time.perf_counter(),
                )  # fmt: skip
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.cancel()
