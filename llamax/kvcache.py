"""KV-cache bookkeeping over llama.cpp's unified cache. Pure Python.

A :class:`Slot` is one llama.cpp sequence id together with the tokens it holds in KV
(positions ``0 .. len(tokens)-1``). On a unified cache ``seq_cp(src, dst, 0, n)`` tags the
existing cells with another id, so a copied prefix costs no cells. We therefore give every
computed token a cell id, share cell ids on copy, and count a cell as used while any slot
references it; that makes ``num_cells_used`` exact without asking llama.cpp.

Slots are ACTIVE (a running sequence or an open session uses them) or RETAINED (a finished
sequence kept for its prefix). Retained slots are evicted LRU whenever a sequence id or
cells are needed; active and pinned (session) slots never are.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from enum import Enum

from .backend.base import Backend

__all__ = ["KVCache", "Slot", "SlotState", "common_prefix_len"]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by binary search over C-speed slice compares."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SlotState(Enum):
    """Who holds a slot."""

    ACTIVE = "active"
    RETAINED = "retained"


class Slot:
    """A sequence id and the tokens it holds in KV."""

    __slots__ = ("cells", "last_used", "pinned", "seq_id", "state", "tokens")

    def __init__(self, seq_id: int, *, pinned: bool = False) -> None:
        self.seq_id = seq_id
        self.tokens: list[int] = []
        self.cells: list[int] = []
        self.state = SlotState.ACTIVE
        self.last_used = 0
        self.pinned = pinned

    def __repr__(self) -> str:
        return f"<Slot {self.seq_id} {self.state.value} {len(self.tokens)} tokens>"


class KVCache:
    """Sequence ids, cell accounting, prefix copies and LRU retention."""

    def __init__(self, backend: Backend, *, retain: bool = True) -> None:
        self._backend = backend
        self._retain = retain
        self._free_ids = list(reversed(range(backend.n_seq_max)))
        self._slots: dict[int, Slot] = {}
        self._refs: dict[int, int] = {}
        self._next_cell = itertools.count()
        self._clock = itertools.count(1)
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_seq_ids(self) -> int:
        """Sequence ids held by no slot."""
        return len(self._free_ids)

    @property
    def num_cells_used(self) -> int:
        """Distinct KV cells referenced by any slot."""
        return len(self._refs)

    @property
    def num_retained(self) -> int:
        """Finished sequences kept for their prefix."""
        return sum(1 for s in self._slots.values() if s.state is SlotState.RETAINED)

    def slots(self) -> list[Slot]:
        """Every slot holding a sequence id."""
        return list(self._slots.values())

    def retained(self) -> list[Slot]:
        """Retained slots, least recently used first."""
        found = [s for s in self._slots.values() if s.state is SlotState.RETAINED]
        return sorted(found, key=lambda s: s.last_used)

    # ------------------------------------------------------------------ changes
    def allocate(self, *, pinned: bool = False, keep: Slot | None = None) -> Slot | None:
        """Take a free sequence id (evicting a retained slot if needed), or return None."""
        if not self._free_ids and not self.evict_one(keep=keep):
            return None
        slot = Slot(self._free_ids.pop(), pinned=pinned)
        self._slots[slot.seq_id] = slot
        return slot

    def release(self, slot: Slot) -> None:
        """Drop every cell of ``slot`` and free its sequence id."""
        self._backend.seq_rm(slot.seq_id, -1, -1)
        self._drop_cells(slot, 0)
        del self._slots[slot.seq_id]
        self._free_ids.append(slot.seq_id)

    def retire(self, slot: Slot) -> None:
        """A sequence finished: keep its cells for reuse (LRU) or release them."""
        if slot.pinned:
            return
        if self._retain and slot.tokens:
            slot.state = SlotState.RETAINED
            slot.last_used = next(self._clock)
        else:
            self.release(slot)

    def adopt(self, slot: Slot) -> None:
        """Make a retained slot active again (a new sequence takes it over)."""
        slot.state = SlotState.ACTIVE
        self.touch(slot)

    def touch(self, slot: Slot) -> None:
        """Mark ``slot`` as just used (for LRU)."""
        slot.last_used = next(self._clock)

    def evict_one(self, *, keep: Slot | None = None) -> bool:
        """Release the least recently used retained slot (never ``keep``)."""
        for slot in self.retained():
            if slot is not keep:
                self.release(slot)
                self.num_evictions += 1
                return True
        return False

    def copy_prefix(self, src: Slot, dst: Slot, num: int) -> None:
        """Make ``dst`` (empty) share the first ``num`` cells of ``src`` (``seq_cp``)."""
        if dst.tokens:
            raise ValueError(f"copy into a non-empty slot {dst!r}")
        self._backend.seq_cp(src.seq_id, dst.seq_id, 0, num)
        dst.tokens = src.tokens[:num]
        dst.cells = src.cells[:num]
        for cell in dst.cells:
            self._refs[cell] += 1
        self.touch(src)

    def append(self, slot: Slot, tokens: Sequence[int]) -> None:
        """Record that ``tokens`` were computed at the end of ``slot`` in fresh cells."""
        slot.tokens.extend(tokens)
        for _ in tokens:
            cell = next(self._next_cell)
            self._refs[cell] = 1
            slot.cells.append(cell)

    def truncate(self, slot: Slot, num: int) -> bool:
        """Keep only the first ``num`` tokens of ``slot``; False if the memory refused."""
        if num >= len(slot.tokens):
            return True
        if not self._backend.seq_rm(slot.seq_id, num, -1):
            return False
        self._drop_cells(slot, num)
        return True

    def shift_out(self, slot: Slot, start: int, end: int) -> bool:
        """Remove tokens ``[start, end)`` and move the rest back by ``end - start`` positions
        (``seq_rm`` + ``seq_add``): the kept cells are reused, not recomputed.

        Returns False (nothing changed) when the memory refuses a partial removal.
        """
        if not 0 <= start <= end <= len(slot.tokens):
            raise ValueError(f"cannot shift out [{start}, {end}) of {slot!r}")
        if start == end:
            return True
        if end == len(slot.tokens):
            return self.truncate(slot, start)
        if not self._backend.seq_rm(slot.seq_id, start, end):
            return False
        self._backend.seq_add(slot.seq_id, end, -1, start - end)
        for cell in slot.cells[start:end]:
            self._unref(cell)
        del slot.cells[start:end], slot.tokens[start:end]
        return True

    def clear(self, slot: Slot) -> None:
        """Drop every cell of ``slot`` but keep its sequence id."""
        self._backend.seq_rm(slot.seq_id, -1, -1)
        self._drop_cells(slot, 0)

    def _drop_cells(self, slot: Slot, keep: int) -> None:
        for cell in slot.cells[keep:]:
            self._unref(cell)
        del slot.cells[keep:]
        del slot.tokens[keep:]

    def _unref(self, cell: int) -> None:
        left = self._refs[cell] - 1
        if left:
            self._refs[cell] = left
        else:
            del self._refs[cell]
