"""Continuous-batching scheduler. Pure Python: the one owner of every sequence and KV slot.

Design note: there is no separate prefill phase and decode phase. Every running sequence
has ``num_computed`` tokens in its KV slot and ``num_pending`` tokens still to compute; a
step gives each running sequence up to ``num_pending`` tokens under one token budget.
Sequences with one pending token (decoding) go first, so long prompts are chunked around
them and never stall streams for more than one chunk. A preempted sequence drops its
cells and re-queues; its prompt plus generated tokens are recomputed, so greedy output
continues unchanged. ``n > 1`` choices fork from the leader's last prompt row: they share
its cells and sample their first token from the same logits.

KV accounting: cells are counted exactly by :class:`~llamax.engine.kv.kvcache.KVCache`. In a
unified cache a step may start only if ``cells_used + pending tokens <= n_ctx``; retained
slots are evicted first, then the newest running sequence is preempted (LIFO). Changes
asked for from outside a step arrive as typed operations (:mod:`llamax.engine.kv.kvops`)
through :meth:`Scheduler.apply`.

The scheduler decides and changes the state of sequences; the components it holds own
the rest and compute, on numbers where they can: the KV cells (``kv``), the prefix cache
and its tiers (``prefix``), slot placement (``placer``), the layout's moves (``layout``),
the room beside open sessions (``room``), the sessions (``sessions``), the step's time
budget and shape (``planner``), drafting (``drafts``), LoRA turns (``turns``) and fair
shares of sequence ids (``fair``). Read-only questions go to the component that owns the
answer.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from itertools import islice
from typing import TypeVar, cast

from ...adapters import NO_ADAPTERS, AdapterSet
from ...backend.base import Backend, Clocked
from ...config import EngineConfig
from ...errors import InvalidParameterError, KVCapacityError, RequestFailedError
from ...results import PrefillProgress, TokenEvent, TokenLogprob
from ...stats import SequenceStats
from ..images import cut_reuse
from ..kv.admission import Outcome, SlotPlacer
from ..kv.checkpoints import MAX_CHECKPOINTS, branch_point, checkpoint_positions, head_point
from ..kv.kvcache import KVCache, Slot
from ..kv.kvops import KVOp, RestoreSession
from ..kv.prefix import InFlight, PrefixCache
from ..kv.relayout import Relayout
from ..kv.room import Room
from ..kv.session_table import SessionTable
from ..plan import ScheduledSequence, StepPlan, StepResult
from ..sequence import TERMINAL_STATES, Request, Sequence, SequenceState
from ..spec.drafts import Drafting, Verify
from ..timing.chunk_budget import halve_newest_chunk
from ..timing.step_budget import StepFeatures
from .adapter_turns import AdapterTurns
from .fair_share import FairShare
from .row_probe import chunks_batch_invariant, rows_batch_invariant
from .step_planner import StepPlanner

__all__ = ["ScheduledSequence", "Scheduler", "StepPlan", "StepResult"]

T = TypeVar("T")
_log = logging.getLogger("llamax.engine")

MAX_HOLD_PROBES = 32
"""Waiting sequences asked each step which in-flight prefix they wait for
(:meth:`Scheduler._prefix_holds`)."""


class Scheduler:
    """Owns every state change of every sequence and slot. Driven by one thread at a time.

    Args:
        backend: The backend the scheduler drives.
        config: The engine's options (``prefix_cache``: whether finished slots are
            retained for their prefix; ``max_step_ms``: the time prompt chunks may add to
            a step's decode rows; the prefix tiers' budgets and directory; ``speculative``).
        allow_drafts: Whether sequences may draft at all.

    Raises:
        InvalidParameterError: the disk tier's directory cannot be used (or is in use); a
            reproducible engine (``reproducible_chunk``) over a cache that is or may become
            unified.
    """

    def __init__(
        self,
        backend: Backend,
        config: EngineConfig | None = None,
        *,
        allow_drafts: bool = True,
    ) -> None:
        config = config if config is not None else EngineConfig()
        self.backend = backend
        """The backend this scheduler drives."""
        self._n_batch = backend.n_batch
        self.kv = KVCache(backend, backend.facts.n_seq_max)
        if config.reproducible_chunk is not None:
            self.kv.grid = min(config.reproducible_chunk, backend.n_batch)
        self.reproducible = self.kv.grid is not None
        """Whether replies must not depend on what else runs (docs/reproducible.md): prompt
        chunks on the grid (:attr:`KVCache.grid`), each decoded alone, no drafts, unless the
        model is batch-invariant (:attr:`KVCache.invariant`: then only under an adapter)."""
        if self.reproducible and (
            self.kv.can_relayout or (self.kv.is_unified and backend.facts.n_seq_max > 1)
        ):
            raise InvalidParameterError(
                "reproducible=True needs the streams layout, pinned: this backend's KV cache "
                "is unified or may move to unified",
                param="kv_layout",
            )
        rows_together = True
        if self.reproducible:  # measured on this model, CPU and build (a few small decodes)
            rows_together = rows_batch_invariant(backend)
            self.kv.invariant = (
                config.reproducible_row_attention
                and backend.cpu_only
                and rows_together
                and chunks_batch_invariant(backend)
            )
            if config.speculative is not None and not self.kv.invariant:
                _log.warning(
                    "reproducible: the model is not batch-invariant here, so nothing drafts "
                    "(a verified draft's cells would differ from a cold run's)"
                )
            _log.info(
                "reproducible: decode rows %s; prompt chunks %s",
                "together" if rows_together else "each alone",
                "as in the default mode (the model is batch-invariant)"
                if self.kv.invariant
                else f"on a grid of {self.kv.grid}, each alone",
            )
        self.prefix = PrefixCache.build(self.kv, config, backend)
        self.placer = SlotPlacer(self.kv, self.prefix, backend.facts.n_ctx)
        self.fair: FairShare[Hashable] = FairShare(backend.facts.n_seq_max)
        self.planner = StepPlanner(backend, config.max_step_ms, self.kv, self.prefix, self.fair)
        self.planner.rows_together = rows_together
        self.budget = self.planner.budget
        self.step_cost = self.budget.cost
        """What a step costs (learned from measured steps; the planner's time budget's)."""
        self.drafts = Drafting(
            backend,
            self.kv,
            config.speculative,
            self.budget.max_step_s,
            allow=allow_drafts and (not self.reproducible or self.kv.invariant),
        )
        self.turns = AdapterTurns()
        self.layout = Relayout(backend, self.kv, self.prefix)
        self.sessions = SessionTable(self)
        self.room = Room(backend, self.kv, self.layout, self.sessions)
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_cached_tokens = 0
        self.clock = backend.clock if isinstance(backend, Clocked) else time.perf_counter
        """What steps are timed with (a :class:`~llamax.backend.base.Clocked` backend's)."""

    # ------------------------------------------------------------------ queries
    @property
    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self._waiting or self._running)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens the running sequences still have to compute."""
        return sum(seq.num_pending for seq in self._running)

    def all_sequences(self) -> list[Sequence]:
        """Every waiting and running sequence."""
        return self._waiting + self._running

    def stats(self) -> SequenceStats:
        """The scheduler's sequences and token counters now."""
        return SequenceStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_preemptions=self.num_preemptions,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens,
            num_cached_tokens=self.num_cached_tokens,
        )

    # ------------------------------------------------------------------ changes
    def add(self, request: Request) -> None:
        """Queue every sequence of a new request."""
        self.drafts.start(request)
        for seq in request.sequences:
            bisect.insort(self._waiting, seq, key=lambda s: s.sort_key)

    def apply(self, op: KVOp[T], result: StepResult) -> T:
        """Apply a KV operation between steps; events it causes go into ``result``."""
        if isinstance(op, RestoreSession) and self.layout.should_unify_for(len(op.tokens)):
            self._relayout(True, result)  # a saved session beyond a stream
        return cast(T, self.sessions.apply(op, result))

    def schedule(self, result: StepResult) -> StepPlan:
        """Choose the KV layout, make room, admit what fits, and plan one step: decode rows
        first, then prompt chunks (:mod:`~llamax.engine.timing.chunk_budget`). Requests that cannot
        go on end with their events in ``result``."""
        self.room.count_idle(self._running)
        self._yield_sessions()
        self._end_what_cannot_fit(result)
        move = self.layout.next_move(
            self._waiting, self._running, token_s=self.budget.cost.coefficients[1]
        )
        if move is not None:
            self._relayout(move, result)
        if self.kv.is_unified:
            self._make_room(lambda: self.kv.num_cells_used, keep=1)
        self._share_sequence_ids()
        for group in self.turns.order([*self._running, *self._waiting]):
            plan = self._plan_group(group)
            if not plan.is_empty:
                self.turns.served(group)
                return plan
        return StepPlan()

    def _plan_group(self, group: AdapterSet | None) -> StepPlan:
        """Plan the step over the sequences of adapter set ``group`` (None: all)."""

        def ours(seq: Sequence) -> bool:
            return group is None or seq.request.adapters == group

        running = [seq for seq in self._running if ours(seq)]
        decode = [seq for seq in running if seq.num_pending == 1][: self._n_batch]
        slots: list[tuple[Sequence, int]] = [(seq, 1) for seq in decode]
        on_grid = self._on_grid(group)
        # on the reproducible grid: each prompt chunk is decoded alone, beside nothing
        budget = self._n_batch - (0 if on_grid else len(decode))
        fixed = self.planner.start(decode)
        for seq in running:
            if seq.num_pending > 1 and budget > 0:
                take, fixed = self.planner.chunk(seq, budget, fixed, len(decode))
                if take:
                    slots.append((seq, take))
                    budget -= take
        blocker = self.turns.blocker(group, self._waiting)
        for seq in self._admission_order(group):
            if budget <= 0:
                break
            if blocker is not None and seq.sort_key > blocker.sort_key:
                continue  # another set's earlier request lacks room: it goes first
            if self.planner.is_fork_candidate(seq):
                continue
            outcome = self._try_admit(seq)
            if outcome is Outcome.NO_ROOM:
                self.turns.lacked_room(seq, group)
                break  # first come, first served: nobody overtakes a request that lacks room
            if outcome is Outcome.ADMITTED:
                self.fair.admit(seq.request.fair_key)
                take, fixed = self.planner.chunk(seq, budget, fixed, len(decode))
                if take:
                    slots.append((seq, take))
                    budget -= take
        if not on_grid:
            budget += self._hold_chunks(slots, group)
        drafts = self.drafts.plan(
            slots, budget, lambda: self.num_pending_tokens, self.room.capacity
        )
        return self.planner.build(slots, drafts)

    def _on_grid(self, group: AdapterSet | None) -> bool:
        """Whether the step over adapter set ``group`` (None: the one set every sequence
        shares) keeps the reproducible mode's chunk grid (:meth:`KVCache.on_grid`)."""
        if not self.reproducible:
            return False
        if group is None:  # every sequence's set is the same one
            seq = next(iter(self._running or self._waiting), None)
            group = NO_ADAPTERS if seq is None else seq.request.adapters
        return self.kv.on_grid(group)

    def _hold_chunks(self, slots: list[tuple[Sequence, int]], group: AdapterSet | None) -> int:
        """Stop the step's prompt chunks where waiting sequences' shared prefix ends (the
        nearest such end past what a chunk's sequence holds: :meth:`SlotPlacer.wait_target`);
        return the tokens that frees.

        A burst sharing one long prompt prefix then goes as the raw loop does: the prefix
        once, then every suffix (the first sequence's too) in one decode, with nobody
        decoding yet. Unheld, the first sequence's last chunk carried its own suffix, it
        decoded from the next step on, and the others' suffixes went beside its row as the
        step's time budget let them (:mod:`~llamax.engine.timing.chunk_budget`): 16
        suffixes in five decodes, each attending over the prefix again
        (benchmarks/results/issue59). Only the first :data:`MAX_HOLD_PROBES` waiting
        sequences in admission order are asked, and none while no sequence id can be had
        (a backlog would pay the questions each step and gain nothing); a chunk of a prompt
        with images is left whole (it may not be cut inside one).
        """
        if not self._waiting:
            return 0
        if self.kv.num_free_seq_ids == 0 and self.prefix.num_retained == 0:
            return 0  # a backlog: nobody waiting can start next step, so nobody joins
        chunks = {
            seq.slot.seq_id: i
            for i, (seq, take) in enumerate(slots)
            if take > 1 and seq.slot is not None and not seq.request.images
        }
        if not chunks:
            return 0
        in_flight = self._in_flight()
        holds: dict[int, int] = {}
        for seq in islice(self._admission_order(group), MAX_HOLD_PROBES):
            if seq.request.session_id is not None or self.planner.is_fork_candidate(seq):
                continue
            target = self.placer.wait_target(seq.token_ids, in_flight, seq.request.adapters)
            if target is not None and target[0] in chunks:
                seq_id, num_later = target
                holds[seq_id] = min(holds.get(seq_id, num_later), num_later)
        freed = 0
        for seq_id, hold in holds.items():
            i = chunks[seq_id]
            seq, take = slots[i]
            keep = hold - seq.num_computed
            if 0 < keep < take:
                slots[i] = (seq, keep)
                freed += take - keep
        return freed

    def _in_flight(self) -> dict[int, InFlight]:
        """The slots of the sequences still prefilling, as a newcomer's prefix match sees
        them (:meth:`~llamax.engine.kv.prefix.PrefixCache.match`)."""
        return {
            s.slot.seq_id: InFlight(s.token_ids, s.checkpoint_from)
            for s in self._running
            if s.slot is not None and s.state is SequenceState.PREFILLING
        }

    def _admission_order(self, group: AdapterSet | None) -> Iterator[Sequence]:
        """The waiting sequences of adapter set ``group`` (None: all) in the order they
        may be admitted: those of fairness keys below their share first, queue order
        within; a key that reaches its share while they are admitted goes after them,
        with the keys at it, which take the ids left (no id idles)."""
        fair = self.fair
        later: list[Sequence] = []
        for seq in list(self._waiting):  # admission removes from the queue
            if group is not None and seq.request.adapters != group:
                continue
            if fair.is_over(seq.request.fair_key):
                later.append(seq)
            else:
                yield seq
        yield from later

    def _take_checkpoint(self, seq: Sequence) -> None:
        """After a prompt chunk: take ``seq``'s checkpoint if the chunk ended at one (a
        checkpoint the memory refuses to give is only a lost shortcut)."""
        slot = seq.slot
        assert slot is not None
        num = len(slot.tokens)
        if num > seq.num_prompt_tokens:
            return
        if num not in (seq.branch_at, seq.head_at) and num not in checkpoint_positions(
            seq.num_prompt_tokens, start=seq.checkpoint_from
        ):
            return
        try:
            self.kv.checkpoint(slot, MAX_CHECKPOINTS)
        except Exception as exc:  # the checkpoint is lost, never the request
            _log.warning("could not take a checkpoint at %d tokens: %s", num, exc)
            return
        self.kv.trim_checkpoints(self.prefix.checkpoint_budget, keep=slot)

    # ------------------------------------------------------------------ layout
    def _relayout(self, unified: bool, result: StepResult) -> None:
        """Move the cache to the other layout. If that fails, stay in this layout from now
        on; when moving to unified, fail the sequences that outgrew their streams."""
        seconds = self.layout.move(unified, self.clock, self._make_room_to_unify)
        if seconds is not None:
            self.budget.note_pause(seconds)
        elif unified:
            for seq, reason in self.room.outgrew_streams(self.all_sequences()):
                self.fail(seq.request, RequestFailedError(reason), result)

    # ------------------------------------------------------------------ fairness
    def _share_sequence_ids(self) -> None:
        """Preempt for each deprived waiting request one sequence of the richest request
        (:mod:`llamax.engine.sched.fair_share`)."""
        fair = self.fair
        fair.count((s.request.fair_key for s in self._running),
                   (s.request.fair_key for s in self._waiting))  # fmt: skip
        need_ids = {s.request.fair_key for s in self._waiting if s.request.session_id is None}
        for key in fair.deprived:
            if key not in need_ids:
                continue  # a session's request runs in its own pinned slot
            if self.kv.num_free_seq_ids or self.prefix.num_retained:
                break  # an id is there, or comes from an eviction at admission
            richest = fair.richest()
            if richest is None:
                break
            mine = [s for s in self._running if s.request.fair_key == richest]
            victim = min(reversed(mine), key=lambda s: s.num_computed)  # cheapest to redo
            self._preempt(victim)
            fair.add(richest, -1)

    def _yield_sessions(self) -> None:
        """While a sequence lacks a sequence id or cells that idle sessions hold, the
        idle sessions that yield give their slots to the prefix cache, least recently
        used first (:meth:`~llamax.engine.kv.session_table.SessionTable.yield_idle`)."""
        busy = {seq.request.session_id for seq in self.all_sequences()}
        if not self.sessions.can_yield(busy):
            return
        while self._lacks_room() and self.sessions.yield_idle(busy):
            self.room.count_idle(self._running)

    def _lacks_room(self) -> bool:
        """Whether a waiting sequence needs a new sequence id and none is free or
        retained, or a sequence can never fit beside the idle sessions but would without
        them."""
        sessions = self.sessions
        needs_id = any(
            seq.request.session_id is None or sessions.is_yielded(seq.request.session_id)
            for seq in self._waiting
        )
        if needs_id and not self.kv.num_free_seq_ids and not self.prefix.num_retained:
            return True
        return self.room.needs_idle_sessions(self.all_sequences())

    def _end_what_cannot_fit(self, result: StepResult) -> None:
        """End the sequences that can never get the cells they need beside the idle open
        sessions: with ``length`` if they have output, else with a KVCapacityError."""
        for seq, reason in self.room.never_fit(self.all_sequences()):
            if seq.num_generated:
                self._finish(seq, SequenceState.FINISHED_LENGTH, result)
            else:
                self.fail(seq.request, KVCapacityError(reason()), result)

    def shrink(self, plan: StepPlan) -> StepPlan:
        """Answer a NO_SLOT decode: drop the drafts, else halve the newest prefill chunk, else
        evict a retained prefix, else preempt the newest sequence."""
        slots = [(e.seq, len(e.item.token_ids) - len(e.draft)) for e in plan.entries]
        whole = plan.num_drafted or any(e.item.non_causal for e in plan.entries)
        # a chunk is never cut off the reproducible mode's grid
        whole = whole or (
            self.reproducible and any(self.kv.on_grid(e.seq.request.adapters) for e in plan.entries)
        )
        halved = None if whole else halve_newest_chunk([n for _, n in slots])
        if halved is not None:
            slots = [(seq, n) for (seq, _), n in zip(slots, halved, strict=True) if n]
        elif not plan.num_drafted and not self.prefix.evict_one() and slots:
            victim = max((seq for seq, _ in slots), key=self._running.index)
            self._preempt(victim)
            slots = [(seq, n) for seq, n in slots if seq is not victim]
        return self.planner.build(slots)

    def update(
        self,
        plan: StepPlan,
        sampled: Mapping[Sequence, int],
        logprobs: Mapping[Sequence, TokenLogprob],
        result: StepResult,
        verify: Verify | None = None,
    ) -> None:
        """Record a successful decode of ``plan`` and the tokens sampled for it (drafted
        entries are verified row by row with ``verify``). Sequences that ended while their
        row was sampled are skipped: their cells are already released."""
        for entry in plan.entries:
            seq = entry.seq
            if seq.state in TERMINAL_STATES:
                continue
            if entry.draft:
                assert verify is not None, "a drafted plan needs a verify function"
                accepted = self.drafts.verify(
                    entry,
                    verify,
                    lambda s, token, lp: self._accept(s, token, result, lp),
                    lambda s, error: self.fail(s.request, error, result),
                )
                self.num_decode_tokens += 1 + accepted
                continue
            num = len(entry.item.token_ids)
            assert seq.slot is not None
            is_decode = num == 1 and seq.num_generated > 0 and seq.num_pending == 1
            reports = seq.request.params.prefill_progress and not is_decode
            if reports and len(seq.slot.tokens) == seq.request.num_cached_tokens:
                self._report_progress(seq, result)  # the first chunk: what the cache held
            is_prompt = not is_decode and len(seq.slot.tokens) + num <= seq.num_prompt_tokens
            self.kv.append(seq.slot, entry.item.token_ids, prompt=is_prompt)
            if is_decode:
                self.num_decode_tokens += 1
            else:
                self.num_prefill_tokens += num  # prompt chunks, and recomputation after preemption
                if self.kv.cuts_at_checkpoints and self.prefix.is_enabled:
                    self._take_checkpoint(seq)
                if reports:
                    self._report_progress(seq, result)
            if entry.item.row is None:
                continue
            for fork in entry.forks:
                self._fork_from(seq, fork)
            for s in (*entry.forks, seq):
                self._accept(s, sampled[s], result, logprobs.get(s))

    @staticmethod
    def _report_progress(seq: Sequence, result: StepResult) -> None:
        """A progress event of ``seq``'s prompt (``prefill_progress``): the first choice's,
        while it is computing its prompt (not a recomputation after a preemption)."""
        request = seq.request
        if seq.index != 0 or seq.num_generated or seq.slot is None:
            return
        progress = PrefillProgress(
            seq.num_prompt_tokens, request.num_cached_tokens, len(seq.slot.tokens)
        )
        result.events.append((request, TokenEvent("", (), 0, progress=progress)))

    def observe(self, plan: StepPlan, features: StepFeatures, seconds: float) -> None:
        """Learn the step cost from a measured step (and the decode cost, if it decoded only)."""
        self.step_cost.observe(features, seconds)
        self.drafts.observe(plan, seconds)

    def abort(self, request: Request, result: StepResult) -> None:
        """Cancel every unfinished sequence of ``request``, freeing its KV cells now."""
        for seq in request.sequences:
            if seq.state not in TERMINAL_STATES:
                self._finish(seq, SequenceState.FINISHED_CANCELLED, result)

    def fail(self, request: Request, error: BaseException, result: StepResult) -> None:
        """End ``request`` with ``error``; other requests are untouched."""
        for seq in request.sequences:
            if seq.state not in TERMINAL_STATES:
                slot = seq.slot
                self._release(seq)
                if slot is not None and slot.pinned:  # a session keeps its slot: the step's
                    self.kv.drop_unrecorded(slot)  # unrecorded decode must not stay behind
                seq.state = SequenceState.FINISHED_ERROR
        result.failed.append((request, error))

    def fail_all(self, error: BaseException) -> StepResult:
        """End every request with ``error`` (used when the engine cannot go on)."""
        result = StepResult()
        for request in {s.request.request_id: s.request for s in self.all_sequences()}.values():
            self.fail(request, error, result)
        return result

    # ------------------------------------------------------------------ admission
    def _try_admit(self, seq: Sequence) -> Outcome:
        """Place ``seq`` in a slot (:class:`~llamax.engine.kv.admission.SlotPlacer`), start it."""
        session_id = seq.request.session_id
        if session_id is not None and not self.sessions.is_yielded(session_id):
            pinned = self.sessions.slot(session_id)
            placement = self.placer.reuse(
                pinned, seq.token_ids, self.num_pending_tokens, seq.request.adapters
            )
        else:  # a session that yielded its slot is placed as a newcomer, then pinned again
            placement = self.placer.place(
                seq.token_ids, self._in_flight(), self.num_pending_tokens, seq.request.adapters
            )
            if session_id is not None and placement.slot is not None:
                self.sessions.pin(session_id, placement.slot)
        if session_id is not None and placement.slot is not None:
            self.sessions.touch(session_id)
        if placement.slot is not None:
            seq.slot = placement.slot
            placement.slot.num_prompt = seq.num_prompt_tokens
            num_reused = self._cut_into_image(seq, placement.slot, placement.num_reused)
            seq.branch_at = branch_point(num_reused, placement.num_shared)
            if self.kv.cuts_at_checkpoints:
                prompt = seq.request.prompt_token_ids  # the sequence's prompt, not a copy
                seq.head_at = head_point(prompt, self.backend.is_eog, num_reused)
                # the reproducible mode cuts a warm prompt where a cold run of it cuts
                on_grid = self.kv.grid is not None and self.kv.on_grid(seq.request.adapters)
                seq.checkpoint_from = 0 if on_grid else num_reused
            self.num_cached_tokens += num_reused
            if seq.index == 0 and seq.num_generated == 0:
                seq.request.num_cached_tokens = num_reused
            self._waiting.remove(seq)
            seq.state = SequenceState.PREFILLING if seq.num_pending > 1 else SequenceState.DECODING
            self._running.append(seq)
        return placement.outcome

    def _cut_into_image(self, seq: Sequence, slot: Slot, num_reused: int) -> int:
        """Cut a reused prefix that ends inside a non-causal image back to the image's
        start (:func:`~llamax.engine.images.cut_reuse`); the tokens it keeps."""
        num = cut_reuse(seq.request.images, num_reused, sliding_window=self.kv.has_sliding_window)
        if num < num_reused and not self.kv.truncate(slot, num):
            self.kv.clear(slot)
            num = 0
        return num

    def _fork_from(self, leader: Sequence, fork: Sequence) -> None:
        assert leader.slot is not None
        slot = self.placer.fork(leader.slot)
        slot.num_prompt = fork.num_prompt_tokens
        self._waiting.remove(fork)
        fork.slot = slot
        self.num_cached_tokens += len(slot.tokens)
        self._running.append(fork)
        fork.state = SequenceState.PREFILLING

    def _make_room_to_unify(self) -> None:
        """Before a move to the unified layout (``n_ctx`` cells; only whole prefixes of
        another slot shared: :meth:`KVCache.unify_shares`)."""
        self._make_room(self.kv.cells_to_unify, keep=0)

    def _make_room(self, num_cells: Callable[[], int], *, keep: int) -> None:
        """Evict retained prefixes, then preempt the newest running sequence (while more
        than ``keep`` run), until ``num_cells()`` and the pending tokens fit ``n_ctx``."""
        while num_cells() + self.num_pending_tokens > self.backend.facts.n_ctx:
            if self.prefix.evict_one():
                continue
            if len(self._running) <= keep:
                return  # before a move, open sessions alone hold more: it fails and says so
            self._preempt(self._running[-1])

    def _preempt(self, seq: Sequence) -> None:
        slot = seq.slot
        if slot is not None:
            self._running.remove(seq)
            if slot.pinned:
                self.kv.clear(slot)
            else:
                self.kv.release(slot)
                seq.slot = None
        seq.state = SequenceState.WAITING
        bisect.insort(self._waiting, seq, key=lambda s: s.sort_key)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ results
    def _accept(
        self, seq: Sequence, token: int, result: StepResult, logprob: TokenLogprob | None
    ) -> None:
        params = seq.request.params
        if seq.state is SequenceState.PREFILLING:
            seq.state = SequenceState.DECODING
        is_eog = not params.ignore_eos and self.backend.is_eog(token)
        if is_eog or token in params.stop_token_ids:
            self._finish(seq, SequenceState.FINISHED_STOPPED, result)
            return
        text, matched = seq.push_token(token)
        lps: tuple[TokenLogprob, ...] = ()
        if logprob is not None and seq.logprobs is not None:
            seq.logprobs.append(logprob)
            lps = (logprob,)
        at_limit = params.max_tokens is not None and seq.num_generated >= params.max_tokens
        if matched:
            self._finish(
                seq, SequenceState.FINISHED_STOPPED, result, text, (token,), lps, drain=False
            )
        elif at_limit or len(seq.token_ids) >= self.room.capacity(seq):
            self._finish(seq, SequenceState.FINISHED_LENGTH, result, text, (token,), lps)
        else:
            result.events.append((seq.request, TokenEvent(text, (token,), seq.index, None, lps)))

    def _finish(
        self,
        seq: Sequence,
        state: SequenceState,
        result: StepResult,
        text: str = "",
        token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
        *,
        drain: bool = True,
    ) -> None:
        if drain:
            text += seq.drain_text()
        self._release(seq, keep_cache=state is not SequenceState.FINISHED_CANCELLED)
        seq.state = state
        result.events.append((seq.request, seq.final_event(text, token_ids, logprobs)))
        if seq.request.is_finished:
            result.finished.append(seq.request)

    def _release(self, seq: Sequence, *, keep_cache: bool = False) -> None:
        if seq.state is SequenceState.WAITING:
            self._waiting.remove(seq)
        elif seq in self._running:
            self._running.remove(seq)
        slot, seq.slot = seq.slot, None
        if slot is not None and keep_cache:  # the mark of the last request run in it
            slot.hinted = seq.request.params.keep_prefix
            slot.hint_owner = seq.request.hint_owner
        if slot is not None and not slot.pinned:
            if keep_cache:
                self.prefix.retire(slot)
            else:
                self.kv.release(slot)
        if seq.sampler is not None:
            self.backend.free_sampler(seq.sampler)
            seq.sampler = None
