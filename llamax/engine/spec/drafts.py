"""The scheduler's speculative drafting: who drafts, a step's drafts, their verification.

:class:`Drafting` owns the :class:`~llamax.engine.spec.draft_planner.DraftPlanner` (the learned
decode cost, the shared acceptance record) and the draft counters. The scheduler asks it
for a step's drafts when it plans, and hands it each drafted entry after the decode: the
longest prefix of the draft that sampling confirms is accepted, plus the token sampled
after it, row by row (so processors, stop strings and ``max_tokens`` see what they would
without drafts); the rejected drafts' cells are cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...backend.base import Backend
from ...drafting import Speculative
from ...errors import RequestFailedError
from ...results import TokenLogprob
from ...stats import SpeculationStats
from ..images import text_only
from ..kv.kvcache import KVCache
from ..plan import ScheduledSequence, StepPlan
from ..sequence import TERMINAL_STATES, Request, SequenceState
from ..sequence import Sequence as Seq
from .draft_planner import DraftPlanner, confirms, draft_limit, drafting_method
from .speculative import DraftState, new_draft_state

__all__ = ["Drafting", "Verify"]

Verify = Callable[[Seq, int], tuple[int, TokenLogprob | None]]
"""Samples a sequence's token from one batch row (speculative verification, row by row)."""


class Drafting:
    """Speculative drafts for the scheduler's steps.

    Args:
        backend: Drafts are rolled back with a partial ``seq_rm``, which recurrent memory
            cannot do (no drafts unless ``backend.can_share_prefix``).
        kv: The cells drafts are fed into (and cut from).
        speculative: The context's drafting method (a request's own goes first).
        max_step_s: A step with drafts stays within this many seconds of its predicted
            time without them (None: no bound).
        allow: Whether drafting is allowed at all (a batch logits processor sees one row
            per sequence, so with one installed nobody drafts).
    """

    def __init__(
        self,
        backend: Backend,
        kv: KVCache,
        speculative: Speculative | None,
        max_step_s: float | None,
        *,
        allow: bool = True,
    ) -> None:
        self.planner = DraftPlanner(max_step_s)
        self._kv = kv
        self._n_ctx = backend.facts.n_ctx
        self._speculative = speculative
        self.can_draft = allow and backend.can_share_prefix
        self.priced = True  # tests turn it off to verify every proposal
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0

    def stats(self) -> SpeculationStats:
        """The draft counters now."""
        return SpeculationStats(self.num_drafted_tokens, self.num_accepted_tokens)

    def start(self, request: Request) -> None:
        """Give each sequence of a new request the draft state its drafting method asks."""
        # in the reproducible mode an adapter's rows depend on the batch: nothing drafts
        can_draft = self.can_draft and not self._kv.on_grid(request.adapters)
        method = drafting_method(request.params.speculative, self._speculative, can_draft=can_draft)
        if method is not None:
            for seq in request.sequences:
                seq.draft_state = new_draft_state(method, self.planner.acceptance)

    def plan(
        self,
        slots: list[tuple[Seq, int]],
        budget: int,
        num_pending: Callable[[], int],
        capacity: Callable[[Seq], int],
    ) -> dict[Seq, tuple[int, ...]]:
        """Draft tokens for the step's decoding sequences
        (:mod:`~llamax.engine.spec.draft_planner`), within the batch's ``budget``, the free
        cells of a unified cache (beside the running sequences' ``num_pending`` tokens) and
        each sequence's ``capacity``."""
        if not self.can_draft:
            return {}
        room, kv = budget, self._kv
        if kv.is_unified:
            room = min(room, self._n_ctx - kv.num_cells_used - num_pending())
        candidates: list[tuple[Seq, DraftState, list[int], int]] = []
        for seq, num in slots:
            state = seq.draft_state
            if state is None or num != 1 or seq.state is not SequenceState.DECODING:
                continue
            limit = draft_limit(
                len(seq.token_ids),
                min(capacity(seq), kv.cells_per_seq),
                num_generated=seq.num_generated,
                max_tokens=seq.request.params.max_tokens,
            )
            history = text_only(seq.token_ids) if seq.request.images else seq.token_ids
            candidates.append((seq, state, history, limit))  # drafts never propose an image
        return self.planner.plan(candidates, [n for _, n in slots], room, priced=self.priced)

    def verify(
        self,
        entry: ScheduledSequence,
        sample: Verify,
        accept: Callable[[Seq, int, TokenLogprob | None], None],
        fail: Callable[[Seq, RequestFailedError], None],
    ) -> int:
        """Record ``entry``'s decode, ``accept`` each token ``sample`` gives row by row
        while it confirms the draft, and cut the rejected drafts' cells; the number of
        draft tokens accepted."""
        seq, draft, slot = entry.seq, entry.draft, entry.seq.slot
        assert slot is not None and seq.draft_state is not None
        kv = self._kv
        kv.append(slot, entry.item.token_ids)  # fed cells, until the rejected are cut
        row_index = 0
        for row_index, row in enumerate(entry.item.rows):
            try:
                token, logprob = sample(seq, row)
            except RequestFailedError as error:
                fail(seq, error)
                break
            accept(seq, token, logprob)
            if seq.state in TERMINAL_STATES or not confirms(draft, row_index, token):
                break
        accepted = row_index
        seq.draft_state.record(len(draft), accepted)
        self.num_drafted_tokens += len(draft)
        self.num_accepted_tokens += accepted
        if not kv.truncate(slot, entry.item.start_pos + 1 + accepted):
            raise RuntimeError("the KV memory refused to remove rejected draft tokens")
        return accepted

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """Learn the decode cost from a measured decode-only step (after judging its
        drafts: were they worth it?)."""
        if not all(len(e.item.token_ids) - len(e.draft) == 1 for e in plan.entries):
            return
        drafted: Sequence[tuple[DraftState, int]] = [
            (state, len(e.draft))
            for e in plan.entries
            if e.draft and (state := e.seq.draft_state) is not None
        ]
        if drafted:
            self.planner.audit(len(plan.entries), seconds, drafted)
        self.planner.decode_cost.observe(plan.num_tokens, seconds, len(plan.entries))
