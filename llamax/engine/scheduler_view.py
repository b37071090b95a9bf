"""What the scheduler owns, and the read-only queries on it.

:class:`SchedulerView` builds the state (KV cells, retained prefixes, the waiting and
running queues, the counters) and the policies that compute on it, and answers every
question about them: the loop's statistics, the audit, the session table and the planning
of a step read the scheduler through these. It changes no sequence, slot or queue: its
subclass :class:`~llamax.engine.scheduler.Scheduler` makes every change, as
:class:`~collections.abc.MutableMapping` adds the changes to
:class:`~collections.abc.Mapping`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ..backend.base import Backend
from ..config import EngineConfig
from .admission import SlotPlacer
from .chunk_budget import ChunkBudget
from .draft_planner import DraftPlanner
from .fair_share import FairShare
from .kvcache import KVCache, Slot
from .layout_policy import LayoutPolicy
from .plan import StepPlan, build_plan, split_plan
from .prefix import PrefixCache
from .sequence import Request, Sequence, SequenceState
from .session_room import SessionRoom
from .speculative import DecodeCost, DraftState
from .split_policy import SplitPolicy
from .step_budget import StepFeatures, tile_waste_table

if TYPE_CHECKING:
    from .session_table import SessionTable

__all__ = ["SchedulerView"]


class SchedulerView:
    """The scheduler's state and policies, read-only.

    Args:
        backend: The backend the scheduler drives.
        config: The engine's options (``prefix_cache``: whether finished slots are
            retained for their prefix; ``max_step_ms``: the time prompt chunks may add to
            a step's decode rows; the prefix tiers' budgets and directory).

    Raises:
        InvalidParameterError: the disk tier's directory cannot be used (or is in use).
    """

    sessions: SessionTable
    """Open sessions (built by the scheduler, which applies their operations)."""

    def __init__(
        self,
        backend: Backend,
        config: EngineConfig,
    ):
        self._backend = backend
        self._n_batch = backend.n_batch
        tiles = backend.attention_tiles
        waste = None if tiles is None else tile_waste_table(backend.n_batch, *tiles)
        self.budget = ChunkBudget(backend.n_batch, config.max_step_ms, waste=waste)
        self.step_cost = self.budget.cost
        self.drafts = DraftPlanner(self.budget.max_step_s)
        self.splitter = SplitPolicy(backend.cpu_attention)
        self.room = SessionRoom(backend.n_ctx, backend.n_ctx_seq, backend.n_seq_max)
        self.fair: FairShare[Request] = FairShare(backend.n_seq_max)
        self.kv = KVCache(backend, backend.n_seq_max)
        self.layout = LayoutPolicy(self.kv.cells_per_seq)  # "auto" starts with streams
        retain = config.prefix_cache and backend.can_share_prefix
        model = json.dumps(backend.model_identity, sort_keys=True, default=str)
        self.prefix = PrefixCache.build(self.kv, config, retain=retain, model=model)
        self.placer = SlotPlacer(self.kv, self.prefix, backend.n_ctx)
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._idle_sessions: list[Slot] = []  # pinned slots no running sequence uses
        self._idle_session_cells = 0
        self.num_preemptions = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_cached_tokens = 0
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0
        self.num_relayouts = 0
        self._move_s: float | None = None  # what the last layout move took

    @property
    def backend(self) -> Backend:
        """The backend this scheduler drives."""
        return self._backend

    @property
    def stream_cells(self) -> int:
        """Cells one sequence holds in its own stream (``kv_layout="auto"`` moves to the
        unified layout beyond that), or what the fixed layout gives one sequence."""
        return self.layout.stream_cells if self.kv.can_relayout else self.kv.cells_per_seq

    @property
    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued without KV cells."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Sequences being computed."""
        return len(self._running)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens the running sequences still have to compute."""
        return sum(seq.num_pending for seq in self._running)

    def all_sequences(self) -> list[Sequence]:
        """Every waiting and running sequence."""
        return self._waiting + self._running

    # ------------------------------------------------------------------ capacity
    def capacity(self, seq: Sequence) -> int:
        """The most tokens ``seq`` may hold now (:meth:`SessionRoom.capacity`)."""
        return self.room.capacity(
            self._num_held(seq),
            unified=self.kv.is_unified,
            stream_cells=self.stream_cells,
            can_relayout=self.kv.can_relayout,
        )

    def _own_session_slot(self, seq: Sequence) -> Slot | None:
        session_id = seq.request.session_id
        return None if session_id is None else self.sessions.slot_or_none(session_id)

    def _num_held(self, seq: Sequence) -> int:
        """Cells the idle open sessions other than the one of ``seq`` hold."""
        own = self._own_session_slot(seq)
        if own is None or own not in self._idle_sessions:
            return self._idle_session_cells
        return num_cells([slot for slot in self._idle_sessions if slot is not own])

    def _no_room_reason(self, seq: Sequence) -> str:
        own = self._own_session_slot(seq)
        idle = [slot for slot in self._idle_sessions if slot is not own]
        fixed = not self.kv.is_unified and not self.kv.can_relayout
        return self.room.no_room_reason(
            len(seq.token_ids),
            session_ids=self.sessions.ids_of(idle),
            num_held=num_cells(idle),
            capacity=self.capacity(seq),
            is_session=own is not None,
            fixed_stream_cells=self.kv.cells_per_seq if fixed else None,
            relayout_failure=self.kv.relayout_failure,
        )

    # ------------------------------------------------------------------ planning
    def split(self, plan: StepPlan) -> list[StepPlan]:
        """The batches that compute ``plan``: usually one; in a unified cache on the CPU,
        many decode rows go in smaller batches (:mod:`llamax.engine.split_policy`)."""
        groups = self.splitter.groups(
            [len(e.item.token_ids) for e in plan.entries],
            [e.seq.num_computed for e in plan.entries],
            self.kv.num_cells_used,
            unified=self.kv.is_unified,
        )
        return [plan] if groups is None else split_plan(plan, groups)

    def features(self, plan: StepPlan) -> StepFeatures:
        """What ``plan`` costs, in the terms of :mod:`llamax.engine.step_budget`'s cost model."""
        entries = [
            (len(e.item.token_ids), e.item.start_pos, e.seq.num_computed) for e in plan.entries
        ]
        return self.budget.step_features(
            entries, self.kv.num_cells_used, unified=self.kv.is_unified
        )

    def _chunk(
        self, seq: Sequence, limit: int, fixed: StepFeatures | None, num_decode: int
    ) -> tuple[int, StepFeatures | None]:
        return self.budget.chunk(
            fixed,
            limit,
            num_pending=seq.num_pending,
            num_computed=seq.num_computed,
            num_cells_used=self.kv.num_cells_used,
            num_decode=num_decode,
            unified=self.kv.is_unified,
        )

    def _build(
        self,
        slots: list[tuple[Sequence, int]],
        drafts: dict[Sequence, tuple[int, ...]] | None = None,
    ) -> StepPlan:
        return build_plan(
            slots,
            self.kv.num_free_seq_ids,
            self._forkable_siblings,
            by_seq_id=not self.kv.is_unified,
            drafts=drafts,
        )

    def _is_fork_candidate(self, seq: Sequence) -> bool:
        """An n>1 sibling whose leader is prefilling the same prompt waits to fork from it."""
        if seq.index == 0 or seq.num_generated:
            return False
        leader = seq.request.sequences[0]
        return leader.state is SequenceState.PREFILLING and self.prefix.is_enabled

    def _forkable_siblings(self, seq: Sequence, free_ids: int) -> tuple[Sequence, ...]:
        """The waiting siblings that fork from ``seq``'s last prompt row, within its share."""
        if seq.index != 0 or seq.num_generated or not self.prefix.is_enabled:
            return ()
        others = self.fair.others_deprived(seq.request)
        num_others = sum(
            1 for r in others if any(s.state is SequenceState.WAITING for s in r.sequences)
        )
        free_ids = self.fair.num_forkable(seq.request, free_ids, num_others)
        siblings = [
            s
            for s in seq.request.sequences[1:]
            if s.state is SequenceState.WAITING and s.num_generated == 0
        ]
        return tuple(siblings[:free_ids])

    # ------------------------------------------------------------------ drafts
    def _price_drafts(
        self,
        slots: list[tuple[Sequence, int]],
        proposals: list[tuple[Sequence, DraftState, tuple[int, ...]]],
        room: int,
    ) -> dict[Sequence, int]:
        return self.drafts.price([n for _, n in slots], proposals, room)

    @property
    def decode_cost(self) -> DecodeCost:
        """What one more token costs a step of decode rows (prices drafts)."""
        return self.drafts.decode_cost

    @decode_cost.setter
    def decode_cost(self, cost: DecodeCost) -> None:
        self.drafts.decode_cost = cost


def num_cells(slots: list[Slot]) -> int:
    """Distinct cells ``slots`` hold (slots that share a prefix share its cells)."""
    return len({cell for slot in slots for cell in slot.cells})
