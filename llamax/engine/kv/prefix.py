"""Prefix reuse: which slot holds the longest prefix of a prompt, and which finished slots
are kept for that (LRU retention). Pure Python, over :class:`~llamax.engine.kv.kvcache.KVCache`.

A finished sequence's slot is *retained*: its cells stay in KV so a later prompt that starts
the same way copies them instead of computing them. Retained slots are evicted least
recently used first whenever a sequence id or cells are needed; active and pinned (session)
slots never are. An evicted slot's state goes to the host-RAM tier below
(:mod:`llamax.engine.kv.prefix_ram`) when one is enabled, and what that tier drops to stay
within its budget goes to the disk tier (:mod:`llamax.engine.kv.prefix_disk`), if any (with
no RAM tier, evicted slots go there directly); ``evict_all`` (``clear_cache``) empties
every tier.

Hints (``SamplingParams.keep_prefix``): a slot whose last request was hinted
(:attr:`Slot.hinted <llamax.engine.kv.kvcache.Slot.hinted>`) is evicted only when no
unhinted retained slot is left, least recently used first among the hinted. The mark is
the last request's that ran in the slot: a request that takes a retained slot over (a
chat's next turn) marks it as it asks, hinted or not; copying a prefix from a slot leaves
its mark as it was (the copier's own slot carries the copier's mark). An evicted slot's
state goes to the tiers below with its mark, and they too drop unhinted entries first.

Matching considers every slot, including those of running sequences. A running sequence
that is still prefilling will soon hold more of its prompt than it holds now: ``match``
reports both, so a newcomer can wait for an in-flight prefix instead of computing it twice.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ...adapters import NO_ADAPTERS, AdapterSet
from ...backend.base import Backend, ImageHost
from ...config import EngineConfig
from ...stats import PrefixCacheStats, PrefixTierStats
from ...tokens import common_prefix_len
from .checkpoints import planned_checkpoint
from .kvcache import KVCache, Slot, SlotState
from .prefix_disk import PrefixDiskTier, default_disk_budget
from .prefix_ram import PrefixRamTier, RamEntry, default_budget
from .prefix_tier import PrefixTier

__all__ = ["InFlight", "PrefixCache", "PrefixMatch"]

_NO_TIER = PrefixTierStats()
"""The stats of a tier there is not (frozen, so one object serves)."""

_log = logging.getLogger("llamax")


class InFlight(NamedTuple):
    """A slot whose owner is still computing its prompt, as a newcomer's match sees it."""

    tokens: Sequence[int]
    """Every token the owner knows (its whole prompt)."""
    start: int = 0
    """Where the owner's computation started (the prefix it reused): on a memory cut only
    at checkpoints, its interval checkpoints count from there."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The best prefix source for a prompt."""

    slot: Slot | None = None
    """The slot to copy from (None: nothing matches)."""
    num_now: int = 0
    """Prompt tokens that slot can give now."""
    num_later: int = 0
    """Prompt tokens it will give once its running owner has computed what it knows."""
    num_shared: int = field(default=0, compare=False)
    """The most computed tokens the prompt shares with any slot of its adapter set (but
    its last one), whether or not a cut can keep them: where a memory cut only at
    checkpoints has none, the prompt's own checkpoint there serves the next one."""


