"""One sequence of llama-server's native API on a slot (``/infill``, and ``/completion``
with ``id_slot``): its slot, handle and clock, and its answer shaped by :mod:`.results`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

from starlette.concurrency import run_in_threadpool

import llamax
from llamax.dialects.llama_native import (
    MEDIA_MARKER,
    NativeRequest,
    Timings,
    final_result,
    partial_result,
    stop_of,
)

from .slots import Slot, SlotTable, SlotTables, table_of

__all__ = ["NativeJob", "num_positions", "prompt_text", "run_job"]


async def run_job(
    ctx: llamax.Context, tables: SlotTables,
    request: NativeRequest, params: llamax.SamplingParams,
    tokens: Callable[[], Sequence[int | llamax.Image]], *, model: str,
    fair_key: str | None = None,
) -> Any:  # fmt: skip
    """Build the prompt (``tokens()``, and its images read to count its positions, in a
    worker: a bad image is refused there), start a :class:`NativeJob` on it and answer: its
    chunks when ``request.stream``, else its whole answer. ``fair_key``: the client's
    (:func:`~llamax.server.fairness.client_key`).

    Raises:
        LlamaError: see :meth:`NativeJob.start`; and what ``tokens`` raises.
    """
    stack = AsyncExitStack()
    try:
        prompt, size = await run_in_threadpool(lambda: _counted(ctx, tokens()))
        job = await NativeJob.start(
            ctx,
            table_of(tables, ctx),
            request,
            params,
            prompt,
            size,
            stack,
            model=model,
            fair_key=fair_key,
        )
    except BaseException:
        await stack.aclose()
        raise
    return job.chunks() if request.stream else await job.whole()


async def _added_in_worker(add: Callable[[], llamax.RequestHandle]) -> llamax.RequestHandle:
    """``add()`` (which checks the request and builds its grammar) in the loop's default
    executor, as the chat routes submit theirs, so the event loop stays free; a caller
    cancelled meanwhile has the request cancelled as soon as it exists."""
    future = asyncio.get_running_loop().run_in_executor(None, add)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(_cancel_added)
        raise


def _cancel_added(future: asyncio.Future[llamax.RequestHandle]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().cancel()


class NativeJob:
    """One sequence of a native request once submitted: on the slot ``id_slot`` names (its
    :class:`~llamax.Session`, so what the slot computed before is reused), or on any
    sequence (shown in ``GET /slots`` under an idle slot). Its answer is ``/completion``'s
    shape, whole (:meth:`whole`) or as chunks (:meth:`chunks`)."""

    def __init__(
        self, ctx: llamax.Context, slot: Slot | None, request: NativeRequest,
        tokens: list[int | llamax.Image], num_positions: int, handle: llamax.RequestHandle,
        stack: AsyncExitStack, model: str,
    ) -> None:  # fmt: skip
        self.ctx, self.slot, self.request, self.model = ctx, slot, request, model
        self.tokens, self.handle, self.stack = tokens, handle, stack
        self.timings = Timings(time.perf_counter(), num_prompt=num_positions)
        self.id_slot = -1 if slot is None else slot.id

    @classmethod
    async def start(
        cls, ctx: llamax.Context, slots: SlotTable, request: NativeRequest,
        params: llamax.SamplingParams, tokens: list[int | llamax.Image], num_positions: int,
        stack: AsyncExitStack, *, model: str, fair_key: str | None = None,
    ) -> NativeJob:  # fmt: skip
        """Take the slot ``request.id_slot`` names (waiting while another request holds
        it; ``-1``: any sequence) and submit ``tokens`` (``num_positions`` of them, an
        image counted by its positions) with ``params``. What ``stack``
        holds (the slot, the handle) is given back when the job ends; ``model`` is the name
        the answer gives the model. Off a slot the request holds its client's share
        (``fair_key``); on a slot it runs on the slot's session, whose sequence id it
        holds already.

        Raises:
            LlamaError: 400 for a bad ``id_slot``; llamax's errors for a prompt it refuses,
                before anything reaches the engine.
        """
        session, slot = None, None
        await slots.close_idle()
        if request.id_slot != -1:
            slot = slots.get(request.id_slot)
            await slot.lock.acquire()
            stack.callback(slot.lock.release)
            session = slots.session_of(slot)
        else:
            slot = slots.idle()
        slots.begin(slot, request.settings, num_positions)
        stack.callback(slots.end, slot)
        if session is None:
            handle = await _added_in_worker(
                lambda: ctx.add_request(tokens, params, fair_key=fair_key)
            )
        else:
            handle = await _added_in_worker(lambda: session.add_request(tokens, params))
        stack.callback(handle.cancel)  # a no-op once it has finished
        return cls(ctx, slot, request, tokens, num_positions, handle, stack, model)

    async def _events(self) -> AsyncIterator[llamax.TokenEvent]:
        timings = self.timings
        async for event in self.handle:
            if timings.first_token is None and event.token_ids:
                timings.first_token = time.perf_counter()
            timings.num_predicted += len(event.token_ids)
            if self.slot is not None and self.slot.task is not None:
                self.slot.task["n_decoded"] = timings.num_predicted
            yield event

    async def _final(self) -> dict[str, Any]:
        result = await self.handle
        usage = result.usage
        self.timings.num_cached = usage.cached_tokens
        if self.slot is not None and self.slot.task is not None:
            self.slot.task["n_prompt_tokens_cache"] = usage.cached_tokens
            self.slot.task["n_prompt_tokens_processed"] = usage.prompt_tokens - usage.cached_tokens
        choice = result.choices[0]
        self.timings.num_predicted = len(choice.token_ids)
        full_text, prompt = await run_in_threadpool(
            lambda: (self.ctx.detokenize(choice.token_ids), prompt_text(self.ctx, self.tokens))
        )
        params = self.request.params
        return final_result(
            self.request, index=0, id_slot=self.id_slot, text=choice.text,
            token_ids=choice.token_ids, prompt=prompt,
            stop=stop_of(choice, full_text, params.stop if params is not None else ()),
            model=self.model, n_ctx=self.ctx.n_ctx_seq, timings=self.timings,
            now=time.perf_counter(), logprobs=choice.logprobs,
        )  # fmt: skip

    async def whole(self) -> dict[str, Any]:
        """The answer, once the sequence has ended."""
        try:
            async for _ in self._events():
                pass
            return await self._final()
        finally:
            await self.stack.aclose()

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """One chunk per event, then the final answer (``stop: true``)."""
        try:
            async for event in self._events():
                if event.text or event.token_ids or event.progress:
                    yield partial_result(
                        self.request, event, index=0, id_slot=self.id_slot,
                        timings=self.timings, now=time.perf_counter(),
                    )  # fmt: skip
            yield await self._final()
        finally:
            await self.stack.aclose()


def num_positions(ctx: llamax.Context, prompt: list[int | llamax.Image]) -> int:
    """A prompt's positions (reading its images, kept for ``add_request``: a bad one is
    refused here)."""
    if not any(isinstance(p, llamax.Image) for p in prompt):
        return len(prompt)
    return ctx.prompt_positions(prompt)


def prompt_text(ctx: llamax.Context, prompt: list[int | llamax.Image]) -> str:
    """A prompt as text, each image as the media marker."""
    text, run = "", []
    for piece in [*prompt, None]:
        if isinstance(piece, int):
            run.append(piece)
            continue
        text += ctx.detokenize(run) + (MEDIA_MARKER if piece is not None else "")
        run = []
    return text


def _counted(
    ctx: llamax.Context, tokens: Sequence[int | llamax.Image]
) -> tuple[list[int | llamax.Image], int]:
    prompt = list(tokens)
    return prompt, num_positions(ctx, prompt)
