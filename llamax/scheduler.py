"""Continuous-batching scheduler. Pure Python: it drives a :class:`~llamax.backend.base.Backend`.

Design note: there is no separate prefill phase and decode phase. Every running sequence
has ``num_computed`` tokens in the KV cache and ``num_pending`` tokens still to compute; a
step gives each running sequence up to ``num_pending`` tokens under one token budget.
Sequences with one pending token (decoding) go first, so long prompts are chunked around
them and never stall streams for more than one chunk. A preempted sequence simply drops
its cells and re-queues with ``num_computed = 0``; its prompt plus generated tokens are
recomputed, so greedy output continues unchanged.

KV accounting on the unified cache: ``committed`` is the sum of all known tokens of the
running sequences (computed or pending). Admission keeps ``committed <= n_ctx``; when the
one-token growth of decoding sequences would overflow it, the newest sequence is
preempted (LIFO, as in vLLM).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from .backend.base import Backend, BatchItem
from .results import TokenEvent
from .sequence import TERMINAL_STATES, Request, Sequence, SequenceState

__all__ = ["Scheduler", "StepPlan", "StepResult"]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step computes: ``items[i]`` belongs to ``sequences[i]``."""

    items: tuple[BatchItem, ...] = ()
    sequences: tuple[Sequence, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch."""
        return sum(len(item.token_ids) for item in self.items)

    @property
    def is_empty(self) -> bool:
        """Whether there is nothing to decode."""
        return not self.items


@dataclass(slots=True)
class StepResult:
    """What a step (or an abort) produced, to be delivered outside the engine."""

    events: list[tuple[Request, TokenEvent]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, BaseException]] = field(default_factory=list)


class Scheduler:
    """Owns every state change of every sequence. Driven by one thread at a time."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._n_ctx = backend.n_ctx
        self._n_batch = backend.n_batch
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._free_seq_ids = list(reversed(range(backend.n_seq_max)))
        self.num_preemptions = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued without KV cells."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Sequences holding a sequence id."""
        return len(self._running)

    @property
    def num_free_seq_ids(self) -> int:
        """Sequence ids not held by any sequence."""
        return len(self._free_seq_ids)

    @property
    def num_cells_in_use(self) -> int:
        """KV cells the running sequences occupy now."""
        return sum(seq.num_computed for seq in self._running)

    @property
    def num_cells_committed(self) -> int:
        """KV cells the running sequences will occupy once their pending tokens are computed."""
        return sum(len(seq.token_ids) for seq in self._running)

    def all_sequences(self) -> list[Sequence]:
        """Every waiting and running sequence."""
        return self._waiting + self._running

    # ------------------------------------------------------------------ changes
    def add(self, request: Request) -> None:
        """Queue every sequence of a new request."""
        for seq in request.sequences:
            bisect.insort(self._waiting, seq, key=lambda s: s.sort_key)

    def schedule(self) -> StepPlan:
        """Preempt if the cache would overflow, admit what fits, and plan one step."""
        while self.num_cells_committed > self._n_ctx and len(self._running) > 1:
            self._preempt(self._running[-1])
        budget = self._n_batch
        slots: list[tuple[Sequence, int]] = []
        for seq in self._running:
            if seq.num_pending == 1 and budget > 0:
                slots.append((seq, 1))
                budget -= 1
        for seq in self._running:
            if seq.num_pending > 1 and budget > 0:
                take = min(seq.num_pending, budget)
                slots.append((seq, take))
                budget -= take
        while budget > 0 and self._waiting and self._can_admit(self._waiting[0]):
            seq = self._admit(self._waiting.pop(0))
            take = min(seq.num_pending, budget)
            slots.append((seq, take))
            budget -= take
        return self._plan(slots)

    def shrink(self, plan: StepPlan) -> StepPlan:
        """Answer a NO_SLOT decode: halve the newest prefill chunk, else preempt the newest."""
        slots = [
            (seq, len(item.token_ids)) for seq, item in zip(plan.sequences, plan.items, strict=True)
        ]
        chunks = [i for i, (_, n) in enumerate(slots) if n > 1]
        if chunks:
            i = chunks[-1]
            seq, n = slots[i]
            if n // 2:
                slots[i] = (seq, n // 2)
            else:
                del slots[i]
        elif slots:
            victim = max((seq for seq, _ in slots), key=self._running.index)
            self._preempt(victim)
            slots = [(seq, n) for seq, n in slots if seq is not victim]
        return self._plan(slots)

    def update(self, plan: StepPlan, sampled: Mapping[int, int]) -> StepResult:
        """Record a successful decode of ``plan`` and the tokens sampled for its rows."""
        result = StepResult()
        for seq, item in zip(plan.sequences, plan.items, strict=True):
            num = len(item.token_ids)
            seq.num_computed += num
            if seq.state is SequenceState.PREFILLING:
                self.num_prefill_tokens += num
            else:
                self.num_decode_tokens += num
            if item.row is not None:
                self._accept(seq, sampled[item.row], result)
        return result

    def abort(self, request: Request, result: StepResult) -> None:
        """Cancel every unfinished sequence of ``request``, freeing its KV cells now."""
        for seq in request.sequences:
            if seq.state not in TERMINAL_STATES:
                self._finish(seq, SequenceState.FINISHED_CANCELLED, result)

    def fail(self, request: Request, error: BaseException, result: StepResult) -> None:
        """End ``request`` with ``error``; other requests are untouched."""
        for seq in request.sequences:
            if seq.state not in TERMINAL_STATES:
                self._release(seq)
                seq.state = SequenceState.FINISHED_ERROR
        result.failed.append((request, error))

    def fail_all(self, error: BaseException) -> StepResult:
        """End every request with ``error`` (used when the engine cannot go on)."""
        result = StepResult()
        requests = {id(s.request): s.request for s in self.all_sequences()}
        for request in requests.values():
            self.fail(request, error, result)
        return result

    # ------------------------------------------------------------------ internals
    def _can_admit(self, seq: Sequence) -> bool:
        return (
            bool(self._free_seq_ids)
            and self.num_cells_committed + len(seq.token_ids) <= self._n_ctx
        )

    def _admit(self, seq: Sequence) -> Sequence:
        seq.seq_id = self._free_seq_ids.pop()
        if seq.sampler is None:
            request = seq.request
            seq.sampler = self._backend.new_sampler(
                request.params, (request.seed + seq.index) % 2**32, seq.token_ids
            )
        seq.state = SequenceState.PREFILLING if seq.num_pending > 1 else SequenceState.DECODING
        self._running.append(seq)
        return seq

    def _preempt(self, seq: Sequence) -> None:
        self._release_kv(seq)
        seq.num_computed = 0
        seq.state = SequenceState.WAITING
        bisect.insort(self._waiting, seq, key=lambda s: s.sort_key)
        self.num_preemptions += 1

    def _accept(self, seq: Sequence, token: int, result: StepResult) -> None:
        params = seq.request.params
        if seq.state is SequenceState.PREFILLING:
            seq.state = SequenceState.DECODING
        is_eog = not params.ignore_eos and self._backend.is_eog(token)
        if is_eog or token in params.stop_token_ids:
            self._finish(seq, SequenceState.FINISHED_STOPPED, result)
            return
        text, matched = seq.push_token(token)
        if matched:
            self._finish(seq, SequenceState.FINISHED_STOPPED, result, text, (token,), drain=False)
        elif (params.max_tokens is not None and seq.num_generated >= params.max_tokens) or len(
            seq.token_ids
        ) >= self._n_ctx:
            self._finish(seq, SequenceState.FINISHED_LENGTH, result, text, (token,))
        else:
            result.events.append((seq.request, TokenEvent(text, (token,), seq.index)))

    def _finish(
        self,
        seq: Sequence,
        state: SequenceState,
        result: StepResult,
        text: str = "",
        token_ids: tuple[int, ...] = (),
        *,
        drain: bool = True,
    ) -> None:
        if drain:
            text += seq.drain_text()
        self._release(seq)
        seq.state = state
        result.events.append((seq.request, seq.final_event(text, token_ids)))
        if seq.request.is_finished:
            result.finished.append(seq.request)

    def _release(self, seq: Sequence) -> None:
        if seq.state is SequenceState.WAITING:
            self._waiting.remove(seq)
        else:
            self._release_kv(seq)
        if seq.sampler is not None:
            self._backend.free_sampler(seq.sampler)
            seq.sampler = None

    def _release_kv(self, seq: Sequence) -> None:
        if seq.seq_id is not None:
            self._backend.seq_rm(seq.seq_id, -1, -1)
            self._free_seq_ids.append(seq.seq_id)
            seq.seq_id = None
            self._running.remove(seq)

    def _plan(self, slots: list[tuple[Sequence, int]]) -> StepPlan:
        items: list[BatchItem] = []
        offset = 0
        for seq, num in slots:
            start = seq.num_computed
            assert seq.seq_id is not None
            end = start + num
            items.append(
                BatchItem(
                    seq_id=seq.seq_id,
                    token_ids=seq.token_ids[start:end],
                    start_pos=start,
                    row=offset + num - 1 if end == len(seq.token_ids) else None,
                )
            )
            offset += num
        return StepPlan(tuple(items), tuple(seq for seq, _ in slots))
