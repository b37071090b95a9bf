"""KV-cell accounting over llama.cpp's KV memory. Pure Python.

A :class:`Slot` is one llama.cpp sequence id together with the tokens it holds in KV
(positions ``0 .. len(tokens)-1``). We give every computed token a cell id and count a cell
as used while any slot references it; that makes ``num_cells_used`` exact without asking
llama.cpp. The two layouts differ only in :meth:`KVCache.copy_prefix`:

- unified (one buffer): ``seq_cp(src, dst, 0, n)`` tags the existing cells with another
  id, so a copied prefix shares its cell ids and costs no cells;
- streams (one buffer per sequence): a partial copy between streams aborts llama.cpp, so
  the whole stream is copied (``seq_cp(src, dst, -1, -1)``, a buffer copy) and the tail
  that is not shared is removed (``seq_rm``); the copy gets cells of its own.

With ``kv_layout="auto"`` the memory can move between the two (:meth:`KVCache.relayout`);
every sequence then holds cells of its own, in either layout, until it is copied again.

Between streams llama.cpp runs a copy's buffer transfer only at the next decode
(:mod:`llamax.engine.kv.stream_copies`); before a state read or write that would see the
difference, the queue is run first, so every call here acts at once.

A recurrent or hybrid memory cannot be cut (``can_share_prefix`` False); if it takes
checkpoints (``can_checkpoint``), a slot keeps them (:meth:`KVCache.checkpoint`, at the
positions :mod:`llamax.engine.kv.checkpoints` chooses) and is cut, or copied in part, only at
one: the checkpoint set back (``state_seq_set(partial=True)``), then the cells past it
removed. :meth:`KVCache.usable` says how much of a slot a cut or copy can keep.

This module only counts and emits the memory calls. Which slots are kept for their prefix,
and which is evicted first, is :mod:`llamax.engine.kv.prefix`'s business; who may change a slot at
all is the scheduler's (see docs/architecture.md).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from enum import Enum

from ...adapters import NO_ADAPTERS, AdapterSet
from ...backend.base import DecodeStatus, KVMemory, SharedPrefix
from ...errors import InvalidParameterError
from ...stats import CheckpointStats
from .checkpoints import least_needed, pack_state, unpack_state
from .stream_copies import QueuedCopies

__all__ = ["LAYOUT_MOVES", "KVCache", "LayoutState", "Slot", "SlotState"]


_AFTER_MEMORY_UPDATE = frozenset({DecodeStatus.OK, DecodeStatus.NO_SLOT, DecodeStatus.ABORTED})


class LayoutState(Enum):
    """Where the KV layout stands; :data:`LAYOUT_MOVES` lists where it may go."""

    FIXED = "fixed"
    """``kv_layout="unified"`` or ``"streams"``: the layout never moves."""
    STREAMS = "streams"
    """``kv_layout="auto"``, one stream per sequence now."""
    UNIFIED = "unified"
    """``kv_layout="auto"``, one buffer now."""
    STUCK = "stuck"
    """``kv_layout="auto"``, but a move failed: the layout stays as it is from now on."""


LAYOUT_MOVES: dict[LayoutState, frozenset[LayoutState]] = {
    LayoutState.FIXED: frozenset(),
    LayoutState.STREAMS: frozenset({LayoutState.UNIFIED, LayoutState.STUCK}),
    LayoutState.UNIFIED: frozenset({LayoutState.STREAMS, LayoutState.STUCK}),
    LayoutState.STUCK: frozenset(),
}
"""The layout's explicit transitions (:meth:`KVCache.relayout`, :meth:`KVCache.fail_relayout`)."""


class SlotState(Enum):
    """Who holds a slot. A slot is born ACTIVE or PINNED; only an ACTIVE or a yielding
    PINNED slot may be retained, only a RETAINED one adopted again, and only an ACTIVE one
    pinned (a yielding session's request placed anew) (:data:`SLOT_MOVES`). A PINNED slot
    keeps its state until its session frees it or, if the session yields, gives it up."""

    ACTIVE = "active"
    """A running sequence."""
    RETAINED = "retained"
    """A finished sequence kept for its prefix (see :mod:`llamax.engine.kv.prefix`)."""
    PINNED = "pinned"
    """Held by a session: never retained nor evicted, released only by the session."""


