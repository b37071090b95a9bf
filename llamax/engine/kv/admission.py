"""Admission's side of the KV cache: which slot a newcomer gets and how much it reuses.

A newcomer copies the longest prefix any slot holds (``seq_cp``: shared cells, no compute).
If a sequence still prefilling will hold a prefix at least :data:`WAIT_FOR_PREFIX_MIN`
tokens longer (a burst with one system prompt), the newcomer waits for it instead of
computing it again. A session's request, or one taking over the retained slot that holds
its prefix (when only that slot holds the sequence id or the cells it needs: admission
never evicts the slot it copies from), keeps the slot's common prefix and drops the rest.
In a unified cache a newcomer fits only if ``cells_used + pending tokens + its new cells
<= n_ctx``, after evicting retained slots (never its source).

When a tier below KV (:mod:`llamax.engine.kv.prefix_tier`: host RAM, disk) holds a longer
prefix than any slot, the newcomer gets a fresh slot with that state restored and cut to
the shared prefix (evicting retained slots for it, the one that gives the shorter prefix
included). The tier giving the most is tried first, the upper one among equals; if there is
no room, or the memory refuses the state, or it does not read back or hold what it claims
(the entry then dropped), the tiers not yet tried are asked again (the evictions for the
try may have changed them), and at last the newcomer is placed from KV alone.

:class:`SlotPlacer` changes slots only (through the KV and prefix caches) and returns a
:class:`Placement`, which the scheduler applies to the sequence; :func:`should_wait` and
:func:`num_to_keep` decide on plain numbers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from ...adapters import NO_ADAPTERS, AdapterSet
from ...tokens import common_prefix_len
from .kvcache import KVCache, Slot, SlotState
from .prefix import InFlight, PrefixCache
from .prefix_tier import PrefixHit, PrefixTier

__all__ = [
    "SHORT_TAIL",
    "WAIT_FOR_PREFIX_MIN",
    "Outcome",
    "Placement",
    "SlotPlacer",
    "num_to_keep",
    "should_wait",
]

WAIT_FOR_PREFIX_MIN = 16
"""A newcomer waits for an in-flight prefix only if it would save at least this many tokens."""


class Outcome(Enum):
    """What became of one try to admit a sequence."""

    ADMITTED = "admitted"
    WAIT_PREFIX = "wait_prefix"
    NO_ROOM = "no_room"


@dataclass(frozen=True, slots=True)
class Placement:
    """The answer to one try to admit a sequence."""

    outcome: Outcome
    slot: Slot | None = None
    """The slot the sequence runs in (only when admitted)."""
    num_reused: int = 0
    """Tokens of the sequence that slot holds already."""
    num_shared: int = 0
    """The most computed tokens the sequence shares with a slot or a tier's entry, whether
    or not they could be reused (:attr:`PrefixMatch.num_shared`)."""


def should_wait(num_now: int, num_later: int) -> bool:
    """Whether to wait for a prefix that gives ``num_later`` tokens once computed, rather
    than take the ``num_now`` tokens the best slot gives now."""
    return num_later - num_now >= WAIT_FOR_PREFIX_MIN


SHORT_TAIL = 64
"""Fewest tokens a retained slot must hold past the prefix a newcomer reuses for the
newcomer to copy that prefix out, where the newcomer extends all of the slot's last
prompt (or for the slot to be spilled to the RAM tier before it is cut). A shorter tail,
a reply that the next turn's prompt tokenizes differently (an agent's or a chat's next
turn: a reply re-rendered from its text or its tool calls' JSON, reasoning dropped from
the history; on a memory cut at checkpoints, the prompt's last token too), is cheaper to
compute again than to keep: the newcomer takes the slot over and cuts it in place, as
llama-server does. No second slot, no copy across streams (17 ms for a 1,300-token
conversation in the streams layout), no spill when that slot is evicted later (22-40 ms
for 1,300-2,300 tokens; the random LFM2-350M-shape hybrid on a 2-core AMD EPYC)."""


def num_to_keep(num_common: int, num_tokens: int) -> int:
    """Tokens a reused slot keeps of a ``num_tokens`` prompt it shares ``num_common`` tokens
    with: never the prompt's last token, which is computed again for its logits."""
    return min(num_common, num_tokens - 1)


