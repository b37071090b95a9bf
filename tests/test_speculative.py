"""Speculative decoding against the fake backend: drafting, verification, rollback, pricing.

The fake model is a function of the tokens in KV, so its output is batch-invariant and a
speculative run must reproduce a plain run exactly: same tokens, text, finish reason,
logprobs, processor calls and seeded samples. ``ctx.audit()`` after every step checks that
the rejected draft cells were removed and the cell accounting is exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import llamax
from llamax.backend import BatchItem, DecodeStatus
from llamax.config import EngineConfig
from llamax.drafting import PromptLookup, PromptLookupDrafter
from llamax.engine.sched.scheduler import Scheduler
from llamax.engine.spec.speculative import (
    DecodeCost,
    DraftState,
    SharedAcceptance,
    new_draft_state,
    window,
)
from llamax.testing import FakeBackend, alphabet_model


@pytest.fixture(params=["unified", "streams"])
def kv_layout(request: pytest.FixtureRequest) -> str:
    """Every test here runs with both KV layouts."""
    return str(request.param)


def glitchy_model(history: Sequence[int]) -> int:
    """The alphabet, except that every 7th position says ``"!"``: drafts learned from the
    prompt are right most of the time and wrong at those positions."""
    if len(history) % 7 == 0:
        return ord("!") + 1
    return alphabet_model(history)


MakeSpec = Callable[..., tuple[llamax.Context, FakeBackend]]


@pytest.fixture
def make_spec(make_fake: MakeSpec) -> MakeSpec:
    """Manual fake contexts (conftest's ``make_fake``: leak-checked after the test) whose
    scheduler verifies every proposal: pricing measures time, which the fake has not."""

    def make(*, price: bool = False, **options: Any) -> tuple[llamax.Context, FakeBackend]:
        options.setdefault("n_ctx", 512)
        ctx, backend = make_fake(**options)
        ctx._engine.scheduler.drafts.priced = price
        return ctx, backend

    return make


def run(ctx: llamax.Context) -> None:
    """Step until idle, auditing the KV bookkeeping after every step."""
    while ctx.has_work():
        ctx.process()
        assert ctx.audit() == []


def complete(
    ctx: llamax.Context, prompts: Sequence[str], params: llamax.SamplingParams
) -> list[llamax.Completion]:
    handles = [ctx.add_request(p, params) for p in prompts]
    run(ctx)
    return [h.result(0) for h in handles]


def same_output(a: llamax.Completion, b: llamax.Completion) -> None:
    for x, y in zip(a.choices, b.choices, strict=True):
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        assert x.logprobs == y.logprobs


ALPHABET = "abcdefghijklmnopqrstuvwxyz" * 2
PROMPTS = [ALPHABET, "xyz" + ALPHABET, "hello " + ALPHABET, "m"]


@pytest.mark.parametrize("model", [alphabet_model, glitchy_model])
def test_greedy_output_is_unchanged_and_drafts_are_used(
    make_spec: MakeSpec, model: Callable[[Sequence[int]], int]
) -> None:
    params = llamax.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logprobs=2)
    plain_ctx, _ = make_spec(next_token=model)
    plain = complete(plain_ctx, PROMPTS, params)
    ctx, backend = make_spec(next_token=model)
    spec = complete(ctx, PROMPTS, llamax_replace(params, speculative=True))
    for a, b in zip(plain, spec, strict=True):
        same_output(a, b)
    drafted = sum(c.usage.drafted_tokens for c in spec)
    accepted = sum(c.usage.accepted_tokens for c in spec)
    stats = ctx.stats()
    assert (stats.num_drafted_tokens, stats.num_accepted_tokens) == (drafted, accepted)
    assert accepted > 0 and drafted > 0
    if model is glitchy_model:
        assert accepted < drafted  # some drafts were rejected and rolled back
    assert stats.num_steps < plain_ctx.stats().num_steps
    assert any(len(item.rows) > 1 for step in backend.decode_log for item in step)
    assert plain[0].usage.drafted_tokens == 0


def llamax_replace(params: llamax.SamplingParams, **changes: Any) -> llamax.SamplingParams:
    return dataclasses.replace(params, **changes)


def test_context_default_and_request_override(make_spec: MakeSpec) -> None:
    params = llamax.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ctx, _ = make_spec(speculative=PromptLookup(max_draft=4))
    on = complete(ctx, [ALPHABET], params)[0]
    off = complete(ctx, [ALPHABET], llamax_replace(params, speculative=False))[0]
    mine = complete(ctx, [ALPHABET], llamax_replace(params, speculative=PromptLookup(max_draft=2)))
    assert on.usage.drafted_tokens > 0 and off.usage.drafted_tokens == 0
    same_output(on, off)
    assert mine[0].usage.drafted_tokens > 0
    plain_ctx, backend = make_spec()
    assert complete(plain_ctx, [ALPHABET], params)[0].usage.drafted_tokens == 0
    assert all(len(item.rows) <= 1 for step in backend.decode_log for item in step)


def test_draft_length_is_capped_by_max_draft(make_spec: MakeSpec) -> None:
    ctx, backend = make_spec()
    params = llamax.SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, speculative=PromptLookup(max_draft=3)
    )
    complete(ctx, [ALPHABET], params)
    assert max(len(item.token_ids) for step in backend.decode_log[1:] for item in step) <= 4


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13, 27])
def test_max_tokens_is_exact(make_spec: MakeSpec, max_tokens: int) -> None:
    ctx, _ = make_spec()
    params = llamax.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, speculative=True
    )
    done = complete(ctx, [ALPHABET], params)[0]
    assert len(done.token_ids) == max_tokens and done.finish_reason == "length"


def test_stop_string_inside_an_accepted_draft(make_spec: MakeSpec) -> None:
    params = llamax.SamplingParams(max_tokens=80, temperature=0, stop=["pqr"], ignore_eos=True)
    plain_ctx, _ = make_spec()
    plain = complete(plain_ctx, ["abcdefghijklmnopqrstuvwxyz" * 2 + "abc"], params)[0]
    ctx, backend = make_spec()
    spec = complete(
        ctx, ["abcdefghijklmnopqrstuvwxyz" * 2 + "abc"], llamax_replace(params, speculative=True)
    )[0]
    same_output(plain, spec)
    assert spec.text == "defghijklmno" and spec.finish_reason == "stop"
    # the stop matched in the middle of a verified draft: the draft ran past it
    assert max(len(item.rows) for step in backend.decode_log for item in step) > 3


def test_stop_token_and_end_of_generation_inside_a_draft(make_spec: MakeSpec) -> None:
    stop_at = ord("k") + 1
    params = llamax.SamplingParams(
        max_tokens=80, temperature=0, stop_token_ids=[stop_at], speculative=True
    )
    ctx, _ = make_spec()
    done = complete(ctx, [ALPHABET + "abc"], params)[0]
    assert done.text == "defghij" and done.finish_reason == "stop"

    def ends_after_j(history: Sequence[int]) -> int:  # end of generation after "j"
        return 0 if history[-1] == ord("j") + 1 else alphabet_model(history)

    ctx2, _ = make_spec(next_token=ends_after_j)
    done = complete(ctx2, [ALPHABET + "abc"], llamax_replace(params, stop_token_ids=()))[0]
    assert done.text == "defghij" and done.finish_reason == "stop"


def test_logits_processors_see_exactly_the_plain_calls(make_spec: MakeSpec) -> None:
    def recorder(calls: list[tuple[int, ...]]) -> llamax.LogitsProcessor:
        def fn(ids: npt.NDArray[np.int32], logits: npt.NDArray[np.float32]) -> None:
            calls.append(tuple(int(t) for t in ids))
            if len(ids) % 11 == 0:  # steer now and then: drafts must follow the steering
                logits[ord("z") + 1] = 100.0

        return fn

    seen: dict[bool, list[tuple[int, ...]]] = {False: [], True: []}
    out = {}
    for spec in (False, True):
        ctx, _ = make_spec()
        params = llamax.SamplingParams(
            max_tokens=40,
            temperature=0,
            ignore_eos=True,
            logits_processors=[recorder(seen[spec])],
            speculative=spec,
        )
        out[spec] = complete(ctx, [ALPHABET], params)[0]
    same_output(out[False], out[True])
    assert seen[True] == seen[False]
    assert out[True].usage.accepted_tokens > 0


@pytest.mark.parametrize("seed", [1, 7, 123])
def test_seeded_sampling_is_reproduced_exactly(make_spec: MakeSpec, seed: int) -> None:
    params = llamax.SamplingParams(max_tokens=50, temperature=0.4, seed=seed, ignore_eos=True)
    plain_ctx, _ = make_spec()
    plain = complete(plain_ctx, [ALPHABET], params)[0]
    ctx, _ = make_spec()
    spec = complete(ctx, [ALPHABET], llamax_replace(params, speculative=True))[0]
    again = complete(ctx, [ALPHABET], llamax_replace(params, speculative=True))[0]
    same_output(plain, spec)
    same_output(spec, again)
    assert spec.usage.drafted_tokens > 0


def test_sampled_acceptance_follows_the_distribution(make_spec: MakeSpec) -> None:
    """Rejection sampling with a one-hot draft is "sample, compare": the first generated
    token of many seeds has the same distribution with and without drafts (here: equal)."""
    prompt = ALPHABET + "abc"
    params = llamax.SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    firsts: dict[bool, list[tuple[int, ...]]] = {False: [], True: []}
    for spec in (False, True):
        ctx, _ = make_spec()
        handles = [
            ctx.add_request(prompt, llamax_replace(params, seed=s, speculative=spec))
            for s in range(40)
        ]
        run(ctx)
        firsts[spec] = [h.result(0).token_ids for h in handles]
    assert firsts[True] == firsts[False]
    assert len(set(firsts[True])) > 1  # really sampled


def test_n_choices_each_draft(make_spec: MakeSpec) -> None:
    params = llamax.SamplingParams(max_tokens=30, temperature=0.5, seed=3, n=3, ignore_eos=True)
    plain_ctx, _ = make_spec()
    plain = complete(plain_ctx, [ALPHABET], params)[0]
    ctx, _ = make_spec()
    spec = complete(ctx, [ALPHABET], llamax_replace(params, speculative=True))[0]
    same_output(plain, spec)
    assert spec.usage.drafted_tokens > 0


def test_cancel_between_verifications_frees_every_cell(make_spec: MakeSpec) -> None:
    ctx, backend = make_spec()
    params = llamax.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, speculative=True)
    handle = ctx.add_request(ALPHABET, params)
    for _ in range(4):
        ctx.process()
        assert ctx.audit() == []
    assert ctx.stats().num_drafted_tokens > 0
    handle.cancel()
    ctx.process()
    assert backend.num_cells_used == 0
    done = handle.result(0)
    assert done.finish_reason == "cancelled" and done.usage.drafted_tokens > 0


def test_no_slot_drops_drafts_first(make_spec: MakeSpec) -> None:
    ctx, backend = make_spec()
    params = llamax.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, speculative=True)
    handle = ctx.add_request(ALPHABET, params)
    ctx.process()  # prefill
    ctx.process()  # first draft
    backend.forced_statuses.append(DecodeStatus.NO_SLOT)
    ctx.process()  # NO_SLOT on a drafted plan: retried without drafts
    last = backend.decode_log[-1]
    assert [len(item.token_ids) for item in last] == [1]
    run(ctx)
    plain_ctx, _ = make_spec()
    same_output(handle.result(0), complete(plain_ctx, [ALPHABET], params)[0])


def test_preempted_sequence_keeps_its_output_and_drafts_again(make_spec: MakeSpec) -> None:
    """A unified cache too small for everybody preempts; drafts never outgrow the cache."""
    options = {"n_ctx": 160, "n_batch": 64}
    params = llamax.SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    prompts = [ALPHABET, "b" + ALPHABET, "c" + ALPHABET]
    plain_ctx, _ = make_spec(**options)
    plain = complete(plain_ctx, prompts, params)
    ctx, _ = make_spec(**options)
    spec = complete(ctx, prompts, llamax_replace(params, speculative=True))
    for a, b in zip(plain, spec, strict=True):
        same_output(a, b)


def test_session_slot_holds_only_accepted_tokens(make_spec: MakeSpec) -> None:
    ctx, _ = make_spec(next_token=glitchy_model)
    params = llamax.SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, speculative=True)
    with ctx.session() as session:
        handle = session.add_request(ALPHABET, params)
        run(ctx)
        done = handle.result(0)
        assert done.usage.accepted_tokens < done.usage.drafted_tokens
        assert ctx.audit() == []
        handle = session.add_request(ALPHABET + "".join(done.text) + "abc", params)
        run(ctx)
        handle.result(0)
        assert ctx.audit() == []


def test_stop_inside_a_draft_retains_a_consistent_prefix(make_spec: MakeSpec) -> None:
    """A request that stops inside its draft leaves a retained slot that a later request
    reuses: the cache's cells and the retained tokens agree (audited each step)."""
    ctx, _ = make_spec()
    params = llamax.SamplingParams(max_tokens=80, temperature=0, stop=["ghi"], speculative=True)
    first = complete(ctx, [ALPHABET + "abc"], params)[0]
    assert first.text == "def"
    second = complete(ctx, [ALPHABET + "abcdef"], llamax_replace(params, stop=["xyz"]))[0]
    assert second.usage.cached_tokens > 0
    assert second.text == "ghijklmnopqrstuvw"


def test_batch_logits_processor_turns_drafting_off() -> None:
    def hook(rows: Sequence[llamax.LogitsRow], logits: npt.NDArray[np.float32]) -> None:
        assert logits.shape[0] == len(rows)

    backend = FakeBackend(n_ctx=512)
    with llamax.Context(
        backend=backend, autostart=False, batch_logits_processor=hook, speculative=PromptLookup()
    ) as ctx:
        ctx._engine.scheduler.drafts.priced = False
        params = llamax.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        handle = ctx.add_request(ALPHABET, params)
        run(ctx)
        assert handle.result(0).usage.drafted_tokens == 0


def test_recurrent_memory_never_drafts(make_spec: MakeSpec) -> None:
    ctx, _ = make_spec(can_share_prefix=False)
    params = llamax.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, speculative=True)
    assert complete(ctx, [ALPHABET], params)[0].usage.drafted_tokens == 0


