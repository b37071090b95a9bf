"""The KV layout's moves (``kv_layout="auto"``): when to move, and the move itself.

:class:`Relayout` owns the :class:`~llamax.engine.kv.layout_policy.LayoutPolicy`, the time the
last move took and the count of moves; it reads the sequences it is shown and moves the
:class:`~llamax.engine.kv.kvcache.KVCache` (whose :class:`~llamax.engine.kv.kvcache.LayoutState`
is the one record of where the layout stands). What a move does to sequences, making room
before it and failing those that outgrew their streams after a failed one, is the
scheduler's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...backend.base import Backend
from ...errors import RequestFailedError
from ...stats import KVStats
from ..sequence import Sequence as Seq
from .kvcache import KVCache, LayoutState
from .layout_policy import MOVE_PRIOR_S_PER_BYTE, RELAYOUT_COOLDOWN_STEPS, LayoutPolicy
from .prefix import PrefixCache

__all__ = ["Relayout"]


class Relayout:
    """Decides and makes the moves between streams and the unified layout.

    Args:
        backend: Its sizes (sequence ids, the KV cache's bytes) price a first move.
        kv: The cells that move.
        prefix: Retained prefixes longer than a stream are evicted before a move to streams.
    """

    def __init__(self, backend: Backend, kv: KVCache, prefix: PrefixCache) -> None:
        self._backend = backend
        self._kv = kv
        self._prefix = prefix
        self.policy = LayoutPolicy(kv.cells_per_seq)  # "auto" starts with streams
        self.num_relayouts = 0
        self._move_s: float | None = None  # what the last move took

    @property
    def stream_cells(self) -> int:
        """Cells one sequence holds in its own stream (``kv_layout="auto"`` moves to the
        unified layout beyond that), or what the fixed layout gives one sequence."""
        return self.policy.stream_cells if self._kv.can_relayout else self._kv.cells_per_seq

    def stats(self) -> KVStats:
        """The KV cache's cells, layout and moves now."""
        backend, kv = self._backend, self._kv
        return KVStats(
            cells_used=kv.num_cells_used,
            cells_total=backend.kv_cells,
            cells_per_seq=backend.facts.n_ctx_seq,
            cells_per_stream=self.stream_cells,
            layout="unified" if kv.is_unified else "streams",
            bytes_total=backend.kv_cells * backend.kv_bytes_per_cell,
            num_free_seq_ids=kv.num_free_seq_ids,
            num_relayouts=self.num_relayouts,
        )

    def should_unify_for(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` (a saved session) needs the unified layout."""
        return (
            self._kv.can_relayout
            and not self._kv.is_unified
            and self.policy.should_unify([num_tokens])
        )

    def next_move(
        self, waiting: Sequence[Seq], running: Sequence[Seq], *, token_s: float
    ) -> bool | None:
        """The layout to move to now (True: unified, False: streams, None: stay), as
        :mod:`~llamax.engine.kv.layout_policy` says; before a move to streams, the retained
        prefixes longer than a stream go. ``token_s`` is what a prompt token costs."""
        if self._kv.layout is LayoutState.FIXED:
            return None
        self.policy.count_step()
        sequences = [*waiting, *running]
        move = self.policy.next_layout(
            unified=self._kv.is_unified,
            can_split=self._kv.can_relayout,
            sequences=(
                (len(s.token_ids), s.num_generated, s.request.params.max_tokens) for s in sequences
            ),
            num_decoding=lambda: sum(1 for s in running if s.num_pending == 1),
            session_cells=(len(slot.tokens) for slot in self._kv.slots() if slot.pinned),
            cooldown_steps=RELAYOUT_COOLDOWN_STEPS,  # this module's, which tests may patch
            to_share=lambda: self._would_copy_a_prefix(waiting, token_s),
            sharing=lambda: self._sharing(sequences),
        )
        if move is False:
            for slot in self._prefix.retained():
                if len(slot.tokens) > self.policy.stream_cells:
                    self._prefix.evict(slot)
        return move

    def move(
        self, unified: bool, clock: Callable[[], float], make_room: Callable[[], None]
    ) -> float | None:
        """Move the cache to the other layout (``make_room`` first, when to unified); the
        seconds it took, or None if the layout is stuck now (a move failed, now or before)."""
        if self._kv.layout is LayoutState.STUCK:
            return None
        started = clock()
        if unified:
            make_room()
        try:
            self._kv.relayout(unified)
        except RequestFailedError as exc:
            self._kv.fail_relayout(f"the unified layout could not be made: {exc}")
            return None
        self.policy.restart_count()
        self.num_relayouts += 1
        self._move_s = clock() - started
        return self._move_s

    def _would_copy_a_prefix(self, waiting: Sequence[Seq], token_s: float) -> bool:
        """In streams: whether the waiting sequences that may start next would copy one
        long prefix into several streams (:meth:`LayoutPolicy.should_unify_to_share`).
        Skipped while no sequence id can be had (a backlog would pay the check each step)."""
        if not waiting or not self._prefix.is_enabled:
            return False
        if self._kv.num_free_seq_ids == 0 and self._prefix.num_retained == 0:
            return False
        backend = self._backend
        n_seq_max = backend.facts.n_seq_max
        next_up = [seq.token_ids for seq in waiting[:n_seq_max] if seq.request.session_id is None]
        move_s = self._move_s
        if move_s is None:
            move_s = backend.kv_cells * backend.kv_bytes_per_cell * MOVE_PRIOR_S_PER_BYTE
        return self.policy.should_unify_to_share(
            next_up, (s.tokens for s in self._kv.slots()), token_s=token_s, move_s=move_s
        )

    def _sharing(self, sequences: Sequence[Seq]) -> tuple[int, int]:
        """Tokens the unfinished sequences hold, and the cells in use (the KV cache's own
        count: no walk over every cell each step)."""
        held = sum(len(s.slot.tokens) for s in sequences if s.slot is not None)
        return held, self._kv.num_cells_used