SLOT_MOVES: dict[SlotState, frozenset[SlotState]] = {
    SlotState.ACTIVE: frozenset({SlotState.RETAINED, SlotState.PINNED}),
    SlotState.RETAINED: frozenset({SlotState.ACTIVE}),
    SlotState.PINNED: frozenset({SlotState.RETAINED}),
}
"""The moves a slot may make; freeing a slot ends it from any state."""


class Slot:
    """A sequence id and the tokens it holds in KV."""

    __slots__ = (
        "_state",
        "adapters",
        "cells",
        "checkpoints",
        "chunked",
        "exact",
        "hint_owner",
        "hinted",
        "num_prompt",
        "seq_id",
        "tokens",
    )

    def __init__(self, seq_id: int, *, pinned: bool = False) -> None:
        self.seq_id = seq_id
        self.tokens: list[int] = []
        self.cells: list[int] = []
        self.adapters: AdapterSet = NO_ADAPTERS
        """The LoRA adapter set its cells were computed under (``()``: the base model);
        a prefix is shared only between sequences of the same set."""
        self.checkpoints: dict[int, bytes] = {}
        """Partial states by position (a memory that cannot be cut: see the module)."""
        self.hinted = False
        """Whether the last request that ran in the slot asked for its prefix to be kept
        longer (``SamplingParams.keep_prefix``): retained, it is evicted after the
        unhinted ones (:mod:`llamax.engine.kv.prefix`)."""
        self.hint_owner: str | None = None
        """The ``fair_key`` of that request, whose share of the tiers' hinted bytes the
        slot's state draws on when evicted (None: no key)."""
        self.num_prompt = 0
        """Of its tokens, how many were the prompt of the last sequence that ran in it (the
        rest that sequence generated; 0: not known). A newcomer extending that prompt may
        take the slot over and cut its reply
        (:data:`~llamax.engine.kv.admission.SHORT_TAIL`)."""
        self.exact = 0
        """The reproducible mode's reusable head: its first ``exact`` tokens (a multiple
        of the chunk grid) hold the cells a cold prompt computes (see
        :meth:`KVCache.usable`)."""
        self.chunked = 0
        """Tokens ``[exact, chunked)`` were computed as this slot's prompt chunks, one after
        the other from ``exact``: a chunk that ends on the grid extends ``exact``."""
        self._state = SlotState.PINNED if pinned else SlotState.ACTIVE

    @property
    def state(self) -> SlotState:
        """Who holds the slot."""
        return self._state

    @property
    def pinned(self) -> bool:
        """Whether a session holds the slot."""
        return self._state is SlotState.PINNED

    def move(self, state: SlotState) -> None:
        """Change who holds the slot.

        Raises:
            RuntimeError: :data:`SLOT_MOVES` does not allow the move.
        """
        if state not in SLOT_MOVES[self._state]:
            raise RuntimeError(f"{self!r} cannot become {state.value}")
        self._state = state

    def __repr__(self) -> str:
        hinted = " hinted" if self.hinted else ""
        return f"<Slot {self.seq_id} {self._state.value}{hinted} {len(self.tokens)} tokens>"


