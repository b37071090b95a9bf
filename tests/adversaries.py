"""Adversaries the robustness tests share: a logits processor that fails on a schedule, and
runners that turn a hang into a failure."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np


class FlakyProcessor:
    """A logits processor that raises whenever the history's length is a multiple of
    ``every``: its request fails on its first row, mid-output, or never."""

    def __init__(self, every: int) -> None:
        self.every = every

    def __call__(self, token_ids: object, logits: object) -> None:
        assert isinstance(token_ids, np.ndarray)
        if len(token_ids) % self.every == 0:
            raise ValueError(f"flaky processor at length {len(token_ids)}")

    def __repr__(self) -> str:
        return f"FlakyProcessor({self.every})"


def in_thread(fn: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Run ``fn`` in a daemon thread; fail (not hang) if it does not return in time."""
    out: Future[Any] = Future()

    def body() -> None:
        try:
            out.set_result(fn())
        except BaseException as exc:
            out.set_exception(exc)

    threading.Thread(target=body, daemon=True).start()
    return out.result(timeout)


class Blocked(Exception):
    """Not an OSError: code that refuses unreadable files must not swallow it."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`Blocked` in this (the main) thread if the block runs longer: a blocking
    ``open`` of a FIFO is interrupted, so a regression fails instead of hanging the suite."""

    def expire(signum: int, frame: object) -> None:
        raise Blocked(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
