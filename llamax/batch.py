"""Batch generation: many prompts submitted at once, results in input order.

:func:`generate` and :func:`agenerate` are the notebook and pipeline way to run a list of
prompts, like vLLM's ``LLM.generate``. Every prompt is submitted before any is waited for,
so the engine's continuous batching runs them together (up to ``n_seq_max`` at a time; the
rest queue). Both work on a background context; :func:`generate` also drives a manual
(``autostart=False``) one from the calling thread.

Errors are per prompt: a prompt that cannot be submitted (too long, empty, bad grammar) or
a request that fails while running does not stop the others when ``return_exceptions=True``;
its exception takes its place in the result list. Otherwise the first error is raised once
the other requests have been cancelled.

Both work on a :class:`BatchHost`: what a batch needs of a context (submit a prompt, say
whether the caller drives the loop, run one step). :class:`llamax.Context` is one, and
hands itself down from :meth:`Context.generate <llamax.Context.generate>`; this module
names no ``Context``, so the facade imports it as it imports chat preparation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from typing import Literal, Protocol, overload

from .errors import (
    ContextClosedError,
    InvalidParameterError,
    InvalidRequestError,
    LoopOwnershipError,
)
from .handle import RequestHandle
from .params import SamplingParams
from .progress import BatchProgress
from .prompts import Prompt
from .results import Completion

__all__ = ["BatchHost", "Prompt", "agenerate", "generate"]

Outcome = Completion | BaseException


class BatchHost(Protocol):
    """What a batch needs of a context (:class:`llamax.Context` is one)."""

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Submit ``prompt``; its handle at once."""
        ...

    @property
    def is_manual(self) -> bool:
        """Whether the caller drives the loop (``autostart=False``) with :meth:`process`."""
        ...

    def process(self) -> bool:
        """Run one step of the loop."""
        ...

_REFRESH_S = 0.5
_SETTLE_TIMEOUT_S = 30.0


