"""Typed step records: what one step computes, and what it produced.

A :class:`StepPlan` holds one :class:`ScheduledSequence` per sequence in the batch: the
sequence, the slice of tokens it feeds (a :class:`~llamax.backend.base.BatchItem` with its
positions and the batch rows whose outputs it reads) and the sibling choices that fork from
its last row. No parallel lists that must stay in the same order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..backend.base import BatchItem
from ..results import TokenEvent
from .images import image_rows
from .sequence import TERMINAL_STATES, Request
from .sequence import Sequence as Seq

__all__ = [
    "ScheduledSequence",
    "StepPlan",
    "StepResult",
    "build_plan",
    "split_images",
    "split_plan",
]


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One sequence's part of a step."""

    seq: Seq
    item: BatchItem
    """Tokens fed, their first position, and the batch rows whose outputs are read."""
    forks: tuple[Seq, ...] = ()
    """Sibling choices (``n > 1``) that sample their first token from this entry's last row
    and copy its cells after the decode."""
    draft: tuple[int, ...] = ()
    """Speculative draft tokens fed after the sequence's pending token; the item then asks
    for logits at the pending token and at every draft token (see
    :mod:`llamax.engine.spec.speculative`)."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step computes, in batch order."""

    entries: tuple[ScheduledSequence, ...] = ()

    @property
    def items(self) -> tuple[BatchItem, ...]:
        """The batch, as the backend decodes it."""
        return tuple(entry.item for entry in self.entries)

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch."""
        return sum(len(entry.item.token_ids) for entry in self.entries)

    @property
    def is_empty(self) -> bool:
        """Whether there is nothing to decode."""
        return not self.entries

    @property
    def num_drafted(self) -> int:
        """Draft tokens in the batch."""
        return sum(len(entry.draft) for entry in self.entries)

    def without_ended(self) -> StepPlan:
        """This plan less the entries whose sequence ended since it was made (a request
        that failed in an earlier part of the same step): their cells are released, so
        decoding them would write to a free sequence id. Rows are renumbered."""
        live = [i for i, e in enumerate(self.entries) if e.seq.state not in TERMINAL_STATES]
        if len(live) == len(self.entries):
            return self
        return split_plan(self, [live])[0]

    def sampled_entries(self) -> list[ScheduledSequence]:
        """Entries with one row to sample from (drafted entries are verified row by row)."""
        return [entry for entry in self.entries if entry.item.rows and not entry.draft]


@dataclass(slots=True)
class StepResult:
    """What a step (or an operation) produced, to be delivered outside every engine lock."""

    events: list[tuple[Request, TokenEvent]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, BaseException]] = field(default_factory=list)
    computed: bool = False
    """Whether a decode ran."""


def build_plan(
    slots: Sequence[tuple[Seq, int]],
    num_free_ids: int,
    forkable: Callable[[Seq, int], tuple[Seq, ...]],
    *,
    by_seq_id: bool = False,
    drafts: Mapping[Seq, tuple[int, ...]] | None = None,
) -> StepPlan:
    """Lay ``(sequence, num_tokens)`` pairs out as one batch.

    A sequence whose slice completes its known tokens reads its last row; the siblings
    ``forkable(seq, free_ids)`` returns fork from it, as long as sequence ids remain.
    A decoding sequence with ``drafts[seq]`` feeds them after its pending token and reads
    every row from that token on.
    ``by_seq_id`` orders the batch by sequence id: with one KV stream per sequence,
    llama.cpp runs one micro-batch per run of consecutive ids in batch order.
    """
    if by_seq_id:
        slots = sorted(slots, key=lambda pair: pair[0].slot.seq_id if pair[0].slot else -1)
    entries: list[ScheduledSequence] = []
    offset = 0
    for seq, num in slots:
        assert seq.slot is not None
        start = seq.num_computed
        end = start + num
        completes = end == len(seq.token_ids)
        draft = drafts.get(seq, ()) if drafts and completes else ()
        if draft:
            rows = tuple(range(offset + num - 1, offset + num + len(draft)))
            item = BatchItem(seq.slot.seq_id, [*seq.token_ids[start:end], *draft], start, rows)
            entries.append(ScheduledSequence(seq, item, draft=draft))
            offset += num + len(draft)
            continue
        rows = (offset + num - 1,) if completes else ()
        image = image_rows(seq.request.images, start, end) if seq.request.images else None
        if image is not None:  # an image's rows: no output (a prompt ends with text)
            embeddings, non_causal = image
            ids = seq.token_ids[start:end]
            item = BatchItem(seq.slot.seq_id, ids, start, (), embeddings, non_causal)
            entries.append(ScheduledSequence(seq, item))
            offset += num
            continue
        item = BatchItem(seq.slot.seq_id, seq.token_ids[start:end], start, rows)
        forks = forkable(seq, num_free_ids) if completes else ()
        num_free_ids -= len(forks)
        entries.append(ScheduledSequence(seq, item, forks))
        offset += num
    return StepPlan(tuple(entries))


def split_plan(plan: StepPlan, groups: Sequence[Sequence[int]]) -> list[StepPlan]:
    """Plans of the entries of ``plan`` at each group's indices, their rows renumbered to
    the smaller batches (each decoded by its own ``llama_decode``)."""
    sizes = (len(entry.item.token_ids) for entry in plan.entries)
    offsets = list(itertools.accumulate(sizes, initial=0))
    parts: list[StepPlan] = []
    for group in groups:
        entries: list[ScheduledSequence] = []
        offset = 0
        for i in group:
            entry = plan.entries[i]
            shift = offset - offsets[i]
            item = dataclasses.replace(entry.item, rows=tuple(r + shift for r in entry.item.rows))
            entries.append(dataclasses.replace(entry, item=item))
            offset += len(entry.item.token_ids)
        parts.append(StepPlan(tuple(entries)))
    return parts


def split_images(plan: StepPlan) -> tuple[list[StepPlan], StepPlan]:
    """``plan``'s image entries, one plan each (a batch holds token ids or embeddings, never
    both; one image a decode, so a failing one fails its request alone), and the plan of
    the rest. The image plans go first: no entry of theirs has a row to sample."""
    images = [i for i, e in enumerate(plan.entries) if e.item.embeddings is not None]
    if not images:
        return [], plan
    rest = [i for i in range(len(plan.entries)) if i not in images]
    *image_plans, text = split_plan(plan, [*([i] for i in images), rest])
    return image_plans, text
