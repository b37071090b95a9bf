"""Time-budgeted steps: the online cost model and the chunks the scheduler takes from it."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

import llamax
from llamax.step_budget import MIN_CHUNK, StepCostModel, StepFeatures, chunk_features
from llamax.testing import FakeBackend

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]


def true_cost(f: StepFeatures) -> float:
    return 0.006 + 0.002 * f.num_tokens + 4e-8 * f.attention


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
    model = StepCostModel()
    rng = random.Random(1)
    for _ in range(200):
        f = StepFeatures(rng.randint(1, 512), rng.randint(0, 3_000_000))
        model.observe(f, true_cost(f))
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
