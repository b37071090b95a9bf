"""``ModelPool``: several named models behind one server, loaded on demand.

Design note: every state change of a model happens under the pool's one condition, and
native work (loading a GGUF, closing a context) happens outside it, in the pool's loader
threads or the idle unloader's thread, never on the event loop. A request *pins* its model
from the moment it names it (:meth:`ModelPool.acquire`) until its response has ended
(:meth:`ModelPool.release`); only a model that nobody pins is unloaded, so a context is
never closed under a request, and a request waiting for a load holds its pin (and its
admission slot) while it waits.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import llamax

from .metrics import engine_metrics

__all__ = ["ModelInfo", "ModelPool", "ModelState"]

log = logging.getLogger("llamax.server")

ModelSource = str | os.PathLike[str] | Callable[[], llamax.Context]
"""A GGUF path, or a function that builds the context (tests pass fake contexts so)."""


class ModelState(enum.Enum):
    """Where one model of a pool stands."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A snapshot of one model of a pool (what ``GET /v1/models`` lists).

    Attributes:
        name: The name requests use in their ``model`` field.
        state: Whether it is loaded.
        num_users: Requests that hold it (running, or waiting for its load).
        context: Its context while loaded, else ``None``.
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
    future: Future[llamax.Context] | None = None  # while LOADING or LOADED
    num_users: int = 0
    last_used: float = 0.0
    last_error: str | None = None
    num_loads: dict[str, int] = field(default_factory=lambda: {"success": 0, "failure": 0})
    num_unloads: int = 0
    has_room: bool = False  # counted against max_loaded: from its load's start to unloaded
    closed: threading.Event = field(default_factory=threading.Event)  # no close under way

    def __post_init__(self) -> None:
        self.closed.set()