def test_bad_speculative_values_are_refused() -> None:
    with pytest.raises(llamax.InvalidParameterError, match="speculative"):
        llamax.SamplingParams(speculative="yes")  # type: ignore[arg-type]
    with pytest.raises(llamax.InvalidParameterError, match="max_draft"):
        PromptLookup(max_draft=0)
    with pytest.raises(llamax.InvalidParameterError, match="ngram_min"):
        PromptLookup(ngram_min=3, ngram_max=2)
    with pytest.raises(llamax.InvalidParameterError, match="speculative"):
        llamax.Context(backend=FakeBackend(), autostart=False, speculative=True)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- drafter and pricing
def test_prompt_lookup_proposes_the_most_recent_longest_match() -> None:
    drafter = PromptLookupDrafter(PromptLookup(max_draft=4, ngram_max=3, ngram_min=1))
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2]
    assert drafter.propose(tokens, 10) == (3, 4, 5, 6)  # (1, 2) last ended at 7
    tokens += [3]
    assert drafter.propose(tokens, 2) == (4, 5)  # (1, 2, 3), incrementally indexed
    assert drafter.propose([7, 8], 5) == ()  # no match (and the index starts over)
    assert drafter.propose([5, 5, 5], 3) == (5,)


def test_draft_state_learns_from_unverified_proposals() -> None:
    state = new_draft_state(PromptLookup())
    prior = state.acceptance
    for _ in range(10):
        state.skipped(5, (7,))
        state.propose([0, 0, 0, 0, 0, 8], 4)  # the proposal was wrong
    assert state.acceptance < prior / 2
    for _ in range(20):
        state.record(4, 4)
    assert state.acceptance > 0.9
    assert state.expected_gain(2) == pytest.approx(state.acceptance**2)