class PrefixCache:
    """LRU retention of finished slots and longest-prefix matching over all slots.

    Args:
        cache: The KV cells.
        retain: Whether finished slots are kept for their prefix.
        ram: Where evicted slots' states go (none when ``retain`` is False).
        disk: Where the RAM tier's dropped entries go (or evicted slots' states, with no
            RAM tier); none when ``retain`` is False.
    """

    def __init__(
        self,
        cache: KVCache,
        *,
        retain: bool = True,
        ram: PrefixRamTier | None = None,
        disk: PrefixDiskTier | None = None,
    ) -> None:
        self._cache = cache
        self._retain = retain
        self._retained: OrderedDict[int, Slot] = OrderedDict()  # seq id -> slot, LRU first
        self.ram = ram if ram is not None and retain else PrefixRamTier(0)
        """The host-RAM tier below (disabled: a budget of 0)."""
        self.disk = disk if retain else None
        """The disk tier below the RAM tier, if any."""
        self.ram.on_drop = self._drop_to_disk
        self.tiers: tuple[PrefixTier[Any], ...] = (
            (self.ram,)
            if self.disk is None
            else (
                self.ram,
                self.disk,
            )
        )
        """The tiers below KV, upper first: what an upper tier drops goes to the next."""
        self.num_evictions = 0
        self.checkpoint_budget = ram.budget_bytes if ram is not None else 0
        """The most bytes the slots' checkpoints may hold (a memory cut at checkpoints):
        the RAM tier's budget, or the default one's share if the tier is off."""
        self.num_spill_failures = 0

    @property
    def is_enabled(self) -> bool:
        """Whether prefixes are shared and finished slots retained."""
        return self._retain

    @property
    def num_retained(self) -> int:
        """Finished slots kept for their prefix."""
        return len(self._retained)

    @property
    def num_hinted(self) -> int:
        """Retained slots whose last request asked for its prefix to be kept longer."""
        return sum(slot.hinted for slot in self._retained.values())

    def retained(self) -> list[Slot]:
        """Retained slots, least recently used first."""
        return list(self._retained.values())

    # ------------------------------------------------------------------ retention
    def retire(self, slot: Slot) -> None:
        """A sequence finished: keep its slot for reuse (most recently used) or release it.
        The slot keeps its :attr:`~llamax.engine.kv.kvcache.Slot.hinted` mark (the
        scheduler sets it from the finished request)."""
        if not slot.pinned:
            self.unpin(slot)

    def unpin(self, slot: Slot) -> None:
        """A session gave its pinned slot up (it yields): keep the slot for its prefix
        (most recently used) or release it, as :meth:`retire` does a finished one's."""
        if self._retain and slot.tokens:
            slot.move(SlotState.RETAINED)
            self._retained[slot.seq_id] = slot
            self._retained.move_to_end(slot.seq_id)
        else:
            self._cache.release(slot)

    def adopt(self, slot: Slot) -> None:
        """Make a retained slot active again (a new sequence takes it over)."""
        del self._retained[slot.seq_id]
        slot.move(SlotState.ACTIVE)

    def touch(self, slot: Slot) -> None:
        """Mark ``slot`` as just used (a prefix was copied from it)."""
        if slot.seq_id in self._retained:
            self._retained.move_to_end(slot.seq_id)

    def evict_one(self, *, keep: Slot | None = None) -> bool:
        """Release the least recently used unhinted retained slot, else the least recently
        used hinted one (never ``keep``)."""
        fallback: Slot | None = None
        for slot in self._retained.values():
            if slot is keep:
                continue
            if not slot.hinted:
                self.evict(slot)
                return True
            if fallback is None:
                fallback = slot
        if fallback is None:
            return False
        self.evict(fallback)
        return True

    def evict(self, slot: Slot) -> None:
        """Release one retained slot, its state kept in the RAM tier if it takes it."""
        del self._retained[slot.seq_id]
        self.spill(slot)
        self._cache.release(slot)
        self.num_evictions += 1

    def evict_all(self) -> int:
        """Release every retained slot and empty both tiers; return how many slots.

        Raises:
            CacheClearError: files of the disk tier could not be deleted (everything else
                was cleared).
        """
        count = len(self._retained)
        for slot in self._retained.values():
            self._cache.release(slot)
        self._retained.clear()
        self.num_evictions += count
        for tier in self.tiers:
            tier.clear()
        return count

    def spill(self, slot: Slot) -> None:
        """Save ``slot``'s state, with its hint mark, into the uppermost tier that takes it:
        the RAM tier, or the disk tier when there is no RAM tier, the state alone exceeds
        its budget, or (unhinted) it would fit only by dropping hinted entries (before the
        slot is released, or cut by a newcomer that takes it over). A save that fails
        loses only the entry."""
        on_grid = self._cache.on_grid(slot.adapters)  # keep only what a cold prompt computes
        if on_grid and (not slot.exact or not self._cache.truncate(slot, slot.exact)):
            return
        num_tokens = len(slot.tokens)
        wanting = [t for t in self.tiers if t.wants(num_tokens, slot.adapters)]
        if not wanting or not self._cache.is_intact(slot):
            return
        try:
            data = self._cache.save(slot)
        except Exception as exc:  # the cache entry is lost, never the engine
            self.num_spill_failures += 1
            _log.warning("could not keep an evicted prefix in RAM: %s", exc)
            return
        for tier in wanting:
            if tier.store(
                slot.tokens, data, slot.adapters, hinted=slot.hinted, owner=slot.hint_owner
            ):
                return

    def _drop_to_disk(self, entry: RamEntry) -> None:
        """The RAM tier dropped ``entry`` to stay within its budget: keep it on disk (with
        its mark)."""
        if self.disk is not None:
            self.disk.store(
                entry.tokens, entry.data, entry.adapters, hinted=entry.hinted, owner=entry.owner
            )

    @classmethod
    def build(cls, cache: KVCache, config: EngineConfig, backend: Backend) -> PrefixCache:
        """The prefix cache over ``cache`` with the tiers ``config`` asks for, if it asks
        for one (``prefix_cache``) and ``backend``'s memory can share a prefix; entries
        are marked with the backend's model identity. A budget left to the machine is this
        context's share of its default (a quarter of the memory available, half the
        directory's free space, each capped at 8 GiB).

        Raises:
            InvalidParameterError: the disk tier's directory cannot be used (or is in use).
        """
        retain = config.prefix_cache and (backend.can_share_prefix or backend.can_checkpoint)
        identity = backend.model_identity
        if config.reproducible_chunk is not None:  # entries cut to a chunk grid's boundary
            identity = {"model": identity, "reproducible_chunk": config.reproducible_chunk}
            if cache.invariant:  # ... or whole: a batch-invariant model's (KVCache.invariant)
                identity["batch_invariant"] = True
        model = json.dumps(identity, sort_keys=True, default=str)
        ram_bytes = config.prefix_ram_bytes
        if ram_bytes is None:
            ram_bytes = int(default_budget() * config.prefix_ram_share)
        directory, disk_bytes = config.prefix_disk_dir, config.prefix_disk_bytes
        if directory is not None and disk_bytes is None:
            disk_bytes = int(default_disk_budget(directory) * config.prefix_disk_share)
        ram = PrefixRamTier(ram_bytes if retain else 0, model=model)
        # an image's cells come from the projector too: with one loaded, the disk tier's
        # folder is this model's and this projector's (a file outlives the context)
        host = backend if isinstance(backend, ImageHost) and backend.facts.sees_images else None
        disk_model = model
        if host is not None:
            disk_model = json.dumps(
                {"model": identity, "projector": host.projector_identity},
                sort_keys=True,
                default=str,
            )
        disk = (
            PrefixDiskTier(directory, disk_bytes, model=disk_model, images=host is not None)
            if retain and directory is not None and disk_bytes
            else None
        )
        made = cls(cache, retain=retain, ram=ram, disk=disk)
        if not made.checkpoint_budget:
            made.checkpoint_budget = int(default_budget() * config.prefix_ram_share)
        return made

    def stats(self) -> PrefixCacheStats:
        """The retained slots' counts now."""
        return PrefixCacheStats(self.num_retained, self.num_hinted, self.num_evictions)

    def tier_stats(self, name: str) -> PrefixTierStats:
        """The stats of the tier named ``name`` (``ram``, ``disk``): all 0 if there is none."""
        for tier in self.tiers:
            if tier.name == name:
                return tier.stats()
        return _NO_TIER

    def audit(self) -> list[str]:
        """Inconsistencies in the tiers' bookkeeping, as sentences."""
        return [problem for tier in self.tiers for problem in tier.audit()]

    def close(self) -> None:
        """Release what the tiers hold outside the process (the disk tier's directory; its
        files stay for the next context). Idempotent."""
        for tier in self.tiers:
            tier.close()

    def allocate(self, *, pinned: bool = False, keep: Slot | None = None) -> Slot | None:
        """Take a free sequence id, evicting a retained slot (never ``keep``) if needed."""
        slot = self._cache.allocate(pinned=pinned)
        if slot is None and self.evict_one(keep=keep):
            slot = self._cache.allocate(pinned=pinned)
        return slot

    # ------------------------------------------------------------------ matching
    def match(
        self,
        prompt: Sequence[int],
        in_flight: Mapping[int, InFlight],
        adapters: AdapterSet = NO_ADAPTERS,
    ) -> PrefixMatch:
        """The slot holding the longest prefix of ``prompt`` (all but its last token)
        computed under the same LoRA ``adapters`` (a prefix computed under one adapter set
        is never reused under another).

        Args:
            prompt: the new sequence's tokens.
            in_flight: for slots of sequences still prefilling, by seq id, every token the
                owner knows (its whole prompt) and where its computation started; they give
                ``num_later`` tokens.
            adapters: the new sequence's adapter set.
        """
        if not self._retain:
            return PrefixMatch()
        limit = len(prompt) - 1  # the last prompt token is computed for its logits
        best = PrefixMatch()
        shared = 0
        for slot in self._cache.slots():
            if slot.adapters != adapters:
                continue
            owner = in_flight.get(slot.seq_id)
            if not slot.tokens and owner is None:
                continue
            if owner is None:
                later = min(common_prefix_len(slot.tokens, prompt), limit)
                shared = max(shared, later)
            else:
                later = min(common_prefix_len(owner.tokens, prompt), limit)
            now = self._cache.usable(slot, later)  # cut at a checkpoint, where it must be
            if now and not self._cache.is_intact(slot, now):
                continue
            if owner is None:
                later = now
            elif self._cache.grid is not None and self._cache.on_grid(adapters):
                grid = self._cache.grid  # what the owner's prompt chunks on the grid give
                num_known = len(owner.tokens)
                later = max(now, min(later, num_known - num_known % grid))
                later -= later % grid
            elif self._cache.cuts_at_checkpoints:
                later = max(now, planned_checkpoint(later, len(owner.tokens), start=owner.start))
            if (now, later) > (best.num_now, best.num_later):
                best = PrefixMatch(slot, now, later)
        return replace(best, num_shared=shared)