def _params_list(
    num_prompts: int, params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * num_prompts
    if not isinstance(params, Sequence):
        raise InvalidRequestError(
            f"params must be a SamplingParams or a sequence of them, got {type(params).__name__}",
            param="params",
        )
    if len(params) != num_prompts:
        raise InvalidParameterError(
            f"params has {len(params)} entries for {num_prompts} prompts; "
            "pass one SamplingParams, or one per prompt",
            param="params",
        )
    for i, item in enumerate(params):
        if not isinstance(item, SamplingParams):
            raise InvalidRequestError(
                f"params[{i}] must be a SamplingParams, got {item!r}", param=f"params[{i}]"
            )
    return list(params)


class _Batch:
    """The requests of one call: submission, outcomes in input order, and cancellation."""

    def __init__(
        self,
        ctx: BatchHost,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        progress: bool | None,
        return_exceptions: bool,
    ) -> None:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidRequestError(
                f"prompts must be a list of prompts, got {type(prompts).__name__}", param="prompts"
            )
        self.ctx = ctx
        self.return_exceptions = return_exceptions
        self.outcomes: list[Outcome | None] = [None] * len(prompts)
        self.handles: dict[int, RequestHandle] = {}
        self.error: BaseException | None = None
        params_list = _params_list(len(prompts), params)
        self.progress = BatchProgress(progress, len(prompts))
        try:
            for i, (prompt, item) in enumerate(zip(prompts, params_list, strict=True)):
                try:
                    self.handles[i] = ctx.add_request(prompt, item)
                except InvalidRequestError as exc:  # this prompt only; ContextClosedError is not
                    self.settle(i, exc)
                    if self.error is not None:
                        break
        except BaseException:
            self.cancel_pending()
            self.progress.close()
            raise
        self.index_of = {h.future: i for i, h in self.handles.items()}

    @property
    def pending(self) -> list[concurrent.futures.Future[Completion]]:
        """Futures of the requests without an outcome yet."""
        return [h.future for i, h in self.handles.items() if self.outcomes[i] is None]

    def settle(self, index: int, outcome: Outcome) -> None:
        """Record a prompt's outcome; the first error ends the batch unless it is kept."""
        self.outcomes[index] = outcome
        self.progress.advance(outcome)
        if isinstance(outcome, BaseException) and not self.return_exceptions:
            self.error = self.error or outcome

    def settle_future(self, future: concurrent.futures.Future[Completion]) -> None:
        """Record the outcome of a finished future."""
        index = self.index_of[future]
        if self.outcomes[index] is not None:
            return
        if future.cancelled():
            self.settle(index, concurrent.futures.CancelledError(f"prompt {index} was cancelled"))
            return
        exc = future.exception()
        self.settle(index, exc if exc is not None else future.result())

    def cancel_pending(self) -> list[concurrent.futures.Future[Completion]]:
        """Cancel every request without an outcome; return their futures."""
        handles = [h for i, h in self.handles.items() if self.outcomes[i] is None]
        for handle in handles:
            handle.cancel()
        return [h.future for h in handles]

    def results(self) -> list[Outcome]:
        """The outcomes in input order, or raise the error that ended the batch."""
        self.progress.close()
        if self.error is not None:
            raise self.error
        return [o for o in self.outcomes if o is not None]


def _step_manual(ctx: BatchHost) -> bool:
    """Run one step if the caller may drive ``ctx``; False if another thread drives it."""
    if not ctx.is_manual:
        return False
    try:
        ctx.process()
    except (LoopOwnershipError, ContextClosedError):
        return False
    return True


def _wait_sync(
    batch: _Batch,
    futures: Sequence[concurrent.futures.Future[Completion]],
    *,
    stop_on_error: bool,
    timeout: float | None = None,
) -> None:
    """Wait for ``futures`` (driving a manual context's loop here) and settle them."""
    is_manual = True
    deadline = None if timeout is None else time.monotonic() + timeout
    waiting = list(futures)
    while waiting and not (stop_on_error and batch.error is not None):
        if deadline is not None and time.monotonic() > deadline:
            return
        if is_manual:
            is_manual = _step_manual(batch.ctx)
        if not is_manual:
            concurrent.futures.wait(
                waiting, timeout=_REFRESH_S, return_when=concurrent.futures.FIRST_COMPLETED
            )
        for future in waiting:
            if future.done():
                batch.settle_future(future)
        waiting = [f for f in waiting if not f.done()]
        batch.progress.refresh()


@overload
def generate(
    ctx: BatchHost,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    progress: bool | None = None,
    return_exceptions: Literal[False] = False,
) -> list[Completion]: ...
@overload
def generate(
    ctx: BatchHost,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    progress: bool | None = None,
    return_exceptions: bool,
) -> list[Completion | BaseException]: ...
def generate(
    ctx: BatchHost,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    progress: bool | None = None,
    return_exceptions: bool = False,
) -> list[Completion] | list[Completion | BaseException]:
    """Run every prompt through ``ctx`` at once and return the completions in input order.

    Every prompt is submitted before any is waited for, so the engine batches them. On a
    manual context (``autostart=False``) the loop is driven from this thread.
    Interrupting the call (Ctrl-C) cancels the requests still running.

    Args:
        ctx: the context.
        prompts: text prompts or token-id lists.
        params: one :class:`SamplingParams` for all prompts, or one per prompt.
            ``None`` means ``SamplingParams()``.
        progress: ``True`` shows a ``tqdm.auto`` progress bar; ``False`` never; ``None``
            (default) shows one if tqdm is installed and the batch runs longer than
            2 seconds.
        return_exceptions: put each prompt's error in its place in the result list instead
            of raising it.

    Returns:
        One :class:`Completion` per prompt (or, with ``return_exceptions=True``, the
        exception that prompt raised).

    Raises:
        InvalidParameterError: ``params`` has not one entry per prompt, or ``progress=True``
            without tqdm.
        InvalidRequestError: ``prompts`` is not a sequence of prompts; or, without
            ``return_exceptions``, a prompt cannot be submitted (e.g.
            :class:`ContextLengthError`). The requests already submitted are cancelled.
        RequestFailedError: without ``return_exceptions``, a request failed while running;
            the others were cancelled first.
        ContextClosedError: the context is closed.
    """
    batch = _Batch(ctx, prompts, params, progress, return_exceptions)
    try:
        _wait_sync(batch, batch.pending, stop_on_error=True)
    except BaseException:
        batch.cancel_pending()
        batch.progress.close()
        raise
    if batch.error is not None:
        _wait_sync(batch, batch.cancel_pending(), stop_on_error=False, timeout=_SETTLE_TIMEOUT_S)
    return batch.results()


@overload
async def agenerate(
    ctx: BatchHost,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    progress: bool | None = None,
    return_exceptions: Literal[False] = False,
) -> list[Completion]: ...
@overload
async def agenerate(
    ctx: BatchHost,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    progress: bool | None = None,
    return_exceptions: bool,
) -> list[Completion | BaseException]: ...
async def agenerate(
    ctx: BatchHost,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    progress: bool | None = None,
    return_exceptions: bool = False,
) -> list[Completion] | list[Completion | BaseException]:
    """Async twin of :func:`generate`, for a running event loop (Jupyter's included).

    Cancelling the awaiting task cancels the requests still running. A manual context
    (``autostart=False``) is driven from the event loop's thread, one step between awaits.

    Args:
        ctx: the context.
        prompts: text prompts or token-id lists.
        params: one :class:`SamplingParams` for all prompts, or one per prompt.
        progress: as in :func:`generate`.
        return_exceptions: as in :func:`generate`.

    Returns:
        One :class:`Completion` (or exception) per prompt, in input order.

    Raises:
        InvalidParameterError: ``params`` has not one entry per prompt.
        InvalidRequestError: as in :func:`generate`.
        RequestFailedError: as in :func:`generate`.
        ContextClosedError: the context is closed.
    """
    batch = _Batch(ctx, prompts, params, progress, return_exceptions)
    try:
        await _wait_async(batch, batch.pending, stop_on_error=True)
    except BaseException:
        batch.cancel_pending()
        batch.progress.close()
        raise
    if batch.error is not None:
        await _wait_async(
            batch, batch.cancel_pending(), stop_on_error=False, timeout=_SETTLE_TIMEOUT_S
        )
    return batch.results()


async def _wait_async(
    batch: _Batch,
    futures: Sequence[concurrent.futures.Future[Completion]],
    *,
    stop_on_error: bool,
    timeout: float | None = None,
) -> None:
    """Await ``futures`` without blocking the event loop (stepping a manual context)."""
    is_manual = True
    deadline = None if timeout is None else time.monotonic() + timeout
    wrapped = {asyncio.wrap_future(f): f for f in futures}
    for wrapper in wrapped:
        wrapper.add_done_callback(_retrieve)
    pending: set[asyncio.Future[Completion]] = set(wrapped)
    while pending and not (stop_on_error and batch.error is not None):
        if deadline is not None and time.monotonic() > deadline:
            return
        if is_manual:
            is_manual = _step_manual(batch.ctx)
        if is_manual:
            await asyncio.sleep(0)
            done = {f for f in pending if f.done()}
        else:
            done, _ = await asyncio.wait(
                pending, timeout=_REFRESH_S, return_when=asyncio.FIRST_COMPLETED
            )
        pending -= done
        for future in done:
            batch.settle_future(wrapped[future])
        batch.progress.refresh()


def _retrieve(future: asyncio.Future[Completion]) -> None:
    """Mark a wrapper's exception as seen: the batch reads it from the original future."""
    if not future.cancelled():
        future.exception()
