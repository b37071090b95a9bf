"""Continuous-batching scheduler. Pure Python: the one owner of every sequence and KV slot.

Design note: there is no separate prefill phase and decode phase. Every running sequence
has ``num_computed`` tokens in its KV slot and ``num_pending`` tokens still to compute; a
step gives each running sequence up to ``num_pending`` tokens under one token budget.
Sequences with one pending token (decoding) go first, so long prompts are chunked around
them and never stall streams for more than one chunk. A preempted sequence drops its
cells and re-queues; its prompt plus generated tokens are recomputed, so greedy output
continues unchanged.

Prefix reuse (:mod:`llamax.engine.prefix`): on admission a sequence copies the longest prefix any
slot holds (``seq_cp``: shared cells, no compute). If a longer prefix is still being
prefilled by a running sequence (a burst with one system prompt), the newcomer waits for it
instead of computing it again. ``n > 1`` choices fork from the leader's last prompt row:
they share its cells and sample their first token from the same logits.

KV accounting: cells are counted exactly by :class:`~llamax.engine.kvcache.KVCache`. In a unified
cache a step may start only if ``cells_used + pending tokens of running sequences <= n_ctx``;
retained slots are evicted first, then the newest running sequence is preempted (LIFO).
With one stream per sequence every sequence owns its cells, so only sequence ids are
scarce; retained prefixes then cost memory but never slow other streams. Changes
asked for from outside a step (sessions, chat shifts, ``clear_cache``) arrive as typed
operations (:mod:`llamax.engine.kvops`) through :meth:`Scheduler.apply`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping
from enum import Enum
from typing import TypeVar, cast

from ..backend.base import Backend
from ..errors import KVCapacityError, RequestFailedError
from ..results import TokenEvent, TokenLogprob
from ..tokens import common_prefix_len
from .chunk_budget import ChunkBudget
from .draft_planner import DraftPlanner
from .fair_share import FairShare
from .kvcache import KVCache, LayoutState, Slot, SlotState
from .kvops import KVOp, RestoreSession
from .layout_policy import RELAYOUT_COOLDOWN_STEPS, LayoutPolicy
from .plan import ScheduledSequence, StepPlan, StepResult, build_plan, split_plan
from .prefix import PrefixCache
from .sequence import TERMINAL_STATES, Request, Sequence, SequenceState
from .session_table import SessionTable
from .speculative import DecodeCost, DraftState, PromptLookup, Speculative
from .split_policy import SplitPolicy
from .step_budget import StepFeatures, tile_waste_table

__all__ = ["ScheduledSequence", "Scheduler", "StepPlan", "StepResult"]

T = TypeVar("T")

WAIT_FOR_PREFIX_MIN = 16
"""A newcomer waits for an in-flight prefix only if it would save at least this many tokens."""
Verify = Callable[[Sequence, int], tuple[int, TokenLogprob | None]]
"""Samples a sequence's token from one batch row (speculative verification, row by row)."""


class _Admission(Enum):
    ADMITTED = "admitted"
    WAIT_PREFIX = "wait_prefix"
    NO_ROOM = "no_room"


