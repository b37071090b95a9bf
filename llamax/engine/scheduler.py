"""Continuous-batching scheduler. Pure Python: the one owner of every sequence and KV slot.

Design note: there is no separate prefill phase and decode phase. Every running sequence
has ``num_computed`` tokens in its KV slot and ``num_pending`` tokens still to compute; a
step gives each running sequence up to ``num_pending`` tokens under one token budget.
Sequences with one pending token (decoding) go first, so long prompts are chunked around
them and never stall streams for more than one chunk. A preempted sequence drops its
cells and re-queues; its prompt plus generated tokens are recomputed, so greedy output
continues unchanged. ``n > 1`` choices fork from the leader's last prompt row: they share
its cells and sample their first token from the same logits.

KV accounting: cells are counted exactly by :class:`~llamax.engine.kvcache.KVCache`. In a
unified cache a step may start only if ``cells_used + pending tokens <= n_ctx``; retained
slots are evicted first, then the newest running sequence is preempted (LIFO). Changes
asked for from outside a step arrive as typed operations (:mod:`llamax.engine.kvops`)
through :meth:`Scheduler.apply`.

The scheduler decides and changes state; the modules beside it compute, on numbers where
they can: admission, session_room, chunk_budget, layout_policy, draft_planner, split_policy
and fair_share. Its read-only queries are :class:`~llamax.engine.scheduler_view.SchedulerView`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping
from typing import TypeVar, cast

from ..adapters import AdapterSet
from ..backend.base import Backend, Clocked
from ..config import EngineConfig
from ..errors import KVCapacityError, RequestFailedError
from ..results import TokenEvent, TokenLogprob
from .admission import Outcome
from .chunk_budget import halve_newest_chunk
from .draft_planner import confirms, draft_limit, drafting_method
from .kvcache import LayoutState
from .kvops import KVOp, RestoreSession
from .layout_policy import MOVE_PRIOR_S_PER_BYTE, RELAYOUT_COOLDOWN_STEPS
from .plan import ScheduledSequence, StepPlan, StepResult
from .scheduler_view import SchedulerView, num_cells
from .sequence import TERMINAL_STATES, Request, Sequence, SequenceState
from .session_table import SessionTable
from .speculative import DraftState, new_draft_state
from .step_budget import StepFeatures

__all__ = ["ScheduledSequence", "Scheduler", "StepPlan", "StepResult"]

T = TypeVar("T")

Verify = Callable[[Sequence, int], tuple[int, TokenLogprob | None]]
"""Samples a sequence's token from one batch row (speculative verification, row by row)."""


