"""The run loop: one thread at a time owns the backend and the scheduler.

Other threads only touch the inbox (new requests), the cancel queue and the operation queue
(:mod:`llamax.engine.kv.kvops`), under one lock; all three are drained at the start of every step.
A step is::

    plan = scheduler.schedule() -> status = backend.decode(plan) -> sample rows
         -> scheduler.update(plan, sampled) -> snapshot stats -> publish

The one-owner rule: the step lock is held while the scheduler or the backend changes, and
never while events are delivered or futures settled. So a done-callback may call any public
``Context`` method (``add_request``, ``stats``, ``clear_cache``, ``session``, ``close``).
What it may not do is *wait* on the loop thread for a request that is still running: that
wait could never end, so it raises :class:`~llamax.errors.DeadlockError`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, TypeVar

from ..backend.base import Backend, ComputeThreads
from ..config import EngineConfig
from ..errors import (
    ContextClosedError,
    DeadlockError,
    EngineError,
    InvalidRequestError,
    LoopOwnershipError,
)
from ..stats import ContextStats
from .kv.kvops import Audit, ClearCache, KVOp, ReadSession, ReleaseSession, SaveSession
from .phase import EngineState, LoopPhase, next_phase
from .plan import StepResult
from .sched.sampling import BatchLogitsProcessor, pop_interrupt
from .sched.scheduler import Scheduler
from .sequence import Request
from .step import Stepper, deliver, settle
from .timing.calibration import apply as apply_calibration
from .timing.calibration import calibrate as calibrate_backend
from .timing.threads import ThreadAdapter

__all__ = ["Engine", "EngineState"]

_log = logging.getLogger("llamax")
T = TypeVar("T")

# what may still run while the context closes: operations that free room or only read
_WHILE_CLOSING = (ReleaseSession, ReadSession, SaveSession, ClearCache, Audit)


class Engine:
    """Owns a backend, a scheduler and (optionally) the background loop thread."""

    def __init__(
        self,
        backend: Backend,
        config: EngineConfig | None = None,
        *,
        autostart: bool = True,
        batch_processor: BatchLogitsProcessor | None = None,
    ) -> None:
        config = config if config is not None else EngineConfig()
        self.backend = backend
        self._batch_processor = batch_processor
        # the batch hook sees one row per sequence, so with one installed nobody drafts
        self.scheduler = Scheduler(backend, config, allow_drafts=batch_processor is None)
        try:
            self.calibration = calibrate_backend(backend) if config.calibrate else None
        except BaseException:
            self._close_tiers()  # the directory is free for the next context
            raise
        finally:
            if config.calibrate:  # it may have decoded on this thread, which may not again
                self._release_threads()
        """This machine's measured step costs the scheduler started from, or None."""
        if self.calibration is not None:
            apply_calibration(
                self.calibration,
                self.scheduler.step_cost,
                self.scheduler.drafts.planner.decode_cost,
            )
        threads = ThreadAdapter(
            backend,
            adapt=config.adapt_threads,
            waste=self.scheduler.step_cost.waste,
            calibration=self.calibration,
        )
        self.stepper = Stepper(backend, self.scheduler, threads, batch_processor)
        """Runs each step and composes the stats."""
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        self._ops: list[tuple[KVOp[Any], Future[Any]]] = []
        self._live: dict[str, Request] = {}  # every submitted request until it is settled
        self._phase = LoopPhase.RUNNING  # changed by _move only, under _lock
        self._failure: BaseException | None = None  # what failed the engine (FAILED phases)
        self._step_lock = threading.Lock()
        self._local = threading.local()  # .in_step / .stepping, per thread
        self._teardown_lock = threading.Lock()
        self._is_stuck = False  # the last step had nothing to do: wait for news, not spin
        self._close_error: BaseException | None = None  # backend.close raised; close() says so
        self._snapshot = self.stepper.stats(self._phase.state.value)
        self._thread: threading.Thread | None = None
        if autostart:
            self._thread = threading.Thread(target=self._run, name="llamax-engine", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ any thread
    @property
    def state(self) -> EngineState:
        """The current lifecycle state."""
        return self._phase.state

    @property
    def is_background(self) -> bool:
        """Whether a background thread drives the loop."""
        return self._thread is not None

    def stats(self) -> ContextStats:
        """The counters published after the latest step or operation, with the live state."""
        with self._lock:
            return dataclasses.replace(
                self._snapshot, state=self._phase.state.value, num_unsettled=len(self._live)
            )

    def submit(self, request: Request) -> None:
        """Enqueue a validated request; it is admitted at the next step.

        Raises:
            ContextClosedError: the engine is closed.
            InvalidRequestError: another unsettled request has the same id.
        """
        with self._lock:
            self._raise_if_not_running()
            if request.request_id in self._live:
                raise InvalidRequestError(
                    f"request id {request.request_id!r} is already in use by an unfinished request",
                    param="request_id",
                )
            self._inbox.append(request)
            self._live[request.request_id] = request
            self._wakeup.notify()

    def cancel(self, request: Request) -> None:
        """Queue a cancellation; applied at the next step boundary."""
        with self._lock:
            if self._phase.state in (EngineState.RUNNING, EngineState.CLOSING):
                self._cancels.append(request)
                self._wakeup.notify()

    def run(self, op: KVOp[T]) -> T:
        """Apply a KV operation on the thread that owns the scheduler, between steps.

        While the engine closes, only operations that free room or read
        (``ReleaseSession``, ``ReadSession``, ``SaveSession``, ``ClearCache``, ``Audit``)
        still run. The caller holds no engine lock while it waits.

        Raises:
            ContextClosedError: the engine is closed (or closes before ``op`` ran).
            DeadlockError: called from inside a step (a logits processor).
        """
        if getattr(self._local, "in_step", False):
            raise DeadlockError("KV operations cannot run inside a step (a logits processor)")
        if self._thread is None or self._thread is threading.current_thread():
            result = StepResult()
            try:
                with self._step_lock:
                    with self._lock:
                        self._raise_if_not_running(op)
                        inbox, self._inbox = self._inbox, []
                    for request in inbox:  # an op may concern a request submitted just before
                        self.scheduler.add(request)
                    try:
                        value = self.scheduler.apply(op, result)
                    finally:  # an op that raises may have changed things (clear_cache)
                        self._publish_snapshot()
            finally:
                self._publish(result)
            return value
        future: Future[T] = Future()
        with self._lock:
            self._raise_if_not_running(op)
            self._ops.append((op, future))
            self._wakeup.notify()
        return future.result()

    def has_work(self) -> bool:
        """Whether any request is queued, running or waiting to be cancelled."""
        with self._lock:
            return bool(self._inbox or self._cancels) or self.scheduler.has_work

    def check_wait(self) -> None:
        """Raise if the calling thread is the one that would have to make progress.

        Raises:
            DeadlockError: this thread runs the loop (a callback, a processor).
        """
        if getattr(self._local, "stepping", False):
            raise DeadlockError(
                "cannot wait for a request on the engine's loop thread (inside a callback or "
                "a logits processor): the loop cannot advance while it waits"
            )

    def drive(self) -> bool:
        """For waiters on a manual context: run one step here unless another thread does.

        Raises:
            DeadlockError: the caller is inside a step or one of its callbacks.
        """
        self.check_wait()
        try:
            return self.process()
        except DeadlockError:
            raise
        except (LoopOwnershipError, ContextClosedError, EngineError):
            return False  # someone else steps, or the failure reached every future

    def process(self) -> bool:
        """Run one step in the calling thread; return whether anything was computed.

        Raises:
            LoopOwnershipError: the background loop runs, or another thread is in process().
            DeadlockError: called from inside a step or a callback of one.
            ContextClosedError: the engine is closed.
            EngineError: llama.cpp failed; every pending request failed and the engine closed.
        """
        if self._phase.state in (EngineState.CLOSED, EngineState.FAILED):
            raise ContextClosedError(f"the context is {self._phase.state.value}")
        if self._thread is not None:
            raise LoopOwnershipError(
                "process() cannot be called while the background loop runs; "
                "create the context with autostart=False to drive it yourself"
            )
        self.check_wait()
        if self._phase.is_torn_down:
            raise ContextClosedError(f"the context is {self._phase.state.value}")
        if not self._step_lock.acquire(blocking=False):
            raise LoopOwnershipError("process() is already running in another thread")
        if self._phase.is_torn_down or self._phase is LoopPhase.FAILED:
            self._step_lock.release()
            raise ContextClosedError(f"the context is {self._phase.state.value}")
        computed = self._step_locked_then_publish()
        with self._lock:
            phase = self._phase
            finished = phase in (LoopPhase.CLOSING, LoopPhase.TEARING_DOWN) or (
                phase is LoopPhase.DRAINING and not (self._inbox or self.scheduler.has_work)
            )
            left = bool(self._inbox) or self.scheduler.has_work
        if computed and not left:  # this caller's thread may not step again
            self._release_threads()
        if finished:  # close() was called inside this step, or a drain has just ended
            self._teardown()
        interrupt = pop_interrupt()
        if interrupt is not None:  # Ctrl-C in a logits processor: its request failed alone
            raise interrupt
        return computed

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop accepting requests, then cancel (default) or finish pending ones, and free.

        With ``drain=True`` pending requests run to completion first (in the background
        loop, or in this thread for a manual context). Then every open session is released
        and the backend is freed. Idempotent.

        Called on the loop thread (a done-callback, or a logits processor of the background
        loop) it only marks the engine closing: the loop tears down when it gets back to
        its top. Called inside a step of a manual context (a logits processor), it does the
        same, and the step's ``process()`` tears down before it returns.

        This waits for the loop thread to leave the step or callback it is in. A user
        callback that never returns keeps it waiting: with ``timeout`` it raises
        ``TimeoutError`` instead, the engine stays closed to new work, and the loop thread
        frees the native memory itself once the callback returns.

        Raises:
            TimeoutError: the loop (or a manual drain) did not finish within ``timeout``.
        """
        with self._lock:
            if self._phase in (LoopPhase.RUNNING, LoopPhase.CLOSING, LoopPhase.DRAINING):
                self._move(LoopPhase.DRAINING if drain else LoopPhase.CLOSING)
            self._wakeup.notify_all()
        if getattr(self._local, "in_step", False):
            return  # inside a step: the step ends first; its process() (or loop) tears down
        thread = self._thread
        if thread is not None and thread is threading.current_thread():
            return  # called from a callback on the loop thread: the loop tears down on exit
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(
                    "the engine loop did not stop in time (a callback or logits processor "
                    "has not returned); it frees the context when it does"
                )
        elif drain:
            try:
                self._drain_here(timeout)
            finally:
                self._release_threads()  # it stepped on this thread
        self._teardown()
        with self._lock:
            error, self._close_error = self._close_error, None
        if error is not None:  # the backend failed to free itself (on whichever thread)
            raise error

    def _drain_here(self, timeout: float | None) -> None:
        """Step a manual context in this thread until nothing is left (``close(drain=True)``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._phase.state is EngineState.CLOSING and self.has_work():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("the context did not drain in time; close() again to cancel")
            if not self._step_lock.acquire(timeout=0.05):
                continue  # another thread steps (process() or a waiting handle)
            if self._phase.is_torn_down:  # another thread's teardown won the step lock first
                self._step_lock.release()
                return
            try:
                computed = self._step_locked_then_publish()
            except EngineError:
                return  # every request has its error; the engine is torn down
            if self._is_stuck:
                return  # what is left cannot finish: teardown cancels it
            if not computed:
                time.sleep(0.005)  # another thread's work settles first: do not spin

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        self._local.stepping = True
        released = True  # this thread keeps no compute workers yet
        while True:
            if not released and self._is_idle():
                self._release_threads()  # before waiting: an idle context slows no other
                released = True
            with self._lock:
                while self._is_idle():
                    self._wakeup.wait()
                stop = self._phase is not LoopPhase.RUNNING and not (
                    self._phase is LoopPhase.DRAINING and (self._inbox or self._can_step())
                )
            if stop:
                break
            self._step_lock.acquire()
            released = False
            try:
                self._step_locked_then_publish()
            except EngineError:
                return  # every request has its error; the engine is torn down
        self._teardown()

    def _is_idle(self) -> bool:
        """The loop has nothing to do until another thread submits, cancels, queues an
        operation or closes (call it holding ``_lock``, or as a hint without)."""
        return not (self._inbox or self._cancels or self._ops or self._can_step()) and (
            self._phase is LoopPhase.RUNNING
        )

    def _release_threads(self) -> None:
        """Give back the compute workers this thread keeps (:class:`ComputeThreads`): a
        thread that stops computing must not slow the threads that go on (GNU OpenMP
        throttles every barrier while more workers are pooled than there are CPUs)."""
        if isinstance(self.backend, ComputeThreads):
            try:
                self.backend.release_compute_threads()
            except Exception as exc:  # only a lost speed-up, never a request
                _log.debug("could not release compute threads: %r", exc)

    def _can_step(self) -> bool:
        """Whether a step could change anything without news from other threads: there is
        work, and the last step was not stuck (a step that planned nothing and ended
        nothing is repeated only after a submission, a cancel, an operation or a close)."""
        return self.scheduler.has_work and not self._is_stuck

    def _step_locked_then_publish(self) -> bool:
        """Step (the caller holds the step lock, released here), then publish unlocked."""
        was_stepping = getattr(self._local, "stepping", False)
        self._local.stepping = True
        try:
            try:
                result, error = self._step_safely()
            finally:
                self._step_lock.release()
            if error is not None:  # free the backend before a failed request settles:
                self._teardown()  # a thread it wakes finds the context closed and freed
            self._publish(result)
        finally:
            self._local.stepping = was_stepping
        if error is not None:
            raise error
        return result.computed

    def _step_safely(self) -> tuple[StepResult, EngineError | None]:
        pop_interrupt()  # one a former step's caller did not take (the background loop)
        self._local.in_step = True
        try:
            result, error = self._step(), None
        except BaseException as exc:
            error = (
                exc if isinstance(exc, EngineError) else EngineError(f"engine step failed: {exc!r}")
            )
            if error is not exc:
                error.__cause__ = exc
            result = self._fail_all(error)
        finally:
            self._local.in_step = False
        return result, error

    def _step(self) -> StepResult:
        result = self._drain_queues()
        self._is_stuck = self.stepper.run(result)
        self._publish_snapshot()
        return result

    def _drain_queues(self) -> StepResult:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            ops, self._ops = self._ops, []
        result = StepResult()
        for request in inbox:
            self.scheduler.add(request)
        for request in cancels:
            self.scheduler.abort(request, result)
        settled: list[tuple[Future[Any], Any, BaseException | None]] = []
        for op, future in ops:
            try:
                settled.append((future, self.scheduler.apply(op, result), None))
            except BaseException as exc:  # delivered to the caller's thread
                settled.append((future, None, exc))
        if settled:  # a caller whose operation returned sees its effect in stats()
            self._publish_snapshot()
        for future, value, error in settled:
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)
        return result

    def _publish_snapshot(self) -> None:
        snapshot = self.stepper.stats(self._phase.state.value)
        with self._lock:
            self._snapshot = snapshot

    # ------------------------------------------------------------------ endings
    def _publish(self, result: StepResult) -> None:
        """Deliver events and settle futures; never under an engine lock."""
        deliver(result)
        with self._lock:  # forget first: a settled future may wake a leak check at once
            for request in result.finished:
                self._forget(request)
            for request, _ in result.failed:
                self._forget(request)
        settle(result)

    def _forget(self, request: Request) -> None:
        if self._live.get(request.request_id) is request:
            del self._live[request.request_id]

    def _fail_all(self, error: EngineError) -> StepResult:
        with self._lock:
            torn_down = self._phase is LoopPhase.TEARING_DOWN
            self._move(LoopPhase.FAILED_TEARDOWN if torn_down else LoopPhase.FAILED)
            self._failure = error
            self._inbox, self._cancels = [], []
            live = list(self._live.values())
        try:
            self.scheduler.fail_all(error)
            self._publish_snapshot()  # before any future settles: a woken reader sees it
        except BaseException:  # the backend may be unusable; still reach every future
            _log.exception("could not release sequences after an engine failure")
        return StepResult(failed=[(request, error) for request in live])

    def _teardown(self) -> None:
        """Cancel what is left, release every session, free the backend; once, and never
        inside a step (the step lock is taken). Events are published afterwards, unlocked,
        so a done-callback that calls back into the context sees it closed."""
        result = StepResult()
        with self._teardown_lock:  # a second caller waits until the memory is freed
            with self._lock:  # from here run() refuses every operation
                if self._phase.is_torn_down:
                    return
                failed = self._phase is LoopPhase.FAILED
                self._move(LoopPhase.FAILED_TEARDOWN if failed else LoopPhase.TEARING_DOWN)
                inbox, self._inbox = self._inbox, []
                self._cancels = []
                ops, self._ops = self._ops, []
            for _, future in ops:
                future.set_exception(
                    ContextClosedError("the context closed before the operation ran")
                )
            with self._step_lock:  # a manual step in another thread ends first
                try:
                    for request in inbox:
                        self.scheduler.add(request)
                    requests = {
                        s.request.request_id: s.request for s in self.scheduler.all_sequences()
                    }
                    for request in requests.values():
                        self.scheduler.abort(request, result)
                    for session_id in self.scheduler.sessions.ids:
                        self.scheduler.apply(ReleaseSession(session_id), result)
                    self._publish_snapshot()
                except BaseException:
                    _log.exception("could not cancel pending requests while closing")
                try:
                    self.backend.close()  # waits for other threads' native calls to end
                except BaseException as exc:
                    _log.exception("the backend failed to close")
                    with self._lock:
                        self._close_error = exc
                finally:
                    self._close_tiers()
                    with self._lock:
                        if self._phase is LoopPhase.TEARING_DOWN:
                            self._move(LoopPhase.CLOSED)
        self._publish(result)

    def _close_tiers(self) -> None:
        """Release what the prefix tiers hold outside the process (the disk tier's directory)."""
        self.scheduler.prefix.close()

    def _move(self, phase: LoopPhase) -> None:
        """Change phase as :data:`~llamax.engine.phase.MOVES` allows; the caller holds
        ``_lock``."""
        self._phase = next_phase(self._phase, phase)

    def _raise_if_not_running(self, op: KVOp[Any] | None = None) -> None:
        """Raise unless the engine runs, or closes (not yet torn down) and ``op`` may still
        run then (``_WHILE_CLOSING``). The caller holds ``_lock``."""
        phase = self._phase
        if phase.state is EngineState.FAILED:
            raise ContextClosedError("the context failed and is closed") from self._failure
        if phase in (LoopPhase.CLOSING, LoopPhase.DRAINING) and isinstance(op, _WHILE_CLOSING):
            return
        if phase is not LoopPhase.RUNNING:
            raise ContextClosedError("the context has been closed")
