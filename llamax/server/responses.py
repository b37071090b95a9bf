"""Pure-ASGI responses that run a completion while watching for the client to leave.

Starlette's ``StreamingResponse`` notices a disconnect only when it next writes, and a plain
JSON route not at all: a client that gives up during a long prefill would keep its
sequence and KV cells busy until the reply was complete. These responses read ``receive``
in a sibling task from the start; ``http.disconnect`` cancels the work at once, which
cancels the llamax request (closing a chunk stream, or cancelling an awaited handle, frees
its KV cells).

The status is chosen only once the work has produced something: an error before the first
chunk still gets its proper status (400, 500 ...); an error after it is sent as a last
``data: {"error": ...}`` event, as OpenAI does.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .dialects import StreamMeter, sse
from .errors import from_exception
from .metrics import ServerMetrics, TokenClock
from .shutdown import CUT_TAIL_KEY, CutTail, shutdown_error

if TYPE_CHECKING:
    from .route import CompletionRoute, Lease

__all__ = ["CompletionJob", "CompletionResponse", "outcome_of"]


class CompletionJob:
    """One admitted request: its route, its parsed body, the lease on its model, and the
    bookkeeping when it ends.

    :meth:`start` returns the response dict, or (streaming) an async iterator of event
    dicts; a stream of OpenAI's chunks always ends with a usage chunk, which the client sees
    when ``include_usage``.
    """

    def __init__(
        self,
        route: CompletionRoute[Any],
        body: Any,
        lease: Lease,
        request: Request,
        metrics: ServerMetrics,
    ) -> None:
        self.route, self.body, self.lease, self.request = route, body, lease, request
        self.metrics = metrics
        self.endpoint, self.dialect = route.endpoint, route.dialect
        self.fields, self.prompt_field = route.fields, route.prompt_field
        self.ping_seconds = route.ping_seconds
        """Send a ``ping`` event whenever the stream has been quiet this long (a long
        prefill, a slow step), so that proxies and clients with idle timeouts wait."""
        self.stream = route.stream(body)
        self.include_usage = route.include_usage(body)
        self.started = time.perf_counter()

    async def start(self) -> Any:
        """Wait for the model, then submit the request on its context."""
        return await self.route.start(self.body, await self.lease.context(), self.request)

    def finish(self, outcome: str) -> None:
        """Record the outcome and free the lease and the admission slot."""
        self.metrics.requests.labels(self.endpoint, outcome).inc()
        self.metrics.duration.labels(self.endpoint).observe(time.perf_counter() - self.started)
        self.lease.release()


def outcome_of(status: int) -> str:
    """The ``outcome`` label of a response status."""
    if status < 400:
        return "success"
    if status == 503:
        return "rejected"
    return "client_error" if status < 500 else "server_error"


_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


async def _send_json(send: Send, status: int, body: object, headers: dict[str, str]) -> None:
    raw = json.dumps(body, ensure_ascii=False).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *extra]})  # fmt: skip
    await send({"type": "http.response.body", "body": raw})


class CompletionResponse(Response):
    """Runs a :class:`CompletionJob` as the response to one HTTP request.

    A :class:`~starlette.responses.Response` only so that FastAPI passes it through; it
    writes its own status, headers and body.
    """

    def __init__(self, job: CompletionJob) -> None:
        super().__init__()
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = "cancelled"  # unless the work ends on its own: disconnect or shutdown
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_cancel_on_disconnect, receive, tasks.cancel_scope)
                if self.job.stream:
                    outcome = await self._stream(send, scope.get(CUT_TAIL_KEY))
                else:
                    outcome = await self._whole(send)
                tasks.cancel_scope.cancel()
        finally:
            self.job.finish(outcome)

    async def _error(self, send: Send, exc: Exception) -> str:
        error = from_exception(exc, self.job.fields, self.job.prompt_field)
        await _send_json(send, error.status, self.job.dialect.error_body(error), error.headers)
        return outcome_of(error.status)

    async def _whole(self, send: Send) -> str:
        try:
            result = await self.job.start()
        except Exception as exc:
            return await self._error(send, exc)
        self.job.metrics.record_usage(self.job.dialect.result_usage(result))
        await _send_json(send, 200, result, {})
        return "success"

    async def _stream(self, send: Send, cut: CutTail | None) -> str:
        job = self.job
        chunks: AsyncGenerator[dict[str, Any], None]
        try:
            chunks = await job.start()
            first = await anext(chunks)
        except Exception as exc:
            return await self._error(send, exc)
        meter = StreamMeter(job.metrics, TokenClock(job.metrics, job.started), job.include_usage)
        if cut is not None:  # what the stream ends with if the shutdown cuts it
            cut.render = lambda: job.dialect.error_event(shutdown_error(), meter) + job.dialect.done
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            if job.ping_seconds is None:
                return await self._send_chunks(send, first, chunks, meter)
            pinged = _PingedSender(send, job.ping_seconds)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(pinged.ping_while_quiet)
                outcome = await self._send_chunks(pinged.send, first, chunks, meter)
                tasks.cancel_scope.cancel()
            return outcome
        finally:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()

    async def _send_chunks(
        self,
        send: Send,
        first: dict[str, Any],
        chunks: AsyncIterator[dict[str, Any]],
        meter: StreamMeter,
    ) -> str:
        job = self.job
        outcome, tail = "success", job.dialect.done
        try:
            await self._send_chunk(send, first, meter)
            async for chunk in chunks:
                await self._send_chunk(send, chunk, meter)
        except Exception as exc:
            error = from_exception(exc, job.fields, job.prompt_field)
            outcome, tail = outcome_of(error.status), job.dialect.error_event(error, meter)
        await send({"type": "http.response.body", "body": tail})
        return outcome

    async def _send_chunk(self, send: Send, chunk: dict[str, Any], meter: StreamMeter) -> None:
        body = self.job.dialect.frame(chunk, meter)
        if body is not None:
            await send({"type": "http.response.body", "body": body, "more_body": True})


_PING = sse({"type": "ping"}, "ping")


class _PingedSender:
    """Wraps an ASGI ``send`` so that a sibling task can slip a ``ping`` event in whenever
    nothing has been sent for ``interval`` seconds; never after the last body message."""

    def __init__(self, send: Send, interval: float) -> None:
        self._send, self._interval = send, interval
        self._lock = anyio.Lock()
        self._last = time.monotonic()
        self._ended = False

    async def send(self, message: Any) -> None:
        async with self._lock:
            await self._send(message)
            self._last = time.monotonic()
            self._ended = not message.get("more_body", False)

    async def ping_while_quiet(self) -> None:
        while True:
            await anyio.sleep(max(0.0, self._last + self._interval - time.monotonic()))
            async with self._lock:
                if self._ended:
                    return
                if time.monotonic() - self._last >= self._interval:
                    await self._send(
                        {"type": "http.response.body", "body": _PING, "more_body": True}
                    )
                    self._last = time.monotonic()


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