def test_a_new_sequence_starts_from_the_contexts_record() -> None:
    shared = SharedAcceptance()
    fresh = new_draft_state(PromptLookup(), shared).acceptance
    for _ in range(30):  # earlier sequences' drafts kept failing
        state = new_draft_state(PromptLookup(), shared)
        state.record(4, 0)
    assert new_draft_state(PromptLookup(), shared).acceptance < fresh / 2
    copying = SharedAcceptance()
    for _ in range(30):
        state = new_draft_state(PromptLookup(), copying)
        state.record(4, 4)
        state.record(4, 4)
    newcomer = new_draft_state(PromptLookup(), copying)
    newcomer.record(2, 2)  # now "copying": the context says that goes on
    assert newcomer.acceptance > 0.9


class _FixedCost:
    """A decode-cost stand-in: ``base + per_token * tokens`` seconds."""

    def __init__(self, base: float, per_token: float) -> None:
        self.base, self.per_token = base, per_token

    def line(self, up_to: int, rows: int | None = None) -> tuple[float, float]:
        return self.base, self.per_token


def _price(num_decoding: int, acceptance_hits: int) -> dict[int, int]:
    """Plan drafts for ``num_decoding`` sequences whose drafts were right ``hits`` of 20."""
    backend = FakeBackend(n_ctx=4096, n_seq_max=64, n_batch=512)
    scheduler = Scheduler(backend, EngineConfig(speculative=PromptLookup(max_draft=8)))
    scheduler.drafts.planner.decode_cost = _FixedCost(0.004, 0.004)  # type: ignore[assignment]
    slots = []
    proposals: list[tuple[Any, DraftState, tuple[int, ...]]] = []
    for i in range(num_decoding):
        state = new_draft_state(PromptLookup())
        for _ in range(20):
            state.record(1, 1) if _ < acceptance_hits else state.record(1, 0)
        seq = _StubSeq(i)
        slots.append((seq, 1))
        proposals.append((seq, state, tuple(range(8))))
    keep = scheduler.drafts.planner.price([n for _, n in slots], proposals, room=512)
    return {seq.i: n for seq, n in keep.items()}  # type: ignore[attr-defined]


