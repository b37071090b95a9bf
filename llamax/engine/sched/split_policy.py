"""The CPU decode split: which decode rows of a step go into separate, smaller decodes.

ggml's CPU flash attention computes a micro-batch of :data:`TILE_ROWS` rows or more in
tiles, and a tile of rows from many sequences attends over the whole used span of the
cache; a smaller batch is computed row by row, and each row skips the cells it may not see.
So 64 streams of 80 cells each, one decode of 64 rows, cost 0.60 s (SmolLM2, 2 threads);
two decodes of 32, 0.39 s. The split is made only in a unified cache, when the span is at
least :data:`SPLIT_SPAN_RATIO` times what a decode row attends to on average: rows that
share a long prefix keep the tiled kernel. Only on the CPU: a GPU would read the weights
once per call and gain nothing.

Pure numbers in, row groups out; :meth:`llamax.engine.sched.scheduler.Scheduler.split` applies them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..timing.step_budget import TILE_ROWS

__all__ = ["SPLIT_SPAN_RATIO", "SplitPolicy"]

SPLIT_SPAN_RATIO = 4
"""Many decode rows are split into batches under ``TILE_ROWS`` rows when the cache's used
span is at least this many times what a row attends to."""


@dataclass(frozen=True, slots=True)
class SplitPolicy:
    """Decides how one step's batch is cut into decodes."""

    cpu_attention: bool
    """Whether attention runs on the CPU (the only case a split pays)."""

    def groups(
        self,
        num_tokens: Sequence[int],
        num_computed: Sequence[int],
        num_cells_used: int,
        *,
        unified: bool,
    ) -> list[list[int]] | None:
        """The entry indices of each decode, or None to decode the step whole.

        Args:
            num_tokens: Tokens each entry feeds (1 for a decode row).
            num_computed: Tokens each entry's sequence already holds in KV.
            num_cells_used: KV cells in use before the step.
            unified: Whether the cache is one buffer (streams never split).

        Returns:
            Groups of decode rows, each under ``TILE_ROWS`` rows and of near-equal size,
            then one group of every other entry (if any); or None.
        """
        if not (unified and self.cpu_attention):
            return None
        singles = [i for i, n in enumerate(num_tokens) if n == 1]
        if len(singles) < TILE_ROWS:
            return None
        span = num_cells_used + sum(num_tokens)
        attended = sum(num_computed[i] + 1 for i in singles) / len(singles)
        if span < SPLIT_SPAN_RATIO * attended:
            return None
        num_groups = -(-len(singles) // (TILE_ROWS - 1))
        size = -(-len(singles) // num_groups)
        groups = [singles[i : i + size] for i in range(0, len(singles), size)]
        others = [i for i, n in enumerate(num_tokens) if n != 1]
        return [*groups, others] if others else groups
