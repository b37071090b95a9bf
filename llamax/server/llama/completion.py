"""llama-server's ``/completion`` once its body is parsed (:mod:`.request`): the prompts
tokenized and submitted through the public ``add_request`` (in a worker), their sequences
followed, and their results shaped by :mod:`.results`, whole or as one stream of every
sequence's chunks. A request that names ``id_slot`` (one prompt, one choice) runs on that
slot's session instead (:class:`~.jobs.NativeJob`), so it continues from what the slot
holds: its earlier requests, or a file restored into it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from starlette.concurrency import run_in_threadpool

import llamax
from llamax.dialects.llama_native import (
    NativePrompt,
    NativeRequest,
    Timings,
    final_result,
    partial_result,
    stop_of,
)

from ..fairness import call_key
from .errors import LlamaError
from .jobs import num_positions, prompt_text, run_job
from .slots import SlotTables

__all__ = ["start_completion"]


async def start_completion(
    request: NativeRequest, ctx: llamax.Context, model: str,
    tables: SlotTables, *, fair_key: str | None = None,
) -> Any:  # fmt: skip
    """Submit ``request`` under its client's ``fair_key``
    (:func:`~llamax.server.fairness.client_key`) and answer: a result (a list of them for
    several prompts or choices), or an async iterator of chunks when it streams.

    Raises:
        LlamaError: 400 for ``id_slot`` with several prompts or choices; what
            :func:`~.jobs.run_job` raises.
        ContextLengthError, EmptyPromptError, InvalidRequestError: a prompt llamax refuses
            (nothing was submitted).
    """
    if request.id_slot != -1 and request.params is not None:  # n_predict 0 runs nothing
        if len(request.prompts) != 1 or request.params.n != 1:
            raise LlamaError(400, "id_slot runs one prompt with one choice on its slot "
                             "(send several prompts, or n_cmpl > 1, without it)")  # fmt: skip
        params = await run_in_threadpool(_with_text_bias, ctx, request)
        tokens = partial(_prompt_tokens, ctx, request.prompts[0])
        return await run_job(ctx, tables, request, params, tokens,
                             model=request.model or model, fair_key=fair_key)  # fmt: skip
    return await _start(request, ctx, model, fair_key)


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


def _with_text_bias(ctx: llamax.Context, request: NativeRequest) -> llamax.SamplingParams:
    """``request.params`` with its ``logit_bias`` given as text added, token by token."""
    params = request.params
    assert params is not None
    if not request.text_bias:
        return params
    bias = dict(params.logit_bias)
    for text, number in request.text_bias:
        bias |= dict.fromkeys(ctx.tokenize(text, add_special=False), number)
    return dataclasses.replace(params, logit_bias=bias)


def _submit(
    ctx: llamax.Context, request: NativeRequest, fair_key: str | None
) -> tuple[list[list[int | llamax.Image]], list[int], list[llamax.RequestHandle]]:
    """Tokenize every prompt, count its positions (reading its images) and submit it (none
    when ``n_predict`` is 0), all under the client's ``fair_key``, or where the peer is
    unknown several under one key of this call's (:mod:`~llamax.server.fairness`); if one
    is refused, the ones already submitted are cancelled."""
    prompts = [_prompt_tokens(ctx, p) for p in request.prompts]
    sizes = [num_positions(ctx, p) for p in prompts]
    handles: list[llamax.RequestHandle] = []
    if request.params is None:
        for tokens in prompts:
            if not tokens:
                raise llamax.EmptyPromptError("the prompt is empty (it tokenized to zero tokens)")
        return prompts, sizes, handles
    params = _with_text_bias(ctx, request)
    key = fair_key or (call_key() if len(prompts) > 1 else None)  # one fair share
    try:
        for tokens in prompts:
            handles.append(ctx.add_request(tokens, params, fair_key=key))
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
            stop, text = stop_of(choice, full, stops), choice.text
            ids, logprobs = choice.token_ids, choice.logprobs
            timings.num_predicted = len(choice.token_ids)
        if usage is not None:
            timings.num_cached = usage.cached_tokens
        return final_result(
            self.request, index=index, id_slot=-1, text=text, token_ids=ids,
            prompt=prompt_text(self.ctx, self.prompts[i]), stop=stop, model=self.model,
            n_ctx=self.ctx.n_ctx_seq, timings=timings, now=time.perf_counter(), logprobs=logprobs,
        )  # fmt: skip


async def _start(
    request: NativeRequest, ctx: llamax.Context, model: str, fair_key: str | None
) -> Any:
    prompts, sizes, handles = await run_in_threadpool(_submit, ctx, request, fair_key)
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
            elif isinstance(item, llamax.TokenEvent) and (
                item.text or item.token_ids or item.progress
            ):
                index = i * run.n + item.index
                timings = run.timings[index]
                yield partial_result(run.request, item, index=index, id_slot=-1,
                                     timings=timings, now=time.perf_counter())  # fmt: skip
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.cancel()


def _shows(event: llamax.TokenEvent) -> bool:
    """Whether a stream sends a chunk for ``event`` (text, tokens or the prompt's progress;
    not an event whose text is held back)."""
    return bool(event.text or event.token_ids or event.progress)