class Scheduler:
    """Owns every state change of every sequence and slot. Driven by one thread at a time."""

    def __init__(
        self,
        backend: Backend,
        *,
        prefix_cache: bool = True,
        max_step_ms: float | None = None,
        speculative: Speculative | None = None,
        allow_drafts: bool = True,
    ) -> None:
        self._backend = backend
        self._n_ctx_seq = backend.n_ctx_seq
        self.splitter = SplitPolicy(backend.cpu_attention)
        self._n_batch = backend.n_batch
        tiles = backend.attention_tiles
        waste = None if tiles is None else tile_waste_table(backend.n_batch, *tiles)
        self.budget = ChunkBudget(backend.n_batch, max_step_ms, waste=waste)
        self.step_cost = self.budget.cost
        self.kv = KVCache(backend, backend.n_seq_max)
        self.prefix = PrefixCache(self.kv, retain=prefix_cache and backend.can_share_prefix)
        self.sessions = SessionTable(self)
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_cached_tokens = 0
        self._speculative = speculative
        # drafts are rolled back with a partial seq_rm, which recurrent memory cannot do
        self._can_draft = allow_drafts and backend.can_share_prefix
        self.drafts = DraftPlanner(self.budget.max_step_s)
        self.price_drafts = True
        """Keep only drafts whose expected gain pays for their compute (tests turn it off
        to make every proposal be verified)."""
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0
        self.layout = LayoutPolicy(self.kv.cells_per_seq)  # "auto" starts with streams
        self.num_relayouts = 0
        self._idle_sessions: list[Slot] = []  # pinned slots no running sequence uses
        self.fair: FairShare[Request] = FairShare(backend.n_seq_max)
        self._idle_session_cells = 0

    # ------------------------------------------------------------------ queries
    @property
    def backend(self) -> Backend:
        """The backend this scheduler drives."""
        return self._backend

    @property
    def stream_cells(self) -> int:
        """Cells one sequence holds in its own stream (``kv_layout="auto"`` moves to the
        unified layout beyond that), or what the fixed layout gives one sequence."""
        return self.layout.stream_cells if self.kv.can_relayout else self.kv.cells_per_seq

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
        """Sequences being computed."""
        return len(self._running)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens the running sequences still have to compute."""
        return sum(seq.num_pending for seq in self._running)

    def all_sequences(self) -> list[Sequence]:
        """Every waiting and running sequence."""
        return self._waiting + self._running

    # ------------------------------------------------------------------ changes
    def add(self, request: Request) -> None:
        """Queue every sequence of a new request."""
        method = self._speculation(request)
        for seq in request.sequences:
            if method is not None:
                seq.draft_state = method.new_state(self.drafts.acceptance)
            bisect.insort(self._waiting, seq, key=lambda s: s.sort_key)

    def _speculation(self, request: Request) -> Speculative | None:
        """The drafting method ``request`` uses: its own, else the context's, or None."""
        asked = request.params.speculative
        if not self._can_draft or asked is False:
            return None
        if asked is True:
            return self._speculative or PromptLookup()
        return self._speculative if asked is None else asked

    def apply(self, op: KVOp[T], result: StepResult) -> T:
        """Apply a KV operation between steps; events it causes go into ``result``."""
        if (
            isinstance(op, RestoreSession)
            and self.kv.can_relayout
            and not self.kv.is_unified
            and len(op.tokens) > self.layout.stream_cells
        ):
            self._relayout(True, result)  # a saved session longer than a stream
        return cast(T, self.sessions.apply(op, result))

    def schedule(self, result: StepResult) -> StepPlan:
        """Choose the KV layout, make room, admit what fits, and plan one step.

        Decode rows go first; prompt chunks fill the rest of the token budget, sized so the
        step stays within ``max_step_ms`` while anybody is decoding (see
        :mod:`llamax.engine.step_budget`). Requests that cannot go on (a layout change failed) end
        with their events in ``result``.
        """
        self._count_idle_sessions()
        self._end_what_cannot_fit(result)
        self._adapt_layout(result)
        self._make_room_for_growth()
        self._share_sequence_ids()
        decode = [seq for seq in self._running if seq.num_pending == 1][: self._n_batch]
        slots: list[tuple[Sequence, int]] = [(seq, 1) for seq in decode]
        budget = self._n_batch - len(decode)
        fixed = self.budget.start_step(
            [seq.num_computed for seq in decode], unified=self.kv.is_unified
        )
        for seq in self._running:
            if seq.num_pending > 1 and budget > 0:
                take, fixed = self._chunk(seq, min(seq.num_pending, budget), fixed, len(decode))
                if take:
                    slots.append((seq, take))
                    budget -= take
        # requests below their share first; those at it take the ids left (no id idles)
        over = [seq for seq in self._waiting if self.fair.is_over(seq.request)]
        under = [seq for seq in self._waiting if not self.fair.is_over(seq.request)]
        for seq in under + over:
            if budget <= 0:
                break
            if self._is_fork_candidate(seq):
                continue
            outcome = self._try_admit(seq)
            if outcome is _Admission.NO_ROOM:
                break  # first come, first served: nobody overtakes a request that lacks room
            if outcome is _Admission.ADMITTED:
                self.fair.add(seq.request)
                take, fixed = self._chunk(seq, min(seq.num_pending, budget), fixed, len(decode))
                if take:
                    slots.append((seq, take))
                    budget -= take
        return build_plan(
            slots,
            self.kv.num_free_seq_ids,
            self._forkable_siblings,
            by_seq_id=not self.kv.is_unified,
            drafts=self._plan_drafts(slots, budget),
        )

    # ------------------------------------------------------------------ layout
    def _adapt_layout(self, result: StepResult) -> None:
        """``kv_layout="auto"``: move between streams and the unified layout when
        :class:`~llamax.engine.layout_policy.LayoutPolicy` says so."""
        if self.kv.layout is LayoutState.FIXED:
            return
        self.layout.count_step()
        if not self.kv.is_unified:
            if self.layout.should_unify(len(s.token_ids) for s in self.all_sequences()):
                self._relayout(True, result)
            return
        if not self.kv.can_relayout:
            return
        cells_to_come = (
            self.layout.cells_to_come(
                len(s.token_ids), s.num_generated, s.request.params.max_tokens
            )
            for s in self.all_sequences()
        )
        if not self.layout.should_split(
            num_decoding=sum(1 for s in self._running if s.num_pending == 1),
            cells_to_come=cells_to_come,
            session_cells=(len(slot.tokens) for slot in self.kv.slots() if slot.pinned),
            cooldown_steps=RELAYOUT_COOLDOWN_STEPS,  # this module's, which tests may patch
        ):
            return
        for slot in self.prefix.retained():
            if len(slot.tokens) > self.layout.stream_cells:
                self.prefix.evict(slot)
        self._relayout(False, result)

    def _relayout(self, unified: bool, result: StepResult) -> None:
        """Move the cache to the other layout. If that fails, stay in this layout from now
        on; when moving to unified, fail the sequences that outgrew their streams."""
        if self.kv.layout is not LayoutState.STUCK:
            started = time.perf_counter()
            if unified:
                self._make_room_to_unify()
            try:
                self.kv.relayout(unified)
            except RequestFailedError as exc:
                self.kv.fail_relayout(f"the unified layout could not be made: {exc}")
            else:
                self.layout.restart_count()
                self.num_relayouts += 1
                self.budget.note_pause(time.perf_counter() - started)
                return
        if not unified:
            return
        cap = self.layout.stream_cells
        for seq in self.all_sequences():
            if len(seq.token_ids) > cap and seq.state not in TERMINAL_STATES:
                error = RequestFailedError(
                    f"the request needs {len(seq.token_ids)} KV cells, one stream holds "
                    f"{cap}, and {self.kv.relayout_failure}"
                )
                self.fail(seq.request, error, result)

    # ------------------------------------------------------------------ fairness
    def _share_sequence_ids(self) -> None:
        """Fairness between requests (:mod:`llamax.engine.fair_share`): a waiting request
        below its share that finds no free sequence id takes one from the request holding
        the most above its share, whose sequence with the fewest computed tokens is
        preempted (recomputed later; one per waiting request and step)."""
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
        """Note the open sessions that no running sequence uses, and their cells: what no
        eviction or preemption can free (a running session request is preempted like any)."""
        busy = {id(s.slot) for s in self._running if s.slot is not None}
        self._idle_sessions = [
            slot for slot in self.kv.slots() if slot.pinned and id(slot) not in busy
        ]
        self._idle_session_cells = len({c for slot in self._idle_sessions for c in slot.cells})

    def capacity(self, seq: Sequence) -> int:
        """The most tokens ``seq`` may hold now: ``n_ctx_seq``, less (in a unified cache)
        the cells idle open sessions other than its own hold; with ``kv_layout="auto"`` in
        streams, at least its own stream."""
        own = self._own_session_slot(seq)
        held = self._idle_session_cells
        if own is not None and own in self._idle_sessions:
            others = [slot for slot in self._idle_sessions if slot is not own]
            held = len({c for slot in others for c in slot.cells})
        if not self.kv.is_unified:
            if not self.kv.can_relayout:
                return self.kv.cells_per_seq
            return min(self._n_ctx_seq, max(self.layout.stream_cells, self._backend.n_ctx - held))
        return min(self._n_ctx_seq, self._backend.n_ctx - held)

    def _own_session_slot(self, seq: Sequence) -> Slot | None:
        session_id = seq.request.session_id
        if session_id is None:
            return None
        return self.sessions.slot_or_none(session_id)

    def _end_what_cannot_fit(self, result: StepResult) -> None:
        """End the sequences that can never get the cells they need beside the idle open
        sessions: one that has output finishes with ``length`` (as at ``n_ctx_seq``), one
        that has none fails with :class:`~llamax.errors.KVCapacityError` naming them. So no
        request waits for room that only closing a session could give."""
        no_ids = len(self._idle_sessions) >= self._backend.n_seq_max
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

    def _no_room_reason(self, seq: Sequence) -> str:
        own = self._own_session_slot(seq)
        idle = [slot for slot in self._idle_sessions if slot is not own]
        names = ", ".join(str(i) for i in self.sessions.ids_of(idle))
        if len(self._idle_sessions) >= self._backend.n_seq_max and own is None:
            return (
                f"every one of the {self._backend.n_seq_max} sequence ids is held by an open "
                f"session (sessions {names}); close a session or raise n_seq_max"
            )
        need = f"the request needs {len(seq.token_ids)} KV cells"
        if not self.kv.is_unified and not self.kv.can_relayout:
            failure = self.kv.relayout_failure
            why = f", and {failure}" if failure else ""
            return f"{need}, one stream holds {self.kv.cells_per_seq}{why}"
        cells = len({c for slot in idle for c in slot.cells})
        return (
            f"{need}, but open sessions (sessions {names}) hold {cells} of the cache's "
            f"{self._backend.n_ctx}, leaving {self.capacity(seq)}; close a session or raise n_ctx"
        )

    def _make_room_to_unify(self) -> None:
        """Before a move to the unified layout, where no cells are shared and the buffer
        holds ``n_ctx`` cells (streams may hold more, each padded): evict retained prefixes,
        then preempt the newest running sequences, as a unified cache under pressure would,
        until what stays and the next step's tokens fit. The preempted are recomputed later.
        """
        n_ctx = self._backend.n_ctx
        while sum(len(slot.tokens) for slot in self.kv.slots()) + self.num_pending_tokens > n_ctx:
            if self.prefix.evict_one():
                continue
            if not self._running:
                return  # open sessions alone hold more: the move fails and says so
            self._preempt(self._running[-1])

    def split(self, plan: StepPlan) -> list[StepPlan]:
        """The batches that compute ``plan``: usually one; in a unified cache on the CPU,
        many decode rows go in smaller batches (:mod:`llamax.engine.split_policy`)."""
        groups = self.splitter.groups(
            [len(e.item.token_ids) for e in plan.entries],
            [e.seq.num_computed for e in plan.entries],
            self.kv.num_cells_used,
            unified=self.kv.is_unified,
        )
        return [plan] if groups is None else split_plan(plan, groups)

    def features(self, plan: StepPlan) -> StepFeatures:
        """What ``plan`` costs, in the terms of :mod:`llamax.engine.step_budget`'s cost model."""
        entries = [
            (len(e.item.token_ids), e.item.start_pos, e.seq.num_computed) for e in plan.entries
        ]
        return self.budget.step_features(
            entries, self.kv.num_cells_used, unified=self.kv.is_unified
        )

    def _chunk(
        self, seq: Sequence, limit: int, fixed: StepFeatures | None, num_decode: int
    ) -> tuple[int, StepFeatures | None]:
        return self.budget.chunk(
            fixed,
            limit,
            num_pending=seq.num_pending,
            num_computed=seq.num_computed,
            num_cells_used=self.kv.num_cells_used,
            num_decode=num_decode,
            unified=self.kv.is_unified,
        )

    def shrink(self, plan: StepPlan) -> StepPlan:
        """Answer a NO_SLOT decode: drop the drafts, else halve the newest prefill chunk, else
        preempt the newest sequence."""
        slots = [(e.seq, len(e.item.token_ids) - len(e.draft)) for e in plan.entries]
        if plan.num_drafted:
            return build_plan(
                slots,
                self.kv.num_free_seq_ids,
                self._forkable_siblings,
                by_seq_id=not self.kv.is_unified,
            )
        chunks = [i for i, (_, n) in enumerate(slots) if n > 1]
        if chunks:
            i = chunks[-1]
            seq, n = slots[i]
            if n // 2:
                slots[i] = (seq, n // 2)
            else:
                del slots[i]
        elif self.prefix.evict_one():
            pass
        elif slots:
            victim = max((seq for seq, _ in slots), key=self._running.index)
            self._preempt(victim)
            slots = [(seq, n) for seq, n in slots if seq is not victim]
        return build_plan(
            slots,
            self.kv.num_free_seq_ids,
            self._forkable_siblings,
            by_seq_id=not self.kv.is_unified,
        )

    def update(
        self,
        plan: StepPlan,
        sampled: Mapping[Sequence, int],
        logprobs: Mapping[Sequence, TokenLogprob],
        result: StepResult,
        verify: Verify | None = None,
    ) -> None:
        """Record a successful decode of ``plan`` and the tokens sampled for it.

        Sequences that ended while their row was sampled (a failing logits processor) are
        skipped: their cells are already released. Drafted entries are verified here, row
        by row with ``verify``.
        """
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
        """Accept the longest prefix of ``entry``'s draft that sampling confirms, plus the one
        token sampled after it; remove the cells of the rejected drafts.

        Rows are sampled in order, each after the tokens before it were accepted, so logits
        processors, grammars, stop strings and ``max_tokens`` see exactly what they would
        without speculation. The slot ends holding what it would hold without speculation
        (every token but the last sampled one), also when the sequence ends inside its draft
        and its slot is retained or belongs to a session.
        """
        seq, draft = entry.seq, entry.draft
        slot = seq.slot
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
            if seq.state in TERMINAL_STATES or row_index == len(draft) or token != draft[row_index]:
                break
        accepted = row_index  # rows before the last one sampled confirmed their draft token
        seq.draft_state.record(len(draft), accepted)
        self.num_drafted_tokens += len(draft)
        self.num_accepted_tokens += accepted
        self.num_decode_tokens += 1 + accepted
        # a released slot holds no tokens any more, so this only cuts live, retained and
        # session slots
        if not self.kv.truncate(slot, entry.item.start_pos + 1 + accepted):
            raise RuntimeError("the KV memory refused to remove rejected draft tokens")

    def _plan_drafts(
        self, slots: list[tuple[Sequence, int]], budget: int
    ) -> dict[Sequence, tuple[int, ...]]:
        """Draft tokens for the step's decoding sequences that may speculate, each within
        its KV room and ``max_tokens`` (:class:`~llamax.engine.draft_planner.DraftPlanner`)."""
        if not self._can_draft:
            return {}
        candidates: list[tuple[Sequence, DraftState, list[int], int]] = []
        for seq, num in slots:
            state = seq.draft_state
            if state is None or num != 1 or seq.state is not SequenceState.DECODING:
                continue
            limit = min(self.capacity(seq), self.kv.cells_per_seq) - len(seq.token_ids)
            max_tokens = seq.request.params.max_tokens
            if max_tokens is not None:
                limit = min(limit, max_tokens - seq.num_generated - 1)
            candidates.append((seq, state, seq.token_ids, limit))
        room = budget
        if self.kv.is_unified:
            room = min(room, self._backend.n_ctx - self.kv.num_cells_used - self.num_pending_tokens)
        return self.drafts.plan(candidates, [n for _, n in slots], room, priced=self.price_drafts)

    def _price_drafts(
        self,
        slots: list[tuple[Sequence, int]],
        proposals: list[tuple[Sequence, DraftState, tuple[int, ...]]],
        room: int,
    ) -> dict[Sequence, int]:
        return self.drafts.price([n for _, n in slots], proposals, room)

    @property
    def decode_cost(self) -> DecodeCost:
        """What one more token costs a step of decode rows (prices drafts)."""
        return self.drafts.decode_cost

    @decode_cost.setter
    def decode_cost(self, cost: DecodeCost) -> None:
        self.drafts.decode_cost = cost

    def observe(self, plan: StepPlan, features: StepFeatures, seconds: float) -> None:
        """Learn from a measured step: the chunk-sizing model, and the draft pricing model
        from steps of decode (and draft) tokens only."""
        self.step_cost.observe(features, seconds)
        if all(len(e.item.token_ids) - len(e.draft) == 1 for e in plan.entries):
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
    def _try_admit(self, seq: Sequence) -> _Admission:
        if seq.request.session_id is not None:
            pinned = self.sessions.slot(seq.request.session_id)
            return self._admit_into(seq, pinned, source=None, num_reused=0)
        in_flight = {
            s.slot.seq_id: s.token_ids
            for s in self._running
            if s.slot is not None and s.state is SequenceState.PREFILLING
        }
        match = self.prefix.match(seq.token_ids, in_flight)
        source, now = match.slot, match.num_now
        if match.num_later - now >= WAIT_FOR_PREFIX_MIN:
            return _Admission.WAIT_PREFIX
        if self.kv.num_free_seq_ids == 0 and not self.prefix.evict_one(keep=source):
            return self._take_over(seq, source)
        if not self._fits(len(seq.token_ids) - now, keep=source):
            return self._take_over(seq, source)
        slot = self.prefix.allocate(keep=source)
        assert slot is not None
        return self._admit_into(seq, slot, source=source, num_reused=now)

    def _take_over(self, seq: Sequence, source: Slot | None) -> _Admission:
        """Admit ``seq`` into the retained slot holding its prefix, cut to that prefix.

        For when the sequence id or the cells the request needs are held only by that slot:
        admission never evicts the slot it copies from, so without this the request would
        wait forever. If it still does not fit, the slot is retained again.
        """
        if source is None or source.state is not SlotState.RETAINED:
            return _Admission.NO_ROOM
        self.prefix.adopt(source)
        admission = self._admit_into(seq, source, source=None, num_reused=0)
        if admission is not _Admission.ADMITTED:
            self.prefix.retire(source)
        return admission

    def _admit_into(
        self, seq: Sequence, slot: Slot, *, source: Slot | None, num_reused: int
    ) -> _Admission:
        if source is None:
            # A session or taken-over slot: keep the common prefix, drop the diverging tail.
            keep = min(common_prefix_len(slot.tokens, seq.token_ids), len(seq.token_ids) - 1)
            if (
                not self.prefix.is_enabled
                or not self.kv.truncate(slot, keep)
                or not self.kv.is_intact(slot)
            ):
                self.kv.clear(slot)
            num_reused = len(slot.tokens)
            if not self._fits(len(seq.token_ids) - num_reused):
                return _Admission.NO_ROOM
        elif num_reused:
            self.kv.copy_prefix(source, slot, num_reused)
            self.prefix.touch(source)
        seq.slot = slot
        self._count_reuse(seq, num_reused)
        self._start(seq)
        return _Admission.ADMITTED

    def _is_fork_candidate(self, seq: Sequence) -> bool:
        """An n>1 sibling whose leader is prefilling the same prompt waits to fork from it."""
        if seq.index == 0 or seq.num_generated:
            return False
        leader = seq.request.sequences[0]
        return leader.state is SequenceState.PREFILLING and self.prefix.is_enabled

    def _forkable_siblings(self, seq: Sequence, free_ids: int) -> tuple[Sequence, ...]:
        if seq.index != 0 or seq.num_generated or not self.prefix.is_enabled:
            return ()
        others = self.fair.others_deprived(seq.request)
        num_others = sum(
            1 for r in others if any(s.state is SequenceState.WAITING for s in r.sequences)
        )
        free_ids = self.fair.num_forkable(seq.request, free_ids, num_others)
        siblings = [
            s
            for s in seq.request.sequences[1:]
            if s.state is SequenceState.WAITING and s.num_generated == 0
        ]
        return tuple(siblings[:free_ids])

    def _fork_from(self, leader: Sequence, fork: Sequence) -> None:
        assert leader.slot is not None
        slot = self.prefix.allocate(keep=leader.slot)
        assert slot is not None, "fork planned without a free sequence id"
        self.kv.copy_prefix(leader.slot, slot, len(leader.slot.tokens))
        self._waiting.remove(fork)
        fork.slot = slot
        self.num_cached_tokens += len(slot.tokens)
        self._running.append(fork)
        fork.state = SequenceState.PREFILLING

    def _start(self, seq: Sequence) -> None:
        self._waiting.remove(seq)
        seq.state = SequenceState.PREFILLING if seq.num_pending > 1 else SequenceState.DECODING
        self._running.append(seq)

    def _count_reuse(self, seq: Sequence, num: int) -> None:
        self.num_cached_tokens += num
        if seq.index == 0 and seq.num_generated == 0:
            seq.request.num_cached_tokens = num

    def _fits(self, new_cells: int, *, keep: Slot | None = None) -> bool:
        if not self.kv.is_unified:
            return True  # every sequence owns a stream of n_ctx_seq cells or more
        while self.kv.num_cells_used + self.num_pending_tokens + new_cells > self._backend.n_ctx:
            if not self.prefix.evict_one(keep=keep):
                return False
        return True

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
