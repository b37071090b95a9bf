"""Helpers the benchmark scripts share: progress on stderr, JSON-only stdout, load, ratios."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import llama_cpp.llama_cpp as C

__all__ = ["eog_token_ids", "load_average", "log", "ratio", "stdout_to_stderr"]


def log(message: str) -> None:
    """Progress, on stderr (stdout holds only the JSON report)."""
    print(message, file=sys.stderr, flush=True)


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (2 cores: anything above ~2 means contention)."""
    return [round(x, 2) for x in os.getloadavg()]


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den`` rounded to 4 digits, or None when either is missing."""
    return round(num / den, 4) if num is not None and den else None


def eog_token_ids(vocab: Any) -> list[int]:
    """Every end-of-generation token id of a vocabulary (0, 2 and 4 for SmolLM2)."""
    return [t for t in range(C.llama_vocab_n_tokens(vocab)) if C.llama_vocab_is_eog(vocab, t)]


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[TextIO]:
    """Send fd 1 to stderr (native prints included); yield a stream on the real stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = os.fdopen(saved, "w")
    try:
        yield real
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        real.close()
