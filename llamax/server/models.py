"""``ModelPool``: several named models behind one server, loaded on demand.

Design note: every state change of a model happens under the pool's one condition, and
native work (loading a GGUF, closing a context) happens outside it, in the pool's loader
threads or the idle unloader's thread, never on the event loop. A request *pins* its model
from the moment it names it (:meth:`ModelPool.acquire`) until its response has ended
(:meth:`ModelPool.release`); only a model that nobody pins is unloaded, so a context is
never closed under a request, and a request waiting for a load holds its pin (and its
admission slot) while it waits.

Fairness: loads wait for room in one queue, in the order their first request arrived, and
only the queue's head takes room. When the pool is full and every loaded model is in use,
the head *drains* the least recently used one: that model takes no new requests (they
queue a reload, behind the head), its requests in flight finish, it is unloaded, and the
head loads. Steady traffic to a loaded model therefore never starves a request for
another. A load whose requests have all left before it started is withdrawn, and a drain
that no queued load needs any more is called off.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

import llamax

from .metrics import ScrapeCollector, engine_metrics, pool_metrics
from .model_sources import (
    DEFAULT_MAX_LOADED,
    ModelSource,
    default_max_loaded,
    factory,
    options_of,
    shared_budgets,
)

__all__ = ["DEFAULT_MAX_LOADED", "ModelInfo", "ModelPool", "ModelState"]

log = logging.getLogger("llamax.server")


class ModelState(enum.Enum):
    """Where one model of a pool stands."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    """A load is under way, or waits for room."""
    LOADED = "loaded"
    DRAINING = "draining"
    """Loaded, but to be unloaded for a queued load: its requests in flight finish, new
    ones wait for its reload."""
    UNLOADING = "unloading"


class _Room(enum.Enum):
    """How a load's wait for room ended."""

    TAKEN = "taken"  # room is held: load the model
    REUSED = "reused"  # its model was draining and nothing else waited: the drain is off
    WITHDRAWN = "withdrawn"  # every request for it left before it started


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A snapshot of one model of a pool (what ``GET /v1/models`` lists).

    Attributes:
        name: The name requests use in their ``model`` field.
        state: Whether it is loaded.
        num_users: Requests that hold it (running, or waiting for its load).
        context: Its context while loaded (or draining), else ``None``.
        last_error: Why its last load failed, if it did (cleared by the next load).
    """

    name: str
    state: ModelState
    num_users: int
    context: llamax.Context | None
    last_error: str | None


@dataclass(eq=False)
class _Entry:
    """One named model; its fields change only under the pool's condition."""

    name: str
    factory: Callable[[], llamax.Context]
    state: ModelState = ModelState.UNLOADED
    future: Future[llamax.Context] | None = None
    """What :meth:`ModelPool.acquire` hands out: the load under way or the loaded context;
    while draining or unloading, the reload queued after it (``None``: none yet)."""
    context: llamax.Context | None = None
    """The loaded context (LOADED or DRAINING)."""
    serving: list[Future[llamax.Context]] = field(default_factory=list)
    """The futures that hand out :attr:`context`: one, or two when a drain was called off
    after a reload had been queued."""
    pins: dict[Future[llamax.Context], int] = field(default_factory=dict)
    """Requests holding each future (released ones removed)."""
    last_used: float = 0.0
    last_error: str | None = None
    num_loads: dict[str, int] = field(default_factory=lambda: {"success": 0, "failure": 0})
    num_unloads: int = 0
    has_room: bool = False  # counted against max_loaded: from taking room to unloaded
    closed: threading.Event = field(default_factory=threading.Event)  # no close under way

    def __post_init__(self) -> None:
        self.closed.set()

    @property
    def num_users(self) -> int:
        """Requests holding the model: running, or waiting for a load."""
        return sum(self.pins.values())

    @property
    def num_serving(self) -> int:
        """Requests holding the loaded context."""
        return sum(self.pins.get(future, 0) for future in self.serving)