class _StubSeq:
    def __init__(self, i: int) -> None:
        self.i = i
        self.num_computed = 100


def test_pricing_drafts_long_when_alone_and_sure() -> None:
    assert _price(1, 20) == {0: 8}


def test_pricing_skips_unlikely_drafts() -> None:
    assert _price(1, 4) == {}


def test_pricing_yields_under_a_full_batch() -> None:
    assert _price(64, 19) == {}
    few = _price(2, 20)
    assert few and all(n >= 4 for n in few.values())


def test_pricing_gives_no_drafts_next_to_a_prompt_chunk() -> None:
    backend = FakeBackend(n_ctx=4096, n_seq_max=4, n_batch=512)
    scheduler = Scheduler(backend, EngineConfig(speculative=PromptLookup(max_draft=8)))
    state = new_draft_state(PromptLookup())
    for _ in range(20):
        state.record(4, 4)
    decoding, prefilling = _StubSeq(0), _StubSeq(1)
    slots = [(decoding, 1), (prefilling, 64)]
    keep = scheduler.drafts.planner.price(
        [n for _, n in slots], [(decoding, state, (1, 2, 3))], room=100
    )
    assert keep == {}


def test_decode_cost_learns_base_and_per_token_cost() -> None:
    cost = DecodeCost()
    assert cost.line(10) == DecodeCost.PRIOR
    for _ in range(5):
        cost.observe(1, 0.028)  # one count seen: the prior's shape, scaled
    base, per_token = cost.line(10)
    assert base + per_token == pytest.approx(0.028)
    assert base / per_token == pytest.approx(DecodeCost.PRIOR[0] / DecodeCost.PRIOR[1])
    for _ in range(200):
        for n in (1, 3, 9):
            cost.observe(n, 0.006 + 0.002 * n)
    base, per_token = cost.line(10)
    assert base == pytest.approx(0.006, rel=0.05)
    assert per_token == pytest.approx(0.002, rel=0.05)


