"""The optional progress bar of batch generation (``tqdm.auto``: a widget in Jupyter)."""

from __future__ import annotations

import time
from typing import Any

from .errors import InvalidParameterError
from .results import Completion

__all__ = ["PROGRESS_DELAY_S", "BatchProgress"]

PROGRESS_DELAY_S = 2.0
"""With ``progress=None``, a bar appears only once a batch has run this long."""


class BatchProgress:
    """An optional ``tqdm.auto`` bar counting finished requests, with generated tok/s.

    Args:
        progress: ``True`` shows the bar at once (and needs tqdm); ``None`` shows it once
            the batch has run :data:`PROGRESS_DELAY_S` seconds, if tqdm is installed;
            ``False`` never.
        total: the number of requests.

    Raises:
        InvalidParameterError: ``progress=True`` and tqdm is not installed.
    """

    def __init__(self, progress: bool | None, total: int) -> None:
        self._wanted = progress
        self._total = total
        self._start = time.monotonic()
        self._num_done = 0
        self._num_tokens = 0
        self._bar: Any = None
        self._tqdm: Any = None
        if progress is not False:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                if progress:
                    raise InvalidParameterError(
                        "progress=True needs tqdm: pip install tqdm", param="progress"
                    ) from None
                return
            self._tqdm = tqdm
            if progress:
                self._open()

    def _open(self) -> None:
        self._bar = self._tqdm(
            total=self._total, initial=self._num_done, unit="req", desc="generate", leave=True
        )

    def advance(self, outcome: Completion | BaseException) -> None:
        """Count one finished request."""
        self._num_done += 1
        if isinstance(outcome, Completion):
            self._num_tokens += outcome.usage.completion_tokens
        self.refresh()

    def refresh(self) -> None:
        """Show the bar once the batch is slow enough, and update it."""
        elapsed = time.monotonic() - self._start
        if self._bar is None:
            if self._tqdm is None or self._wanted is False or elapsed < PROGRESS_DELAY_S:
                return
            if self._num_done >= self._total:
                return
            self._open()
        self._bar.n = self._num_done
        self._bar.set_postfix_str(f"{self._num_tokens / max(elapsed, 1e-9):.1f} tok/s")

    def close(self) -> None:
        """Close the bar (if it was shown)."""
        if self._bar is not None:
            self._bar.n = self._num_done
            self._bar.close()