class ModelPool:
    """Named models, each with its own :class:`llamax.Context`, loaded when a request first
    names one and unloaded when idle or to make room.

    Args:
        models: Name → GGUF path (or a function returning a context; one that takes
            ``**options`` is called with the model's context options, its budget shares
            included). The first is the default, for requests that name no model.
        max_loaded: Most models loaded (or loading) at once; to load one more, the least
            recently used model that no request holds is unloaded first, and when every
            loaded model is in use the least recently used one is drained (it takes no new
            requests, its requests in flight finish, then it is unloaded). Loads wait for
            room in the order their first request arrived. ``None``: no bound.
        idle_unload_seconds: Unload a model no request has held for this long. ``None``:
            never.
        max_wait_seconds: Longest a request waits for its model (room and load); the
            server answers 503 with ``Retry-After`` past it. ``None``: no bound.
        clock: Monotonic seconds (tests inject one).
        **context_options: Options of every path's :class:`llamax.Context`; a
            ``prefix_disk_dir`` gets a folder per model name inside it. The host-RAM
            tier's budget (``prefix_ram_bytes``, else the machine's default) is the
            pool's, divided among the models loaded at once; the disk tier's default is
            divided among all the models (see :attr:`context_options`).

    Raises:
        ValueError: no models, an empty name, or a bound that is not positive.
    """

    def __init__(
        self,
        models: Mapping[str, ModelSource],
        *,
        max_loaded: int | None = None,
        idle_unload_seconds: float | None = None,
        max_wait_seconds: float | None = 60.0,
        clock: Callable[[], float] = time.monotonic,
        **context_options: Any,
    ) -> None:
        if not models:
            raise ValueError("a model pool needs at least one model")
        if any(not name for name in models):
            raise ValueError("model names must not be empty")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        for name, value in (("idle_unload_seconds", idle_unload_seconds),
                            ("max_wait_seconds", max_wait_seconds)):  # fmt: skip
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.max_loaded = max_loaded
        self.idle_unload_seconds = idle_unload_seconds
        self.max_wait_seconds = max_wait_seconds
        self._clock = clock
        self._context_options = shared_budgets(context_options, len(models), max_loaded)
        self._entries = {
            name: _Entry(name, factory(source, options_of(name, self._context_options)))
            for name, source in models.items()
        }
        self._queue: list[_Entry] = []  # models whose load waits for room, first come first
        self._cond = threading.Condition()
        self._closed = False
        # a withdrawn load holds its thread until it wakes and sees it: two per model
        self._loader = ThreadPoolExecutor(2 * len(self._entries), thread_name_prefix="llamax-load")
        self._unloader: threading.Thread | None = None
        if idle_unload_seconds is not None:
            self._unloader = threading.Thread(
                target=self._unload_when_idle, name="llamax-unload", daemon=True
            )
            self._unloader.start()

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], **options: Any) -> ModelPool:
        """Every ``*.gguf`` in ``directory``, named by file stem (sorted by name). Unless
        ``options`` give ``max_loaded``, it is :meth:`default_max_loaded` of the files.

        Raises:
            ValueError: the directory holds no ``.gguf`` file.
            OSError: it cannot be read.
        """
        paths = sorted(Path(directory).glob("*.gguf"))
        if not paths:
            raise ValueError(f"no .gguf file in {os.fspath(directory)!r}")
        options.setdefault("max_loaded", cls.default_max_loaded(paths))
        return cls({path.stem: path for path in paths}, **options)

    @staticmethod
    def default_max_loaded(
        paths: Iterable[str | os.PathLike[str]], available_bytes: int | None = None
    ) -> int:
        """The bound on models loaded at once for a directory of models whose size nobody
        gave: :data:`DEFAULT_MAX_LOADED`, or as many of the largest file as fit in half
        the memory available (``available_bytes``; default: ``MemAvailable`` now), if
        fewer; at least 1 (:func:`~llamax.server.model_sources.default_max_loaded`).
        """
        return default_max_loaded(paths, available_bytes)

    @property
    def names(self) -> list[str]:
        """The model names, the default first."""
        return list(self._entries)

    @property
    def default(self) -> str:
        """The model of requests that name none."""
        return next(iter(self._entries))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    @property
    def context_options(self) -> dict[str, Any]:
        """The options each GGUF path's :class:`llamax.Context` gets: those given, plus each
        model's share of the prefix tiers' default budgets (``prefix_ram_share``: one over
        the models loaded at once, ``max_loaded`` or all; ``prefix_disk_share``: one over
        all the models, since a model's files stay when it unloads), unless the budget
        itself was given (a ``prefix_ram_bytes`` given is the pool's: each model gets
        that share of it); a ``prefix_disk_dir`` then gets a folder per model name."""
        return dict(self._context_options)

    def acquire(self, name: str | None) -> Future[llamax.Context]:
        """Pin model ``name`` (the default for ``None``) and return its context's future,
        queueing its load if it is not loaded (or is draining). Cheap: safe on an event
        loop. Every call must be matched by one :meth:`release` of the future it returned.

        Raises:
            NotFoundError: no model has that name.
            ContextClosedError: the pool is closed.
        """
        name = self.default if name is None else name
        with self._cond:
            if self._closed:
                raise llamax.ContextClosedError("the model pool is closed")
            entry = self._entries.get(name)
            if entry is None:
                raise llamax.NotFoundError(
                    f"model {name!r} is not served here; the models are: {', '.join(self.names)}",
                    param="model",
                )
            entry.last_used = self._clock()
            if entry.future is None:  # not loaded, or draining: queue a load
                entry.future = Future()
                entry.future.set_running_or_notify_cancel()  # so that nobody can cancel it
                if entry.state is ModelState.UNLOADED:
                    entry.state = ModelState.LOADING
                self._queue.append(entry)
                self._loader.submit(self._load, entry, entry.future)
            future = entry.future
            entry.pins[future] = entry.pins.get(future, 0) + 1
            return future

    def release(self, loading: Future[llamax.Context]) -> None:
        """Unpin what :meth:`acquire` pinned (``loading``: the future it returned); the
        model's idle time starts now. A queued load that no request waits for any more is
        withdrawn.

        Raises:
            ValueError: ``loading`` holds no pin of this pool.
        """
        with self._cond:
            entry = next((e for e in self._entries.values() if loading in e.pins), None)
            if entry is None:
                raise ValueError("release() of a future this pool holds no pin for")
            left = entry.pins.pop(loading) - 1
            if left:
                entry.pins[loading] = left
            entry.last_used = self._clock()
            if not left and loading is entry.future and entry in self._queue:
                self._withdraw(entry)
            self._cond.notify_all()

    def models(self) -> list[ModelInfo]:
        """A snapshot of every model, in order."""
        with self._cond:
            return [self._info(entry) for entry in self._entries.values()]

    def loaded(self, name: str | None = None) -> llamax.Context | None:
        """Model ``name``'s context (the default's for ``None``) when it is loaded."""
        with self._cond:
            return self._info(self._entries[self.default if name is None else name]).context

    def unload(self, name: str) -> None:
        """Unload model ``name`` now (llama-server's ``POST /models/unload``); a later
        request loads it again.

        Raises:
            NotFoundError: no model has that name.
            InvalidRequestError: it is not loaded, or requests hold it (they would lose
                their context: unload it once they finish).
        """
        with self._cond:
            entry = self._entries.get(name)
            if entry is None:
                raise llamax.NotFoundError(f"model {name!r} is not served here", param="model")
            if entry.state is not ModelState.LOADED:
                raise llamax.InvalidRequestError(
                    f"model {name!r} is not running ({entry.state.value})", param="model"
                )
            if entry.num_users:
                raise llamax.InvalidRequestError(
                    f"model {name!r} is in use by {entry.num_users} requests; unload it once "
                    "they finish",
                    param="model",
                )
            ctx = self._begin_unload(entry)
        self._finish_unload(entry, ctx)

    def unload_idle(self) -> list[str]:
        """Unload now every model that no request has held for ``idle_unload_seconds``
        (the unloader thread calls this; tests with an injected clock may too).

        Returns:
            The names unloaded.
        """
        if self.idle_unload_seconds is None:
            return []
        with self._cond:
            deadline = self._clock() - self.idle_unload_seconds
            idle = [e for e in self._entries.values() if _is_idle(e) and e.last_used <= deadline]
            contexts = [self._begin_unload(entry) for entry in idle]
        for entry, ctx in zip(idle, contexts, strict=True):
            self._finish_unload(entry, ctx)
        return [entry.name for entry in idle]

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, wait for loads under way, and close every loaded context
        (each with ``timeout``). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._unloader is not None:
            self._unloader.join()
        self._loader.shutdown(wait=True)
        with self._cond:
            loaded = [e for e in self._entries.values() if e.context is not None]
            contexts = [self._begin_unload(entry) for entry in loaded]
        for entry, ctx in zip(loaded, contexts, strict=True):
            self._finish_unload(entry, ctx, timeout)
        for entry in self._entries.values():
            entry.closed.wait()

    def collector(self) -> Collector:
        """A Prometheus collector of the per-model figures (see docs/models.md)."""
        return ScrapeCollector(self._figures)

    def _figures(self) -> Iterator[Metric]:
        """The pool's figures (:func:`~llamax.server.metrics.pool_metrics`), then each loaded
        model's engine figures, labelled by model."""
        with self._cond:
            rows = [(e.name, e.state in (ModelState.LOADED, ModelState.DRAINING), e.num_users,
                     dict(e.num_loads), e.num_unloads) for e in self._entries.values()]  # fmt: skip
        engines = [((i.name,), i.context.stats()) for i in self.models() if i.context is not None]
        yield from pool_metrics(rows)
        yield from engine_metrics(engines, ("model",))

    # -------------------------------------------------------------- under the condition
    def _info(self, entry: _Entry) -> ModelInfo:
        return ModelInfo(entry.name, entry.state, entry.num_users, entry.context, entry.last_error)

    def _begin_unload(self, entry: _Entry) -> llamax.Context:
        assert entry.context is not None
        ctx, entry.context = entry.context, None
        if entry.future in entry.serving:
            entry.future = None
        entry.state, entry.serving = ModelState.UNLOADING, []
        entry.closed.clear()
        return ctx

    def _dequeue(self, entry: _Entry) -> None:
        """Take ``entry`` off the queue; with the queue empty, no load waits for the room a
        drain makes, so every drain is called off."""
        self._queue.remove(entry)
        if self._queue:
            return
        for other in self._entries.values():
            if other.state is ModelState.DRAINING:
                other.state, other.future = ModelState.LOADED, other.serving[-1]

    def _withdraw(self, entry: _Entry) -> None:
        """Drop ``entry``'s queued load (nobody waits for it); its thread sees and ends."""
        entry.future = None
        if entry.state is ModelState.LOADING:
            entry.state = ModelState.UNLOADED
        self._dequeue(entry)

    def _next_move(self, entry: _Entry) -> _Room | _Entry | None:
        """What ``entry``'s queued load does now: take room, keep its draining context, or
        unload a victim first (returned); ``None``: wait. Only the queue's head moves."""
        if self._queue[0] is not entry or entry.state is ModelState.UNLOADING:
            return None
        if entry.state is ModelState.DRAINING:  # nothing ahead waits for its room: keep it
            assert entry.future is not None
            entry.state = ModelState.LOADED
            entry.serving.append(entry.future)
            self._dequeue(entry)
            return _Room.REUSED
        others = [e for e in self._entries.values() if e is not entry]
        if self.max_loaded is None or sum(e.has_room for e in others) < self.max_loaded:
            entry.has_room, entry.state = True, ModelState.LOADING
            self._dequeue(entry)
            return _Room.TAKEN
        loaded = [e for e in others if e.state in (ModelState.LOADED, ModelState.DRAINING)]
        idle = [e for e in loaded if e.num_serving == 0]
        if idle:
            return min(idle, key=lambda e: e.last_used)
        if not any(e.state in (ModelState.DRAINING, ModelState.UNLOADING) for e in others):
            busy = [e for e in loaded if e.state is ModelState.LOADED]
            if busy:  # none idle: drain the least recently used, its room frees when it ends
                victim = min(busy, key=lambda e: e.last_used)
                victim.state, victim.future = ModelState.DRAINING, None
                log.info("draining model %r to load %r", victim.name, entry.name)
        return None

    # -------------------------------------------------------------- worker threads
    def _finish_unload(
        self, entry: _Entry, ctx: llamax.Context, timeout: float | None = None
    ) -> None:
        log.info("unloading model %r", entry.name)
        try:
            ctx.close(timeout=timeout)
        finally:
            with self._cond:
                if entry.state is ModelState.UNLOADING:  # a queued reload may go on now
                    entry.state = (
                        ModelState.UNLOADED if entry.future is None else ModelState.LOADING
                    )
                entry.has_room = False
                entry.num_unloads += 1
                entry.closed.set()
                self._cond.notify_all()

    def _wait_for_room(
        self, entry: _Entry, future: Future[llamax.Context]
    ) -> tuple[_Room, llamax.Context | None]:
        """Wait until ``entry``'s load (``future``) is the queue's head and has room,
        unloading idle or drained models on the way; with :attr:`_Room.REUSED`, the context
        it keeps.

        Raises:
            ContextClosedError: the pool closed meanwhile.
        """
        while True:
            with self._cond:
                move = None
                while move is None:
                    if entry.future is not future:
                        return _Room.WITHDRAWN, None
                    if self._closed:
                        self._dequeue(entry)
                        raise llamax.ContextClosedError("the model pool is closed")
                    move = self._next_move(entry)
                    if move is None:
                        self._cond.wait()
                if isinstance(move, _Room):
                    return move, entry.context
                victim, ctx = move, self._begin_unload(move)
            self._finish_unload(victim, ctx)

    def _load(self, entry: _Entry, future: Future[llamax.Context]) -> None:
        try:
            room, reused = self._wait_for_room(entry, future)
            if room is _Room.WITHDRAWN:
                future.set_exception(llamax.ContextClosedError("no request waits for it"))
                return
            if room is _Room.REUSED:
                assert reused is not None
                future.set_result(reused)
                return
            log.info("loading model %r", entry.name)
            ctx = entry.factory()
            if self._closed:  # close() began while it loaded: it waits for this thread
                ctx.close()
                raise llamax.ContextClosedError("the model pool is closed")
        except BaseException as exc:
            log.error("model %r failed to load: %s", entry.name, exc)
            with self._cond:
                if entry.future is future:
                    entry.future = None
                    if entry.state is ModelState.LOADING:
                        entry.state, entry.has_room = ModelState.UNLOADED, False
                entry.last_error = f"{type(exc).__name__}: {exc}"
                entry.num_loads["failure"] += 1
                self._cond.notify_all()
            future.set_exception(exc)
            return
        with self._cond:
            entry.state, entry.last_error = ModelState.LOADED, None
            entry.context, entry.serving = ctx, [future]
            entry.last_used = self._clock()
            entry.num_loads["success"] += 1
            self._cond.notify_all()
        future.set_result(ctx)

    def _unload_when_idle(self) -> None:
        assert self.idle_unload_seconds is not None
        while True:
            with self._cond:
                if self._closed:
                    return
                idle = [e.last_used for e in self._entries.values() if _is_idle(e)]
                wait = self.idle_unload_seconds
                if idle:
                    wait = min(idle) + self.idle_unload_seconds - self._clock()
                self._cond.wait(min(max(wait, 0.01), self.idle_unload_seconds))
            self.unload_idle()


def _is_idle(entry: _Entry) -> bool:
    return entry.state is ModelState.LOADED and entry.num_serving == 0
