"""A byte budget for image decodes in flight, shared by every projector in the process.

A decode's pixels are allocated by native code (stb_image, inside ``mtmd``) on whichever
thread reads the image: a chat's executor threads, Starlette's pool for ``/completion``,
a user's own threads. Each decode is bounded by the pixel limits, but nothing bounded how
many run at once: sixteen 4096x4096 images decoded together take gigabytes. Every decode
first takes its peak bytes from one :class:`DecodeBudget` and gives them back when it
ends; a decode that does not fit waits for others to finish. One process, one machine:
the budget is the process's (:data:`DECODE_BUDGET`), not a context's, so a pool of models
shares it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .image_file import ImageHeader

__all__ = ["DECODE_BUDGET", "DECODE_BUDGET_BYTES", "DecodeBudget", "decode_bytes"]

DECODE_BUDGET_BYTES = 256 * 2**20
"""The bytes of image decodes in flight at once: one image at the default pixel limit."""
_PEAK_BYTES_A_PIXEL = 16  # a PNG's rows inflated (16-bit RGBA: 8), stb's output, the RGB copy


def decode_bytes(header: ImageHeader) -> int:
    """What decoding the image of ``header`` allocates at its peak, about: stb_image's
    inflated PNG rows and its output, then the RGB copies (16-bit RGBA PNGs come closest)."""
    return _PEAK_BYTES_A_PIXEL * header.width * header.height


class DecodeBudget:
    """Bytes of decodes in flight, at most ``capacity``; any thread.

    A decode larger than the whole budget still runs, alone (it takes all of it).

    Args:
        capacity: The bytes decodes may hold at once.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._cond = threading.Condition()
        self._num_bytes = 0
        self._num_waiting = 0

    @property
    def num_bytes(self) -> int:
        """The bytes held by decodes running now."""
        with self._cond:
            return self._num_bytes

    @property
    def num_waiting(self) -> int:
        """Decodes waiting for room."""
        with self._cond:
            return self._num_waiting

    @contextmanager
    def held(self, num_bytes: int) -> Iterator[None]:
        """Hold ``num_bytes`` (at most the capacity) while the block runs, waiting first
        until they fit beside what other decodes hold."""
        take = min(max(num_bytes, 0), self.capacity)
        with self._cond:
            self._num_waiting += 1
            try:
                self._cond.wait_for(lambda: self._num_bytes + take <= self.capacity)
            finally:
                self._num_waiting -= 1
            self._num_bytes += take
        try:
            yield
        finally:
            with self._cond:
                self._num_bytes -= take
                self._cond.notify_all()


DECODE_BUDGET = DecodeBudget(DECODE_BUDGET_BYTES)
"""The process's budget: decoded pixels compete for one machine's memory, whichever
context or model reads them."""
