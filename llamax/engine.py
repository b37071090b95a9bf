"""The run loop: one thread at a time owns the backend and the scheduler.

Other threads only touch the inbox (new requests) and the cancel queue, under one lock;
both are drained at the start of every step. A step is::

    plan = scheduler.schedule() -> status = backend.decode(plan) -> sample rows
         -> result = scheduler.update(plan, sampled) -> publish (outside every lock)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from enum import Enum
from typing import Any, TypeVar

from .backend.base import Backend, DecodeStatus
from .errors import ContextClosedError, EngineError, LoopOwnershipError
from .sampling import BatchLogitsProcessor, sample_plan
from .scheduler import Scheduler, StepPlan, StepResult
from .sequence import Request

__all__ = ["Engine", "EngineState"]

_log = logging.getLogger("llamax")
T = TypeVar("T")

_MAX_SHRINKS_PER_STEP = 64
_MAX_STALLED_STEPS = 16


class EngineState(Enum):
    """Lifecycle of an engine (and its context)."""

    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"


class Engine:
    """Owns a backend, a scheduler and (optionally) the background loop thread."""

    def __init__(
        self,
        backend: Backend,
        *,
        autostart: bool = True,
        prefix_cache: bool = True,
        batch_processor: BatchLogitsProcessor | None = None,
    ) -> None:
        self.backend = backend
        self._batch_processor = batch_processor
        self.scheduler = Scheduler(backend, prefix_cache=prefix_cache)
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        self._live: dict[int, Request] = {}  # every submitted request until it is settled
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._state = EngineState.RUNNING
        self._failure: BaseException | None = None
        self._step_lock = threading.Lock()
        self._teardown_lock = threading.Lock()
        self._torn_down = False
        self._stalled_steps = 0
        self._draining = False
        self.num_steps = 0
        self._thread: threading.Thread | None = None
        if autostart:
            self._thread = threading.Thread(target=self._run, name="llamax-engine", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ any thread
    @property
    def state(self) -> EngineState:
        """The current lifecycle state."""
        return self._state

    @property
    def is_background(self) -> bool:
        """Whether a background thread drives the loop."""
        return self._thread is not None

    @property
    def num_unsettled(self) -> int:
        """Submitted requests whose future has not been resolved yet."""
        with self._lock:
            return len(self._live)

    def submit(self, request: Request) -> None:
        """Enqueue a validated request; it is admitted at the next step."""
        with self._lock:
            self._raise_if_not_running()
            self._inbox.append(request)
            self._live[id(request)] = request
            self._wakeup.notify()

    def cancel(self, request: Request) -> None:
        """Queue a cancellation; applied at the next step boundary."""
        with self._lock:
            if self._state is EngineState.RUNNING or self._state is EngineState.CLOSING:
                self._cancels.append(request)
                self._wakeup.notify()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the thread that owns the backend, between steps, and return its result.

        Raises:
            ContextClosedError: the engine is closed (or closes before ``fn`` ran).
        """
        if self._thread is None or self._thread is threading.current_thread():
            with self._step_lock:
                with self._lock:
                    self._raise_if_not_running()
                return fn()
        future: Future[T] = Future()
        with self._lock:
            self._raise_if_not_running()
            self._calls.append((fn, future))
            self._wakeup.notify()
        return future.result()

    def has_work(self) -> bool:
        """Whether any request is queued, running or waiting to be cancelled."""
        with self._lock:
            return bool(self._inbox or self._cancels) or self.scheduler.has_work

    def process(self) -> bool:
        """Run one step in the calling thread; return whether anything was computed.

        Raises:
            LoopOwnershipError: the background loop runs, or another thread is in process().
            ContextClosedError: the engine is closed.
            EngineError: llama.cpp failed; every pending request failed and the engine closed.
        """
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise LoopOwnershipError(
                "process() cannot be called while the background loop runs; "
                "create the context with autostart=False to drive it yourself"
            )
        if not self._step_lock.acquire(blocking=False):
            raise LoopOwnershipError("process() is already running in another thread")
        try:
            if self._state in (EngineState.CLOSED, EngineState.FAILED):
                raise ContextClosedError(f"the context is {self._state.value}")
            return self._step_or_fail()
        finally:
            self._step_lock.release()

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop accepting requests, then cancel (default) or finish pending ones, and free.

        With ``drain=True`` pending requests run to completion first (in the background
        loop, or in this thread for a manual context). Idempotent.
        """
        with self._lock:
            if self._state is EngineState.RUNNING:
                self._state = EngineState.CLOSING
            self._draining = drain
            self._wakeup.notify()
        thread = self._thread
        if thread is not None and thread is threading.current_thread():
            return  # called from a callback on the loop thread: the loop tears down on exit
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError("the engine loop did not stop in time")
        else:
            with self._step_lock:
                while drain and self._state is EngineState.CLOSING and self.has_work():
                    self._step_or_fail()
        self._teardown()

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        while True:
            with self._lock:
                while not (
                    self._inbox or self._cancels or self._calls or self.scheduler.has_work
                ) and (self._state is EngineState.RUNNING):
                    self._wakeup.wait()
                stop = self._state is not EngineState.RUNNING and not (
                    self._draining and (self._inbox or self.scheduler.has_work)
                )
            if stop:
                break
            with self._step_lock:
                try:
                    self._step_or_fail()
                except EngineError:
                    return  # every request has its error; the engine is torn down
        self._teardown()

    def _step_or_fail(self) -> bool:
        try:
            return self._step()
        except BaseException as exc:
            error = (
                exc if isinstance(exc, EngineError) else EngineError(f"engine step failed: {exc!r}")
            )
            if error is not exc:
                error.__cause__ = exc
            self._fail(error)
            if error is exc:
                raise
            raise error from exc

    def _step(self) -> bool:
        result = self._drain_queues()
        plan = self.scheduler.schedule()
        if not plan.is_empty:
            plan = self._decode(plan)
        if not plan.is_empty:
            rows = [
                (seq, item, forks)
                for seq, item, forks in zip(plan.sequences, plan.items, plan.forks, strict=True)
                if item.row is not None
            ]
            sampled = sample_plan(self.backend, rows, self._batch_processor)
            for request, error in sampled.failed.values():
                self.scheduler.fail(request, error, result)
            step = self.scheduler.update(plan, sampled.tokens, sampled.logprobs)
            result.events += step.events
            result.finished += step.finished
            result.failed += step.failed
            self.num_steps += 1
        self._publish(result)
        return not plan.is_empty

    def _decode(self, plan: StepPlan) -> StepPlan:
        """Decode ``plan``, shrinking it on NO_SLOT; return what was actually computed."""
        for _ in range(_MAX_SHRINKS_PER_STEP):
            status = self.backend.decode(plan.items)
            if status == DecodeStatus.OK:
                self._stalled_steps = 0
                return plan
            if status != DecodeStatus.NO_SLOT:
                raise EngineError(f"llama_decode failed with status {status}")
            _log.debug("llama_decode found no KV slot for %d tokens; shrinking", plan.num_tokens)
            plan = self.scheduler.shrink(plan)
            if plan.is_empty:
                break
        self._stalled_steps += 1
        if self._stalled_steps > _MAX_STALLED_STEPS:
            raise EngineError("llama_decode found no KV slot even for a single token")
        return StepPlan()

    def _drain_queues(self) -> StepResult:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            calls, self._calls = self._calls, []
        result = StepResult()
        for request in inbox:
            self.scheduler.add(request)
        for request in cancels:
            self.scheduler.abort(request, result)
        for fn, future in calls:
            try:
                future.set_result(fn())
            except BaseException as exc:  # delivered to the caller's thread
                future.set_exception(exc)
        return result

    # ------------------------------------------------------------------ endings
    def _publish(self, result: StepResult) -> None:
        by_request: dict[int, tuple[Request, list[object]]] = {}
        for request, event in result.events:
            by_request.setdefault(id(request), (request, []))[1].append(event)
        for request, events in by_request.values():
            request.handle._publish(events)
        with self._lock:  # forget first: a settled future may wake a leak check at once
            for request in result.finished:
                self._live.pop(id(request), None)
            for request, _ in result.failed:
                self._live.pop(id(request), None)
        for request in result.finished:
            _settle(request, completion=True)
        for request, error in result.failed:
            _settle(request, error=error)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._state = EngineState.FAILED
            self._failure = error
            self._inbox, self._cancels = [], []
            live = list(self._live.values())
        try:
            self.scheduler.fail_all(error)
        except BaseException:  # the backend may be unusable; still reach every future
            _log.exception("could not release sequences after an engine failure")
        result = StepResult(failed=[(request, error) for request in live])
        self._publish(result)
        self._teardown()

    def _teardown(self) -> None:
        with self._teardown_lock:
            if self._torn_down:
                return
            self._torn_down = True
        with self._lock:
            inbox, self._inbox = self._inbox, []
            self._cancels = []
            calls, self._calls = self._calls, []
        for _, future in calls:
            future.set_exception(ContextClosedError("the context closed before the call ran"))
        result = StepResult()
        for request in inbox:
            self.scheduler.add(request)
        for request in {id(s.request): s.request for s in self.scheduler.all_sequences()}.values():
            self.scheduler.abort(request, result)
        self._publish(result)
        self.backend.close()
        with self._lock:
            if self._state is not EngineState.FAILED:
                self._state = EngineState.CLOSED

    def _raise_if_not_running(self) -> None:
        if self._state is EngineState.FAILED:
            raise ContextClosedError("the context failed and is closed") from self._failure
        if self._state is not EngineState.RUNNING:
            raise ContextClosedError("cannot add a request: the context has been closed")


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
