"""Speculative decoding inside the continuous batch: drafters and their per-sequence state.

A decoding sequence may carry draft tokens in its batch entry: the step feeds its pending
token followed by ``k`` guesses and asks for logits at every one of those positions, in the
same ``llama_decode`` as every other sequence. After the decode the scheduler samples the
rows in order with the sequence's own sampler chain (logits processors, grammar, penalties,
logprobs, seed: all as without speculation) and keeps going while the sampled token equals
the draft. The first mismatch, or the row after the last draft, yields one more token that
is always right. Rejected cells are removed with ``seq_rm``.

Why this is lossless: each row is sampled from exactly the distribution the sequence would
have sampled from without speculation, given the tokens before it, which are all accepted
(so equal to what it would have produced). With a deterministic draft ``d`` (one-hot
``q``), the standard speculative rule "accept ``d`` with probability ``min(1, p(d)/q(d)) =
p(d)``, else sample from ``norm(max(0, p - q))``" is the same as "sample ``t ~ p``; accept
if ``t == d``, else emit ``t``": both accept with probability ``p(d)`` and, on rejection,
draw from ``p`` restricted to tokens other than ``d``. The sampler consumes one random draw
per emitted token, as without speculation, so a seeded request is reproduced too.

Only the *drafter* is pluggable: :class:`PromptLookup` matches the sequence's last n-gram
against its own prompt and output. A small draft model can implement :class:`Drafter`
later; verification, acceptance and rollback stay the scheduler's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import numpy as np

from .errors import InvalidParameterError

__all__ = [
    "DecodeCost",
    "DraftState",
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
                raise InvalidParameterError(f"PromptLookup.{name} must be an int, got {value!r}")
        if not 1 <= self.max_draft <= MAX_DRAFT:
            raise InvalidParameterError(
                f"PromptLookup.max_draft must be in [1, {MAX_DRAFT}], got {self.max_draft}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise InvalidParameterError(
                "PromptLookup needs 1 <= ngram_min <= ngram_max <= 16, got "
                f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}"
            )

    def new_state(self) -> DraftState:
        """Per-sequence state: an incremental n-gram index and an acceptance record."""
        return DraftState(PromptLookupDrafter(self))


Speculative: TypeAlias = PromptLookup
"""The drafting methods a context or a request can ask for (a draft model may join later)."""


class Drafter(Protocol):
    """Proposes draft tokens for one sequence. Called on the engine thread only."""

    def propose(self, token_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens likely to follow ``token_ids`` (prompt plus output)."""
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


class DraftState:
    """One sequence's drafter and its acceptance record.

    ``acceptance`` estimates the probability that a draft token is accepted given the ones
    before it (a geometric model), from decayed counts of verified drafts. Copying comes in
    runs, so the counts are kept apart for two regimes: after a draft that was accepted
    whole ("hot": the output is copying) and otherwise ("cold"). The scheduler prices each
    draft token with the current regime's rate (see :meth:`expected_gain`) against the
    compute the token adds to the step, so the draft length adapts per sequence and per
    step, and a sequence whose drafts do not pay stops drafting. While it does not draft,
    the drafter's first proposed token is still checked against the token that actually
    follows (for free), so a sequence whose text turns repetitive starts drafting again.
    """

    __slots__ = (
        "_hot",
        "_shadow",
        "_successes",
        "_trials",
        "drafter",
        "num_accepted",
        "num_drafted",
    )

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        # [cold, hot] priors: acceptance 0.3 and 0.9
        self._successes, self._trials = [1.5, 4.5], [5.0, 5.0]
        self._hot = False
        self._shadow: tuple[int, int] | None = None  # (position, first proposed token)
        self.num_drafted = 0
        self.num_accepted = 0

    @property
    def acceptance(self) -> float:
        """Estimated probability that a draft token is accepted, given the ones before it."""
        return self._successes[self._hot] / self._trials[self._hot]

    def propose(self, token_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """A draft of at most ``limit`` tokens (``()`` when nothing matches)."""
        shadow, self._shadow = self._shadow, None
        if shadow is not None and shadow[0] < len(token_ids):
            hit = token_ids[shadow[0]] == shadow[1]
            self._learn(int(hit), 1, hot=hit)
        return self.drafter.propose(token_ids, limit)

    def expected_gain(self, j: int) -> float:
        """Probability that the ``j``-th draft token (1-based) is accepted."""
        return float(self.acceptance**j)

    def skipped(self, position: int, draft: Sequence[int]) -> None:
        """``draft`` was proposed at ``position`` but not verified: check it later."""
        if draft:
            self._shadow = (position, int(draft[0]))

    def record(self, drafted: int, accepted: int) -> None:
        """Learn from one verification of ``drafted`` tokens, ``accepted`` of them kept."""
        if drafted <= 0:
            return
        self.num_drafted += drafted
        self.num_accepted += accepted
        self._learn(accepted, accepted + (accepted < drafted), hot=accepted == drafted)

    def _learn(self, successes: int, trials: int, *, hot: bool) -> None:
        # decayed counts follow a sequence whose text changes character
        regime = self._hot
        self._successes[regime] = 0.85 * self._successes[regime] + successes
        self._trials[regime] = 0.85 * self._trials[regime] + trials
        self._hot = hot


class DecodeCost:
    """Online fit of ``seconds = base + per_token * tokens`` over steps without prompt chunks.

    Draft tokens are priced with it: what one more token adds to a step of decode rows.
    A separate, two-coefficient fit (rather than the chunk-sizing model of
    :mod:`llamax.step_budget`) because only small steps matter here, and there the token
    count alone explains the time well; verification steps of varying size make both
    coefficients identifiable. Recursive least squares on relative errors, with
    forgetting, from a prior of 4 ms + 3 ms a token (2 CPU threads, a 135M model).
    """

    def __init__(self, *, forgetting: float = 0.98) -> None:
        self._theta = np.array([0.004, 0.003])
        self._p = np.diag([1e-5, 1e-5])
        self._forgetting = forgetting

    @property
    def base(self) -> float:
        """Seconds a step costs beyond its tokens (at least 0)."""
        return max(float(self._theta[0]), 0.0)

    @property
    def per_token(self) -> float:
        """Seconds one more token adds to a small step (kept above 0.1 ms)."""
        return max(float(self._theta[1]), 1e-4)

    def predict(self, num_tokens: int) -> float:
        """Predicted seconds of a step of ``num_tokens`` decode and draft tokens."""
        return self.base + self.per_token * num_tokens

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Update the fit with one measured step."""
        weight = 1.0 / max(seconds, 1e-4)
        x = np.array([1.0, float(num_tokens)]) * weight
        px = self._p @ x
        gain = px / (self._forgetting + x @ px)
        self._theta = self._theta + gain * (seconds * weight - x @ self._theta)
        self._p = (self._p - np.outer(gain, px)) / self._forgetting
