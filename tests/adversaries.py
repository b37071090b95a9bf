"""Adversaries the robustness tests share: a logits processor that fails on a schedule, and
a runner that turns a hang into a failure."""

from __future__ import annotations

import threading
from collections.abc import Callable
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
