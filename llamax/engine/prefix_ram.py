"""The host-RAM tier below the KV prefix cache. Pure Python.

When :class:`~llamax.engine.prefix.PrefixCache` evicts a retained slot, its saved KV state
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
model (:attr:`PrefixRamTier.model`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ..adapters import NO_ADAPTERS, AdapterSet
from ..tokens import common_prefix_len

__all__ = [
    "MAX_DEFAULT_BYTES",
    "MIN_STORED_TOKENS",
    "PrefixRamTier",
    "RamEntry",
    "RamMatch",
    "best_prefix",
    "default_budget",
]

MIN_STORED_TOKENS = 32
"""Shorter prefixes are not kept: recomputing them costs about what restoring them does."""

MAX_DEFAULT_BYTES = 8 << 30
"""The default budget's cap (llama-server's ``--cache-ram`` default is 8 GiB too)."""

Key = tuple[tuple[object, ...], tuple[int, ...]]


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

    @property
    def key(self) -> Key:
        """``(adapters, tokens)``."""
        return self.adapters, self.tokens


@dataclass(frozen=True, slots=True)
class RamMatch:
    """A stored entry and how many of a prompt's tokens it gives."""

    entry: RamEntry
    num_common: int
    """Prompt tokens the entry holds (its common prefix with the prompt, less the last)."""


E = TypeVar("E", bound="_HasTokens")


class _HasTokens(Protocol):
    @property
    def tokens(self) -> tuple[int, ...]: ...


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
    shortest entry. Entries holding more than ``max_tokens`` are skipped. (The RAM and disk
    tiers' match.)"""
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


class PrefixRamTier:
    """Evicted prefixes' states in host RAM, least recently used first out, by bytes.

    Args:
        budget_bytes: The most bytes of state kept (0 disables the tier).
        model: The identity of the model every entry was computed with.
        min_tokens: Shorter prefixes are not stored.
    """

    def __init__(
        self, budget_bytes: int, *, model: str = "", min_tokens: int = MIN_STORED_TOKENS
    ) -> None:
        self.budget_bytes = budget_bytes
        self.model = model
        self.min_tokens = min_tokens
        self._entries: OrderedDict[Key, RamEntry] = OrderedDict()  # LRU first
        self._num_bytes = 0
        self.on_drop: Callable[[RamEntry], None] | None = None
        """Called with each entry dropped to stay within the budget (the disk tier takes it)."""
        self.num_stored = 0
        """States stored (on eviction from KV)."""
        self.num_dropped = 0
        """Entries dropped to stay within the budget."""
        self.num_hits = 0
        """Prompts that found a longer prefix here than in KV (restores tried)."""
        self.num_restores = 0
        """Restores that succeeded."""
        self.num_refused = 0
        """Restores the memory refused or whose extent did not match: recomputed."""
        self.num_restored_tokens = 0
        """Prompt tokens restored instead of computed."""
        self.restore_seconds = 0.0
        """Time spent restoring (successful or not)."""

    @property
    def is_enabled(self) -> bool:
        """Whether anything may be stored."""
        return self.budget_bytes > 0

    @property
    def num_bytes(self) -> int:
        """Bytes of state held."""
        return self._num_bytes

    @property
    def num_entries(self) -> int:
        """Entries held."""
        return len(self._entries)

    def entries(self) -> list[RamEntry]:
        """Entries, least recently used first."""
        return list(self._entries.values())

    # ------------------------------------------------------------------ changes
    def wants(self, num_tokens: int) -> bool:
        """Whether a prefix of ``num_tokens`` tokens would be stored (before saving it)."""
        return self.is_enabled and num_tokens >= self.min_tokens

    def store(self, tokens: Sequence[int], data: bytes, adapters: AdapterSet = NO_ADAPTERS) -> bool:
        """Keep ``data`` (the state of ``tokens``) as the most recently used entry, dropping
        the least recently used ones beyond the budget; False if it alone exceeds it."""
        if not self.wants(len(tokens)) or len(data) > self.budget_bytes:
            return False
        self.put(RamEntry(adapters, tuple(tokens), data))
        self.num_stored += 1
        return True

    def put(self, entry: RamEntry) -> None:
        """Hold ``entry`` (new, or one :meth:`take` gave out) as the most recently used,
        dropping the least recently used entries beyond the budget."""
        self.remove(entry.key)
        while self._entries and self._num_bytes + len(entry.data) > self.budget_bytes:
            _, oldest = self._entries.popitem(last=False)
            self._num_bytes -= len(oldest.data)
            self.num_dropped += 1
            if self.on_drop is not None:
                self.on_drop(oldest)
        if len(entry.data) <= self.budget_bytes:
            self._entries[entry.key] = entry
            self._num_bytes += len(entry.data)

    def remove(self, key: Key) -> RamEntry | None:
        """Drop the entry under ``key``, if any; return it."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._num_bytes -= len(entry.data)
        return entry

    def take(self, match: RamMatch) -> RamEntry:
        """Move the matched entry out of the tier to restore it (counted as a hit)."""
        self.remove(match.entry.key)
        self.num_hits += 1
        return match.entry

    def record_restore(self, num_tokens: int, seconds: float) -> None:
        """A restore gave ``num_tokens`` prompt tokens (0: refused) in ``seconds``."""
        self.restore_seconds += seconds
        if num_tokens:
            self.num_restores += 1
            self.num_restored_tokens += num_tokens
        else:
            self.num_refused += 1

    def clear(self) -> int:
        """Drop every entry; return how many."""
        count = len(self._entries)
        self._entries.clear()
        self._num_bytes = 0
        return count

    # ------------------------------------------------------------------ queries
    def match(
        self,
        prompt: Sequence[int],
        adapters: AdapterSet = NO_ADAPTERS,
        *,
        longer_than: int = 0,
        max_tokens: int | None = None,
    ) -> RamMatch | None:
        """The entry giving the most of ``prompt`` (all but its last token), if it gives
        more than ``longer_than`` tokens (what the KV tier gives) and at least
        :attr:`min_tokens`; among equals the shortest entry (fewest bytes to restore).

        Args:
            prompt: The new sequence's tokens.
            adapters: Its LoRA adapter set; only entries computed with the same one match.
            longer_than: Tokens the KV tier gives already.
            max_tokens: Entries holding more tokens are skipped (a stream could not hold them).
        """
        found = best_prefix(
            (e for e in self._entries.values() if e.adapters == adapters),
            prompt,
            longer_than=longer_than,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
        )
        return None if found is None else RamMatch(*found)

    def audit(self) -> list[str]:
        """Inconsistencies in the tier's bookkeeping, as sentences."""
        problems = []
        held = sum(len(e.data) for e in self._entries.values())
        if held != self._num_bytes:
            problems.append(f"the RAM tier accounts {self._num_bytes} bytes, entries hold {held}")
        if self._num_bytes > self.budget_bytes:
            problems.append(f"the RAM tier holds {self._num_bytes} bytes > {self.budget_bytes}")
        for key, entry in self._entries.items():
            if key != entry.key:
                problems.append(f"a RAM entry of {len(entry.tokens)} tokens is filed elsewhere")
        return problems
