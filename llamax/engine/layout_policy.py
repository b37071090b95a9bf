"""KV-layout adaptation for ``kv_layout="auto"``: when to move between streams and unified.

One stream per sequence while every sequence fits one: each decode attends only to its
own cells. The unified layout while one needs more: any sequence may grow to ``n_ctx``, but
each decode attends over the whole used span (docs/kv-cache.md). Streams again once all
fit with room to grow, after :data:`RELAYOUT_COOLDOWN_STEPS` steps in the unified layout
and with at least :data:`RELAYOUT_MIN_DECODING` sequences decoding (to whom streams are
faster).

:class:`LayoutPolicy` decides on numbers (token counts); the layout's state and its moves
belong to :class:`~llamax.engine.kvcache.KVCache` (:class:`~llamax.engine.kvcache.LayoutState`);
the scheduler makes room before a move and performs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["RELAYOUT_COOLDOWN_STEPS", "RELAYOUT_MIN_DECODING", "LayoutPolicy"]

RELAYOUT_COOLDOWN_STEPS = 32
"""With ``kv_layout="auto"``, steps spent in the unified layout before moving back to streams."""
RELAYOUT_MIN_DECODING = 2
"""Decoding sequences needed to move back to streams (one sequence attends alike in both)."""


@dataclass(slots=True)
class LayoutPolicy:
    """Decides the moves of ``kv_layout="auto"`` between streams and the unified layout."""

    stream_cells: int
    """Cells one sequence holds in its own stream."""
    num_steps_in_layout: int = 0
    """Steps since the last move."""

    def count_step(self) -> None:
        """Count one more step in the current layout."""
        self.num_steps_in_layout += 1

    def restart_count(self) -> None:
        """The layout just moved: the cooldown starts again."""
        self.num_steps_in_layout = 0

    def should_unify(self, num_tokens: Iterable[int]) -> bool:
        """Whether a sequence holding one of ``num_tokens`` tokens outgrew its stream."""
        return any(num > self.stream_cells for num in num_tokens)

    def cells_to_come(self, num_tokens: int, num_generated: int, max_tokens: int | None) -> int:
        """Cells a sequence will hold within a quarter stream of growth (or its
        ``max_tokens``).

        Args:
            num_tokens: Tokens it holds (prompt and output).
            num_generated: Tokens it generated.
            max_tokens: Its request's ``max_tokens``.
        """
        room = self.stream_cells // 4
        if max_tokens is not None:
            room = min(room, max(0, max_tokens - num_generated))
        return num_tokens + room

    def should_split(
        self,
        *,
        num_decoding: int,
        cells_to_come: Iterable[int],
        session_cells: Iterable[int],
        cooldown_steps: int = RELAYOUT_COOLDOWN_STEPS,
    ) -> bool:
        """Whether the unified cache should move back to one stream per sequence.

        Args:
            num_decoding: Sequences decoding now.
            cells_to_come: :meth:`cells_to_come` of every unfinished sequence (read only
                if the cooldown is over and enough sequences decode).
            session_cells: Tokens each open session holds (it would have to fit a stream).
            cooldown_steps: Steps to stay in the unified layout after a move.
        """
        if self.num_steps_in_layout < cooldown_steps or num_decoding < RELAYOUT_MIN_DECODING:
            return False
        cap = self.stream_cells
        return all(num <= cap for num in cells_to_come) and all(num <= cap for num in session_cells)

    def next_layout(
        self,
        *,
        unified: bool,
        can_split: bool,
        sequences: Iterable[tuple[int, int, int | None]],
        num_decoding: Callable[[], int],
        session_cells: Iterable[int],
        cooldown_steps: int = RELAYOUT_COOLDOWN_STEPS,
    ) -> bool | None:
        """The layout to move to now: True for unified, False for streams, None to stay.

        Args:
            unified: Whether the cache is one buffer now.
            can_split: Whether the unified cache may move back to streams.
            sequences: ``(tokens held, tokens generated, max_tokens)`` of every unfinished
                sequence (read lazily).
            num_decoding: Counts the sequences decoding now (called only if needed).
            session_cells: Tokens each open session holds.
            cooldown_steps: Steps to stay in the unified layout after a move.
        """
        if not unified:
            return True if self.should_unify(num for num, _, _ in sequences) else None
        if not can_split:
            return None
        split = self.should_split(
            num_decoding=num_decoding(),
            cells_to_come=(self.cells_to_come(*s) for s in sequences),
            session_cells=session_cells,
            cooldown_steps=cooldown_steps,
        )
        return False if split else None