class SlotPlacer:
    """Finds the slot for a newcomer, reusing what the cache holds.

    Args:
        kv: The KV cells.
        prefix: Retained prefixes.
        n_ctx: Cells of the unified cache.
    """

    def __init__(self, kv: KVCache, prefix: PrefixCache, n_ctx: int) -> None:
        self._kv = kv
        self._prefix = prefix
        self._n_ctx = n_ctx

    def place(
        self,
        token_ids: Sequence[int],
        in_flight: Mapping[int, InFlight],
        num_pending: int,
        adapters: AdapterSet = NO_ADAPTERS,
    ) -> Placement:
        """Place a newcomer with the longest prefix a slot gives it.

        Args:
            token_ids: The sequence's tokens.
            in_flight: For each slot of a sequence still prefilling, by sequence id, its
                whole prompt and where its computation started.
            num_pending: Tokens the running sequences still have to compute.
            adapters: The sequence's LoRA adapter set: only a slot of the same set gives
                it a prefix.
        """
        if not self._kv.cuts_at_checkpoints:
            return self._place(token_ids, in_flight, num_pending, adapters)
        match = self._prefix.match(token_ids, in_flight, adapters)  # before any eviction
        hit = self._lookup(self._prefix.tiers, token_ids, adapters, 0)
        shared = max(match.num_shared, hit.num_common if hit is not None else 0)
        placement = self._place(token_ids, in_flight, num_pending, adapters)
        return replace(placement, num_shared=min(shared, len(token_ids) - 1))

    def wait_target(
        self,
        token_ids: Sequence[int],
        in_flight: Mapping[int, InFlight],
        adapters: AdapterSet = NO_ADAPTERS,
    ) -> tuple[int, int] | None:
        """The in-flight prefix a newcomer would wait for if it were placed now: the
        sequence id of the slot and the tokens it will give; None if it would not wait.
        Changes nothing (the scheduler stops the slot's owner's prompt chunk there, so
        that the waiters' suffixes go in one decode with the owner's)."""
        if self._kv.cuts_at_checkpoints:
            return None  # such a memory is cut where its checkpoints are, not here
        match = self._prefix.match(token_ids, in_flight, adapters)
        if match.slot is None or match.num_later <= match.num_now:
            return None
        hit = self._lookup(self._prefix.tiers, token_ids, adapters, match.num_now)
        if not should_wait(match.num_now if hit is None else hit.num_common, match.num_later):
            return None
        return match.slot.seq_id, match.num_later

    def _place(
        self,
        token_ids: Sequence[int],
        in_flight: Mapping[int, InFlight],
        num_pending: int,
        adapters: AdapterSet,
    ) -> Placement:
        match = self._prefix.match(token_ids, in_flight, adapters)
        source, now = match.slot, match.num_now
        untried = list(self._prefix.tiers)
        hit = self._lookup(untried, token_ids, adapters, now)
        if should_wait(now if hit is None else hit.num_common, match.num_later):
            return Placement(Outcome.WAIT_PREFIX)
        # a tier's longer prefix may evict the slot that gives the shorter one (every chat
        # prompt shares its template's head with some slot: protecting that slot left the
        # tiers unused whenever sequence ids were scarce); a failed try looks again
        if hit is not None:
            while hit is not None:
                restored = self._restore(hit, token_ids, num_pending, adapters)
                if restored is not None:
                    return restored
                untried.remove(hit.tier)
                hit = self._lookup(untried, token_ids, adapters, now)
            match = self._prefix.match(token_ids, in_flight, adapters)  # the source may be gone
            source, now = match.slot, match.num_now
        if (
            source is not None
            and source.state is SlotState.RETAINED
            and (now == len(source.tokens) or self._ends_a_turn(source, token_ids, now))
        ):  # a continuation of a retained slot (a chat's next turn) goes on in it: a copy
            # would keep a second, shorter copy of the conversation (a stream's worth of
            # bytes copied each turn, cells spilled to the tiers when evicted) that holds
            # nothing the continuation does not (but a short reply); and it would evict
            # another conversation's slot when no sequence id is free
            return self._take_over(source, token_ids, num_pending, adapters)
        if self._kv.num_free_seq_ids == 0 and not self._prefix.evict_one(keep=source):
            return self._take_over(source, token_ids, num_pending, adapters)
        if not self.fits(len(token_ids) - now, num_pending, keep=source):
            return self._take_over(source, token_ids, num_pending, adapters)
        slot = self._prefix.allocate(keep=source)
        assert slot is not None
        slot.adapters = adapters
        if now and source is not None:
            if self._kv.copy_prefix(source, slot, now):
                self._prefix.touch(source)
            else:  # the memory refused the source's checkpoint: computed instead
                now = 0
        return Placement(Outcome.ADMITTED, slot, now)

    @staticmethod
    def _ends_a_turn(source: Slot, token_ids: Sequence[int], now: int) -> bool:
        """Whether a newcomer ``token_ids`` reusing ``now`` tokens of retained ``source``
        goes on from the turn that ran in it: it extends all of that turn's prompt, and
        what it would cut (the turn's reply, which the next prompt tokenizes differently;
        on a memory cut at checkpoints, the prompt's last token too) is shorter than
        :data:`SHORT_TAIL`. The same prompt again (a retry, or another client's) is not a
        next turn: it copies, keeping the first reply."""
        return (
            0 < source.num_prompt < len(token_ids)
            and len(source.tokens) - now < SHORT_TAIL
            and common_prefix_len(source.tokens, token_ids) >= source.num_prompt
        )

    def _lookup(
        self,
        tiers: Sequence[PrefixTier[Any]],
        token_ids: Sequence[int],
        adapters: AdapterSet,
        now: int,
    ) -> PrefixHit[Any] | None:
        """The hit giving the most tokens past the ``now`` KV gives, among ``tiers`` (the
        upper tier among equals)."""
        best: PrefixHit[Any] | None = None
        for tier in tiers:
            hit = tier.lookup(
                token_ids,
                adapters,
                longer_than=now if best is None else best.num_common,
                max_tokens=self._kv.cells_per_seq,
            )
            if hit is not None:
                best = hit
        return best

    def _restore(
        self,
        hit: PrefixHit[Any],
        token_ids: Sequence[int],
        num_pending: int,
        adapters: AdapterSet,
    ) -> Placement | None:
        """Admit with ``hit``'s state restored in a fresh slot; None when there is no room
        for it, or its entry does not read back, or the memory would not take it (then
        the tier drops the entry)."""
        tier = hit.tier
        tier.hold(hit)  # first: the evictions below spill into the tiers
        slot = self._fresh_slot(hit.num_stored, token_ids, num_pending, adapters)
        if slot is None:
            tier.release(hit, refused=False)
            return None
        started = time.perf_counter()
        data = tier.read(hit)
        kept = None
        if data is None:
            self._kv.release(slot)
        else:
            kept = self._load(slot, hit.entry.tokens, data, hit.num_common)
            if kept is None:
                tier.release(hit, refused=True)
            elif not kept:  # sound, but no checkpoint in the shared part: kept for later
                tier.release(hit, refused=False)
        ok = bool(kept)
        tier.record_restore(kept or 0, time.perf_counter() - started)
        return Placement(Outcome.ADMITTED, slot, kept or 0) if ok else None

    def _fresh_slot(
        self,
        num_stored: int,
        token_ids: Sequence[int],
        num_pending: int,
        adapters: AdapterSet,
    ) -> Slot | None:
        """A free slot with room for a stored state of ``num_stored`` tokens and the prompt
        (the whole state lands before the cut), evicting retained slots as needed."""
        need = max(num_stored, len(token_ids))
        has_id = self._kv.num_free_seq_ids > 0 or self._prefix.evict_one()
        if not has_id or not self.fits(need, num_pending):
            return None
        slot = self._prefix.allocate()
        assert slot is not None
        slot.adapters = adapters
        return slot

    def _load(
        self, slot: Slot, tokens: tuple[int, ...], data: bytes, num_common: int
    ) -> int | None:
        """Restore ``data`` (the state of ``tokens``) into the fresh ``slot`` and cut it to
        ``num_common`` tokens (a memory cut at checkpoints: to the last checkpoint the state
        holds at or before that); the tokens kept, 0 (the slot released) when that is
        none, None (released) if the memory refuses it or it does not hold what it claims."""
        try:
            kept: int | None = None
            if self._kv.restore(slot, tokens, data, exact=True):
                keep = self._kv.usable(slot, num_common)
                if not keep:
                    kept = 0
                elif self._kv.truncate(slot, keep) and self._kv.is_intact(slot):
                    kept = keep
        except Exception:  # a failed restore costs the entry, never the engine
            kept = None
        if not kept:
            self._kv.release(slot)
        return kept

    def reuse(
        self,
        slot: Slot,
        token_ids: Sequence[int],
        num_pending: int,
        adapters: AdapterSet = NO_ADAPTERS,
    ) -> Placement:
        """Place a sequence in ``slot`` (a session's, or one taken over): keep the common
        prefix, drop the diverging tail (everything, if the slot cannot be cut or its
        cells were computed under another adapter set)."""
        kv = self._kv
        keep = num_to_keep(common_prefix_len(slot.tokens, token_ids), len(token_ids))
        keep = kv.usable(slot, keep)  # cut at a checkpoint, where it must be
        if (
            not self._prefix.is_enabled
            or slot.adapters != adapters
            or not kv.truncate(slot, keep)
            or not kv.is_intact(slot)
        ):
            kv.clear(slot)
        slot.adapters = adapters
        num_reused = len(slot.tokens)
        if not self.fits(len(token_ids) - num_reused, num_pending):
            return Placement(Outcome.NO_ROOM)
        return Placement(Outcome.ADMITTED, slot, num_reused)

    def _take_over(
        self,
        source: Slot | None,
        token_ids: Sequence[int],
        num_pending: int,
        adapters: AdapterSet,
    ) -> Placement:
        """Reuse the retained slot holding the prefix (its state kept in the RAM tier first,
        if that takes it, unless the newcomer goes on from the turn that ran in it); if even
        that does not fit, it is retained again."""
        if source is None or source.state is not SlotState.RETAINED:
            return Placement(Outcome.NO_ROOM)
        keep = num_to_keep(common_prefix_len(source.tokens, token_ids), len(token_ids))
        # the tail about to be cut goes to the RAM tier, unless it is a turn's short reply
        now = self._kv.usable(source, keep)
        if now < len(source.tokens) and not self._ends_a_turn(source, token_ids, now):
            self._prefix.spill(source)
        self._prefix.adopt(source)
        placement = self.reuse(source, token_ids, num_pending, adapters)
        if placement.outcome is not Outcome.ADMITTED:
            self._prefix.retire(source)
        return placement

    def fork(self, leader: Slot) -> Slot:
        """A new slot sharing every cell of ``leader`` (an ``n > 1`` choice)."""
        slot = self._prefix.allocate(keep=leader)
        assert slot is not None, "fork planned without a free sequence id"
        slot.adapters = leader.adapters
        self._kv.copy_prefix(leader, slot, len(leader.tokens))
        return slot

    def fits(self, num_new: int, num_pending: int, *, keep: Slot | None = None) -> bool:
        """Whether ``num_new`` more cells fit beside the pending tokens, evicting retained
        slots (never ``keep``) as needed. Streams always fit: each holds a sequence."""
        if not self._kv.is_unified:
            return True
        while self._kv.num_cells_used + num_pending + num_new > self._n_ctx:
            if not self._prefix.evict_one(keep=keep):
                return False
        return True
