"""Time-budgeted steps: the online cost model and the chunks the scheduler takes from it."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

import llamax
from llamax.step_budget import (
    FAIR_SLOWDOWN,
    MIN_CHUNK,
    StepCostModel,
    StepFeatures,
    chunk_features,
)
from llamax.testing import FakeBackend

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]


def true_cost(f: StepFeatures) -> float:
    return 0.006 + 0.002 * f.num_tokens + 4e-8 * f.attention


def fitted(seed: int) -> StepCostModel:
    """A model that observed 200 random steps priced exactly by ``true_cost``."""
    model = StepCostModel()
    rng = random.Random(seed)
    for _ in range(200):
        f = StepFeatures(rng.randint(1, 512), rng.randint(0, 3_000_000))
        model.observe(f, true_cost(f))
    return model


def test_the_model_learns_a_linear_cost_from_noisy_steps() -> None:
    model = StepCostModel()
    rng = random.Random(0)
    for _ in range(300):
        f = StepFeatures(rng.randint(1, 512), rng.randint(0, 3_000_000))
        model.observe(f, true_cost(f) * rng.uniform(0.95, 1.05))
    assert model.is_ready
    # ±5% noise and a window of ~20 steps: steps the size of a time budget (0.4-1.1 s here)
    # are predicted within 10%; a 15 ms decode step, which never decides a chunk, within 25%
    for f in (StepFeatures(200, 600_000), StepFeatures(512, 2_500_000)):
        assert model.predict(f) == pytest.approx(true_cost(f), rel=0.1)
    assert model.predict(StepFeatures(4, 20_000)) == pytest.approx(0.0148, rel=0.25)


def test_it_follows_a_machine_that_slows_down() -> None:
    model = StepCostModel()
    f = StepFeatures(64, 100_000)
    for _ in range(50):
        model.observe(f, 0.1)
    for _ in range(100):
        model.observe(f, 0.3)  # a neighbour took a core
    assert model.predict(f) == pytest.approx(0.3, rel=0.1)


@pytest.mark.parametrize("unified", [True, False])
def test_largest_chunk_fits_the_budget_and_never_starves(unified: bool) -> None:
    model = fitted(seed=1)
    decode = StepFeatures(4, 4 * 3000)
    for attend, budget in ((100, 0.25), (3000, 0.25), (3000, 0.1)):
        k = model.largest_chunk(decode, attend, 512, budget, unified=unified)
        step = decode + chunk_features(k, attend, decode, unified=unified)
        assert MIN_CHUNK <= k < 512 and true_cost(step) <= budget * 1.05
        bigger = decode + chunk_features(k + 8, attend, decode, unified=unified)
        assert true_cost(bigger) > budget * 0.95  # the chunk is about as large as fits
    assert model.largest_chunk(decode, 3000, 512, 0.001, unified=unified) == MIN_CHUNK
    assert model.largest_chunk(decode, 3000, 10, 0.001, unified=unified) == 10


def test_the_scheduler_chunks_long_prompts_by_time_while_others_decode(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx, backend = make_fake(n_ctx=4096, n_batch=512)
    model = ctx._engine.scheduler.step_cost
    for _ in range(20):  # a slow machine: 5 ms a token
        model.observe(StepFeatures(1, 10), 0.005)
        model.observe(StepFeatures(100, 10_000), 0.5)
    monkeypatch.setattr(model, "observe", lambda *_: None)  # the fake itself is fast
    streams = [ctx.add_request("ab", llamax.SamplingParams(max_tokens=50)) for _ in range(2)]
    ctx.process()
    ctx.process()
    long = ctx.add_request("x" * 1500, llamax.SamplingParams(max_tokens=1))
    ctx.process()
    chunk = max(len(item.token_ids) for item in backend.decode_log[-1])
    assert 40 <= chunk <= 52  # 250 ms at 5 ms a token, not n_batch = 512
    assert long.result().finish_reason == "length"
    for handle in streams:
        handle.cancel()
    while ctx.has_work():
        ctx.process()


def test_many_alike_decode_steps_do_not_wind_the_fit_up() -> None:
    """With forgetting, a long run of alike decode steps excites one direction only; the
    covariance stays bounded, so the next prefill steps do not throw the fit off."""
    model = StepCostModel()
    rng = random.Random(2)
    for _ in range(200):
        f = StepFeatures(rng.randint(1, 512), rng.randint(0, 3_000_000))
        model.observe(f, true_cost(f))
    decode = StepFeatures(4, 4 * 300)
    for _ in range(1000):
        model.observe(decode, true_cost(decode) * rng.uniform(0.9, 1.1))
    prefill = StepFeatures(100, 100 * 3000)
    model.observe(prefill, true_cost(prefill) * 1.3)  # a neighbour took a core for a moment
    for f in (prefill, StepFeatures(300, 300 * 3000), StepFeatures(30, 30 * 3000), decode):
        assert model.predict(f) == pytest.approx(true_cost(f), rel=0.4)  # unbounded: 26x off


@pytest.mark.parametrize("unified", [True, False])
def test_the_fair_chunk_keeps_a_long_prompt_near_its_lone_speed(unified: bool) -> None:
    model = fitted(seed=3)
    decode = StepFeatures(16, 16 * 3000)
    empty = StepFeatures()
    for attend in (100, 3000):
        k = model.fair_chunk(decode, attend, 512, 512, unified=unified)
        lone_per_token = true_cost(chunk_features(512, attend, empty, unified=unified)) / 512
        step = true_cost(decode + chunk_features(k, attend, decode, unified=unified))
        assert step <= FAIR_SLOWDOWN * lone_per_token * k * 1.05
        smaller = true_cost(decode + chunk_features(k - 8, attend, decode, unified=unified))
        assert smaller > FAIR_SLOWDOWN * lone_per_token * (k - 8) * 0.95  # the fewest that do
    assert model.fair_chunk(decode, 3000, 10, 512, unified=unified) == 10  # none is fair enough
    assert model.fair_chunk(decode, 3000, 0, 512, unified=unified) == 0


def test_slow_decode_rows_stretch_the_first_chunk_up_to_twice_the_budget(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 ms of decode rows next to 5 ms a prompt token: a 250 ms chunk would make the long
    prompt ~1.4x slower than alone, so it gets the fair chunk instead (about 75 tokens);
    with decode rows costing 400 ms that would exceed 2 x max_step_ms, so the cap holds."""
    ctx, backend = make_fake(n_ctx=4096, n_batch=512)
    scheduler = ctx._engine.scheduler
    model = scheduler.step_cost

    def cost(f: StepFeatures, overhead: float) -> float:
        return overhead + 0.005 * f.num_tokens

    for overhead, expect_min, expect_max in ((0.1, 60, 90), (0.4, 95, 105)):
        model.__init__()  # type: ignore[misc]
        ctx.clear_cache()  # no prefix hits from the previous round
        for n in (1, 2, 50, 100, 300, 512) * 10:
            f = StepFeatures(n, n * 10)
            model.observe(f, cost(f, overhead))
        monkeypatch.setattr(model, "observe", lambda *_: None)  # the fake itself is fast
        streams = [ctx.add_request("ab", llamax.SamplingParams(max_tokens=60)) for _ in range(2)]
        ctx.process()
        ctx.process()
        long = ctx.add_request("x" * 1500, llamax.SamplingParams(max_tokens=1))
        ctx.process()
        chunk = max(len(item.token_ids) for item in backend.decode_log[-1])
        budget_chunk = 250 // 5 - 2  # what max_step_ms alone would give
        assert budget_chunk < chunk and expect_min <= chunk <= expect_max
        assert long.result().finish_reason == "length"
        for handle in streams:
            handle.cancel()
        while ctx.has_work():
            ctx.process()
        monkeypatch.undo()


