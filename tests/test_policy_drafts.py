"""The draft planner on plain numbers (:mod:`llamax.engine.spec.draft_planner`): no backend."""

from __future__ import annotations

from llamax.drafting import PromptLookup
from llamax.engine.spec.draft_planner import DraftPlanner, confirms, draft_limit, drafting_method
from llamax.engine.spec.speculative import DraftState, new_draft_state

REPEATING = [1, 2, 3, 4, 5] * 6  # prompt lookup proposes the continuation of the cycle


def state(hits: int, of: int = 20) -> DraftState:
    """A draft state whose single-token drafts were right ``hits`` times of ``of``."""
    s = new_draft_state(PromptLookup(max_draft=8))
    for i in range(of):
        s.record(1, 1 if i < hits else 0)
    return s


def planner(
    base: float = 0.004, per_token: float = 0.004, max_step_s: float | None = None
) -> DraftPlanner:
    p = DraftPlanner(max_step_s)
    for _ in range(5):  # a line through (1, base + per_token) and (2, base + 2 * per_token)
        p.decode_cost.observe(1, base + per_token)
        p.decode_cost.observe(2, base + 2 * per_token)
    return p


def test_a_sure_lone_sequence_drafts_its_whole_proposal() -> None:
    keep = planner().price([1], [("a", state(20), tuple(range(8)))], room=512)
    assert keep == {"a": 8}


def test_unlikely_drafts_are_not_verified() -> None:
    assert planner().price([1], [("a", state(4), tuple(range(8)))], room=512) == {}


def test_drafting_yields_under_a_full_batch() -> None:
    proposals = [(i, state(19), tuple(range(8))) for i in range(64)]
    assert planner().price([1] * 64, proposals, room=512) == {}


def test_a_step_with_a_prompt_chunk_gets_no_drafts() -> None:
    keep = planner().price([1, 64], [("a", state(20), (1, 2, 3))], room=100)
    assert keep == {}


def test_room_and_max_step_bound_the_drafts() -> None:
    sure = [(i, state(20), tuple(range(8))) for i in range(2)]
    assert sum(planner().price([1, 1], sure, room=3).values()) == 3
    # each draft token costs 4 ms: a 10 ms bound on top of the step leaves room for two
    assert sum(planner(max_step_s=0.010).price([1, 1], sure, room=512).values()) == 2


def test_plan_proposes_cuts_and_remembers_what_it_skipped() -> None:
    p = planner()
    sure, unsure = state(20), state(0)
    candidates = [
        ("sure", sure, REPEATING, 4),
        ("unsure", unsure, REPEATING, 4),
        ("no match", state(20), [9, 8, 7], 4),
    ]
    drafts = p.plan(candidates, [1, 1, 1], room=512)
    assert drafts == {"sure": (1, 2, 3, 4)}  # at most the candidate's limit
    # the skipped proposal is checked against the token that follows: a hit makes it hot
    before = unsure.acceptance
    unsure.propose([*REPEATING, 1], 4)
    assert unsure.acceptance > before


def test_unpriced_plans_verify_every_proposal_within_room() -> None:
    p = planner()
    candidates = [(i, state(0), REPEATING, 4) for i in range(3)]
    assert p.plan(candidates, [1, 1, 1], room=6, priced=False) == {
        0: (1, 2, 3, 4),
        1: (1, 2),
    }
    assert p.plan([], [1], room=6) == {}


def test_a_draft_stays_within_kv_room_and_max_tokens() -> None:
    assert draft_limit(100, 108, num_generated=5, max_tokens=None) == 8
    assert draft_limit(100, 108, num_generated=5, max_tokens=10) == 4  # one is sampled anyway
    assert draft_limit(100, 100, num_generated=0, max_tokens=None) == 0


def test_each_sampled_token_confirms_the_draft_token_after_its_row() -> None:
    draft = (7, 8, 9)
    assert confirms(draft, 0, 7) and confirms(draft, 2, 9)
    assert not confirms(draft, 1, 7)  # rejected: the sampled token replaces the draft's
    assert not confirms(draft, 3, 1)  # the last row follows the whole draft: nothing after


def test_a_request_drafts_with_its_own_method_else_the_contexts() -> None:
    context, own = PromptLookup(max_draft=4), PromptLookup(max_draft=2)
    assert drafting_method(None, context, can_draft=True) is context
    assert drafting_method(None, None, can_draft=True) is None
    assert drafting_method(own, context, can_draft=True) is own
    assert drafting_method(True, context, can_draft=True) is context
    assert isinstance(drafting_method(True, None, can_draft=True), PromptLookup)
    assert drafting_method(False, context, can_draft=True) is None
    assert drafting_method(True, context, can_draft=False) is None
