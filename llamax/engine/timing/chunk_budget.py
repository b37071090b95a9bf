"""Time-budgeted chunking: how many prompt tokens each step computes beside its decode rows.

:class:`ChunkBudget` turns ``max_step_ms`` and
:class:`~llamax.engine.timing.step_budget.StepCostModel`'s prediction into chunk sizes (the
idea and the measurements are in :mod:`llamax.engine.timing.step_budget`). It sees numbers
only (tokens, cells, positions); the scheduler asks it once per step
(:meth:`ChunkBudget.start_step`) and once per prompt chunk (:meth:`ChunkBudget.chunk`), and
applies the answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from .step_budget import (
    MAX_STRETCH,
    MIN_CHUNK,
    OVERRUN,
    StepCostModel,
    StepFeatures,
    Waste,
    micro_batch,
    step_with_chunk,
)

__all__ = ["ChunkBudget", "halve_newest_chunk"]


class ChunkBudget:
    """Sizes prompt chunks so a step stays within ``max_step_ms`` while anybody decodes.

    Args:
        n_batch: The most tokens a step may hold.
        max_step_ms: The time prompt chunks may add to a step's decode rows; None gives
            every chunk what the batch has room for.
        waste: The backend's tile waste table
            (:func:`~llamax.engine.timing.step_budget.tile_waste_table`).
    """

    def __init__(self, n_batch: int, max_step_ms: float | None, *, waste: Waste | None = None):
        self.cost = StepCostModel(waste=waste)
        """The learned step cost model (the scheduler feeds it measured steps)."""
        self.n_batch = n_batch
        self.max_step_s = None if max_step_ms is None else max_step_ms / 1000
        self._step_s = 0.0
        self._stretched_s = 0.0
        self._pause_s = 0.0

    def note_pause(self, seconds: float) -> None:
        """The streams were just paused ``seconds`` (a KV layout move): the next step's
        chunks get that much less time."""
        self._pause_s = seconds

    def start_step(
        self, decode_computed: Sequence[int], *, unified: bool, streaming: bool = True
    ) -> StepFeatures | None:
        """Set this step's budget from its decode rows.

        Args:
            decode_computed: The tokens each decoding sequence of the step holds in KV.
            unified: Whether the cache is one buffer.
            streaming: Whether a row is a reply's, whose stream waits for its next token;
                rows that only compute a prompt's last token (a memory cut at checkpoints
                computes it alone) keep nobody's pace.

        Returns:
            The decode rows' features, which :meth:`chunk` takes and grows; None when
            chunks are not timed (no reply decodes, or no ``max_step_ms``).
        """
        pause, self._pause_s = self._pause_s, 0.0
        if not decode_computed or not streaming or self.max_step_s is None:
            return None
        fixed = self.decode_features(decode_computed, unified=unified)
        # the prompt chunks of a step may add up to max_step_ms to its decode rows, and a
        # chunk that would be unfair may stretch the step to MAX_STRETCH times the larger of
        # max_step_ms and the decode rows' time, the overrun a faster chunk may take
        # included (so the stretched budget is that over OVERRUN); a layout move's pause
        # comes off both
        decode_s = self.cost.predict(fixed)
        self._step_s = self.max_step_s + decode_s - pause
        self._stretched_s = MAX_STRETCH * max(self.max_step_s, decode_s) / OVERRUN - pause
        return fixed

    def chunk(
        self,
        fixed: StepFeatures | None,
        limit: int,
        *,
        num_pending: int,
        num_computed: int,
        num_cells_used: int,
        num_decode: int,
        unified: bool,
    ) -> tuple[int, StepFeatures | None]:
        """How many of a sequence's pending tokens this step computes, within the budget.

        The first prompt chunk of a timed step always advances (``MIN_CHUNK`` at least).
        A chunk that the budget would keep smaller than its fair chunk gets the most that
        keeps the step within ``MAX_STRETCH`` times the larger of ``max_step_ms`` and the
        decode rows' time instead (predicted within that over ``OVERRUN``, which only a
        chunk making progress 1.5x faster may use), so a long prompt is not slowed down
        much by the decode rows and a burst of short prompts is admitted in few steps;
        otherwise a chunk gets only what room the prediction leaves.

        Args:
            fixed: What the step holds so far (from :meth:`start_step` or the last call).
            limit: The most tokens the chunk may have (batch room, pending tokens).
            num_pending: The sequence's pending tokens.
            num_computed: The tokens the sequence holds in KV.
            num_cells_used: KV cells in use.
            num_decode: Decode rows in the step.
            unified: Whether the cache is one buffer.

        Returns:
            The chunk's size and the step's features with it.
        """
        if fixed is None or self.max_step_s is None:
            return limit, fixed
        attend = num_cells_used + fixed.num_tokens if unified else num_computed
        cost = self.cost
        floor = MIN_CHUNK if fixed.num_tokens == num_decode else 0  # the step's first chunk
        take = cost.largest_chunk(fixed, attend, limit, self._step_s, unified=unified, floor=floor)
        budget = self._step_s
        if take < limit and self._is_unfair(fixed, attend, limit, take, num_pending, unified):
            budget = max(self._step_s, self._stretched_s)
            most = cost.largest_chunk(fixed, attend, limit, budget, unified=unified, floor=0)
            take = max(take, most)
        if take < limit == num_pending:
            take = cost.last_chunks(fixed, attend, take, limit, budget, unified=unified)
        return take, step_with_chunk(fixed, take, attend, unified=unified, waste=cost.waste)

    def _is_unfair(
        self,
        fixed: StepFeatures,
        attend: int,
        limit: int,
        take: int,
        num_pending: int,
        unified: bool,
    ) -> bool:
        """Whether the budget's chunk of ``take`` tokens is smaller than the fair one, here
        or where the prompt's last chunk will attend (``attend`` plus its pending tokens).

        Judged here alone, a long prompt's early chunks look fair (they attend to little)
        and only its late ones stretch, when most of the slowdown can no longer be won
        back; judged at its end too, a prompt that will need the stretch has it from its
        first chunk, where a larger chunk also costs less a token.
        """
        cost = self.cost
        lone = min(self.n_batch, num_pending)
        if cost.fair_chunk(fixed, attend, limit, lone, unified=unified) > take:
            return True
        end = attend + num_pending - limit
        if end <= attend:
            return False
        at_end = cost.largest_chunk(fixed, end, limit, self._step_s, unified=unified, overrun=False)
        return cost.fair_chunk(fixed, end, limit, lone, unified=unified) > at_end

    def whole(
        self,
        fixed: StepFeatures | None,
        take: int,
        *,
        num_computed: int,
        num_cells_used: int,
        unified: bool,
    ) -> StepFeatures | None:
        """The step's features with a chunk of ``take`` tokens that cannot be cut (a
        non-causal image), whatever the budget says."""
        if fixed is None or self.max_step_s is None:
            return fixed
        attend = num_cells_used + fixed.num_tokens if unified else num_computed
        return step_with_chunk(fixed, take, attend, unified=unified, waste=self.cost.waste)

    def decode_features(self, decode_computed: Sequence[int], *, unified: bool) -> StepFeatures:
        """Features of decode rows whose sequences hold ``decode_computed`` tokens."""
        if unified:
            cells = sum(num + 1 for num in decode_computed)
            return micro_batch(len(decode_computed), cells, waste=self.cost.waste)
        return sum((micro_batch(1, num + 1) for num in decode_computed), StepFeatures())

    def step_features(
        self, entries: Sequence[tuple[int, int, int]], num_cells_used: int, *, unified: bool
    ) -> StepFeatures:
        """What a step costs, in the cost model's terms.

        Args:
            entries: ``(tokens fed, first position, tokens computed)`` of each sequence.
            num_cells_used: KV cells in use before the step.
            unified: Whether the cache is one buffer.
        """
        waste = self.cost.waste
        if unified:  # a decode row reads its own cells; a prompt chunk, the span
            num = sum(n for n, _, _ in entries)
            own = [computed + 1 for n, _, computed in entries if n == 1]
            chunks = (num - len(own)) * (num_cells_used + num)
            return micro_batch(num, sum(own) + chunks, waste=waste)
        return sum(
            (micro_batch(n, n * (start + n // 2), waste=waste) for n, start, _ in entries),
            StepFeatures(),
        )


def halve_newest_chunk(num_tokens: Sequence[int]) -> list[int] | None:
    """The tokens each entry of a step feeds once its newest prompt chunk (the last entry
    of more than one token) is halved, to answer a decode that found no room; None if the
    step holds no chunk."""
    chunks = [i for i, num in enumerate(num_tokens) if num > 1]
    if not chunks:
        return None
    halved = list(num_tokens)
    halved[chunks[-1]] //= 2
    return halved