def test_the_first_steps_are_budgeted_from_the_prior(make_fake: MakeFake) -> None:
    """No step measured yet: the prior (3 ms a token) already chunks a long prompt."""
    ctx, backend = make_fake(n_ctx=4096, n_batch=512)
    model = ctx._engine.scheduler.step_cost
    assert model.num_observations == 0
    stream = ctx.add_request("ab", llamax.SamplingParams(max_tokens=50))
    long = ctx.add_request("x" * 1500, llamax.SamplingParams(max_tokens=1))
    ctx.process()  # both prompts: nobody decodes yet, so the whole n_batch
    ctx.process()
    chunks = [len(item.token_ids) for item in backend.decode_log[-1]]
    assert max(chunks) < 512 and 1 in chunks
    assert long.result().finish_reason == "length"
    stream.cancel()
    while ctx.has_work():
        ctx.process()


def test_a_burst_of_short_prompts_is_admitted_within_twice_the_budget(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 ms of decode rows, 5 ms a prompt token: each 12-token prompt is only fair as a
    whole, so prompts join a step until 2 x max_step_ms beyond its decode rows is used
    (~100 tokens), not just max_step_ms (~50)."""
    ctx, backend = make_fake(n_ctx=4096, n_batch=512, n_seq_max=32)
    model = ctx._engine.scheduler.step_cost
    for n in (1, 2, 50, 100, 300, 512) * 10:
        model.observe(StepFeatures(n, n * 10), 0.1 + 0.005 * n)
    monkeypatch.setattr(model, "observe", lambda *_: None)
    streams = [ctx.add_request("ab", llamax.SamplingParams(max_tokens=60)) for _ in range(2)]
    ctx.process()
    ctx.process()
    burst = [
        ctx.add_request(f"prompt {i:02d} abc", llamax.SamplingParams(max_tokens=1))
        for i in range(20)
    ]
    ctx.process()
    prompt_tokens = sum(
        len(item.token_ids) for item in backend.decode_log[-1] if len(item.token_ids) > 1
    )
    assert 75 <= prompt_tokens <= 105
    for handle in burst:
        assert handle.result().finish_reason == "length"
    for handle in streams:
        handle.cancel()
    while ctx.has_work():
        ctx.process()
