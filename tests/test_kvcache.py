"""KV-cell accounting (llamax.engine.kv.kvcache) against the fake backend's memory, no engine."""

from __future__ import annotations

import pytest

from llamax.adapters import AdapterSet
from llamax.backend import BatchItem
from llamax.backend.base import SharedPrefix
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
    kv = KVCache(backend, backend.facts.n_seq_max)
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


def test_a_move_to_unified_shares_only_whole_prefixes_under_the_same_adapters() -> None:
    """A slot whose every token begins a longer slot (a chat's earlier turn kept beside
    its continuation) shares that slot's cells after a move to the unified layout instead
    of holding copies that every later decode would attend over. The fake checks that
    each share reads exactly the K/V its slot computed (the old code copied them all)."""
    backend = FakeBackend(n_ctx=256, n_seq_max=4, kv_layout="auto")
    kv = KVCache(backend, 4)
    assert not kv.is_unified
    long, turn, other_lora, diverged = (kv.allocate() for _ in range(4))
    assert long and turn and other_lora and diverged
    compute(kv, backend, long, list(range(1, 11)))
    compute(kv, backend, turn, list(range(1, 7)))  # computed on its own: the same K/V
    compute(kv, backend, other_lora, list(range(1, 7)))
    other_lora.adapters = AdapterSet.of([("style", 1.0)])  # its K/V differ
    compute(kv, backend, diverged, [1, 2, 3, 99])  # shares 3 tokens, then goes its own way
    assert kv.unify_shares() == [SharedPrefix(turn.seq_id, long.seq_id, 6)]
    assert kv.cells_to_unify() == 10 + 6 + 4
    kv.relayout(True)
    assert kv.is_unified and kv.num_cells_used == 20 == backend.num_cells_used
    assert turn.cells == long.cells[:6]
    kv.release(long)  # the turn keeps the cells it shares
    assert kv.num_cells_used == 6 + 6 + 4 == backend.num_cells_used
    compute(kv, backend, turn, [42])  # and grows in cells of its own
    assert kv.num_cells_used == 17 == backend.num_cells_used
    assert backend.cells[turn.seq_id] == [*range(1, 7), 42]


def test_a_move_back_to_streams_gives_every_slot_its_own_cells() -> None:
    backend = FakeBackend(n_ctx=256, n_seq_max=2, kv_layout="auto")
    kv = KVCache(backend, 2)
    long, turn = kv.allocate(), kv.allocate()
    assert long and turn
    compute(kv, backend, long, [1, 2, 3, 4])
    compute(kv, backend, turn, [1, 2])
    kv.relayout(True)
    assert kv.num_cells_used == 4 == backend.num_cells_used
    kv.relayout(False)
    assert kv.num_cells_used == 6 == backend.num_cells_used


def test_a_sessions_slot_keeps_cells_of_its_own_through_a_move() -> None:
    """A session's history shift moves its cells (``seq_add``): shared, it would move
    another sequence's too. So a move to the unified layout shares no cell with a pinned
    slot, either way (a fault-injection run caught "seq_add 0 moves cells another
    sequence holds too" with sessions shared)."""
    backend = FakeBackend(n_ctx=256, n_seq_max=3, kv_layout="auto")
    kv = KVCache(backend, 3)
    session, longer, retained = kv.allocate(pinned=True), kv.allocate(), kv.allocate()
    assert session and longer and retained
    compute(kv, backend, session, [1, 2, 3])
    compute(kv, backend, longer, [1, 2, 3, 4, 5])
    compute(kv, backend, retained, [1, 2, 3, 4])
    assert kv.unify_shares() == [SharedPrefix(retained.seq_id, longer.seq_id, 4)]
    kv.relayout(True)
    assert kv.num_cells_used == 3 + 5 == backend.num_cells_used
    assert kv.shift_out(session, 0, 1)  # the fake refuses a shift of shared cells
    assert kv.num_cells_used == 2 + 5 == backend.num_cells_used
