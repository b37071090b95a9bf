"""Submitting off the event loop: rendering and tokenizing a call is CPU work, so an async
caller runs it in a worker thread, and a caller that goes away cancels what it submitted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from ..handle import RequestHandle

__all__ = ["submit_in_worker"]

T = TypeVar("T")


async def submit_in_worker(submit: Callable[[], T], handle_of: Callable[[T], RequestHandle]) -> T:
    """Run ``submit`` (render, tokenize, submit) in the loop's default executor, so the
    event loop stays free; ``handle_of`` finds the submitted request's handle in its result.

    Cancelling the caller does not stop the worker; the request it submits is cancelled
    as soon as it exists, so nothing runs for a caller that has gone.
    """
    future = asyncio.get_running_loop().run_in_executor(None, submit)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(lambda done: _cancel_submitted(done, handle_of))
        raise


def _cancel_submitted(future: asyncio.Future[T], handle_of: Callable[[T], RequestHandle]) -> None:
    if not future.cancelled() and future.exception() is None:
        handle_of(future.result()).cancel()
