"""The prefix-tier seam: the byte-budgeted LRU every tier keeps its entries in, and the
contract admission relies on, checked on every tier (a new tier joins ``TIERS``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llamax.adapters import NO_ADAPTERS, AdapterSet
from llamax.engine.kv.prefix_disk import PrefixDiskTier
from llamax.engine.kv.prefix_ram import PrefixRamTier
from llamax.engine.kv.prefix_tier import ByteLRU, PrefixTier

MB = 1 << 20


# ---------------------------------------------------------------------- ByteLRU
def lru(budget: int = 10) -> tuple[ByteLRU[str, tuple[str, int]], list[str]]:
    dropped: list[str] = []
    store: ByteLRU[str, tuple[str, int]] = ByteLRU(
        budget,
        size=lambda e: e[1],
        key=lambda e: e[0],
        on_drop=lambda e: dropped.append(e[0]),
        label="the test store",
    )
    return store, dropped


def test_the_lru_drops_least_recently_used_first_to_stay_within_the_budget() -> None:
    store, dropped = lru(10)
    assert store.put(("a", 4)) and store.put(("b", 4))
    store.touch("a")  # now b is the oldest
    assert store.put(("c", 4))
    assert [k for k, _ in store] == ["a", "c"] and dropped == ["b"]
    assert store.num_bytes == 8 and len(store) == 2 and store.audit() == []


def test_the_lru_replaces_an_entry_under_the_same_key_without_dropping_it() -> None:
    store, dropped = lru(10)
    store.put(("a", 4))
    store.put(("b", 4))
    assert store.put(("a", 6))  # replaces a: 6 + 4 fits
    assert [e for e in store] == [("b", 4), ("a", 6)] and dropped == []
    assert store.num_bytes == 10


def test_an_entry_larger_than_the_budget_is_refused_and_drops_nothing() -> None:
    store, dropped = lru(10)
    store.put(("a", 4))
    assert not store.put(("big", 11))
    assert [k for k, _ in store] == ["a"] and dropped == [] and store.num_bytes == 4


def test_fill_keeps_the_newest_within_the_budget() -> None:
    store, dropped = lru(10)
    store.fill([("old", 4), ("mid", 4), ("new", 4)])  # oldest first
    assert [k for k, _ in store] == ["mid", "new"] and dropped == ["old"]


def test_pop_get_and_clear() -> None:
    store, _ = lru(10)
    store.put(("a", 3))
    assert store.get("a") == ("a", 3) and store.get("x") is None
    assert store.pop("a") == ("a", 3) and store.pop("a") is None and store.num_bytes == 0
    store.put(("b", 3))
    assert store.clear() == 1 and len(store) == 0 and store.num_bytes == 0


def test_the_audit_names_a_wrong_count_an_overrun_and_a_misfiled_entry() -> None:
    store, _ = lru(10)
    store.put(("a", 4))
    store._num_bytes += 1
    assert any("accounts 5 bytes, entries hold 4" in p for p in store.audit())
    store._num_bytes = 11
    assert any("holds 11 bytes > 10" in p for p in store.audit())
    store._num_bytes = 4
    store._entries["z"] = store._entries.pop("a")
    assert any("filed under another key" in p for p in store.audit())


# ---------------------------------------------------------------------- the contract
Make = Callable[[int], PrefixTier[Any]]


@pytest.fixture(params=["ram", "disk"])
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    made: list[PrefixTier[Any]] = []

    def build(budget: int = MB) -> PrefixTier[Any]:
        tier: PrefixTier[Any]
        if request.param == "ram":
            tier = PrefixRamTier(budget, min_tokens=2)
        else:
            tier = PrefixDiskTier(str(tmp_path / f"d{len(made)}"), budget, min_tokens=2)
        made.append(tier)
        return tier

    yield build
    for tier in made:
        assert tier.audit() == []
        tier.close()


PROMPT = [1, 2, 3, 4, 5, 6]


def stored(tier: PrefixTier[Any], adapters: AdapterSet = NO_ADAPTERS) -> None:
    assert tier.wants(4, adapters)
    assert tier.store([1, 2, 3, 4], b"state", adapters)


def test_a_tier_gives_the_common_prefix_never_the_last_token(make_tier: Make) -> None:
    tier = make_tier(MB)
    stored(tier)
    hit = tier.lookup(PROMPT, NO_ADAPTERS)
    assert hit is not None and hit.tier is tier
    assert (hit.num_common, hit.num_stored, hit.entry.tokens) == (4, 4, (1, 2, 3, 4))
    assert tier.lookup([1, 2, 3, 4], NO_ADAPTERS).num_common == 3  # type: ignore[union-attr]
    assert tier.lookup(PROMPT, NO_ADAPTERS, longer_than=4) is None  # an upper tier gives 4
    assert tier.lookup(PROMPT, NO_ADAPTERS, max_tokens=3) is None  # a stream holds 3
    assert tier.lookup([9, *PROMPT], NO_ADAPTERS) is None


def test_a_restore_reads_the_stored_state_and_counts_a_hit(make_tier: Make) -> None:
    tier = make_tier(MB)
    stored(tier)
    hit = tier.lookup(PROMPT, NO_ADAPTERS)
    assert hit is not None
    tier.hold(hit)
    assert tier.read(hit) == b"state"
    tier.record_restore(hit.num_common, 0.5)
    stats = tier.stats()
    assert (stats.num_stored, stats.num_hits, stats.num_restores) == (1, 1, 1)
    assert (stats.num_restored_tokens, stats.restore_seconds, stats.num_refused) == (4, 0.5, 0)


def test_a_restore_without_room_leaves_the_entry_in_the_tier(make_tier: Make) -> None:
    tier = make_tier(MB)
    stored(tier)
    hit = tier.lookup(PROMPT, NO_ADAPTERS)
    assert hit is not None
    tier.hold(hit)
    tier.release(hit, refused=False)
    again = tier.lookup(PROMPT, NO_ADAPTERS)
    assert again is not None and again.entry == hit.entry and tier.stats().num_refused == 0


def test_a_state_the_memory_refuses_is_dropped_and_counted(make_tier: Make) -> None:
    tier = make_tier(MB)
    stored(tier)
    hit = tier.lookup(PROMPT, NO_ADAPTERS)
    assert hit is not None
    tier.hold(hit)
    assert tier.read(hit) == b"state"
    tier.release(hit, refused=True)
    tier.record_restore(0, 0.1)
    stats = tier.stats()
    assert tier.lookup(PROMPT, NO_ADAPTERS) is None
    assert (stats.num_entries, stats.num_refused, stats.num_restores) == (0, 1, 0)


def test_an_entry_is_found_only_under_its_own_adapter_set(make_tier: Make) -> None:
    tier = make_tier(MB)
    stored(tier)
    lora = AdapterSet.of([("a", 1.0)])
    assert tier.lookup(PROMPT, lora) is None
    if tier.wants(4, lora):  # a tier that keeps adapter states keys them apart
        assert tier.store([1, 2, 3, 4], b"lora", lora)
        hit = tier.lookup(PROMPT, lora)
        assert hit is not None and tier.read(hit) == b"lora"


def test_a_tier_stays_within_its_budget_and_clear_empties_it(make_tier: Make) -> None:
    tier = make_tier(MB)
    stored(tier)
    size = tier.stats().num_bytes
    small = make_tier(2 * size)  # room for two entries of this size
    for head in (1, 5, 9):
        assert small.store([head, 2, 3, 4], b"state", NO_ADAPTERS)
    stats = small.stats()
    assert (stats.num_entries, stats.num_dropped, stats.budget_bytes) == (2, 1, 2 * size)
    assert small.lookup([1, 2, 3, 4, 5], NO_ADAPTERS) is None  # the oldest went
    assert small.clear() == 2 and small.stats().num_bytes == 0


def test_a_tiers_stats_follow_every_change_and_are_one_object_between_changes(
    make_tier: Make,
) -> None:
    """The engine publishes stats every step, so a tier keeps its last stats object while
    nothing changed; every store, hit, restore, refusal and drop gives a new one."""
    tier = make_tier(MB)
    first = tier.stats()
    assert tier.stats() is first and (first.num_entries, first.num_bytes) == (0, 0)
    assert first.budget_bytes == MB
    stored(tier)
    after_store = tier.stats()
    assert after_store is not first and after_store.num_entries == 1 and after_store.num_bytes
    assert after_store.num_stored == 1 and tier.stats() is after_store
    hit = tier.lookup(PROMPT, NO_ADAPTERS)
    assert hit is not None
    tier.hold(hit)
    tier.read(hit)
    tier.record_restore(hit.num_common, 0.25)
    restored = tier.stats()
    assert (restored.num_restores, restored.num_restored_tokens) == (1, 4)
    tier.release(hit, refused=True)
    dropped = tier.stats()
    assert dropped.num_refused == 1 and dropped.num_entries == 0 and dropped.num_bytes == 0
    assert tier.stats() is dropped