class ModelPool:
    """Named models, each with its own :class:`llamax.Context`, loaded when a request first
    names one and unloaded when idle or to make room.

    Args:
        models: Name → GGUF path (or a function returning a context). The first is the
            default, for requests that name no model.
        max_loaded: Most models loaded (or loading) at once; to load one more, the least
            recently used model that no request holds is unloaded first (a load waits when
            every loaded model is in use). ``None``: no bound.
        idle_unload_seconds: Unload a model no request has held for this long. ``None``:
            never.
        clock: Monotonic seconds (tests inject one).
        **context_options: Options of every path's :class:`llamax.Context`; a
            ``prefix_disk_dir`` gets a folder per model name inside it.

    Raises:
        ValueError: no models, an empty name, or a bound that is not positive.
    """

    def __init__(
        self,
        models: Mapping[str, ModelSource],
        *,
        max_loaded: int | None = None,
        idle_unload_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        **context_options: Any,
    ) -> None:
        if not models:
            raise ValueError("a model pool needs at least one model")
        if any(not name for name in models):
            raise ValueError("model names must not be empty")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        if idle_unload_seconds is not None and not idle_unload_seconds > 0:
            raise ValueError(f"idle_unload_seconds must be > 0, got {idle_unload_seconds}")
        self.max_loaded = max_loaded
        self.idle_unload_seconds = idle_unload_seconds
        self._clock = clock
        self._entries = {
            name: _Entry(name, _factory(source, _options_of(name, context_options)))
            for name, source in models.items()
        }
        self._cond = threading.Condition()
        self._closed = False
        self._loader = ThreadPoolExecutor(len(self._entries), thread_name_prefix="llamax-load")
        self._unloader: threading.Thread | None = None
        if idle_unload_seconds is not None:
            self._unloader = threading.Thread(
                target=self._unload_when_idle, name="llamax-unload", daemon=True
            )
            self._unloader.start()

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], **options: Any) -> ModelPool:
        """Every ``*.gguf`` in ``directory``, named by file stem (sorted by name).

        Raises:
            ValueError: the directory holds no ``.gguf`` file.
            OSError: it cannot be read.
        """
        paths = sorted(Path(directory).glob("*.gguf"))
        if not paths:
            raise ValueError(f"no .gguf file in {os.fspath(directory)!r}")
        return cls({path.stem: path for path in paths}, **options)

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

    def acquire(self, name: str | None) -> Future[llamax.Context]:
        """Pin model ``name`` (the default for ``None``) and return its context's future,
        starting its load in a loader thread if it is not loaded. Cheap: safe on an event
        loop. Every call must be matched by one :meth:`release`.

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
                    f"model {name!r} is not served here; the models are: {', '.join(self.names)}"
                )
            entry.num_users += 1
            entry.last_used = self._clock()
            if entry.future is None:  # UNLOADED or UNLOADING: load it (again)
                entry.state = ModelState.LOADING
                entry.future = Future()
                entry.future.set_running_or_notify_cancel()  # so that nobody can cancel it
                self._loader.submit(self._load, entry, entry.future)
            return entry.future

    def release(self, name: str | None) -> None:
        """Unpin a model pinned by :meth:`acquire`; its idle time starts now."""
        with self._cond:
            entry = self._entries[self.default if name is None else name]
            entry.num_users -= 1
            entry.last_used = self._clock()
            self._cond.notify_all()

    def models(self) -> list[ModelInfo]:
        """A snapshot of every model, in order."""
        with self._cond:
            return [self._info(entry) for entry in self._entries.values()]

    def loaded(self, name: str | None = None) -> llamax.Context | None:
        """Model ``name``'s context (the default's for ``None``) when it is loaded."""
        with self._cond:
            return self._info(self._entries[self.default if name is None else name]).context

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
            loaded = [e for e in self._entries.values() if e.state is ModelState.LOADED]
            contexts = [self._begin_unload(entry) for entry in loaded]
        for entry, ctx in zip(loaded, contexts, strict=True):
            self._finish_unload(entry, ctx, timeout)
        for entry in self._entries.values():
            entry.closed.wait()

    def collector(self) -> Collector:
        """A Prometheus collector of the per-model figures (see docs/models.md)."""
        return _PoolCollector(self)

    # -------------------------------------------------------------- under the condition
    def _info(self, entry: _Entry) -> ModelInfo:
        ctx = None
        if entry.state is ModelState.LOADED and entry.future is not None:
            ctx = entry.future.result()
        return ModelInfo(entry.name, entry.state, entry.num_users, ctx, entry.last_error)

    def _begin_unload(self, entry: _Entry) -> llamax.Context:
        assert entry.future is not None and entry.state is ModelState.LOADED
        ctx = entry.future.result()
        entry.state, entry.future = ModelState.UNLOADING, None
        entry.closed.clear()
        return ctx

    def _room_or_victim(self, loading: _Entry) -> tuple[bool, _Entry | None]:
        """Whether ``loading`` may load now, else the LRU idle model to unload first."""
        others = [e for e in self._entries.values() if e is not loading]
        if self.max_loaded is None or sum(e.has_room for e in others) < self.max_loaded:
            loading.has_room = True
            return True, None
        idle = [e for e in others if _is_idle(e)]
        return False, min(idle, key=lambda e: e.last_used, default=None)

    # -------------------------------------------------------------- worker threads
    def _finish_unload(
        self, entry: _Entry, ctx: llamax.Context, timeout: float | None = None
    ) -> None:
        log.info("unloading model %r", entry.name)
        try:
            ctx.close(timeout=timeout)
        finally:
            with self._cond:
                if entry.state is ModelState.UNLOADING:
                    entry.state = ModelState.UNLOADED
                entry.has_room = False
                entry.num_unloads += 1
                entry.closed.set()
                self._cond.notify_all()

    def _make_room(self, entry: _Entry) -> None:
        """Unload LRU idle models until ``entry`` may load (waiting while all are in use)."""
        while True:
            with self._cond:
                room, victim = self._room_or_victim(entry)
                while not room and victim is None and not self._closed:
                    self._cond.wait()
                    room, victim = self._room_or_victim(entry)
                if room or self._closed:
                    return
                assert victim is not None
                ctx = self._begin_unload(victim)
            self._finish_unload(victim, ctx)

    def _load(self, entry: _Entry, future: Future[llamax.Context]) -> None:
        try:
            entry.closed.wait()  # a close of this model's previous context
            self._make_room(entry)
            if self._closed:
                raise llamax.ContextClosedError("the model pool is closed")
            log.info("loading model %r", entry.name)
            ctx = entry.factory()
            if self._closed:  # close() began while it loaded: it waits for this thread
                ctx.close()
                raise llamax.ContextClosedError("the model pool is closed")
        except BaseException as exc:
            log.error("model %r failed to load: %s", entry.name, exc)
            with self._cond:
                entry.state, entry.future = ModelState.UNLOADED, None
                entry.has_room = False
                entry.last_error = f"{type(exc).__name__}: {exc}"
                entry.num_loads["failure"] += 1
                self._cond.notify_all()
            future.set_exception(exc)
            return
        with self._cond:
            entry.state, entry.last_error = ModelState.LOADED, None
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
    return entry.state is ModelState.LOADED and entry.num_users == 0


_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _options_of(name: str, options: Mapping[str, Any]) -> Mapping[str, Any]:
    """``options`` for the model named ``name``: its disk prefix tier (if any) in a folder
    of its own, ``<prefix_disk_dir>/<name>/``, so one GGUF served under two names gets two
    tiers rather than a lock conflict (one context per tier folder). A name that is not a
    plain file name is folded into ``model-<hash>``."""
    directory = options.get("prefix_disk_dir")
    if directory is None:
        return options
    folder = (
        name
        if _PLAIN_NAME.fullmatch(name)
        else "model-" + hashlib.sha256(name.encode()).hexdigest()[:16]
    )
    return {**options, "prefix_disk_dir": os.path.join(os.fspath(directory), folder)}


def _factory(source: ModelSource, options: Mapping[str, Any]) -> Callable[[], llamax.Context]:
    if callable(source):
        return source
    path = os.fspath(source)
    return lambda: llamax.Context(path, **options)


class _PoolCollector(Collector):
    """``llamax_model_loaded{model}`` and the loads and unloads, read at each scrape."""

    def __init__(self, pool: ModelPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        loaded = GaugeMetricFamily(
            "llamax_model_loaded", "1 while the model is loaded", labels=["model"]
        )
        users = GaugeMetricFamily(
            "llamax_model_requests", "Requests holding the model (running or waiting for its load)",
            labels=["model"],
        )  # fmt: skip
        loads = CounterMetricFamily(
            "llamax_model_loads", "Model loads by outcome", labels=["model", "outcome"]
        )
        unloads = CounterMetricFamily("llamax_model_unloads", "Model unloads", labels=["model"])
        with self._pool._cond:
            entries = list(self._pool._entries.values())
            rows = [(e.name, e.state, e.num_users, dict(e.num_loads), e.num_unloads)
                    for e in entries]  # fmt: skip
        for name, state, num_users, num_loads, num_unloads in rows:
            loaded.add_metric([name], float(state is ModelState.LOADED))
            users.add_metric([name], num_users)
            for outcome, count in num_loads.items():
                loads.add_metric([name, outcome], count)
            unloads.add_metric([name], num_unloads)
        yield from (loaded, users, loads, unloads)
        engines = []  # each loaded model's engine figures, labelled by model
        for info in self._pool.models():
            if info.context is not None:
                engines.append(((info.name,), info.context.stats()))
        yield from engine_metrics(engines, ("model",))
