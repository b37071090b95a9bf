"""What one app holds: the context (or its loading future, or a pool of named models),
limits, metrics and guards; and :class:`ContextLease`, how a request gets its context."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

import llamax
from llamax.openai import ResponseStore

from .config import ServerConfig
from .errors import APIError
from .images import ImageFetcher
from .metrics import ServerMetrics
from .models import ModelPool
from .responses import outcome_of

__all__ = [
    "ContextLease",
    "ServerState",
    "admit_leased",
    "admit_parsed",
    "model_id",
    "read_body",
    "run_leased",
]

T = TypeVar("T")
R = TypeVar("R")


def model_id(ctx: llamax.Context) -> str:
    """The id a single model is served under: its GGUF file's name without ``.gguf``
    (``SmolLM2-135M-Instruct-Q8_0``), what clients send back as ``model``; the name in the
    GGUF's metadata (``Smollm2 135M ...``) for a context without a file (a test backend).
    """
    path = PurePath(ctx.config.model_path.replace("\\", "/"))
    return path.stem if path.suffix.lower() == ".gguf" and path.stem else ctx.model_name


@dataclass(eq=False, kw_only=True)
class ServerState:
    """Per-app state; routes close over it (no globals, so apps never share anything).

    Args:
        source: The context, or a future that will hold it once the model has loaded, or
            a pool of named models (each request's ``model`` picks one; docs/models.md).
        config: The server's settings (limits, key, defaults, images ...).
    """

    source: llamax.Context | Future[llamax.Context] | ModelPool
    config: ServerConfig = field(default_factory=ServerConfig)
    responses: ResponseStore = field(init=False)
    """The Responses API's store of recent responses (``previous_response_id``)."""
    image_fetcher: ImageFetcher = field(init=False)
    """Fetches the image URLs of requests (``images.allow_urls``), a bounded number at once."""
    metrics: ServerMetrics = field(init=False)
    num_in_flight: int = 0

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.config.max_stored_responses)
        self.image_fetcher = ImageFetcher(self.config.images)
        self.metrics = ServerMetrics(self.stats)
        if self.pool is not None:
            self.metrics.registry.register(self.pool.collector())

    @property
    def pool(self) -> ModelPool | None:
        """The pool of named models, when the app serves several."""
        return self.source if isinstance(self.source, ModelPool) else None

    def model_name(self, ctx: llamax.Context) -> str:
        """The name ``ctx``'s model is served under: the alias, when one is set and the
        server has one model; else :func:`model_id`."""
        if self.config.model_alias is not None and self.pool is None:
            return self.config.model_alias
        return model_id(ctx)

    def model_names(self, ctx: llamax.Context) -> tuple[str, ...]:
        """Every name a client may use for ``ctx``'s model (``/v1/models/{id}``): the name
        it is served under, and the GGUF's display name that llamax 0.x served."""
        return (self.model_name(ctx), ctx.model_name)

    def with_defaults(self, options: dict[str, Any], max_tokens: str = "max_tokens") -> None:
        """Fill in the server's default reply length (under the name ``max_tokens``) and
        seed where ``options`` (llamax's OpenAI-named options) sets none."""
        if self.config.default_max_tokens is not None and options.get(max_tokens) is None:
            options[max_tokens] = self.config.default_max_tokens
        if self.config.default_seed is not None and options.get("seed") is None:
            options["seed"] = self.config.default_seed

    def lease(self, model: object) -> ContextLease:
        """The context a request for ``model`` (its ``model`` field) runs on. Cheap: with
        a pool it pins the model and starts its load if needed; the caller then awaits
        :meth:`ContextLease.context` and must call :meth:`ContextLease.release`.

        Raises:
            APIError: 400 for a ``model`` that is not a string, 404 for one the pool does
                not hold, 503 (one model) while it loads or once it is closed.
        """
        if self.pool is None:
            return ContextLease(self, None, None, self.context())
        if model is not None and not isinstance(model, str):
            raise APIError(400, f"model must be a string, got {type(model).__name__}",
                           param="model", code="invalid_value")  # fmt: skip
        try:
            return ContextLease(self, model, self.pool.acquire(model), None)
        except llamax.NotFoundError as exc:
            raise APIError(404, str(exc), param="model", code="model_not_found") from exc
        except llamax.ContextClosedError as exc:
            raise APIError(503, f"the server is closing: {exc}", code="model_unavailable") from exc

    def loaded(self) -> llamax.Context | None:
        """The context once loaded (``None`` while loading or if loading failed); with a
        pool, the default model's while it is loaded."""
        if isinstance(self.source, llamax.Context):
            return self.source
        if isinstance(self.source, ModelPool):
            return self.source.loaded()
        if self.source.done() and self.source.exception() is None:
            return self.source.result()
        return None

    def status(self) -> str:
        """``ok``, ``loading``, ``failed`` (the model did not load) or ``closed``."""
        if isinstance(self.source, ModelPool):  # models load on demand
            return "closed" if self.source.closed else "ok"
        ctx = self.loaded()
        if ctx is not None:
            return "closed" if ctx.closed else "ok"
        assert isinstance(self.source, Future)
        return "failed" if self.source.done() else "loading"

    def context(self) -> llamax.Context:
        """The context, ready to take requests.

        Raises:
            APIError: 503 while the model loads, or when the context is closed.
        """
        ctx = self.loaded()
        if ctx is None or ctx.closed:
            status, retry = self.status(), str(self.config.retry_after_seconds)
            raise APIError(503, f"the model is not available ({status})", code=f"model_{status}",
                           headers={"Retry-After": retry})  # fmt: skip
        return ctx

    def stats(self) -> llamax.ContextStats | None:
        """The context's stats, or ``None`` while loading (and with a pool: its figures
        are per model, see :meth:`ModelPool.collector`)."""
        ctx = None if self.pool is not None else self.loaded()
        return None if ctx is None else ctx.stats()

    def admit(self) -> None:
        """Take an admission slot; give it back with :meth:`release`.

        Raises:
            APIError: 503 with ``Retry-After`` when ``max_queue`` requests are in flight.
        """
        if self.num_in_flight >= self.config.max_queue:
            raise APIError(
                503,
                f"the server is busy: {self.num_in_flight} requests in flight "
                f"(max_queue={self.config.max_queue}); retry later",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_seconds)},
            )
        self.num_in_flight += 1
        self.metrics.in_flight.inc()

    def release(self) -> None:
        """Give back an admission slot taken by :meth:`admit`."""
        self.num_in_flight -= 1
        self.metrics.in_flight.dec()

    def check_api_key(self, request: Request) -> None:
        """Raise 401 unless the request carries the key (when one is set)."""
        if self.config.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.headers.get("x-api-key", "")  # Anthropic's clients send this
        if not given or not hmac.compare_digest(
            given.strip().encode(), self.config.api_key.encode()
        ):
            raise APIError(
                401, "missing or wrong API key (send 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>')", code="invalid_api_key",
            )  # fmt: skip


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes.

    Raises:
        APIError: 413 when the body (declared or streamed) is larger.
    """
    too_large = APIError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def admit_parsed(
    state: ServerState,
    request: Request,
    endpoint: str,
    parse: Callable[[bytes], T],
    *,
    check_key: bool = False,
) -> T:
    """Check the key (``check_key``: for routes that answer in their own error shape), read
    the body, take an admission slot and run ``parse(body)`` in a worker: what a route
    that builds a :class:`~llamax.server.responses.CompletionJob` does first. The slot is
    then held until the job releases it.

    Raises:
        APIError: 401, 413, 503, or what ``parse`` raises; counted under ``endpoint``, its
            slot given back.
    """
    admitted = False
    try:
        if check_key:
            state.check_api_key(request)
        raw = await read_body(request, state.config.max_body_bytes)
        state.admit()
        admitted = True
        return await run_in_threadpool(parse, raw)
    except APIError as error:
        state.metrics.requests.labels(endpoint, outcome_of(error.status)).inc()
        if admitted:
            state.release()
        raise
    except BaseException:
        if admitted:
            state.release()
        raise


class ContextLease:
    """One request's hold on the context it runs on: with a pool, its model stays pinned
    (never unloaded) until :meth:`release`, which also gives back the admission slot.

    Args:
        state: The app's state.
        model: The model named (``None``: the default).
        loading: With a pool, the future of the model's context; else ``None``.
        ctx: Without a pool, the context.
    """

    def __init__(
        self,
        state: ServerState,
        model: str | None,
        loading: Future[llamax.Context] | None,
        ctx: llamax.Context | None,
    ) -> None:
        self._state, self._model, self._loading, self._ctx = state, model, loading, ctx
        self._released = False

    async def context(self) -> llamax.Context:
        """The context, once its model has loaded (awaited: the load runs in a worker).

        Raises:
            APIError: 500 ``model_load_failed`` when the model did not load (the next
                request tries again), 503 ``model_wait_timeout`` with ``Retry-After`` when
                it was not ready within the pool's ``max_wait_seconds``, 503 when its
                context or the pool is closed.
        """
        if self._loading is not None:
            try:
                self._ctx = await self._wait_for_load(self._loading)
            except APIError:
                raise
            except llamax.ContextClosedError as exc:
                raise APIError(503, f"the model is not available: {exc}",
                               code="model_unavailable") from exc  # fmt: skip
            except Exception as exc:
                name = self._model or "the default model"
                raise APIError(
                    500, f"model {name!r} failed to load ({type(exc).__name__}; the server "
                    "log says why); a later request tries again", code="model_load_failed",
                ) from exc  # fmt: skip
        assert self._ctx is not None
        if self._ctx.closed:
            retry = {"Retry-After": str(self._state.config.retry_after_seconds)}
            raise APIError(503, "the model is not available (closed)", code="model_closed",
                           headers=retry)  # fmt: skip
        return self._ctx

    async def _wait_for_load(self, loading: Future[llamax.Context]) -> llamax.Context:
        """``loading``'s context, within the pool's bound on the wait."""
        pool = self._state.pool
        assert pool is not None
        waiter = asyncio.wrap_future(loading)
        try:
            done, _ = await asyncio.wait({waiter}, timeout=pool.max_wait_seconds)
        finally:
            if not waiter.done():
                waiter.cancel()  # unhooks it; the load itself cannot be cancelled
        if not done:
            name = self._model or pool.default
            raise APIError(
                503, f"model {name!r} was not ready within {pool.max_wait_seconds:g} s (it "
                "waits for room: requests to other models finish first); retry later",
                code="model_wait_timeout",
                headers={"Retry-After": str(self._state.config.retry_after_seconds)},
            )  # fmt: skip
        return waiter.result()

    async def run(self, start: Callable[[llamax.Context], Awaitable[R]]) -> R:
        """``await start(ctx)`` once the context is ready (a job's ``start``)."""
        return await start(await self.context())

    def release(self) -> None:
        """Unpin the model and give back the admission slot. Idempotent."""
        if self._released:
            return
        self._released = True
        pool = self._state.pool
        if pool is not None and self._loading is not None:
            pool.release(self._loading)
        self._state.release()


async def admit_leased(
    state: ServerState,
    request: Request,
    endpoint: str,
    parse: Callable[[bytes], T],
    model_of: Callable[[T], object],
    *,
    check_key: bool = False,
) -> tuple[T, ContextLease]:
    """:func:`admit_parsed`, then the lease on the model the body names: what a route that
    builds a :class:`~llamax.server.responses.CompletionJob` does first (the job's
    ``release`` is the lease's).

    Raises:
        APIError: as :func:`admit_parsed`, or 400/404/503 from :meth:`ServerState.lease`.
    """
    body = await admit_parsed(state, request, endpoint, parse, check_key=check_key)
    try:
        return body, state.lease(model_of(body))
    except APIError as error:
        state.metrics.requests.labels(endpoint, outcome_of(error.status)).inc()
        state.release()
        raise


async def run_leased(
    state: ServerState,
    request: Request,
    parse: Callable[[bytes], T],
    model_of: Callable[[T], object],
    work: Callable[[T, llamax.Context], R],
    *,
    check_key: bool = False,
) -> R:
    """Read the body, take an admission slot, ``parse`` it in a worker, wait for the model
    it names, and run ``work(body, ctx)`` (tokenizing, embedding, building the response) in
    a worker, so the event loop stays free. The slot and the model are held throughout.

    Raises:
        APIError: 401, 413, 503, what ``parse`` or ``work`` raise, or a lease's errors.
    """
    if check_key:
        state.check_api_key(request)
    raw = await read_body(request, state.config.max_body_bytes)
    state.admit()
    lease: ContextLease | None = None
    try:
        body = await run_in_threadpool(parse, raw)
        lease = state.lease(model_of(body))
        ctx = await lease.context()
        return await run_in_threadpool(work, body, ctx)
    finally:
        if lease is not None:
            lease.release()
        else:
            state.release()
