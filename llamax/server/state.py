"""What one app holds: the context (or its loading future), limits, metrics and guards."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

import llamax
from llamax.openai import ResponseStore

from .errors import APIError
from .metrics import ServerMetrics
from .responses import outcome_of

__all__ = ["ServerState", "admit_parsed", "read_body"]

T = TypeVar("T")


@dataclass(eq=False)
class ServerState:
    """Per-app state; routes close over it (no globals, so apps never share anything).

    Args:
        source: The context, or a future that will hold it once the model has loaded.
        api_key: The key clients must send as ``Authorization: Bearer ...``; ``None``: none.
        max_queue: Most requests admitted at once (being parsed, tokenized, rendered,
            running or waiting, tokenize and embeddings requests included); more get 503.
        max_body_bytes: Largest request body; larger ones get 413.
        retry_after_seconds: The ``Retry-After`` of a 503.
        parse_special_in_content: Chat message content may hold special tokens (unsafe;
            off by default, see docs/chat.md).
        responses: The Responses API's store of recent responses (``previous_response_id``).
        stream_ping_seconds: An Anthropic stream quiet this long gets a ``ping`` event.
    """

    source: llamax.Context | Future[llamax.Context]
    api_key: str | None = None
    max_queue: int = 256
    max_body_bytes: int = 8 << 20
    retry_after_seconds: int = 1
    parse_special_in_content: bool = False
    responses: ResponseStore = field(default_factory=ResponseStore)
    stream_ping_seconds: float = 10.0
    metrics: ServerMetrics = field(init=False)
    num_in_flight: int = 0

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.stats)

    def loaded(self) -> llamax.Context | None:
        """The context once loaded (``None`` while loading or if loading failed)."""
        if isinstance(self.source, llamax.Context):
            return self.source
        if self.source.done() and self.source.exception() is None:
            return self.source.result()
        return None

    def status(self) -> str:
        """``ok``, ``loading``, ``failed`` (the model did not load) or ``closed``."""
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
            status = self.status()
            raise APIError(503, f"the model is not available ({status})", code=f"model_{status}",
                           headers={"Retry-After": str(self.retry_after_seconds)})  # fmt: skip
        return ctx

    def stats(self) -> llamax.ContextStats | None:
        """The context's stats, or ``None`` while loading."""
        ctx = self.loaded()
        return None if ctx is None else ctx.stats()

    def admit(self) -> None:
        """Take an admission slot; give it back with :meth:`release`.

        Raises:
            APIError: 503 with ``Retry-After`` when ``max_queue`` requests are in flight.
        """
        if self.num_in_flight >= self.max_queue:
            raise APIError(
                503,
                f"the server is busy: {self.num_in_flight} requests in flight "
                f"(max_queue={self.max_queue}); retry later",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_seconds)},
            )
        self.num_in_flight += 1
        self.metrics.in_flight.inc()

    def release(self) -> None:
        """Give back an admission slot taken by :meth:`admit`."""
        self.num_in_flight -= 1
        self.metrics.in_flight.dec()

    def check_api_key(self, request: Request) -> None:
        """Raise 401 unless the request carries the key (when one is set)."""
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.headers.get("x-api-key", "")  # Anthropic's clients send this
        if not given or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
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
        raw = await read_body(request, state.max_body_bytes)
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
