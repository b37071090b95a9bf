"""The seam under the KV prefix cache: what every tier of evicted prefixes answers. Pure Python.

A tier keeps evicted prefixes' saved KV states (``llama_state_seq_get_data``) somewhere
cheaper than KV: host RAM (:mod:`llamax.engine.kv.prefix_ram`), files
(:mod:`llamax.engine.kv.prefix_disk`). Admission asks every tier one question, "how many
tokens of this prompt can you give me" (:meth:`PrefixTier.lookup`, a :class:`PrefixHit`),
and restores the best answer through one path (:meth:`PrefixTier.hold`, :meth:`~PrefixTier.read`,
:meth:`~PrefixTier.release`), in the spirit of vLLM's KV connector. A tier is one class:
its entries live in a :class:`ByteLRU` (least recently used out first, by bytes, with the
byte audit) and it counts in a frozen :class:`~llamax.stats.PrefixTierStats`
(:meth:`~llamax.stats.PrefixTierStats.counted`), reported with its sizes; :class:`StoredTier`
holds both for every tier.

An entry is worth its longest common prefix with the prompt, never the prompt's last
token (computed for its logits): :func:`best_prefix`.

Hints: an entry may be *hinted* (stored from a slot whose last request asked for its
prefix to be kept longer, ``SamplingParams.keep_prefix``). Making room drops the least
recently used unhinted entry first and a hinted one only when no unhinted one is left,
and an unhinted entry that would fit only by dropping hinted ones is not kept
(:meth:`ByteLRU.put`): a hinted entry outlives every unhinted one.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ...adapters import AdapterSet
from ...stats import PrefixTierStats
from ...tokens import common_prefix_len

__all__ = [
    "MIN_STORED_TOKENS",
    "ByteLRU",
    "PrefixHit",
    "PrefixTier",
    "StoredPrefix",
    "StoredTier",
    "best_prefix",
]

MIN_STORED_TOKENS = 32
"""Shorter prefixes are not kept: recomputing them costs about what restoring them does."""


class StoredPrefix(Protocol):
    """What every tier's entry has: the tokens its state holds."""

    @property
    def tokens(self) -> tuple[int, ...]: ...

    @property
    def hinted(self) -> bool: ...


E = TypeVar("E", bound=StoredPrefix)
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class PrefixHit(Generic[E]):
    """A tier's answer for a prompt: a stored entry and how many of the prompt's tokens it
    gives."""

    tier: PrefixTier[E]
    """The tier holding the entry."""
    entry: E
    """The entry (the tier's own type)."""
    num_common: int
    """Prompt tokens the entry holds (its common prefix with the prompt, less the last)."""

    @property
    def num_stored(self) -> int:
        """Tokens the entry's state holds (all land before the cut to :attr:`num_common`)."""
        return len(self.entry.tokens)


class PrefixTier(Protocol[E]):
    """A tier of evicted prefixes' states below the KV prefix cache.

    Admission restores a hit as: :meth:`hold` (before making room, whose evictions spill
    into the tiers), then either :meth:`release` with ``refused=False`` (no room), or
    :meth:`read` and the restore, :meth:`release` with ``refused=True`` when the memory
    refused the state, and :meth:`record_restore` in every case that read.
    """

    name: str
    """``ram``, ``disk``: the tier's name in stats and logs."""

    @property
    def is_enabled(self) -> bool:
        """Whether anything may be stored."""
        ...

    def wants(self, num_tokens: int, adapters: AdapterSet) -> bool:
        """Whether a prefix of ``num_tokens`` tokens computed under ``adapters`` would be
        stored (asked before saving its state)."""
        ...

    def store(
        self,
        tokens: Sequence[int],
        data: bytes,
        adapters: AdapterSet,
        *,
        hinted: bool = False,
        owner: str | None = None,
    ) -> bool:
        """Keep ``data``, the state of ``tokens``, as the most recently used entry (marked
        ``hinted``: dropped after the unhinted ones, within ``owner``'s share of the
        hinted bytes, :class:`ByteLRU`); False if not kept."""
        ...

    def lookup(
        self,
        prompt: Sequence[int],
        adapters: AdapterSet,
        *,
        longer_than: int = 0,
        max_tokens: int | None = None,
    ) -> PrefixHit[E] | None:
        """The entry computed under ``adapters`` giving the most of ``prompt`` (all but its
        last token), if more than ``longer_than`` tokens; entries of more than
        ``max_tokens`` tokens are skipped (a stream could not hold them)."""
        ...

    def hold(self, hit: PrefixHit[E]) -> None:
        """A restore of ``hit`` begins (counted as a hit): keep its entry out of the way of
        the evictions that make room for it."""
        ...

    def read(self, hit: PrefixHit[E]) -> bytes | None:
        """The held entry's state; None if it is gone or does not read back as written
        (then dropped and counted refused)."""
        ...

    def release(self, hit: PrefixHit[E], *, refused: bool) -> None:
        """The restore of the held ``hit`` did not happen: for want of room (the entry
        stays), or ``refused`` by the memory (dropped, counted refused)."""
        ...

    def record_restore(self, num_tokens: int, seconds: float) -> None:
        """A restore gave ``num_tokens`` prompt tokens (0: none) in ``seconds``."""
        ...

    def stats(self) -> PrefixTierStats:
        """Counters and sizes, frozen."""
        ...

    def audit(self) -> list[str]:
        """Inconsistencies in the tier's bookkeeping, as sentences."""
        ...

    def clear(self) -> int:
        """Drop every entry; return how many."""
        ...

    def close(self) -> None:
        """Release what the tier holds outside the process (idempotent)."""
        ...