class KVCache:
    """Sequence ids and exact cell accounting; every change emits its memory call."""

    def __init__(self, memory: KVMemory, n_seq_max: int) -> None:
        self._memory = memory
        self._is_adaptive = memory.can_relayout  # kv_layout="auto"
        self._relayout_failure: str | None = None
        self._free_ids = list(range(n_seq_max))  # a min-heap: the lowest free id goes first
        self._slots: dict[int, Slot] = {}
        self._refs: dict[int, int] = {}
        self._next_cell = itertools.count()
        self._queued = QueuedCopies()
        self.num_queue_runs = 0
        """Times a state call had to run the memory's queued stream copies first."""
        self._at_checkpoints = not memory.can_share_prefix and memory.can_checkpoint
        self.grid: int | None = None
        """The reproducible mode's chunk grid (None: off): a prefix is reused only up to a
        multiple of it that its slot computed as prompt chunks (:meth:`usable`)."""
        self.invariant = False
        """In the reproducible mode: whether the base model computes a cell alike however
        its prompt was chunked and whatever shared its decodes (measured at start-up,
        :func:`~llamax.engine.sched.row_probe.chunks_batch_invariant`). The grid then binds
        only cells computed under LoRA adapters (:meth:`on_grid`)."""
        self.num_checkpoints = 0
        """Checkpoints taken."""
        self.num_checkpoint_restores = 0
        """Cuts and copies that set a checkpoint back."""

    # ------------------------------------------------------------------ queries
    @property
    def num_free_seq_ids(self) -> int:
        """Sequence ids held by no slot."""
        return len(self._free_ids)

    @property
    def num_cells_used(self) -> int:
        """Distinct KV cells referenced by any slot."""
        return len(self._refs)

    def slots(self) -> list[Slot]:
        """Every slot holding a sequence id."""
        return list(self._slots.values())

    @property
    def is_unified(self) -> bool:
        """Whether all sequences share one buffer now (copied prefixes share cells): the
        memory's own answer, the one record of which layout the cells are in."""
        return self._memory.is_unified

    @property
    def cells_per_seq(self) -> int:
        """Cells one sequence may hold in the current layout."""
        return self._memory.n_ctx_stream

    @property
    def layout(self) -> LayoutState:
        """Where the layout stands (see :data:`LAYOUT_MOVES`): derived, not stored, from
        whether it may move, whether a move failed, and which layout the memory holds."""
        if not self._is_adaptive:
            return LayoutState.FIXED
        if self._relayout_failure is not None:
            return LayoutState.STUCK
        return LayoutState.UNIFIED if self._memory.is_unified else LayoutState.STREAMS

    @property
    def can_relayout(self) -> bool:
        """Whether :meth:`relayout` may switch layouts."""
        return self._is_adaptive and self._relayout_failure is None

    @property
    def relayout_failure(self) -> str | None:
        """Why the layout is :attr:`LayoutState.STUCK` (None in any other state)."""
        return self._relayout_failure

    def fail_relayout(self, reason: str) -> None:
        """Stay in the current layout from now on: a move failed because of ``reason``.

        Raises:
            RuntimeError: The layout is not ``kv_layout="auto"``'s, or already stuck.
        """
        self._check_move(LayoutState.STUCK)
        self._relayout_failure = reason

    def _check_move(self, to: LayoutState) -> None:
        layout = self.layout
        if to not in LAYOUT_MOVES[layout]:
            raise RuntimeError(f"the KV layout cannot move from {layout.value} to {to.value}")

    @property
    def num_queued_copies(self) -> int:
        """Cross-stream copies the memory has queued for its next decode."""
        return len(self._queued)

    def decoded(self, status: int) -> None:
        """The backend ran a decode that returned ``status``: llama.cpp ran its queued
        copies first unless the batch was refused before that (a negative status)."""
        if status in _AFTER_MEMORY_UPDATE:
            self._queued.ran()

    def _run_queue(self) -> None:
        """Have the memory run its queued copies now (a state call is about to see them)."""
        self._memory.run_queued_copies()
        self._queued.ran()
        self.num_queue_runs += 1

    @property
    def cuts_at_checkpoints(self) -> bool:
        """Whether the memory is cut only where a slot took a checkpoint."""
        return self._at_checkpoints

    def on_grid(self, adapters: AdapterSet) -> bool:
        """Whether cells computed under ``adapters`` (``()``: the base model) are exact only
        up to :attr:`Slot.exact` (the reproducible mode's grid; an adapter's products
        depend on the batch even where the base model's do not)."""
        return self.grid is not None and (not self.invariant or bool(adapters))

    def usable(self, slot: Slot, num: int) -> int:
        """How many of ``slot``'s first ``num`` tokens a cut or copy can keep: all of them,
        unless the memory is cut at checkpoints (then the last one at or before ``num``, or
        the whole slot). In the reproducible mode (:attr:`grid`), only what a cold run of
        the same prompt would hold bit for bit: the last grid boundary at or before
        ``num`` within :attr:`Slot.exact` (none for a memory cut at checkpoints), unless
        the model is batch-invariant (:attr:`invariant`, :meth:`on_grid`)."""
        num = min(num, len(slot.tokens))
        if self.grid is not None and self.on_grid(slot.adapters):  # a cold run's boundary
            return 0 if self._at_checkpoints else min(num - num % self.grid, slot.exact)
        if not self._at_checkpoints or num == len(slot.tokens):
            return num
        return max((p for p in slot.checkpoints if p <= num), default=0)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes the slots' checkpoints hold (a checkpoint shared by copies counted once)."""
        if not self._at_checkpoints:  # read for every step's stats: nothing to count
            return 0
        seen = {id(d): len(d) for slot in self._slots.values() for d in slot.checkpoints.values()}
        return sum(seen.values())

    def checkpoint_stats(self) -> CheckpointStats:
        """The checkpoints' counters and bytes now."""
        return CheckpointStats(
            self.num_checkpoints, self.num_checkpoint_restores, self.checkpoint_bytes
        )

    def checkpoint(self, slot: Slot, max_kept: int) -> None:
        """Take a checkpoint of ``slot`` at its current length, keeping at most
        ``max_kept`` (:func:`~llamax.engine.kv.checkpoints.least_needed` dropped first). A
        memory that refuses it costs the checkpoint."""
        num = len(slot.tokens)
        if not self._at_checkpoints or not num or num in slot.checkpoints:
            return
        if self._queued.blocks_read(slot.seq_id):
            self._run_queue()
        data = self._memory.state_seq_get(slot.seq_id, partial=True)
        slot.checkpoints[num] = data
        self.num_checkpoints += 1
        while len(slot.checkpoints) > max_kept:
            del slot.checkpoints[least_needed(slot.checkpoints)]

    def trim_checkpoints(self, budget: int, keep: Slot) -> None:
        """Drop checkpoints until they hold at most ``budget`` bytes: the least needed of
        the slot holding most first, ``keep``'s last of all, and never ``keep``'s newest."""
        while self.checkpoint_bytes > budget:
            holders = [s for s in self._slots.values() if len(s.checkpoints) > (s is keep)]
            if not holders:
                return
            slot = max(holders, key=lambda s: (s is not keep, len(s.checkpoints)))
            newest = max(slot.checkpoints) if slot is keep else None
            del slot.checkpoints[least_needed([p for p in slot.checkpoints if p != newest])]

    def _set_back(self, slot: Slot, num: int, data: bytes) -> bool:
        """Set ``slot``'s checkpoint at ``num`` back and remove the cells past it; False
        (the memory may have lost the sequence: clear it) if the memory refused."""
        if self._queued.blocks_write(slot.seq_id):
            self._run_queue()
        if not self._memory.state_seq_set(slot.seq_id, data, partial=True):
            return False
        if not self._memory.seq_rm(slot.seq_id, num, -1):
            return False
        self.num_checkpoint_restores += 1
        return True

    @property
    def has_sliding_window(self) -> bool:
        """Whether the model has sliding-window layers."""
        return self._memory.sliding_window > 0

    def is_intact(self, slot: Slot, num: int | None = None) -> bool:
        """Whether the memory holds every cell a continuation of ``slot``'s first ``num``
        tokens (default: all) reads. A sliding-window cache may have dropped the first
        cells (llama.cpp reuses cells the window has passed; a saved state holds only the
        window), but a continuation from ``num`` reads only the window before it. A memory
        cut at checkpoints is intact: its attention cache is full size, and its recurrent
        state, which holds only its last position, is what the checkpoints are for."""
        if self._at_checkpoints or not slot.tokens:
            return True
        num = len(slot.tokens) if num is None else min(num, len(slot.tokens))
        window = self._memory.sliding_window
        first_read = max(0, num - window + 1) if window else 0
        # -1: the memory holds none of it (a window cut below what a saved state held)
        return 0 <= self._memory.seq_pos_min(slot.seq_id) <= first_read

    # ------------------------------------------------------------------ changes
    def allocate(self, *, pinned: bool = False) -> Slot | None:
        """Take the lowest free sequence id, or return None when none is free.

        Low ids first keeps running sequences on consecutive ids: with one stream per
        sequence llama.cpp splits a batch into one micro-batch per run of consecutive ids."""
        if not self._free_ids:
            return None
        slot = Slot(heapq.heappop(self._free_ids), pinned=pinned)
        self._slots[slot.seq_id] = slot
        return slot

    def relayout(self, unified: bool) -> None:
        """Move every slot into the other layout (``KVMemory.relayout``). The memory gives
        each sequence cells of its own, except, moving to the unified layout, the slots of
        :meth:`unify_shares`, which share their sources' cells as a copied prefix does.

        Raises:
            RuntimeError: The layout may not move (:attr:`can_relayout` is False).
            RequestFailedError: The memory could not move (nothing changed).
        """
        if unified == self._memory.is_unified:
            return
        self._check_move(LayoutState.UNIFIED if unified else LayoutState.STREAMS)
        if self._queued:  # the move reads every state, and the old context's queue never runs
            self._run_queue()
        shared = self.unify_shares() if unified else []
        self._memory.relayout(unified, shared)
        self._refs.clear()
        sharers = {share.seq_id for share in shared}
        for slot in self._slots.values():
            if slot.seq_id in sharers:
                continue
            slot.cells = []
            for _ in slot.tokens:
                cell = next(self._next_cell)
                self._refs[cell] = 1
                slot.cells.append(cell)
        for share in shared:
            slot, source = self._slots[share.seq_id], self._slots[share.source]
            slot.cells = source.cells[: share.num_tokens]
            for cell in slot.cells:
                self._refs[cell] += 1

    def unify_shares(self) -> list[SharedPrefix]:
        """The slots that, in a move to the unified layout, share the cells of a slot that
        holds all their tokens first (under the same adapters, so the same K/V) instead of
        copies: a chat's earlier turns kept beside its latest, a retried prompt. The
        longest slots keep cells of their own; a shorter one shares with the first of them
        that it begins. A session's (pinned) slot neither shares nor is shared: its history
        shift moves its cells (``seq_add``), which would move another sequence's too.
        None on a memory cut at checkpoints: a hybrid's ``seq_cp`` copies the source's whole
        recurrent state, not the state at the shared prefix's end."""
        if self._at_checkpoints:
            return []
        owners: list[Slot] = []
        shared: list[SharedPrefix] = []
        for slot in sorted(self._slots.values(), key=lambda s: len(s.tokens), reverse=True):
            if slot.pinned:
                continue
            n = len(slot.tokens)
            source = next(
                (
                    owner
                    for owner in owners
                    if n
                    and not slot.checkpoints
                    and owner.adapters == slot.adapters
                    and owner.tokens[:n] == slot.tokens
                ),
                None,
            )
            if source is None:
                owners.append(slot)
            else:
                shared.append(SharedPrefix(slot.seq_id, source.seq_id, n))
        return shared

    def cells_to_unify(self) -> int:
        """The cells every slot holds once moved to the unified layout (shares counted once)."""
        shared = {share.seq_id for share in self.unify_shares()}
        return sum(len(slot.tokens) for slot in self._slots.values() if slot.seq_id not in shared)

    def release(self, slot: Slot) -> None:
        """Drop every cell of ``slot`` and free its sequence id.

        A ``seq_rm`` that raises is tried once more (removing a whole sequence is
        idempotent); if it raises again the slot stays registered, and the caller's
        bookkeeping must keep holding it."""
        try:
            self._memory.seq_rm(slot.seq_id, -1, -1)
        except Exception:  # a transient fault: a session closed on it leaked its slot
            self._memory.seq_rm(slot.seq_id, -1, -1)
        self._drop_cells(slot, 0)
        del self._slots[slot.seq_id]
        heapq.heappush(self._free_ids, slot.seq_id)

    def copy_prefix(self, src: Slot, dst: Slot, num: int) -> bool:
        """Make ``dst`` (empty) hold the first ``num`` tokens of ``src`` without computing
        them: shared cells in a unified cache, a copied stream otherwise. A memory cut at
        checkpoints copies at ``src``'s checkpoint at ``num`` (or the whole slot); False,
        ``dst`` left empty, if it refuses that checkpoint."""
        if dst.tokens:
            raise ValueError(f"copy into a non-empty slot {dst!r}")
        checkpoint = None
        if self._at_checkpoints and num < len(src.tokens):
            checkpoint = src.checkpoints.get(num)
            if checkpoint is None:
                raise ValueError(f"{src!r} has no checkpoint at {num} tokens to copy")
        dst.checkpoints = {p: d for p, d in src.checkpoints.items() if p <= num}
        if self.grid is not None:
            dst.exact = dst.chunked = min(src.exact, num - num % self.grid)
        if self._memory.is_unified:
            self._memory.seq_cp(src.seq_id, dst.seq_id, 0, num)
            dst.tokens = src.tokens[:num]
            dst.cells = src.cells[:num]
            for cell in dst.cells:
                self._refs[cell] += 1
        else:
            self._memory.seq_cp(src.seq_id, dst.seq_id, -1, -1)
            self._queued.add(src.seq_id, dst.seq_id)
            cut = checkpoint is None and num < len(src.tokens)
            if cut and not self._memory.seq_rm(dst.seq_id, num, -1):
                self._memory.seq_rm(dst.seq_id, -1, -1)
                dst.checkpoints = {}
                raise ValueError(f"the memory cannot cut a copied stream to {num} tokens")
            self.append(dst, src.tokens[:num], prompt=False)
        # a recurrent state is shared whole whatever the range: set the copy's back
        if checkpoint is not None and not self._set_back(dst, num, checkpoint):
            self.clear(dst)
            return False
        return True

    def append(self, slot: Slot, tokens: Sequence[int], *, prompt: bool = False) -> None:
        """Record that ``tokens`` were computed at the end of ``slot`` in fresh cells
        (``prompt``: as a prompt chunk, which may extend :attr:`Slot.exact`)."""
        if self.grid is not None and prompt:
            start, end = len(slot.tokens), len(slot.tokens) + len(tokens)
            if start == slot.chunked:
                slot.chunked = end
                if end % self.grid == 0:
                    slot.exact = end
        slot.tokens.extend(tokens)
        for _ in tokens:
            cell = next(self._next_cell)
            self._refs[cell] = 1
            slot.cells.append(cell)

    def restore(
        self, slot: Slot, tokens: Sequence[int], state: bytes, *, exact: bool = False
    ) -> bool:
        """Load a saved sequence state into ``slot`` (empty); False if llama.cpp refused it
        or it does not hold exactly ``len(tokens)`` positions (then nothing is kept). A
        memory cut at checkpoints gets the slot's checkpoints back from it too. ``exact``:
        the state holds what a cold prompt computes (a prefix tier's entry in the
        reproducible mode, cut to :attr:`Slot.exact` when it was saved)."""
        if slot.tokens:
            raise ValueError(f"restore into a non-empty slot {slot!r}")
        checkpoints: dict[int, bytes] = {}
        if self._at_checkpoints:
            try:
                state, checkpoints = unpack_state(state)
            except ValueError:
                return False
            if any(not 0 < p <= len(tokens) for p in checkpoints):
                return False
        if self._queued.blocks_write(slot.seq_id):
            self._run_queue()
        if not self._memory.state_seq_set(slot.seq_id, state):
            return False
        if self._memory.seq_pos_max(slot.seq_id) != len(tokens) - 1:
            self._memory.seq_rm(slot.seq_id, -1, -1)
            return False
        self.append(slot, tokens)
        slot.checkpoints = checkpoints
        if exact and self.grid is not None:
            slot.exact = slot.chunked = len(tokens) - len(tokens) % self.grid
        return True

    def save(self, slot: Slot) -> bytes:
        """Serialise ``slot``'s KV state (a memory cut at checkpoints: with the slot's
        checkpoints, :func:`~llamax.engine.kv.checkpoints.pack_state`, which :meth:`restore`
        reads back)."""
        if self._queued.blocks_read(slot.seq_id):
            self._run_queue()
        state = self._memory.state_seq_get(slot.seq_id)
        return pack_state(state, slot.checkpoints) if self._at_checkpoints else state

    def truncate(self, slot: Slot, num: int) -> bool:
        """Keep only the first ``num`` tokens of ``slot``; False if the memory refused. A
        memory cut at checkpoints is cut only where the slot took one (else False, nothing
        changed); if it refuses the checkpoint, the slot is cleared."""
        if num >= len(slot.tokens):
            return True
        if self._at_checkpoints and num:
            checkpoint = slot.checkpoints.get(num)
            if checkpoint is None:
                return False
            if not self._set_back(slot, num, checkpoint):
                self.clear(slot)
                return False
        elif not self._memory.seq_rm(slot.seq_id, num, -1):
            return False
        self._drop_cells(slot, num)
        return True

    def shift_out(self, slot: Slot, start: int, end: int) -> bool:
        """Remove tokens ``[start, end)`` and move the rest back by ``end - start`` positions
        (``seq_rm`` + ``seq_add``): the kept cells are reused, not recomputed.

        Returns False (nothing changed) when the memory refuses a partial removal, or
        cannot shift a recurrent state (it would keep the removed tokens).
        """
        if not 0 <= start <= end <= len(slot.tokens):
            raise InvalidParameterError(
                f"cannot shift out [{start}, {end}): the session holds {len(slot.tokens)} tokens",
                param="end",
            )
        if start == end:
            return True
        if end == len(slot.tokens):
            return self.truncate(slot, start)
        if not self._memory.can_share_prefix:
            # a recurrent state holds the span: llama.cpp accepts the removal and keeps
            # the state as it was, which would answer from the dropped tokens
            return False
        if not self._memory.seq_rm(slot.seq_id, start, end):
            return False
        try:
            self._memory.seq_add(slot.seq_id, end, -1, start - end)
        except BaseException:  # the span is gone and the rest did not move: keep the head
            self._drop_cells(slot, start)
            self._memory.seq_rm(slot.seq_id, start, -1)
            raise
        for cell in slot.cells[start:end]:
            self._unref(cell)
        del slot.cells[start:end], slot.tokens[start:end]
        slot.exact = slot.chunked = min(slot.exact, start - start % (self.grid or 1))
        return True

    def drop_unrecorded(self, slot: Slot) -> None:
        """Remove the cells the memory holds past ``slot``'s recorded tokens: a decode whose
        sequence failed (sampler, logits processor) before it was recorded. Clears the slot
        if the memory cannot remove part of a sequence."""
        if not self._memory.seq_rm(slot.seq_id, len(slot.tokens), -1):
            self.clear(slot)

    def clear(self, slot: Slot) -> None:
        """Drop every cell of ``slot`` but keep its sequence id."""
        self._memory.seq_rm(slot.seq_id, -1, -1)
        self._drop_cells(slot, 0)

    def _drop_cells(self, slot: Slot, keep: int) -> None:
        if keep < len(slot.tokens):  # a cut: only a whole chunk from exact extends it again
            slot.exact = slot.chunked = min(slot.exact, keep - keep % (self.grid or 1))
        for cell in slot.cells[keep:]:
            self._unref(cell)
        del slot.cells[keep:]
        del slot.tokens[keep:]
        slot.num_prompt = min(slot.num_prompt, keep)
        if slot.checkpoints:
            slot.checkpoints = {p: d for p, d in slot.checkpoints.items() if p <= keep}

    def _unref(self, cell: int) -> None:
        left = self._refs[cell] - 1
        if left:
            self._refs[cell] = left
        else:
            del self._refs[cell]
