"""The shape of a step: prompt chunks within the time budget, forks, drafts' room, batches.

:class:`StepPlanner` owns the :class:`~llamax.engine.timing.chunk_budget.ChunkBudget` (and its
learned step cost) and the :class:`~llamax.engine.sched.split_policy.SplitPolicy`; it reads the
KV cells and the fair shares, and builds the frozen :class:`~llamax.engine.plan.StepPlan`
from the sequences and token counts the scheduler chose. It changes no sequence.
"""

from __future__ import annotations

from collections.abc import Hashable

from ...backend.base import Backend
from ..images import chunk_limit, image_at
from ..kv.checkpoints import next_checkpoint
from ..kv.kvcache import KVCache
from ..kv.prefix import PrefixCache
from ..plan import StepPlan, build_plan, split_plan
from ..sequence import Sequence as Seq
from ..sequence import SequenceState
from ..timing.chunk_budget import ChunkBudget
from ..timing.step_budget import StepFeatures, tile_waste_table
from .fair_share import FairShare
from .split_policy import SplitPolicy

__all__ = ["StepPlanner"]


class StepPlanner:
    """Chunks, forks and batches of a step.

    Args:
        backend: Its batch size, attention tiles and CPU attention shape the steps.
        max_step_ms: The time prompt chunks may add to a step's decode rows (None: no bound).
        kv: The cells a step attends over.
        prefix: Forks share a prefix, so only while the prefix cache is enabled.
        fair: The fair shares of sequence ids (forks stay within theirs).
    """

    def __init__(
        self,
        backend: Backend,
        max_step_ms: float | None,
        kv: KVCache,
        prefix: PrefixCache,
        fair: FairShare[Hashable],
    ) -> None:
        tiles = backend.attention_tiles
        waste = None if tiles is None else tile_waste_table(backend.n_batch, *tiles)
        self.budget = ChunkBudget(backend.n_batch, max_step_ms, waste=waste)
        self.splitter = SplitPolicy(backend.cpu_attention)
        self._kv = kv
        self._prefix = prefix
        self._fair = fair
        self.rows_together = True
        """In the reproducible mode: whether one-token decode rows share a decode (the
        backend computes a row's bits alike beside other rows: :mod:`.row_probe`), or each
        goes alone."""

    def start(self, decode: list[Seq]) -> StepFeatures | None:
        """Start a step with the decode rows of ``decode`` (:meth:`ChunkBudget.start_step`)."""
        return self.budget.start_step(
            [seq.num_computed for seq in decode],
            unified=self._kv.is_unified,
            streaming=any(seq.num_generated for seq in decode),
        )

    def chunk(
        self, seq: Seq, budget: int, fixed: StepFeatures | None, num_decode: int
    ) -> tuple[int, StepFeatures | None]:
        """The prompt chunk ``seq`` computes this step, within ``budget`` tokens, and the
        step's features with it (:meth:`ChunkBudget.chunk`). Where the memory is cut only
        at checkpoints, the chunk ends at the sequence's next one. A chunk stays within one
        image or one run of text; a non-causal image is taken whole, even past ``budget``
        (its rows take a decode of their own)."""
        images = seq.request.images
        image = image_at(images, seq.num_computed) if images else None
        if image is not None and image.is_non_causal:
            take = image.end - seq.num_computed
            return take, self.budget.whole(
                fixed,
                take,
                num_computed=seq.num_computed,
                num_cells_used=self._kv.num_cells_used,
                unified=self._kv.is_unified,
            )
        grid = self._kv.grid
        if grid is not None and self._kv.on_grid(seq.request.adapters):
            return self._chunk_on_grid(seq, grid, budget, fixed)
        limit = min(seq.num_pending, budget)
        if images:
            limit = chunk_limit(images, seq.num_computed, limit)
        following = self._checkpoint_cut(seq, seq.num_computed)
        if following is not None:
            limit = min(limit, following - seq.num_computed)
        return self.budget.chunk(
            fixed,
            limit,
            num_pending=seq.num_pending,
            num_computed=seq.num_computed,
            num_cells_used=self._kv.num_cells_used,
            num_decode=num_decode,
            unified=self._kv.is_unified,
        )

    def _checkpoint_cut(self, seq: Seq, start: int) -> int | None:
        """Where a prompt chunk from ``start`` must end to take a checkpoint, on a memory cut
        only at checkpoints (None: nowhere): the next interval checkpoint (counted from
        where the prompt's computation started), or the branch or head point
        (:mod:`~llamax.engine.kv.checkpoints`) if one comes first."""
        if not (self._kv.cuts_at_checkpoints and self._prefix.is_enabled):
            return None
        following = next_checkpoint(start, seq.num_prompt_tokens, start=seq.checkpoint_from)
        for extra in (seq.branch_at, seq.head_at):
            if start < extra < (following or seq.num_prompt_tokens):
                following = extra
        return following

    def _chunk_on_grid(
        self, seq: Seq, grid: int, budget: int, fixed: StepFeatures | None
    ) -> tuple[int, StepFeatures | None]:
        """The reproducible mode's chunk (docs/reproducible.md): up to the next multiple of
        ``grid`` (or the prompt's end, an image's edge, a checkpoint), whatever the time
        budget wants, so that it is cut where a cold run of the prompt cuts it; nothing this
        step if the batch has no room for all of it. Tokens past the prompt (a preempted
        sequence's reply, computed again) go one at a time, as they were decoded."""
        start = seq.num_computed
        if start >= seq.num_prompt_tokens:
            want = 1
        else:
            want = min(seq.num_prompt_tokens - start, grid - start % grid)
        images = seq.request.images
        if images:
            want = chunk_limit(images, start, want)
        following = self._checkpoint_cut(seq, start)
        if following is not None:
            want = min(want, following - start)
        return (want if want <= budget else 0), fixed

    def build(
        self, slots: list[tuple[Seq, int]], drafts: dict[Seq, tuple[int, ...]] | None = None
    ) -> StepPlan:
        """The plan that feeds each ``(sequence, tokens)`` of ``slots`` (and ``drafts``),
        with the waiting siblings that fork from a leader's last prompt row."""
        return build_plan(
            slots,
            self._kv.num_free_seq_ids,
            self._forkable_siblings,
            by_seq_id=not self._kv.is_unified,
            drafts=drafts,
        )

    def split(self, plan: StepPlan) -> list[StepPlan]:
        """The batches that compute ``plan``: usually one; in a unified cache on the CPU,
        many decode rows go in smaller batches (:mod:`llamax.engine.sched.split_policy`)."""
        if self._kv.grid is not None and any(  # the reproducible mode only
            self._kv.on_grid(e.seq.request.adapters) for e in plan.entries
        ):
            return self._split_reproducible(plan)
        groups = self.splitter.groups(
            [len(e.item.token_ids) for e in plan.entries],
            [e.seq.num_computed for e in plan.entries],
            self._kv.num_cells_used,
            unified=self._kv.is_unified,
        )
        return [plan] if groups is None else split_plan(plan, groups)

    def _split_reproducible(self, plan: StepPlan) -> list[StepPlan]:
        """The reproducible mode's decodes: the one-token rows together where the backend
        computes a row alike beside others (:attr:`rows_together`; without flash attention
        the attention sums do not depend on the rows beside it: measured,
        benchmarks/results/issue60) and no LoRA adapter applies, else each alone; each
        prompt chunk alone (beside other sequences' rows llama.cpp cuts it into other
        micro-batches than a cold run does)."""
        entries = plan.entries
        single = [i for i, e in enumerate(entries) if len(e.item.token_ids) == 1]
        chunks = [[i] for i, e in enumerate(entries) if len(e.item.token_ids) > 1]
        # a LoRA adapter's products are F32 matmuls, which compute a row differently in a
        # batch on this CPU (measured): rows under adapters go alone
        plain = [i for i in single if not entries[i].seq.request.adapters]
        apart = [[i] for i in single if entries[i].seq.request.adapters]
        rows = [plain] if self.rows_together and plain else [[i] for i in plain]
        groups = [*rows, *apart, *chunks]
        return [plan] if len(groups) <= 1 else split_plan(plan, groups)

    def features(self, plan: StepPlan) -> StepFeatures:
        """What ``plan`` costs, in the terms of the cost model
        (:mod:`llamax.engine.timing.step_budget`)."""
        entries = [
            (len(e.item.token_ids), e.item.start_pos, e.seq.num_computed) for e in plan.entries
        ]
        return self.budget.step_features(
            entries, self._kv.num_cells_used, unified=self._kv.is_unified
        )

    def is_fork_candidate(self, seq: Seq) -> bool:
        """An n>1 sibling whose leader is prefilling the same prompt waits to fork from it."""
        if seq.index == 0 or seq.num_generated:
            return False
        leader = seq.request.sequences[0]
        return leader.state is SequenceState.PREFILLING and self._prefix.is_enabled

    def _forkable_siblings(self, seq: Seq, free_ids: int) -> tuple[Seq, ...]:
        """The waiting siblings that fork from ``seq``'s last prompt row, within its share."""
        if seq.index != 0 or seq.num_generated or not self._prefix.is_enabled:
            return ()
        fair, key = self._fair, seq.request.fair_key
        free_ids = fair.num_forkable(key, free_ids, len(fair.others_deprived(key)))
        siblings = [
            s
            for s in seq.request.sequences[1:]
            if s.state is SequenceState.WAITING and s.num_generated == 0
        ]
        return tuple(siblings[:free_ids])
