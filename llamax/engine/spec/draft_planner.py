"""Draft planning: which speculative draft tokens a step verifies.

:class:`DraftPlanner` asks each candidate's :class:`~llamax.engine.spec.speculative.DraftState`
for a proposal and cuts it to the tokens worth computing, from the sequences' measured
acceptance rates and the learned cost of a decode token
(:class:`~llamax.engine.spec.speculative.DecodeCost`). It sees numbers and draft states only;
the scheduler says who may draft and how far (KV room, ``max_tokens``), puts the drafts in
the plan, and :class:`~llamax.engine.spec.drafts.Drafting` verifies them after the decode.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from typing import TypeVar

from ...drafting import PromptLookup, Speculative
from .speculative import DecodeCost, DraftState, SharedAcceptance, window

__all__ = ["DraftPlanner", "confirms", "draft_limit", "drafting_method"]

K = TypeVar("K", bound=Hashable)

Proposal = tuple[K, DraftState, tuple[int, ...]]
"""Who drafts (any key), its draft state, and the tokens it proposes."""


def drafting_method(
    asked: bool | Speculative | None, default: Speculative | None, *, can_draft: bool
) -> Speculative | None:
    """The drafting method of a request that ``asked`` for one (its ``speculative``
    parameter): its own, else the context's ``default`` (``True`` without one: prompt
    lookup), or None (``False``, or the memory cannot roll drafts back: not ``can_draft``)."""
    if not can_draft or asked is False:
        return None
    if asked is True:
        return default or PromptLookup()
    return default if asked is None else asked


def draft_limit(
    num_tokens: int, capacity: int, *, num_generated: int, max_tokens: int | None
) -> int:
    """The most draft tokens a sequence may feed: what its KV room holds beyond its
    ``num_tokens``, and (with ``max_tokens``) fewer than the tokens it may still generate."""
    limit = capacity - num_tokens
    if max_tokens is not None:
        limit = min(limit, max_tokens - num_generated - 1)
    return limit


def confirms(draft: Sequence[int], row_index: int, token: int) -> bool:
    """Whether ``token``, sampled from row ``row_index`` of a drafted entry, confirms the
    draft token fed after that row, so the next row's sample counts too. Rows before the
    last one sampled are each one accepted draft token."""
    return row_index < len(draft) and token == draft[row_index]


class DraftPlanner:
    """Proposes and prices speculative drafts for one step at a time.

    Args:
        max_step_s: A step with drafts stays within this many seconds of its predicted
            time without them (None: no bound).
    """

    def __init__(self, max_step_s: float | None) -> None:
        self.max_step_s = max_step_s
        self.decode_cost = DecodeCost()
        """What one more token costs a step of decode rows (learned from measured steps)."""
        self.acceptance = SharedAcceptance()
        """The context's acceptance record, which every new draft state starts from."""

    def plan(
        self,
        candidates: Sequence[tuple[K, DraftState, Sequence[int], int]],
        num_tokens: Sequence[int],
        room: int,
        *,
        priced: bool = True,
    ) -> dict[K, tuple[int, ...]]:
        """The draft tokens each candidate feeds this step.

        What is proposed but not verified is remembered by the candidate's draft state
        (:meth:`~llamax.engine.spec.speculative.DraftState.skipped`), to learn its acceptance
        rate anyway.

        Args:
            candidates: ``(key, draft state, tokens so far, most draft tokens)`` of each
                decoding sequence that may draft.
            num_tokens: Tokens each sequence of the step feeds without drafts.
            room: The most draft tokens the step may add (batch and KV room).
            priced: Keep only drafts worth their compute (:meth:`price`) from sequences the
                guard lets draft (:meth:`audit`); if False, every proposal is verified as
                far as ``room`` allows.

        Returns:
            The drafts to feed, by key; candidates without one are absent.
        """
        proposals: list[Proposal[K]] = []
        position: dict[K, int] = {}
        for key, state, token_ids, limit in candidates:
            draft = state.propose(token_ids, limit)
            state.tick(len(num_tokens))
            if draft and state.paused and priced:  # the guard stopped it: only learn
                state.skipped(len(token_ids), draft)
            elif draft:
                proposals.append((key, state, draft))
                position[key] = len(token_ids)
        if not proposals:
            return {}
        if priced:
            keep = self.price(num_tokens, proposals, room)
        else:
            keep = {}
            for key, _, draft in proposals:
                keep[key] = max(0, min(len(draft), room))
                room -= keep[key]
        drafts: dict[K, tuple[int, ...]] = {}
        for key, state, draft in proposals:
            num = keep.get(key, 0)
            if num:
                drafts[key] = draft[:num]
            else:
                state.skipped(position[key], draft)
        return drafts

    def audit(
        self, num_rows: int, seconds: float, drafted: Sequence[tuple[DraftState, int]]
    ) -> None:
        """Check what the drafts of one measured decode-only step realized (the guard).

        The step decoded ``num_rows`` sequences, ``drafted`` are the states of those that
        fed drafts and how many tokens each, and it took ``seconds``. Without drafts it
        would have taken the measured cost of ``num_rows`` rows
        (:meth:`~llamax.engine.spec.speculative.DecodeCost.plain`); the difference is what the
        drafts cost, shared in proportion to their tokens. Each accepted token saved one
        row's share of that plain step: a token the sequence would otherwise have waited a
        step for. Each state weighs the two
        (:meth:`~llamax.engine.spec.speculative.DraftState.audit`).
        """
        total = sum(num for _, num in drafted)
        if total <= 0:
            return
        plain = self.decode_cost.plain(num_rows)
        extra = max(0.0, seconds - plain)
        for state, num in drafted:
            state.audit(state.last_accepted * plain / num_rows, extra * num / total, num_rows)

    def price(
        self, num_tokens: Sequence[int], proposals: Sequence[Proposal[K]], room: int
    ) -> dict[K, int]:
        """How many tokens of each proposal to verify so the step's expected useful tokens
        per predicted second is highest.

        The ``j``-th draft token of a sequence is accepted with probability ``a**j`` (its
        measured rate ``a``) and costs what one more token adds to a step of decode rows
        (:class:`~llamax.engine.spec.speculative.DecodeCost`). Tokens are taken greedily, best
        gain per second first, while each raises the step's expected tokens per second:
        under a full batch a token already costs its full share, so drafting yields unless
        nearly certain; a step with prompt chunks is compute-bound and gets no drafts. The
        step also stays within ``max_step_s`` of its predicted time without drafts.

        Args:
            num_tokens: Tokens each sequence of the step feeds without drafts.
            proposals: The proposed drafts.
            room: The most draft tokens in all.

        Returns:
            Draft tokens to keep, by key (absent: none).
        """
        total = sum(num_tokens)
        if total > len(num_tokens):  # prompt chunks make the step compute-bound: no drafts
            return {}
        base, cost = self.decode_cost.line(window(total), len(num_tokens))
        seconds = base + cost * total
        limit_s = seconds + self.max_step_s if self.max_step_s is not None else float("inf")
        useful = float(total)
        heap = [(-state.expected_gain(1) / cost, i, 1) for i, (_, state, _) in enumerate(proposals)]
        heapq.heapify(heap)
        keep: dict[K, int] = {}
        while heap and room > 0:
            neg_ratio, i, j = heapq.heappop(heap)
            if -neg_ratio * seconds <= useful or seconds + cost > limit_s:
                break
            key, state, draft = proposals[i]
            keep[key] = j
            useful += state.expected_gain(j)
            seconds += cost
            room -= 1
            if j < len(draft):
                heapq.heappush(heap, (-state.expected_gain(j + 1) / cost, i, j + 1))
        return keep
