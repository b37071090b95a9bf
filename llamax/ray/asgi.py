"""Carry one HTTP request from the ingress to a replica and run it through the server app.

The replica serves ``llamax.server.create_app(ctx)`` unchanged: :func:`run_asgi` drives that
ASGI app in-process and yields what it sends, so streaming (SSE), errors and cancellation
on disconnect behave exactly as under ``llamax serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ForwardedRequest", "ResponseStart", "run_asgi"]

Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """One HTTP request as the ingress hands it to a replica.

    ``routing_key`` is what the prefix-aware router hashes (``None``: any replica).
    """

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    routing_key: str | None = None


@dataclass(frozen=True, slots=True)
class ResponseStart:
    """The first item a replica yields: status and headers, plus who served it."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    replica: str
    pid: int
    extra: dict[str, Any] = field(default_factory=dict)


async def run_asgi(
    app: ASGIApp, request: ForwardedRequest
) -> AsyncIterator[tuple[int, tuple[tuple[bytes, bytes], ...]] | bytes]:
    """Run ``request`` through ``app``; yield ``(status, headers)`` once, then body chunks.

    Closing the iterator early (the client went away) tells the app the client
    disconnected, which cancels the llamax request, then waits for the app to finish.

    Args:
        app: An ASGI application (the llamax server).
        request: The request to run.

    Yields:
        ``(status, headers)`` first, then each non-empty body chunk.
    """
    scope: Message = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path,
        "raw_path": request.path.encode(), "query_string": request.query_string,
        "root_path": "", "headers": list(request.headers),
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    outbox: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await outbox.put(message)

    async def serve() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await outbox.put(None)

    task = asyncio.ensure_future(serve())
    try:
        while (message := await outbox.get()) is not None:
            if message["type"] == "http.response.start":
                yield (
                    message["status"],
                    tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ())),
                )
            elif message["type"] == "http.response.body" and message.get("body"):
                yield bytes(message["body"])
        await task
    finally:
        disconnected.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout=5)
            task.cancel()
