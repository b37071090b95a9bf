"""Prefix matching and LRU retention (llamax.engine.kv.prefix) over a KVCache, no engine."""

from __future__ import annotations

from llamax.backend import BatchItem
from llamax.engine.kv.kvcache import KVCache, Slot, SlotState
from llamax.engine.kv.prefix import InFlight, PrefixCache, PrefixMatch
from llamax.testing import FakeBackend


def make(n_seq_max: int = 3, *, retain: bool = True) -> tuple[PrefixCache, KVCache, FakeBackend]:
    backend = FakeBackend(n_seq_max=n_seq_max)
    kv = KVCache(backend, n_seq_max)
    return PrefixCache(kv, retain=retain), kv, backend


def filled(prefix: PrefixCache, kv: KVCache, backend: FakeBackend, tokens: list[int]) -> Slot:
    slot = prefix.allocate()
    assert slot is not None
    assert backend.decode([BatchItem(slot.seq_id, tokens, 0)]) == 0
    kv.append(slot, tokens)
    return slot


def test_match_finds_the_longest_prefix_but_never_the_last_prompt_token() -> None:
    prefix, kv, backend = make()
    short = filled(prefix, kv, backend, [1, 2, 3])
    long = filled(prefix, kv, backend, [1, 2, 3, 4, 5, 6])
    assert prefix.match([1, 2, 3, 4, 9], {}) == PrefixMatch(long, 4, 4)
    assert prefix.match([1, 2, 3, 4, 5, 6], {}) == PrefixMatch(long, 5, 5)  # last one recomputed
    assert prefix.match([1, 2, 7], {}).slot in (short, long)
    assert prefix.match([8, 9], {}) == PrefixMatch()


def test_match_reports_what_an_in_flight_prefill_will_give() -> None:
    prefix, kv, backend = make()
    leader = filled(prefix, kv, backend, [1, 2])  # computing [1..20] in chunks
    match = prefix.match([*range(1, 21), 99], {leader.seq_id: InFlight(list(range(1, 21)))})
    assert match == PrefixMatch(leader, 2, 20)


def test_retired_slots_are_evicted_least_recently_used_first_never_keep() -> None:
    prefix, kv, backend = make(3)
    a = filled(prefix, kv, backend, [1])
    b = filled(prefix, kv, backend, [2])
    c = filled(prefix, kv, backend, [3])
    for slot in (a, b, c):
        prefix.retire(slot)
    assert a.state is SlotState.RETAINED and prefix.num_retained == 3
    prefix.touch(a)  # a prefix was copied from it: most recently used now
    assert prefix.retained() == [b, c, a]
    assert prefix.evict_one(keep=b)
    assert prefix.retained() == [b, a]  # c went, b was kept
    assert prefix.allocate() is not None  # c's id was free
    assert prefix.allocate(keep=b) is not None  # no free id: evicts a, never b
    assert prefix.retained() == [b]
    prefix.adopt(b)
    assert b.state is SlotState.ACTIVE and prefix.num_retained == 0
    assert not prefix.evict_one()
    assert prefix.num_evictions == 2


def test_without_retention_nothing_is_kept_or_matched() -> None:
    prefix, kv, backend = make(retain=False)
    slot = filled(prefix, kv, backend, [1, 2, 3])
    assert prefix.match([1, 2, 3, 4], {}) == PrefixMatch()
    prefix.retire(slot)
    assert kv.num_free_seq_ids == 3 and backend.num_cells_used == 0


def test_pinned_slots_are_never_retired_and_empty_ones_are_released() -> None:
    prefix, kv, _ = make()
    pinned = prefix.allocate(pinned=True)
    assert pinned is not None
    prefix.retire(pinned)
    assert pinned.state is SlotState.PINNED and prefix.num_retained == 0
    empty = prefix.allocate()
    assert empty is not None
    prefix.retire(empty)
    assert kv.num_free_seq_ids == 2


def test_evict_all_frees_every_retained_slot() -> None:
    prefix, kv, backend = make()
    for tokens in ([1], [2]):
        prefix.retire(filled(prefix, kv, backend, tokens))
    assert prefix.evict_all() == 2 and backend.num_cells_used == 0
