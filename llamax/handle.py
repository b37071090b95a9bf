"""The user's side of a request: a future, a sync stream and an async stream in one object."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from concurrent.futures import CancelledError, Future
from concurrent.futures import wait as wait_futures
from typing import Any

from .results import Completion, TokenEvent

__all__ = ["RequestHandle"]

_END = object()


class RequestHandle:
    """A submitted request. Thread-safe; returned at once by ``Context.add_request``.

    - ``handle.future`` is a :class:`concurrent.futures.Future` of the :class:`Completion`;
      ``handle.result(timeout)`` waits for it.
    - ``for event in handle`` streams :class:`TokenEvent` s; ``async for`` does the same in
      an event loop, and ``await handle`` gives the completion.
    - ``handle.cancel()`` works from any thread at any stage. The request then completes
      with ``finish_reason == "cancelled"`` and the text produced so far.

    The event stream can be consumed once, by one consumer (sync or async). Events are
    buffered until consumed, so starting to iterate late loses nothing.

    On a manual context (``autostart=False``), ``result()`` and iteration run the loop's
    steps in the waiting thread. Waiting on the loop thread itself (in a done-callback)
    for a request that is still running raises :class:`~llamax.DeadlockError`.
    """

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._cancel: Callable[[], None] = lambda: None
        self._check_wait: Callable[[], None] = lambda: None
        self._drive: Callable[[], bool] | None = None
        self._owner: object = None
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._events: deque[object] = deque()
        self._async_sink: tuple[asyncio.AbstractEventLoop, asyncio.Queue[object]] | None = None
        self._consumed = False
        self.future: Future[Completion] = Future()
        """Resolves to the :class:`Completion`, or to the exception that failed the request."""
        self.future.add_done_callback(self._on_future_done)

    @property
    def request_id(self) -> str:
        """The request's id (also ``Completion.request_id``)."""
        return self._request_id

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the completion; raises the request's error, or ``TimeoutError``.

        Raises:
            DeadlockError: called on the engine's loop thread while the request runs.
        """
        if not self.future.done():
            self._check_wait()
            if self._drive is not None:
                timeout = self._drive_until_done(timeout)
        return self.future.result(timeout)

    def _drive_until_done(self, timeout: float | None) -> float | None:
        """Run a manual context's steps here; return the time left of ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.future.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return 0.0
            if not (self._drive is not None and self._drive()):
                wait_futures([self.future], timeout=0.005 if left is None else min(left, 0.005))
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def done(self) -> bool:
        """Whether the request has ended (completed, cancelled or failed)."""
        return self.future.done()

    def cancel(self) -> bool:
        """Ask the engine to stop this request at the next step boundary.

        Returns False when the request had already ended. The KV cells and sequence id are
        freed before the next decode; the completion keeps the text produced so far.
        """
        if self.future.done():
            return False
        self._cancel()
        return True

    # ------------------------------------------------------------------ sync stream
    def __iter__(self) -> Iterator[TokenEvent]:
        self._claim_stream()
        return self._iterate(self._drive)

    def _iterate(self, drive: Callable[[], object] | None = None) -> Iterator[TokenEvent]:
        while True:
            with self._ready:
                while not self._events:
                    if not self.future.done():
                        self._check_wait()
                    if drive is None:
                        self._ready.wait()
                        continue
                    self._lock.release()  # run a step of a manual context, unlocked
                    try:
                        progressed = drive()
                    finally:
                        self._lock.acquire()
                    if not progressed and not self._events:
                        self._ready.wait(0.005)  # another thread steps: wait for its events
                item = self._events.popleft()
            if item is _END:
                self._raise_failure()
                return
            yield item  # type: ignore[misc]

    def stream(self, *, drive: Callable[[], object] | None = None) -> Iterator[TokenEvent]:
        """Iterate the events; ``drive`` (e.g. ``ctx.process``) is called whenever none is
        ready, which lets a manual (``autostart=False``) context stream from one thread."""
        self._claim_stream()
        return self._iterate(drive)

    # ------------------------------------------------------------------ asyncio
    def __await__(self) -> Generator[Any, None, Completion]:
        return asyncio.wrap_future(self.future).__await__()

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        self._claim_stream()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        with self._lock:
            while self._events:
                queue.put_nowait(self._events.popleft())
            self._async_sink = (loop, queue)
        return self._aiterate(queue)

    async def _aiterate(self, queue: asyncio.Queue[object]) -> AsyncIterator[TokenEvent]:
        while True:
            item = await queue.get()
            if item is _END:
                self._raise_failure()
                return
            yield item  # type: ignore[misc]

    # ------------------------------------------------------------------ engine side
    def _bind(
        self,
        cancel: Callable[[], None],
        *,
        check_wait: Callable[[], None],
        drive: Callable[[], bool] | None = None,
        owner: object = None,
    ) -> None:
        """Connect the handle to its engine (once, before the request is submitted):
        ``cancel`` queues a cancellation, ``check_wait`` raises where a wait would never end,
        ``drive`` (manual contexts) runs one step in the waiting thread, and ``owner`` (the
        context) is kept alive until the request ends."""
        self._owner = owner
        self._cancel = cancel
        self._check_wait = check_wait
        self._drive = drive
        self.future.add_done_callback(lambda f: cancel() if f.cancelled() else None)

    def _publish(self, events: list[object]) -> None:
        """Deliver events (engine thread only; never under the engine's lock)."""
        with self._lock:
            sink = self._async_sink
            if sink is None:
                self._events.extend(events)
                self._ready.notify_all()
                return
        loop, queue = sink
        with contextlib.suppress(RuntimeError):  # the consumer's loop is closed: nobody listens
            loop.call_soon_threadsafe(_put_all, queue, events)

    def _on_future_done(self, _future: Future[Completion]) -> None:
        self._publish([_END])
        self._owner = None  # the context may be collected (and closed) from now on

    def _claim_stream(self) -> None:
        with self._lock:
            if self._consumed:
                raise RuntimeError(
                    f"the event stream of request {self._request_id} is already being consumed"
                )
            self._consumed = True

    def _raise_failure(self) -> None:
        if self.future.cancelled():
            raise CancelledError(f"request {self._request_id} was cancelled")
        exc = self.future.exception()
        if exc is not None:
            raise exc

    def __repr__(self) -> str:
        state = "done" if self.future.done() else "pending"
        return f"<RequestHandle {self._request_id} {state}>"


def _put_all(queue: asyncio.Queue[object], events: list[object]) -> None:
    for event in events:
        queue.put_nowait(event)
