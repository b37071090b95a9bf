"""KV-cell accounting (llamax.engine.kv.kvcache) against the fake backend's memory, no engine."""

from __future__ import annotations

import pytest

from llamax.backend import BatchItem
from llamax.engine.kv.kvcache import KVCache, Slot, SlotState
from llamax.testing import FakeBackend


def make(n_seq_max: int = 3) -> tuple[KVCache, FakeBackend]:
    backend = FakeBackend(n_seq_max=n_seq_max)
    return KVCache(backend, n_seq_max), backend


def compute(kv: KVCache, backend: FakeBackend, slot: Slot, tokens: list[int]) -> None:
    """Decode ``tokens`` at the end of ``slot`` in the fake, then record them."""
    assert backend.decode([BatchItem(slot.seq_id, tokens, len(slot.tokens))]) == 0
    kv.append(slot, tokens)


def test_allocate_until_no_id_is_free_then_release() -> None:
    kv, _ = make(2)
    a, b = kv.allocate(), kv.allocate()
    assert a is not None and b is not None and a.seq_id != b.seq_id
    assert kv.allocate() is None and kv.num_free_seq_ids == 0
    kv.release(a)
    assert kv.num_free_seq_ids == 1 and kv.slots() == [b]


def test_copied_prefix_shares_cells_and_counts_them_once() -> None:
    kv, backend = make()
    src, dst = kv.allocate(), kv.allocate()
    assert src is not None and dst is not None
    compute(kv, backend, src, [5, 6, 7, 8])
    kv.copy_prefix(src, dst, 3)
    assert dst.tokens == [5, 6, 7] and kv.num_cells_used == 4 == backend.num_cells_used
    kv.release(src)
    assert kv.num_cells_used == 3 == backend.num_cells_used  # dst still holds the shared ones
    with pytest.raises(ValueError, match="non-empty"):
        kv.copy_prefix(dst, dst, 1)


def test_truncate_shift_and_clear_keep_counts_exact() -> None:
    kv, backend = make()
    slot = kv.allocate()
    assert slot is not None and slot.state is SlotState.ACTIVE
    compute(kv, backend, slot, list(range(1, 11)))
    assert kv.shift_out(slot, 2, 5)
    assert slot.tokens == [1, 2, 6, 7, 8, 9, 10] and kv.num_cells_used == 7
    assert backend.seq_pos_max(slot.seq_id) == 6
    assert kv.truncate(slot, 4) and slot.tokens == [1, 2, 6, 7]
    with pytest.raises(ValueError, match="cannot shift out"):
        kv.shift_out(slot, 3, 9)
    kv.clear(slot)
    assert slot.tokens == [] and kv.num_cells_used == 0 == backend.num_cells_used


def test_refused_partial_removal_changes_nothing() -> None:
    backend = FakeBackend(can_share_prefix=False)
    kv = KVCache(backend, backend.n_seq_max)
    slot = kv.allocate()
    assert slot is not None
    compute(kv, backend, slot, [1, 2, 3])
    assert not kv.truncate(slot, 1) and not kv.shift_out(slot, 1, 2)
    assert slot.tokens == [1, 2, 3] and kv.num_cells_used == 3


def test_save_and_restore_a_slot() -> None:
    kv, backend = make()
    slot = kv.allocate()
    assert slot is not None
    compute(kv, backend, slot, [9, 8, 7])
    state = kv.save(slot)
    other = kv.allocate()
    assert other is not None and kv.restore(other, [9, 8, 7], state)
    assert other.tokens == [9, 8, 7] and backend.seq_tokens(other.seq_id) == [9, 8, 7]
    third = kv.allocate()
    assert third is not None and not kv.restore(third, [1], b"garbage")
    assert third.tokens == []


def test_a_slot_moves_only_as_slot_moves_allows() -> None:
    """A slot is born ACTIVE or PINNED; ACTIVE and RETAINED swap; ACTIVE may be pinned and
    PINNED retained (a yielding session), nothing else."""
    from llamax.engine.kv.kvcache import SLOT_MOVES

    for start in SlotState:
        for end in SlotState:
            slot = Slot(0, pinned=start is SlotState.PINNED)
            if start is SlotState.RETAINED:
                slot.move(SlotState.RETAINED)
            assert slot.state is start
            if end in SLOT_MOVES[start]:
                slot.move(end)
                assert slot.state is end
            else:
                with pytest.raises(RuntimeError, match=f"cannot become {end.value}"):
                    slot.move(end)
                assert slot.state is start
    assert Slot(1, pinned=True).pinned and not Slot(2).pinned
