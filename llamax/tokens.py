"""Helpers on token id sequences."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FimTokens", "common_prefix_len"]


@dataclass(frozen=True, slots=True)
class FimTokens:
    """The model's fill-in-the-middle tokens, as llama.cpp's vocabulary knows them (from
    the GGUF's ``tokenizer.ggml.fim_*_token_id`` keys, or found by their text, such as
    ``<fim_prefix>``); ``None`` for each the model lacks. ``Context.fim_tokens``."""

    prefix: int | None = None
    """Opens the code before the cursor (``<fim_prefix>``, ``<|fim_prefix|>``, ``<PRE>``)."""
    suffix: int | None = None
    """Opens the code after the cursor."""
    middle: int | None = None
    """Ends the prompt: the model writes the middle after it."""
    pad: int | None = None
    repo: int | None = None
    """Opens a repository name (repo-level FIM, Qwen2.5-Coder's ``<|repo_name|>``)."""
    separator: int | None = None
    """Opens each extra file of repo-level FIM (``<|file_sep|>``)."""

    @property
    def can_infill(self) -> bool:
        """Whether prefix, suffix and middle are all known (what infill needs)."""
        return None not in (self.prefix, self.suffix, self.middle)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by binary search over C-speed slice compares."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
