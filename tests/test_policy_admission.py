"""Admission's side of the KV cache (:mod:`llamax.engine.kv.admission`): the decisions on plain
numbers, and the slot placer on a fake backend's KV memory (no scheduler, no sequences)."""

from __future__ import annotations

from llamax.backend.base import BatchItem
from llamax.engine.kv.admission import (
    WAIT_FOR_PREFIX_MIN,
    Outcome,
    SlotPlacer,
    num_to_keep,
    should_wait,
)
from llamax.engine.kv.kvcache import KVCache, Slot, SlotState
from llamax.engine.kv.prefix import InFlight, PrefixCache
from llamax.testing import FakeBackend


def test_a_newcomer_waits_only_for_a_prefix_that_saves_enough() -> None:
    assert not should_wait(0, 0)
    assert not should_wait(10, 10 + WAIT_FOR_PREFIX_MIN - 1)
    assert should_wait(10, 10 + WAIT_FOR_PREFIX_MIN)
    assert should_wait(0, 500)


def test_a_reused_slot_never_keeps_the_prompts_last_token() -> None:
    assert num_to_keep(5, 10) == 5
    assert num_to_keep(10, 10) == 9  # the whole prompt matches: its last token is redone
    assert num_to_keep(50, 10) == 9  # the slot holds more than the prompt
    assert num_to_keep(0, 1) == 0


_BACKENDS: dict[int, FakeBackend] = {}
"""The fake memory behind each test's KV cache."""


def _placer(n_ctx: int = 64, n_seq_max: int = 2) -> tuple[SlotPlacer, KVCache, PrefixCache]:
    backend = FakeBackend(n_ctx=n_ctx, n_seq_max=n_seq_max)
    kv = KVCache(backend, backend.facts.n_seq_max)
    _BACKENDS[id(kv)] = backend
    prefix = PrefixCache(kv)
    return SlotPlacer(kv, prefix, backend.facts.n_ctx), kv, prefix


def _compute(kv: KVCache, slot: Slot, tokens: list[int]) -> None:
    """Decode ``tokens`` into ``slot`` (the fake memory's cells) and record them."""
    assert _BACKENDS[id(kv)].decode([BatchItem(slot.seq_id, tokens, len(slot.tokens))]) == 0
    kv.append(slot, tokens)


def _retained(kv: KVCache, prefix: PrefixCache, tokens: list[int]) -> None:
    slot = kv.allocate()
    assert slot is not None
    _compute(kv, slot, tokens)
    prefix.retire(slot)


def test_a_newcomer_copies_the_longest_retained_prefix() -> None:
    placer, kv, prefix = _placer()
    _retained(kv, prefix, [1, 2, 3, 4, 5])
    placement = placer.place([1, 2, 3, 9, 9], {}, num_pending=0)
    assert placement.outcome is Outcome.ADMITTED and placement.num_reused == 3
    assert placement.slot is not None and placement.slot.tokens == [1, 2, 3]


def test_a_newcomer_waits_for_a_long_prefix_still_being_computed() -> None:
    placer, kv, _ = _placer()
    owner = kv.allocate()
    assert owner is not None
    prompt = list(range(1, 41))
    _compute(kv, owner, prompt[:8])  # 8 of 40 prompt tokens computed so far
    placement = placer.place([*prompt, 99], {owner.seq_id: InFlight(prompt)}, num_pending=32)
    assert placement.outcome is Outcome.WAIT_PREFIX and placement.slot is None


def test_without_a_free_id_the_newcomer_takes_over_the_retained_slot_it_copies() -> None:
    placer, kv, prefix = _placer(n_seq_max=1)
    _retained(kv, prefix, [1, 2, 3, 4, 5])
    placement = placer.place([1, 2, 3, 7], {}, num_pending=0)
    assert placement.outcome is Outcome.ADMITTED and placement.num_reused == 3
    assert placement.slot is not None and placement.slot.state is not SlotState.RETAINED
    assert placement.slot.tokens == [1, 2, 3] and prefix.num_retained == 0


def test_a_take_over_that_does_not_fit_retains_the_slot_again() -> None:
    placer, kv, prefix = _placer(n_ctx=16, n_seq_max=1)
    _retained(kv, prefix, [1, 2, 3, 4, 5])
    placement = placer.place([1, 2, 3] + [7] * 30, {}, num_pending=0)  # 33 cells > 16
    assert placement.outcome is Outcome.NO_ROOM and placement.slot is None
    assert prefix.num_retained == 1


def test_fits_evicts_retained_slots_but_never_the_source() -> None:
    placer, kv, prefix = _placer(n_ctx=16, n_seq_max=3)
    _retained(kv, prefix, [1] * 6)
    keep = kv.slots()[0]
    _retained(kv, prefix, [2] * 6)
    assert placer.fits(4, num_pending=0, keep=keep)  # 12 + 4 <= 16: nothing to evict
    assert prefix.num_retained == 2
    assert placer.fits(8, num_pending=0, keep=keep)  # evicts the other one only
    assert prefix.retained() == [keep]
    assert not placer.fits(20, num_pending=0, keep=keep)


def test_a_session_slot_keeps_the_common_prefix_and_drops_the_rest() -> None:
    placer, kv, _ = _placer()
    slot = kv.allocate(pinned=True)
    assert slot is not None
    _compute(kv, slot, [1, 2, 3, 4, 5, 6])
    placement = placer.reuse(slot, [1, 2, 3, 9], num_pending=0)
    assert placement.outcome is Outcome.ADMITTED and placement.num_reused == 3
    assert slot.tokens == [1, 2, 3]


def test_a_fork_shares_every_cell_of_its_leader() -> None:
    placer, kv, _ = _placer()
    leader = kv.allocate()
    assert leader is not None
    _compute(kv, leader, [1, 2, 3])
    fork = placer.fork(leader)
    assert fork.tokens == [1, 2, 3] and fork.cells == leader.cells
    assert kv.num_cells_used == 3
