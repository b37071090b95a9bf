"""One step of the engine, and what it publishes.

:class:`Stepper` runs a step on the thread that holds the step lock::

    plan = scheduler.schedule() -> backend.decode(plan) (shrunk on NO_SLOT) -> sample rows
         -> scheduler.update(plan, sampled) -> learn the step's cost and threads

and composes :class:`~llamax.stats.ContextStats` from each component's own group.
:func:`deliver` and :func:`settle` hand a step's events and endings to the requests'
handles and futures; the loop calls them outside every engine lock.
"""

from __future__ import annotations

import logging
from concurrent.futures import InvalidStateError

from ..backend.base import Backend, DecodeStatus, GraphSampling, ImageHost, LoraHost
from ..errors import EngineError, RequestFailedError
from ..results import TokenLogprob
from ..stats import ContextStats
from .plan import StepPlan, StepResult, split_images
from .sched.sampling import (
    BatchLogitsProcessor,
    graph_items,
    keep_interrupt,
    sample_plan,
    sample_row,
)
from .sched.scheduler import Scheduler
from .sequence import Request
from .sequence import Sequence as Seq
from .timing.step_budget import StepFeatures
from .timing.threads import ThreadAdapter

__all__ = ["Stepper", "deliver", "settle"]

_log = logging.getLogger("llamax")

_MAX_SHRINKS_PER_STEP = 64
_MAX_STALLED_STEPS = 16


