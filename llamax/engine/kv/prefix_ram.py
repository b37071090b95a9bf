"""The host-RAM tier below the KV prefix cache. Pure Python.

When :class:`~llamax.engine.kv.prefix.PrefixCache` evicts a retained slot, its saved KV state
(``llama_state_seq_get_data``) is kept here, within a byte budget, instead of being lost.
A later prompt that shares a longer prefix with a stored entry than with any KV slot gets
that state restored into a fresh slot (``llama_state_seq_set_data``), cut to the shared
prefix, instead of computing it again.

Design note: an entry holds a whole retained sequence (prompt and answer), so the next
turn's prompt rarely *starts with* all of it: a system prompt followed by another question
shares only the system prompt. As in the KV tier (:meth:`PrefixCache.match`), an entry is
worth its longest common prefix with the prompt (never the prompt's last token, computed
for its logits); the restored tail past it is cut with ``seq_rm``. An entry moves out of
the tier when it is restored (the KV slot holds it then, and spills it again when evicted),
so a prefix is held by one tier at a time.

Entries are keyed by ``(adapters, tokens)``; a tier belongs to one context and so to one
model (:attr:`PrefixRamTier.model`). The tier is one
:class:`~llamax.engine.kv.prefix_tier.PrefixTier`: admission looks it up and restores from it
as from any other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...adapters import NO_ADAPTERS, AdapterSet
from .prefix_tier import MIN_STORED_TOKENS, ByteLRU, PrefixHit, StoredTier, best_prefix

__all__ = [
    "MAX_DEFAULT_BYTES",
    "PrefixRamTier",
    "RamEntry",
    "default_budget",
]

MAX_DEFAULT_BYTES = 8 << 30
"""The default budget's cap (llama-server's ``--cache-ram`` default is 8 GiB too)."""

Key = tuple[AdapterSet, tuple[int, ...]]


def default_budget(meminfo: str = "/proc/meminfo") -> int:
    """The default byte budget: a quarter of the memory available now (``MemAvailable``,
    else the free physical pages), at most :data:`MAX_DEFAULT_BYTES`; 0 when neither can
    be read."""
    available = 0
    try:
        with open(meminfo, encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if not available:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            available = 0
    return max(0, min(available // 4, MAX_DEFAULT_BYTES))


@dataclass(frozen=True, slots=True)
class RamEntry:
    """One evicted prefix's saved KV state."""

    adapters: AdapterSet
    """The LoRA adapter set its KV was computed with (``()``: none)."""
    tokens: tuple[int, ...]
    """The tokens the state holds, at positions ``0 .. len(tokens) - 1``."""
    data: bytes
    """The backend's serialised state (``KVMemory.state_seq_get``)."""
    hinted: bool = False
    """Whether a hint asked to keep it longer (``SamplingParams.keep_prefix``): dropped
    after the unhinted entries, within its owner's share (:class:`~llamax.engine.kv.
    prefix_tier.ByteLRU`), and to the disk tier with its mark."""
    owner: str | None = None
    """The ``fair_key`` of the request that hinted it (None: none), whose share it uses."""

    @property
    def key(self) -> Key:
        """``(adapters, tokens)``."""
        return self.adapters, self.tokens


class PrefixRamTier(StoredTier[Key, RamEntry]):
    """Evicted prefixes' states in host RAM, least recently used first out, by bytes.

    Args:
        budget_bytes: The most bytes of state kept (0 disables the tier).
        model: The identity of the model every entry was computed with.
        min_tokens: Shorter prefixes are not stored.
    """

    name = "ram"

    def __init__(
        self, budget_bytes: int, *, model: str = "", min_tokens: int = MIN_STORED_TOKENS
    ) -> None:
        lru: ByteLRU[Key, RamEntry] = ByteLRU(
            budget_bytes,
            size=lambda e: len(e.data),
            key=lambda e: e.key,
            on_drop=self._dropped,
            label="the RAM tier",
            hinted=lambda e: e.hinted,
            owner=lambda e: e.owner,
        )
        super().__init__(lru, model=model, min_tokens=min_tokens)
        self.on_drop: Callable[[RamEntry], None] | None = None
        """Called with each entry dropped to stay within the budget (the disk tier takes it)."""

    @property
    def is_enabled(self) -> bool:
        """Whether anything may be stored."""
        return self.budget_bytes > 0

    # ------------------------------------------------------------------ changes
    def wants(self, num_tokens: int, adapters: AdapterSet = NO_ADAPTERS) -> bool:
        """Whether a prefix of ``num_tokens`` tokens would be stored (before saving it);
        any adapter set is."""
        return self.is_enabled and num_tokens >= self.min_tokens

    def store(
        self,
        tokens: Sequence[int],
        data: bytes,
        adapters: AdapterSet = NO_ADAPTERS,
        *,
        hinted: bool = False,
        owner: str | None = None,
    ) -> bool:
        """Keep ``data`` (the state of ``tokens``) as the most recently used entry, marked
        ``hinted`` (for ``owner``) or not, dropping entries beyond the budget (unhinted
        ones first, least recently used first: :class:`~llamax.engine.kv.prefix_tier.
        ByteLRU`); False if it alone exceeds the budget, or would fit only by dropping
        hinted entries within their owners' shares (the disk tier may take it then)."""
        entry = RamEntry(adapters, tuple(tokens), data, hinted, owner)
        if not self.wants(len(tokens)) or not self._lru.put(entry):
            return False
        self.counts = self.counts.counted(num_stored=1)
        return True

    def _dropped(self, entry: RamEntry) -> None:
        self.counts = self.counts.counted(num_dropped=1)
        if self.on_drop is not None:
            self.on_drop(entry)

    def hold(self, hit: PrefixHit[RamEntry]) -> None:
        """Move the entry out of the tier (counted as a hit): the evictions that make room
        for it spill into this tier, and a restored prefix lives in KV, not here."""
        self._lru.pop(hit.entry.key)
        self.counts = self.counts.counted(num_hits=1)

    def read(self, hit: PrefixHit[RamEntry]) -> bytes:
        """The held entry's state."""
        return hit.entry.data

    def release(self, hit: PrefixHit[RamEntry], *, refused: bool) -> None:
        """The restore did not happen: the entry comes back as the most recently used (no
        room), or stays out, counted refused."""
        if refused:
            self.counts = self.counts.counted(num_refused=1)
        else:
            self._lru.put(hit.entry)

    def clear(self) -> int:
        """Drop every entry; return how many."""
        return self._lru.clear()

    def close(self) -> None:
        """Nothing to release outside the process."""

    # ------------------------------------------------------------------ queries
    def lookup(
        self,
        prompt: Sequence[int],
        adapters: AdapterSet = NO_ADAPTERS,
        *,
        longer_than: int = 0,
        max_tokens: int | None = None,
    ) -> PrefixHit[RamEntry] | None:
        """The entry giving the most of ``prompt`` (all but its last token), if it gives
        more than ``longer_than`` tokens (what the KV tier gives) and at least
        :attr:`min_tokens`; among equals the shortest entry (fewest bytes to restore).

        Args:
            prompt: The new sequence's tokens.
            adapters: Its LoRA adapter set; only entries computed with the same one match.
            longer_than: Tokens the tiers above give already.
            max_tokens: Entries holding more tokens are skipped (a stream could not hold them).
        """
        found = best_prefix(
            (e for e in self._lru if e.adapters == adapters),
            prompt,
            longer_than=longer_than,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
        )
        return None if found is None else PrefixHit(self, *found)