def best_prefix(
    entries: Iterable[E],
    prompt: Sequence[int],
    *,
    longer_than: int,
    max_tokens: int | None,
    min_tokens: int,
) -> tuple[E, int] | None:
    """The stored entry giving the most of ``prompt`` (all but its last token) and how
    many tokens, if more than ``longer_than`` and at least ``min_tokens``; among equals the
    shortest entry (fewest bytes to restore). Entries holding more than ``max_tokens`` are
    skipped."""
    limit = len(prompt) - 1
    if limit <= longer_than or not prompt:
        return None
    best: tuple[E, int] | None = None
    prompt = tuple(prompt)  # slices of a tuple and a list never compare equal
    head = prompt[0]
    for entry in entries:
        tokens = entry.tokens
        if not tokens or tokens[0] != head:
            continue
        if max_tokens is not None and len(tokens) > max_tokens:
            continue
        common = min(common_prefix_len(tokens, prompt), limit)
        if common <= longer_than or common < min_tokens:
            continue
        if best is None or (common, -len(tokens)) > (best[1], -len(best[0].tokens)):
            best = (entry, common)
    return best


_NOBODY = object()  # an owner no entry has


class ByteLRU(Generic[K, V]):
    """Entries by key, least recently used first, within a byte budget; hinted entries
    (``hinted(entry)``) are kept longer than unhinted ones, within their owner's share.

    Each hinted entry has an owner (``owner(entry)``: the ``fair_key`` of the request that
    hinted it, None for requests without one). Hints are a claim on a shared resource, so
    no owner's claim is unbounded: with ``n`` owners holding hinted entries (a newcomer's
    counted), each owner's hinted entries are protected up to ``budget / (n + 1)`` bytes,
    the last share left to the traffic that sends no hints. Making room for an entry
    drops, least recently used first, the unhinted entries and the hinted ones of owners
    beyond their share; then, for a hinted entry, its own owner's hinted ones; never
    another owner's hinted entries within its share. An entry that cannot fit that way is
    not kept (:meth:`put` returns False). So one client that hints every request holds
    at most half a tier against everyone else's unhinted prefixes, and with others
    hinting too, an equal share each.

    Args:
        budget_bytes: The most bytes held.
        size: An entry's bytes.
        key: An entry's key.
        on_drop: Called with each entry dropped to stay within the budget.
        label: The tier's name in :meth:`audit`'s sentences ("the RAM tier").
        hinted: Whether an entry is hinted (default: none is).
        owner: A hinted entry's owner (default: one owner for all).
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        size: Callable[[V], int],
        key: Callable[[V], K],
        on_drop: Callable[[V], None],
        label: str,
        hinted: Callable[[V], bool] = lambda entry: False,
        owner: Callable[[V], Hashable] = lambda entry: None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self._size = size
        self._key = key
        self._on_drop = on_drop
        self._label = label
        self._hinted = hinted
        self._owner = owner
        self._entries: OrderedDict[K, V] = OrderedDict()  # LRU first
        self._num_bytes = 0
        self._num_hinted = 0
        self._hinted_bytes = 0
        self._owner_bytes: dict[Hashable, int] = {}  # hinted bytes by owner holding any
        self._owner_entries: dict[Hashable, int] = {}

    @property
    def num_bytes(self) -> int:
        """Bytes held."""
        return self._num_bytes

    @property
    def num_hinted(self) -> int:
        """Hinted entries held."""
        return self._num_hinted

    @property
    def hinted_bytes(self) -> int:
        """Bytes the hinted entries hold."""
        return self._hinted_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[V]:
        """Entries, least recently used first."""
        return iter(self._entries.values())

    def get(self, key: K) -> V | None:
        """The entry under ``key``, if any (not marked used)."""
        return self._entries.get(key)

    def touch(self, key: K) -> None:
        """Mark the entry under ``key`` (if any) as just used."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def share_bytes(self, *owners: Hashable) -> int:
        """The bytes each owner's hinted entries are protected up to, with ``owners``
        (newcomers: None is the owner of requests without a key) counted among those
        holding some (see the class)."""
        return self.budget_bytes // (len(set(self._owner_bytes) | set(owners)) + 1)

    def _drops_for(self, entry: V | None) -> list[K] | None:
        """The keys to drop, in order, so that ``entry`` fits (the entry under its own key
        is replaced, not counted; None: so that what is held fits); None if it cannot fit
        without dropping another owner's hinted entries within that owner's share, or
        alone exceeds the budget. What is held always can: the shares sum to less than the
        budget."""
        if entry is None:
            size, key, held = 0, _NOBODY, None
        else:
            size, key = self._size(entry), self._key(entry)
            held = self._entries.get(key)
        if size > self.budget_bytes:
            return None
        owners = dict(self._owner_bytes)
        held_owner: Hashable = _NOBODY
        if held is not None and self._hinted(held):
            held_owner = self._owner(held)
            owners[held_owner] -= self._size(held)
        mine: Hashable = _NOBODY  # None is an owner: requests without a key
        if entry is not None and self._hinted(entry):
            mine = self._owner(entry)
        holding = {o for o, n in self._owner_entries.items() if n > (held_owner == o)}
        share = self.budget_bytes // (len(holding | ({mine} - {_NOBODY})) + 1)
        over = self._num_bytes - (self._size(held) if held is not None else 0) + size
        over -= self.budget_bytes
        drops: list[K] = []
        for other, held_entry in self._entries.items():  # unhinted, and hints beyond a share
            if over <= 0:
                return drops
            if other == key:
                continue
            if self._hinted(held_entry):
                whose = self._owner(held_entry)
                if owners[whose] <= share:
                    continue
                owners[whose] -= self._size(held_entry)
            drops.append(other)
            over -= self._size(held_entry)
        if mine is not _NOBODY:  # then the newcomer's own owner's hints
            dropped = set(drops)
            for other, held_entry in self._entries.items():
                if over <= 0:
                    break
                if other == key or other in dropped or not self._hinted(held_entry):
                    continue
                if self._owner(held_entry) == mine:
                    drops.append(other)
                    over -= self._size(held_entry)
        return drops if over <= 0 else None

    def make_room_for(self, entry: V) -> bool:
        """Drop what :meth:`put` would drop for ``entry`` (without holding it); False,
        nothing dropped, if it cannot fit: it alone exceeds the budget, or it would need
        another owner's hinted entries within their share (see the class)."""
        drops = self._drops_for(entry)
        if drops is None:
            return False
        for key in drops:
            dropped = self.pop(key)
            assert dropped is not None
            self._on_drop(dropped)
        return True

    def put(self, entry: V) -> bool:
        """Hold ``entry`` as the most recently used (replacing one under its key), dropping
        entries to stay within the budget as the class says; False (nothing dropped) if
        it cannot fit (:meth:`make_room_for`)."""
        if not self.make_room_for(entry):
            return False
        self.pop(self._key(entry))
        self._add(entry)
        return True

    def _add(self, entry: V) -> None:
        size = self._size(entry)
        self._entries[self._key(entry)] = entry
        self._num_bytes += size
        if self._hinted(entry):
            self._num_hinted += 1
            self._hinted_bytes += size
            owner = self._owner(entry)
            self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
            self._owner_entries[owner] = self._owner_entries.get(owner, 0) + 1

    def fill(self, entries: Iterable[V]) -> None:
        """Hold ``entries`` (keys unique, least recently used first) in an empty store,
        then drop what is beyond the budget, by the rule :meth:`put` follows."""
        assert not self._entries, "fill() is for an empty store"
        for entry in entries:
            self._add(entry)
        for key in self._drops_for(None) or []:
            dropped = self.pop(key)
            assert dropped is not None
            self._on_drop(dropped)

    def pop(self, key: K) -> V | None:
        """Forget the entry under ``key``, if any; return it."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            size = self._size(entry)
            self._num_bytes -= size
            if self._hinted(entry):
                self._num_hinted -= 1
                self._hinted_bytes -= size
                owner = self._owner(entry)
                self._owner_bytes[owner] -= size
                self._owner_entries[owner] -= 1
                if not self._owner_entries[owner]:
                    del self._owner_bytes[owner], self._owner_entries[owner]
        return entry

    def clear(self) -> int:
        """Forget every entry; return how many."""
        count = len(self._entries)
        self._entries.clear()
        self._num_bytes = self._num_hinted = self._hinted_bytes = 0
        self._owner_bytes.clear()
        self._owner_entries.clear()
        return count

    def audit(self) -> list[str]:
        """Inconsistencies between the entries, their byte count and the budget."""
        problems = []
        held = sum(self._size(e) for e in self._entries.values())
        if held != self._num_bytes:
            problems.append(f"{self._label} accounts {self._num_bytes} bytes, entries hold {held}")
        if self._num_bytes > self.budget_bytes:
            problems.append(f"{self._label} holds {self._num_bytes} bytes > {self.budget_bytes}")
        for key, entry in self._entries.items():
            if key != self._key(entry):
                problems.append(f"an entry of {self._label} is filed under another key")
        hinted = [e for e in self._entries.values() if self._hinted(e)]
        hinted_bytes = sum(self._size(e) for e in hinted)
        if (len(hinted), hinted_bytes) != (self._num_hinted, self._hinted_bytes):
            problems.append(
                f"{self._label} accounts {self._num_hinted} hinted entries of "
                f"{self._hinted_bytes} bytes, holds {len(hinted)} of {hinted_bytes}"
            )
        owners: dict[Hashable, int] = {}
        for entry in hinted:
            owners[self._owner(entry)] = owners.get(self._owner(entry), 0) + self._size(entry)
        if owners != self._owner_bytes:
            problems.append(f"{self._label} accounts hinted bytes by owner wrongly")
        return problems


class StoredTier(Generic[K, E]):
    """What every tier shares: its entries in a :class:`ByteLRU`, its counts in a
    :class:`~llamax.stats.PrefixTierStats`, and the queries over both. A tier adds where its
    entries live (:meth:`PrefixTier.store`, ``hold``, ``read``, ``release``, ``lookup``).

    Args:
        lru: The tier's entries.
        model: The identity of the model every entry was computed with.
        min_tokens: Shorter prefixes are not stored.
    """

    def __init__(self, lru: ByteLRU[K, E], *, model: str, min_tokens: int) -> None:
        self.model = model
        self.min_tokens = min_tokens
        self._lru = lru
        self.counts = PrefixTierStats()
        """The counters (:meth:`stats` adds the sizes)."""
        self._stats: tuple[tuple[object, ...], PrefixTierStats] | None = None

    @property
    def budget_bytes(self) -> int:
        """The most bytes kept."""
        return self._lru.budget_bytes

    @property
    def num_bytes(self) -> int:
        """Bytes held."""
        return self._lru.num_bytes

    @property
    def num_entries(self) -> int:
        """Entries held."""
        return len(self._lru)

    def entries(self) -> list[E]:
        """Entries, least recently used first."""
        return list(self._lru)

    def share_bytes(self, *owners: Hashable) -> int:
        """The bytes each owner's hinted entries are protected up to, with ``owners``
        counted (:meth:`ByteLRU.share_bytes`)."""
        return self._lru.share_bytes(*owners)

    def stats(self) -> PrefixTierStats:
        """Counters and sizes, frozen; the same object while none of them changed (the
        engine publishes stats every step, and ``dataclasses.replace`` is not cheap)."""
        lru = self._lru
        key = (self.counts, lru.num_bytes, lru.budget_bytes, len(lru), lru.num_hinted)
        if self._stats is None or self._stats[0] != key:
            stats = dataclasses.replace(
                self.counts,
                num_bytes=key[1],
                budget_bytes=key[2],
                num_entries=key[3],
                num_hinted=key[4],
            )
            self._stats = (key, stats)
        return self._stats[1]

    def record_restore(self, num_tokens: int, seconds: float) -> None:
        """A restore gave ``num_tokens`` prompt tokens (0: none) in ``seconds``."""
        self.counts = self.counts.with_restore(num_tokens, seconds)

    def audit(self) -> list[str]:
        """Inconsistencies in the tier's bookkeeping, as sentences."""
        return self._lru.audit()