def test_decode_cost_does_not_wind_up_on_equal_steps() -> None:
    """Thousands of 4-token steps (4 streams), then 1-token steps: the line stays sane."""
    cost = DecodeCost()
    for n in (1, 5, 9):
        cost.observe(n, 0.01 + 0.01 * n)
    for _ in range(5000):
        cost.observe(4, 0.05)
    for _ in range(50):
        cost.observe(1, 0.02)
    base, per_token = cost.line(20)
    assert 0.002 < base < 0.02
    assert 0.005 < per_token < 0.02


def test_big_steps_do_not_price_one_sequence_drafts_out() -> None:
    """Regression: after 64-stream steps (super-linear: unified attention over thousands of
    cells), a line through every size had no base cost, so a lone sequence never drafted
    again. The line is fitted locally, to the sizes being priced."""
    cost = DecodeCost()
    for _ in range(20):
        for n in (1, 2, 5, 9):
            cost.observe(n, 0.013 + 0.017 * n)
        cost.observe(16, 0.1)
        cost.observe(64, 0.52)
    base, per_token = cost.line(window(1))
    assert base == pytest.approx(0.013, rel=0.1) and per_token == pytest.approx(0.017, rel=0.1)


def test_a_lone_sequence_is_priced_by_lone_steps_not_by_batches_of_as_many_tokens() -> None:
    """Issue 59: on a context that ran 4-sequence batches, a 4-token step (4 rows over 4
    sequences' cells, 40 ms) was averaged with a lone sequence's 1 row + 3 drafts (17 ms),
    and the pooled line priced a lone draft token as a whole step: a quote request copying
    at 95% drafted 65 tokens of 210 where a fresh context drafted 150-192. The line for a
    step of one row is fitted to steps of one row."""
    cost = DecodeCost()
    for _ in range(200):  # batches of 4 rows, some with drafts: dear per token
        for n in (4, 6, 9):
            cost.observe(n, 0.004 + 0.009 * n, rows=4)
    for _ in range(20):  # a lone sequence: 10 ms a step, 2.5 ms a draft token
        for n in (1, 2, 4):
            cost.observe(n, 0.0075 + 0.0025 * n, rows=1)
    base, per_token = cost.line(window(1), rows=1)
    assert base == pytest.approx(0.0075, rel=0.05) and per_token == pytest.approx(0.0025, rel=0.05)
    base4, per_token4 = cost.line(window(4), rows=4)
    assert base4 == pytest.approx(0.004, rel=0.05) and per_token4 == pytest.approx(0.009, rel=0.05)
    assert cost.plain(1) == pytest.approx(0.01) and cost.plain(4) == pytest.approx(0.04)
    # rows never seen alone: the pooled line; one plain count seen: the prior's shape
    assert cost.line(window(2), rows=2) == cost.line(window(2))
    cost.observe(8, 0.08, rows=8)
    base8, per_token8 = cost.line(window(8), rows=8)
    assert base8 + 8 * per_token8 == pytest.approx(0.08)
    assert base8 / per_token8 == pytest.approx(DecodeCost.PRIOR[0] / DecodeCost.PRIOR[1])


def test_decode_rows_are_checked_by_the_fake() -> None:
    """The fake refuses rows outside their item: a drafted item's rows are its own."""
    backend = FakeBackend()
    assert backend.decode([BatchItem(0, [1, 2, 3], 0, (0, 1, 2))]) == DecodeStatus.OK
    with pytest.raises(AssertionError):
        backend.decode([BatchItem(1, [1, 2], 0, (0, 2))])
