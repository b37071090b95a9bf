"""Graceful shutdown that tells the clients it cuts.

Design: on the first SIGINT/SIGTERM (or :meth:`BackgroundServer.stop`) the server stops
accepting connections and lets every request in flight, streams included, run for
``--shutdown-timeout`` seconds; a reply that ends in time is whole. When the timeout runs
out, or at once on a second Ctrl-C, what still runs is cancelled (which frees its KV
cells) and answered in its API's shape: a request not yet answered gets a 503, and an open
stream gets its dialect's error event (OpenAI: a ``data: {"error": ...}`` then
``data: [DONE]``; Anthropic: ``event: error`` with ``overloaded_error``; Responses: an
``error`` event; llama-server: its error shape), then the end of its body. A stream is
given the grace rather than cut at once so that a rolling restart does not cut replies
that would have finished; ``--shutdown-timeout 0`` cuts them at once.

uvicorn does the draining (``timeout_graceful_shutdown``) and the cancelling;
:class:`GracefulServer` adds a log line saying what it waits for, and on a forced exit it
cancels the requests itself and finishes the app's lifespan, which uvicorn skips (asyncio
then cancels the lifespan task and Starlette logs that as a ``CancelledError`` traceback).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from .errors import APIError

__all__ = ["CUT_TAIL_KEY", "CutTail", "GracefulServer", "shutdown_error"]

logger = logging.getLogger("llamax.server")

CUT_TAIL_KEY = "llamax.cut_tail"
"""The ASGI scope key of a request's :class:`CutTail`."""

_FORCED_CUT_SECONDS = 5.0
"""How long a forced exit waits for the cancelled requests to send their last bytes."""


def shutdown_error() -> APIError:
    """The error a request cut by the shutdown gets (503: the client may send it again)."""
    return APIError(
        503,
        "server shutting down: the request was cut before it finished; send it again",
        code="server_shutting_down",
    )


@dataclass(slots=True)
class CutTail:
    """What a started stream sends last if the shutdown cuts it; set by the stream once
    its headers are out (None: end the body with nothing more)."""

    render: Callable[[], bytes] | None = None


class GracefulServer(uvicorn.Server):
    """uvicorn's server, with a shutdown that says what it waits for and a forced exit
    (a second Ctrl-C) that answers what it cuts and leaves no traceback."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop accepting; let requests finish within the timeout; answer the rest."""
        num_open, seconds = len(self.server_state.tasks), self.config.timeout_graceful_shutdown
        if num_open:
            logger.warning(
                "shutting down: %d request(s) in flight get %s to finish, then are cut "
                "with an error; press Ctrl-C again to cut them now",
                num_open, "all the time they need" if seconds is None else f"{seconds} s",
            )  # fmt: skip
        await super().shutdown(sockets)
        if self.force_exit:
            await self._cut_requests()
            await self.lifespan.shutdown()

    async def _cut_requests(self) -> None:
        """Cancel the requests still running and wait (bounded) until each has sent its
        last bytes: a 503, or a stream's error event and end."""
        tasks = list(self.server_state.tasks)
        if not tasks:
            return
        logger.warning("forced exit: cutting %d request(s)", len(tasks))
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=_FORCED_CUT_SECONDS)