class Stepper:
    """Runs steps over a scheduler and a backend.

    Args:
        backend: What decodes and samples.
        scheduler: What plans and records each step.
        threads: The thread count under contention.
        batch_processor: A logits hook over a whole step (its steps stay whole, undrafted).
    """

    def __init__(
        self,
        backend: Backend,
        scheduler: Scheduler,
        threads: ThreadAdapter,
        batch_processor: BatchLogitsProcessor | None,
    ) -> None:
        self._backend = backend
        self._scheduler = scheduler
        self.threads = threads
        self._batch_processor = batch_processor
        # backend sampling: plain rows sampled in the decode (a batch hook reads every row)
        self._in_graph = (
            batch_processor is None
            and isinstance(backend, GraphSampling)
            and backend.samples_in_graph
        )
        self._lora = backend if isinstance(backend, LoraHost) else None  # checked once: a
        # runtime Protocol check walks every method, too slow for each step
        self._images = backend if isinstance(backend, ImageHost) else None
        self._stalled_steps = 0
        self.num_steps = 0
        """Steps that computed something."""

    def run(self, result: StepResult) -> bool:
        """Plan, decode, sample and record one step into ``result``; whether it was stuck
        (it planned nothing and ended nothing: repeat it only after news)."""
        scheduler = self._scheduler
        plan = scheduler.schedule(result)
        is_stuck = plan.is_empty and not (result.events or result.finished or result.failed)
        # images first, a decode each (no batch mixes ids and embeddings); a batch logits
        # processor sees the rest of the step at once, so it stays whole
        images, plan = split_images(plan)
        whole = self._batch_processor is not None and not scheduler.reproducible
        rest = [plan] if whole else scheduler.planner.split(plan)
        for part in [*images, *rest]:
            part = part.without_ended()  # a request that failed in an earlier part is gone
            if not part.is_empty:
                part, features, started, decoded = self._decode(part, result)
            if part.is_empty:
                continue
            sampled = sample_plan(self._backend, part.sampled_entries(), self._batch_processor)
            for request, error in sampled.failed.values():
                scheduler.fail(request, error, result)
            scheduler.update(part, sampled.tokens, sampled.logprobs, result, self._verify)
            seconds = scheduler.clock() - started
            scheduler.observe(part, features, seconds)
            # threads are judged by the decode alone: sampling, grammars and logits
            # callbacks run on this thread, and a slow one is not another process
            self.threads.observe(features, decoded - started)
            result.computed = True
        if result.computed:
            self.num_steps += 1
        return is_stuck

    def _verify(self, seq: Seq, row: int) -> tuple[int, TokenLogprob | None]:
        return sample_row(self._backend, seq, row)

    def _decode(
        self, plan: StepPlan, result: StepResult
    ) -> tuple[StepPlan, StepFeatures, float, float]:
        """Decode ``plan``, shrinking it on NO_SLOT; return what was actually computed, its
        cost features, and when its decode started and ended. An image's decode that fails
        fails its request alone (into ``result``)."""
        scheduler = self._scheduler
        if self._lora is not None:
            adapters = {entry.seq.request.adapters for entry in plan.entries}
            if len(adapters) != 1:  # the scheduler plans each step within one set
                raise EngineError(f"a step mixes LoRA adapter sets: {sorted(adapters)}")
            self._lora.set_adapters(adapters.pop())
        for _ in range(_MAX_SHRINKS_PER_STEP):
            features, started = scheduler.planner.features(plan), scheduler.clock()
            if plan.entries[0].item.embeddings is not None:
                status = self._decode_image(plan, result)
                if status is None:
                    return StepPlan(), StepFeatures(), 0.0, 0.0
            elif self._in_graph:
                status = self._backend.decode(graph_items(self._backend, plan.entries))
            else:
                status = self._backend.decode(plan.items)
            scheduler.kv.decoded(status)
            if status == DecodeStatus.OK:
                self._stalled_steps = 0
                return plan, features, started, scheduler.clock()
            if status != DecodeStatus.NO_SLOT:
                raise EngineError(f"llama_decode failed with status {status}")
            _log.debug("llama_decode found no KV slot for %d tokens; shrinking", plan.num_tokens)
            plan = scheduler.shrink(plan)
            if plan.is_empty:
                break
        self._stalled_steps += 1
        if self._stalled_steps > _MAX_STALLED_STEPS:
            raise EngineError("llama_decode found no KV slot even for a single token")
        return StepPlan(), StepFeatures(), 0.0, 0.0

    def _decode_image(self, plan: StepPlan, result: StepResult) -> int | None:
        """Decode the one image entry of ``plan``: OK or NO_SLOT, or None when it failed
        (its request failed into ``result``: llama.cpp restores the memory on an error)."""
        (entry,) = plan.entries
        if self._images is None:
            raise EngineError("a step holds an image, but the backend reads none")
        try:
            status = self._images.decode_embeddings(plan.items, non_causal=entry.item.non_causal)
        except Exception as exc:
            error = RequestFailedError(f"decoding the image failed: {exc!r}")
            error.__cause__ = exc
        else:
            if status in (DecodeStatus.OK, DecodeStatus.NO_SLOT):
                return status
            self._scheduler.kv.decoded(status)
            error = RequestFailedError(f"decoding the image failed with status {status}")
        self._scheduler.fail(entry.seq.request, error, result)
        return None

    def stats(self, state: str) -> ContextStats:
        """The stats now (the engine in ``state``): each group is its component's own."""
        s = self._scheduler
        return ContextStats(
            state=state,
            num_unsettled=0,  # the loop's to count
            num_sessions=s.sessions.num_open,
            num_steps=self.num_steps,
            sequences=s.stats(),
            kv=s.layout.stats(),
            prefix=s.prefix.stats(),
            prefix_ram=s.prefix.tier_stats("ram"),
            prefix_disk=s.prefix.tier_stats("disk"),
            checkpoints=s.kv.checkpoint_stats(),
            threads=self.threads.stats(),
            speculation=s.drafts.stats(),
        )


def deliver(result: StepResult) -> None:
    """Hand each request its events of the step, in order (never under an engine lock)."""
    by_request: dict[str, tuple[Request, list[object]]] = {}
    for request, event in result.events:
        by_request.setdefault(request.request_id, (request, []))[1].append(event)
    for request, events in by_request.values():
        request.handle._publish(events)


def settle(result: StepResult) -> None:
    """Settle the futures of the requests that finished or failed in the step (never
    under an engine lock: a done-callback may call back into the context)."""
    for request in result.finished:
        _settle(request, completion=True)
    for request, error in result.failed:
        _settle(request, error=error)


def _settle(
    request: Request, *, completion: bool = False, error: BaseException | None = None
) -> None:
    future = request.handle.future
    try:
        if error is not None:
            future.set_exception(error)
        elif completion:
            future.set_result(request.completion())
    except InvalidStateError:  # the user cancelled the future itself; nothing to deliver
        pass
    except BaseException as exc:  # a done-callback raised past Future's own `except Exception`
        _log.exception("a done-callback of request %s raised", request.request_id)
        keep_interrupt(exc)  # process() re-raises a KeyboardInterrupt after the step