class Scheduler(SchedulerView):
    """Owns every state change of every sequence and slot. Driven by one thread at a time."""

    def __init__(
        self,
        backend: Backend,
        config: EngineConfig | None = None,
        *,
        allow_drafts: bool = True,
    ) -> None:
        config = config if config is not None else EngineConfig()
        super().__init__(backend, config)
        self.sessions = SessionTable(self)
        self._speculative = config.speculative
        # drafts are rolled back with a partial seq_rm, which recurrent memory cannot do
        self._can_draft = allow_drafts and backend.can_share_prefix
        self.price_drafts = True  # tests turn it off to verify every proposal
        self._last_group: AdapterSet | None = None
        """The adapter set the last step ran (see :meth:`_adapter_groups`)."""
        self._room_waiter: Sequence | None = None
        """With several adapter sets: the first request in queue order that lacked room
        on its set's turn; no later request of another set takes room before it."""
        self.clock = backend.clock if isinstance(backend, Clocked) else time.perf_counter
        """What steps are timed with (a :class:`~llamax.backend.base.Clocked` backend's)."""

    # ------------------------------------------------------------------ changes
    def add(self, request: Request) -> None:
        """Queue every sequence of a new request."""
        method = drafting_method(
            request.params.speculative, self._speculative, can_draft=self._can_draft
        )
        for seq in request.sequences:
            if method is not None:
                seq.draft_state = new_draft_state(method, self.drafts.acceptance)
            bisect.insort(self._waiting, seq, key=lambda s: s.sort_key)

    def apply(self, op: KVOp[T], result: StepResult) -> T:
        """Apply a KV operation between steps; events it causes go into ``result``."""
        if (
            isinstance(op, RestoreSession)
            and self.kv.can_relayout
            and not self.kv.is_unified
            and self.layout.should_unify([len(op.tokens)])  # a saved session beyond a stream
        ):
            self._relayout(True, result)
        return cast(T, self.sessions.apply(op, result))

    def schedule(self, result: StepResult) -> StepPlan:
        """Choose the KV layout, make room, admit what fits, and plan one step: decode rows
        first, then prompt chunks (:mod:`~llamax.engine.chunk_budget`). Requests that cannot
        go on end with their events in ``result``."""
        self._count_idle_sessions()
        self._end_what_cannot_fit(result)
        self._adapt_layout(result)
        self._make_room_for_growth()
        self._share_sequence_ids()
        for group in self._adapter_groups():
            plan = self._plan_group(group)
            if not plan.is_empty:
                self._last_group = group
                return plan
        return StepPlan()

    def _adapter_groups(self) -> list[AdapterSet | None]:
        """The LoRA adapter sets to try this step, in turn (``[None]``: one set, no filter).

        llama.cpp applies adapters to a whole context, so a step carries one set. The sets
        with work take turns, one step each, starting after the last one served: none
        starves, and the next set is tried when one has nothing it can run."""
        sets = {seq.request.adapters for seq in self._running}
        sets.update(seq.request.adapters for seq in self._waiting)
        if len(sets) <= 1:
            return [None]
        order = sorted(sets)
        last = self._last_group
        start = next((i for i, key in enumerate(order) if last is not None and key > last), 0)
        return [*order[start:], *order[:start]]

    def _room_blocker(self, group: AdapterSet | None) -> Sequence | None:
        """The request of another adapter set than ``group`` that lacked room and still
        waits (:attr:`_room_waiter`), or None. Sets take turns (:meth:`_adapter_groups`),
        so without this a set's newcomers could take, on its turns, the room that an
        earlier request of another set waits for, again and again."""
        waiter = self._room_waiter
        if waiter is None:
            return None
        if not any(seq is waiter for seq in self._waiting):  # admitted, or gone
            self._room_waiter = None
            return None
        return waiter if group is not None and waiter.request.adapters != group else None

    def _plan_group(self, group: AdapterSet | None) -> StepPlan:
        """Plan the step over the sequences of adapter set ``group`` (None: all)."""

        def ours(seq: Sequence) -> bool:
            return group is None or seq.request.adapters == group

        running = [seq for seq in self._running if ours(seq)]
        decode = [seq for seq in running if seq.num_pending == 1][: self._n_batch]
        slots: list[tuple[Sequence, int]] = [(seq, 1) for seq in decode]
        budget = self._n_batch - len(decode)
        fixed = self.budget.start_step(
            [seq.num_computed for seq in decode], unified=self.kv.is_unified
        )
        for seq in running:
            if seq.num_pending > 1 and budget > 0:
                take, fixed = self._chunk(seq, min(seq.num_pending, budget), fixed, len(decode))
                if take:
                    slots.append((seq, take))
                    budget -= take
        # requests below their share first; those at it take the ids left (no id idles)
        waiting = [seq for seq in self._waiting if ours(seq)]
        over = [seq for seq in waiting if self.fair.is_over(seq.request)]
        under = [seq for seq in waiting if not self.fair.is_over(seq.request)]
        blocker = self._room_blocker(group)
        for seq in under + over:
            if budget <= 0:
                break
            if blocker is not None and seq.sort_key > blocker.sort_key:
                continue  # another set's earlier request lacks room: it goes first
            if self._is_fork_candidate(seq):
                continue
            outcome = self._try_admit(seq)
            if outcome is Outcome.NO_ROOM:
                waiter = self._room_waiter
                if group is not None and (waiter is None or seq.sort_key < waiter.sort_key):
                    self._room_waiter = seq
                break  # first come, first served: nobody overtakes a request that lacks room
            if outcome is Outcome.ADMITTED:
                self.fair.add(seq.request)
                take, fixed = self._chunk(seq, min(seq.num_pending, budget), fixed, len(decode))
                if take:
                    slots.append((seq, take))
                    budget -= take
        return self._build(slots, self._plan_drafts(slots, budget))

    # ------------------------------------------------------------------ layout
    def _adapt_layout(self, result: StepResult) -> None:
        """``kv_layout="auto"``: move when :mod:`~llamax.engine.layout_policy` says so."""
        if self.kv.layout is LayoutState.FIXED:
            return
        self.layout.count_step()
        move = self.layout.next_layout(
            unified=self.kv.is_unified,
            can_split=self.kv.can_relayout,
            sequences=(
                (len(s.token_ids), s.num_generated, s.request.params.max_tokens)
                for s in self.all_sequences()
            ),
            num_decoding=lambda: sum(1 for s in self._running if s.num_pending == 1),
            session_cells=(len(slot.tokens) for slot in self.kv.slots() if slot.pinned),
            cooldown_steps=RELAYOUT_COOLDOWN_STEPS,  # this module's, which tests may patch
            to_share=self._would_copy_a_prefix,
            sharing=self._sharing,
        )
        if move is False:  # retained prefixes longer than a stream go
            for slot in self.prefix.retained():
                if len(slot.tokens) > self.layout.stream_cells:
                    self.prefix.evict(slot)
        if move is not None:
            self._relayout(move, result)

    def _would_copy_a_prefix(self) -> bool:
        """In streams: whether the waiting sequences that may start next would copy one
        long prefix into several streams (:meth:`LayoutPolicy.should_unify_to_share`).
        Skipped while no sequence id can be had (a backlog would pay the check each step)."""
        if not self._waiting or not self.prefix.is_enabled:
            return False
        if self.kv.num_free_seq_ids == 0 and self.prefix.num_retained == 0:
            return False
        next_up = [
            seq.token_ids
            for seq in self._waiting[: self._backend.n_seq_max]
            if seq.request.session_id is None
        ]
        move_s = self._move_s
        if move_s is None:
            kv_bytes = self._backend.kv_cells * self._backend.kv_bytes_per_cell
            move_s = kv_bytes * MOVE_PRIOR_S_PER_BYTE
        return self.layout.should_unify_to_share(
            next_up,
            (s.tokens for s in self.kv.slots()),
            token_s=self.budget.cost.coefficients[1],
            move_s=move_s,
        )

    def _sharing(self) -> tuple[int, int]:
        """Tokens the unfinished sequences hold, and the cells in use (the KV cache's own
        count: no walk over every cell each step)."""
        held = sum(len(s.slot.tokens) for s in self.all_sequences() if s.slot is not None)
        return held, self.kv.num_cells_used

    def _relayout(self, unified: bool, result: StepResult) -> None:
        """Move the cache to the other layout. If that fails, stay in this layout from now
        on; when moving to unified, fail the sequences that outgrew their streams."""
        if self.kv.layout is not LayoutState.STUCK:
            started = self.clock()
            if unified:
                self._make_room_to_unify()
            try:
                self.kv.relayout(unified)
            except RequestFailedError as exc:
                self.kv.fail_relayout(f"the unified layout could not be made: {exc}")
            else:
                self.layout.restart_count()
                self.num_relayouts += 1
                self._move_s = self.clock() - started
                self.budget.note_pause(self._move_s)
                return
        if not unified:
            return
        cap = self.layout.stream_cells
        for seq in self.all_sequences():
            if len(seq.token_ids) > cap and seq.state not in TERMINAL_STATES:
                reason = self.room.stream_reason(len(seq.token_ids), cap, self.kv.relayout_failure)
                self.fail(seq.request, RequestFailedError(reason), result)

    def _make_room_to_unify(self) -> None:
        """Before a move to the unified layout (no cells shared, ``n_ctx`` of them): evict
        retained prefixes, then preempt the newest, until the next step fits."""
        n_ctx = self._backend.n_ctx
        while sum(len(slot.tokens) for slot in self.kv.slots()) + self.num_pending_tokens > n_ctx:
            if self.prefix.evict_one():
                continue
            if not self._running:
                return  # open sessions alone hold more: the move fails and says so
            self._preempt(self._running[-1])

    # ------------------------------------------------------------------ fairness
    def _share_sequence_ids(self) -> None:
        """Preempt for each deprived waiting request one sequence of the richest request
        (:mod:`llamax.engine.fair_share`)."""
        fair = self.fair
        fair.count((s.request for s in self._running), (s.request for s in self._waiting))
        for request in fair.deprived:
            if request.session_id is not None:
                continue
            if self.kv.num_free_seq_ids or self.prefix.num_retained:
                break  # an id is there, or comes from an eviction at admission
            richest = fair.richest()
            if richest is None:
                break
            mine = [s for s in self._running if s.request is richest]
            victim = min(reversed(mine), key=lambda s: s.num_computed)  # cheapest to redo
            self._preempt(victim)
            fair.add(richest, -1)

    # ------------------------------------------------------------------ capacity
    def _count_idle_sessions(self) -> None:
        """Note the open sessions no running sequence uses, and their cells (what no
        eviction or preemption frees; :mod:`llamax.engine.session_room`)."""
        busy = {id(s.slot) for s in self._running if s.slot is not None}
        self._idle_sessions = [
            slot for slot in self.kv.slots() if slot.pinned and id(slot) not in busy
        ]
        self._idle_session_cells = num_cells(self._idle_sessions)

    def _end_what_cannot_fit(self, result: StepResult) -> None:
        """End the sequences that can never get the cells they need beside the idle open
        sessions: with ``length`` if they have output, else with a KVCapacityError."""
        no_ids = self.room.are_ids_held(len(self._idle_sessions))
        for seq in self.all_sequences():
            if seq.state in TERMINAL_STATES:
                continue
            is_session = seq.request.session_id is not None
            waits_for_id = no_ids and not is_session and seq.state is SequenceState.WAITING
            if not waits_for_id and len(seq.token_ids) <= self.capacity(seq):
                continue
            if seq.num_generated:
                self._finish(seq, SequenceState.FINISHED_LENGTH, result)
            else:
                self.fail(seq.request, KVCapacityError(self._no_room_reason(seq)), result)

    # ------------------------------------------------------------------ steps
    def shrink(self, plan: StepPlan) -> StepPlan:
        """Answer a NO_SLOT decode: drop the drafts, else halve the newest prefill chunk, else
        evict a retained prefix, else preempt the newest sequence."""
        slots = [(e.seq, len(e.item.token_ids) - len(e.draft)) for e in plan.entries]
        halved = None if plan.num_drafted else halve_newest_chunk([n for _, n in slots])
        if halved is not None:
            slots = [(seq, n) for (seq, _), n in zip(slots, halved, strict=True) if n]
        elif not plan.num_drafted and not self.prefix.evict_one() and slots:
            victim = max((seq for seq, _ in slots), key=self._running.index)
            self._preempt(victim)
            slots = [(seq, n) for seq, n in slots if seq is not victim]
        return self._build(slots)

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
                self._verify(entry, verify, result)
                continue
            num = len(entry.item.token_ids)
            assert seq.slot is not None
            is_decode = num == 1 and seq.num_generated > 0 and seq.num_pending == 1
            self.kv.append(seq.slot, entry.item.token_ids)
            if is_decode:
                self.num_decode_tokens += 1
            else:
                self.num_prefill_tokens += num  # prompt chunks, and recomputation after preemption
            if entry.item.row is None:
                continue
            for fork in entry.forks:
                self._fork_from(seq, fork)
            for s in (*entry.forks, seq):
                self._accept(s, sampled[s], result, logprobs.get(s))

    def _verify(self, entry: ScheduledSequence, verify: Verify, result: StepResult) -> None:
        """Accept the longest prefix of ``entry``'s draft that sampling confirms, plus the
        token sampled after it, row by row (so processors, stop strings and ``max_tokens``
        see what they would without drafts); cut the rejected drafts' cells."""
        seq, draft, slot = entry.seq, entry.draft, entry.seq.slot
        assert slot is not None and seq.draft_state is not None
        self.kv.append(slot, entry.item.token_ids)  # fed cells, until the rejected are cut
        row_index = 0
        for row_index, row in enumerate(entry.item.rows):
            try:
                token, logprob = verify(seq, row)
            except RequestFailedError as error:
                self.fail(seq.request, error, result)
                break
            self._accept(seq, token, result, logprob)
            if seq.state in TERMINAL_STATES or not confirms(draft, row_index, token):
                break
        accepted = row_index
        seq.draft_state.record(len(draft), accepted)
        self.num_drafted_tokens += len(draft)
        self.num_accepted_tokens += accepted
        self.num_decode_tokens += 1 + accepted
        if not self.kv.truncate(slot, entry.item.start_pos + 1 + accepted):
            raise RuntimeError("the KV memory refused to remove rejected draft tokens")

    def _plan_drafts(
        self, slots: list[tuple[Sequence, int]], budget: int
    ) -> dict[Sequence, tuple[int, ...]]:
        """Draft tokens for the step's decoding sequences (:mod:`~llamax.engine.draft_planner`)."""
        if not self._can_draft:
            return {}
        candidates: list[tuple[Sequence, DraftState, list[int], int]] = []
        for seq, num in slots:
            state = seq.draft_state
            if state is None or num != 1 or seq.state is not SequenceState.DECODING:
                continue
            limit = draft_limit(
                len(seq.token_ids),
                min(self.capacity(seq), self.kv.cells_per_seq),
                num_generated=seq.num_generated,
                max_tokens=seq.request.params.max_tokens,
            )
            candidates.append((seq, state, seq.token_ids, limit))
        room = budget
        if self.kv.is_unified:
            room = min(room, self._backend.n_ctx - self.kv.num_cells_used - self.num_pending_tokens)
        return self.drafts.plan(candidates, [n for _, n in slots], room, priced=self.price_drafts)

    def observe(self, plan: StepPlan, features: StepFeatures, seconds: float) -> None:
        """Learn the step cost from a measured step (and the decode cost, if it decoded only)."""
        self.step_cost.observe(features, seconds)
        if all(len(e.item.token_ids) - len(e.draft) == 1 for e in plan.entries):
            drafted = [
                (state, len(e.draft))
                for e in plan.entries
                if e.draft and (state := e.seq.draft_state) is not None
            ]
            if drafted:  # a step with drafts: was it worth them? (before it is learned)
                self.drafts.audit(len(plan.entries), seconds, drafted)
            self.drafts.decode_cost.observe(plan.num_tokens, seconds)

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
        """Place ``seq`` in a slot (:class:`~llamax.engine.admission.SlotPlacer`) and start it."""
        if seq.request.session_id is not None:
            pinned = self.sessions.slot(seq.request.session_id)
            placement = self.placer.reuse(
                pinned, seq.token_ids, self.num_pending_tokens, seq.request.adapters
            )
        else:
            in_flight = {
                s.slot.seq_id: s.token_ids
                for s in self._running
                if s.slot is not None and s.state is SequenceState.PREFILLING
            }
            placement = self.placer.place(
                seq.token_ids, in_flight, self.num_pending_tokens, seq.request.adapters
            )
        if placement.slot is not None:
            seq.slot = placement.slot
            self.num_cached_tokens += placement.num_reused
            if seq.index == 0 and seq.num_generated == 0:
                seq.request.num_cached_tokens = placement.num_reused
            self._waiting.remove(seq)
            seq.state = SequenceState.PREFILLING if seq.num_pending > 1 else SequenceState.DECODING
            self._running.append(seq)
        return placement.outcome

    def _fork_from(self, leader: Sequence, fork: Sequence) -> None:
        assert leader.slot is not None
        slot = self.placer.fork(leader.slot)
        self._waiting.remove(fork)
        fork.slot = slot
        self.num_cached_tokens += len(slot.tokens)
        self._running.append(fork)
        fork.state = SequenceState.PREFILLING

    def _make_room_for_growth(self) -> None:
        while (
            self.kv.is_unified
            and self.kv.num_cells_used + self.num_pending_tokens > self._backend.n_ctx
        ):
            if self.prefix.evict_one():
                continue
            if len(self._running) <= 1:
                break
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
        is_eog = not params.ignore_eos and self._backend.is_eog(token)
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
        elif at_limit or len(seq.token_ids) >= self.capacity(seq):
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
        if slot is not None and not slot.pinned:
            if keep_cache:
                self.prefix.retire(slot)
            else:
                self.kv.release(slot)
        if seq.sampler is not None:
            self._backend.free_sampler(seq.sampler)
            seq.sampler = None
