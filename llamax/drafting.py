"""What a request or a context asks speculative decoding to draft with: plain values, below
the engine.

:class:`PromptLookup` is the method llamax ships (prompt-lookup, n-gram drafting; see
docs/speculative.md); a method is anything that makes each sequence a :class:`Drafter`
(:class:`DraftMethod`). Verification, acceptance and rollback are the engine's
(``llamax.engine.spec.speculative``): a drafter only proposes tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from .errors import InvalidParameterError

__all__ = [
    "MAX_DRAFT",
    "DraftMethod",
    "Drafter",
    "PromptLookup",
    "PromptLookupDrafter",
    "Speculative",
]

MAX_DRAFT = 64
"""The largest ``max_draft`` accepted."""


@dataclass(frozen=True, slots=True)
class PromptLookup:
    """Prompt-lookup (n-gram) drafting: no draft model, no extra memory.

    At each step the sequence's last ``n`` tokens (``ngram_max`` down to ``ngram_min``) are
    looked up in its own prompt and output; the tokens that followed their most recent
    earlier occurrence are the draft, at most ``max_draft`` of them. The scheduler keeps only
    the draft tokens whose expected gain, from the sequence's measured acceptance rate, pays
    for the compute they add to the step, so the length adapts per sequence and drafting
    yields under a full batch or a long prompt chunk.
    """

    max_draft: int = 10
    ngram_max: int = 3
    ngram_min: int = 2

    def __post_init__(self) -> None:
        for name in ("max_draft", "ngram_max", "ngram_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidParameterError(
                    f"PromptLookup.{name} must be an int, got {value!r}", param=name
                )
            if value.bit_length() > 63:  # before any message shows it (repr past 4,300 digits)
                raise InvalidParameterError(
                    f"PromptLookup.{name} is out of range: an int of {value.bit_length()} bits",
                    param=name,
                )
        if not 1 <= self.max_draft <= MAX_DRAFT:
            raise InvalidParameterError(
                f"PromptLookup.max_draft must be in [1, {MAX_DRAFT}], got {self.max_draft}",
                param="max_draft",
            )
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise InvalidParameterError(
                "PromptLookup needs 1 <= ngram_min <= ngram_max <= 16, got "
                f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}",
                param="ngram_min" if not 1 <= self.ngram_min <= 16 else "ngram_max",
            )

    def new_drafter(self) -> PromptLookupDrafter:
        """A new sequence's drafter: an incremental n-gram index of its tokens."""
        return PromptLookupDrafter(self)


Speculative: TypeAlias = PromptLookup
"""The drafting methods a context or a request can ask for (a draft model may join later)."""


class Drafter(Protocol):
    """Proposes draft tokens for one sequence. Called on the engine thread only."""

    def propose(self, token_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens likely to follow ``token_ids`` (prompt plus output)."""
        ...


@runtime_checkable
class DraftMethod(Protocol):
    """A drafting method (such as :class:`PromptLookup`): makes each sequence's drafter.
    Callers check for this protocol, not for a class, so a new method touches no caller;
    the engine keeps each sequence's acceptance record beside the drafter."""

    def new_drafter(self) -> Drafter:
        """A new sequence's drafter."""
        ...


class PromptLookupDrafter:
    """Incremental index of every n-gram of one sequence: n-gram -> where it last ended.

    Indexing is O(``ngram_max - ngram_min + 1``) per new token; a lookup is one dict probe
    per n-gram size. Only ends strictly before the sequence's last token are indexed, so the
    final n-gram never matches itself.
    """

    __slots__ = ("_config", "_indexed", "_last_end")

    def __init__(self, config: PromptLookup) -> None:
        self._config = config
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at e < _indexed are in the index

    def propose(self, token_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """The continuation of the longest suffix n-gram seen earlier (most recent wins)."""
        length = len(token_ids)
        limit = min(limit, self._config.max_draft)
        if length < self._indexed:  # the sequence was cut back (never in practice)
            self._last_end.clear()
            self._indexed = 0
        lo, hi = self._config.ngram_min, self._config.ngram_max
        last_end = self._last_end
        for end in range(self._indexed, length):  # index n-grams ending before ``length``
            for n in range(lo, min(hi, end) + 1):
                last_end[tuple(token_ids[end - n : end])] = end
        self._indexed = max(self._indexed, length)
        if limit <= 0:
            return ()
        for n in range(min(hi, length), lo - 1, -1):
            found = last_end.get(tuple(token_ids[length - n :]))
            if found is not None:
                return tuple(token_ids[found : found + limit])
        return ()
