"""Time-budgeted steps: the online cost model and the chunks the scheduler takes from it."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import numpy as np
import pytest

import llamax
from llamax.engine.timing.chunk_budget import ChunkBudget
from llamax.engine.timing.step_budget import (
    FAIR_SLOWDOWN,
    MAX_STRETCH,
    MIN_CHUNK,
    OVERRUN,
    TILE_ROWS,
    StepCostModel,
    StepFeatures,
    micro_batch,
    step_with_chunk,
    tile_waste_table,
)
from llamax.testing import FakeBackend

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]


def true_cost(f: StepFeatures) -> float:
    return 0.006 + 0.002 * f.num_tokens + 4e-8 * f.attention


def random_step(rng: random.Random) -> StepFeatures:
    return micro_batch(rng.randint(1, 512), rng.randint(0, 3_000_000))


def fitted(seed: int, cost: Callable[[StepFeatures], float] = true_cost) -> StepCostModel:
    """A model that observed 200 random steps priced exactly by ``cost``."""
    model = StepCostModel()
    rng = random.Random(seed)
    for _ in range(200):
        f = random_step(rng)
        model.observe(f, cost(f))
    return model


def first_chunk_beside_two_streams(
    ctx: llamax.Context, backend: FakeBackend, prompt: int, stream_tokens: int
) -> int:
    """Two streams decode, then a ``prompt``-token prompt arrives: the size of its first
    chunk. The prompt is run to its end and the streams cancelled, so the engine is idle."""
    params = llamax.SamplingParams(max_tokens=stream_tokens)
    streams = [ctx.add_request("ab", params) for _ in range(2)]
    ctx.process()
    ctx.process()
    long = ctx.add_request("x" * prompt, llamax.SamplingParams(max_tokens=1))
    ctx.process()
    chunk = max(len(item.token_ids) for item in backend.decode_log[-1])
    assert long.result().finish_reason == "length"
    for handle in streams:
        handle.cancel()
    while ctx.has_work():
        ctx.process()
    return chunk


def test_the_model_learns_a_linear_cost_from_noisy_steps() -> None:
    model = StepCostModel()
    rng = random.Random(0)
    for _ in range(300):
        f = random_step(rng)
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


class NumpyFit:
    """The fit as it was written in numpy (one eigendecomposition a step once the
    covariance's trace passed the bound): the reference the Python-float fit must match."""

    def __init__(self, coefficients: tuple[float, float, float, float]) -> None:
        self.scale = np.array([1.0, 1e-2, 1e-5, 1e-5])
        self.theta = np.array(coefficients) / self.scale  # as StepCostModel.start_from
        self.p = np.eye(4) * 0.25
        self.spread = 0.1
        self.n = 4

    def observe(self, f: StepFeatures, seconds: float) -> None:
        weight = 1.0 / max(seconds, 1e-4)
        x = f.vector() * weight
        error = seconds * weight - x @ self.theta
        if self.n >= 4:
            bound = max(0.05, 3.0 * self.spread)
            error = min(error, bound)
            self.spread += 0.05 * (min(abs(error), bound) - self.spread)
        px = self.p @ x
        gain = px / (0.95 + x @ px)
        self.theta = self.theta + gain * error
        self.p = (self.p - np.outer(gain, px)) / 0.95
        if float(np.trace(self.p)) > 1.0:
            values, vectors = np.linalg.eigh(self.p)
            self.p = (vectors * np.minimum(values, 1.0)) @ vectors.T
        self.n += 1

    def predict(self, f: StepFeatures) -> float:
        return float(f.vector() @ np.maximum(self.theta, 0.0))


def test_the_python_fit_matches_the_numpy_one_where_the_bound_does_not_bind() -> None:
    """From a calibrated start, varied steps keep every direction excited, so no
    eigenvalue reaches the bound and the two fits are the same arithmetic: the same
    predictions, to rounding. (The reference rebuilds its covariance from an
    eigendecomposition at every step once its trace passes 1, which moves the last digits,
    and the outlier clipping lets such differences grow: 1e-12 apart after 150 steps,
    1e-9 after 250, 1e-6 after 360.)"""
    calibration = (0.005, 0.002, 4e-8, 1e-7)
    model, reference = StepCostModel(), NumpyFit(calibration)
    model.start_from(calibration)
    rng = random.Random(7)
    for _ in range(150):
        f = random_step(rng)
        seconds = true_cost(f) * rng.uniform(0.8, 1.3)
        model.observe(f, seconds)
        reference.observe(f, seconds)
        assert model.largest_variance < 1.0
        for probe in (f, StepFeatures(4, 1200), StepFeatures(300, 900_000, 50_000)):
            assert model.predict(probe) == pytest.approx(reference.predict(probe), rel=1e-9)


def test_the_covariance_stays_within_the_bound_at_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through long runs of alike decode steps (which excite one direction and let the
    others grow by the forgetting factor each step), the covariance's largest eigenvalue
    never passes the prior's, and it is decomposed at most once in five such steps."""
    calls = []
    eigh = np.linalg.eigh
    monkeypatch.setattr(np.linalg, "eigh", lambda a: calls.append(1) or eigh(a))
    model = StepCostModel()
    rng = random.Random(3)
    decode = StepFeatures(1, 300, 300)
    for round_ in range(6):
        for _ in range(50):
            f = random_step(rng)
            model.observe(f, true_cost(f))
            assert model.largest_variance <= 1.0 + 1e-12
        calls.clear()
        for _ in range(500):
            model.observe(decode, true_cost(decode) * rng.uniform(0.9, 1.1))
            assert model.largest_variance <= 1.0 + 1e-12
        assert len(calls) <= 500 // 5 + 1, round_
    calibrated = StepCostModel()
    calibrated.start_from((0.005, 0.002, 4e-8, 1e-7))
    for _ in range(300):
        calibrated.observe(decode, true_cost(decode))
        assert calibrated.largest_variance <= 1.0 + 1e-12


@pytest.mark.parametrize("unified", [True, False])
def test_largest_chunk_fits_the_budget_and_never_starves(unified: bool) -> None:
    model = fitted(seed=1)
    decode = StepFeatures(4, 4 * 3000)
    for attend, budget in ((100, 0.25), (3000, 0.25), (3000, 0.1)):
        k = model.largest_chunk(decode, attend, 512, budget, unified=unified)
        step = step_with_chunk(decode, k, attend, unified=unified)
        assert MIN_CHUNK <= k < 512 and true_cost(step) <= budget * 1.05
        bigger = step_with_chunk(decode, k + 8, attend, unified=unified)
        assert true_cost(bigger) > budget * 0.95  # the chunk is about as large as fits
    assert model.largest_chunk(decode, 3000, 512, 0.001, unified=unified) == MIN_CHUNK
    assert model.largest_chunk(decode, 3000, 10, 0.001, unified=unified) == 10


def test_the_scheduler_chunks_long_prompts_by_time_while_others_decode(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx, backend = make_fake(n_ctx=4096, n_batch=512)
    model = ctx._engine.scheduler.step_cost
    for n, cells in itertools.product((1, 2, 50, 100, 300, 512) * 4, (10, 1000, 3000)):
        model.observe(micro_batch(n, n * cells), 0.005 * n)  # a slow machine: 5 ms a token
    monkeypatch.setattr(model, "observe", lambda *_: None)  # the fake itself is fast
    chunk = first_chunk_beside_two_streams(ctx, backend, 1500, stream_tokens=50)
    assert 40 <= chunk <= 52  # 250 ms at 5 ms a token, not n_batch = 512


def test_many_alike_decode_steps_do_not_wind_the_fit_up() -> None:
    """With forgetting, a long run of alike decode steps excites one direction only; the
    covariance stays bounded, so the next prefill steps do not throw the fit off."""
    model = StepCostModel()
    rng = random.Random(2)
    for _ in range(200):
        f = random_step(rng)
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
        lone_per_token = true_cost(step_with_chunk(empty, 512, attend, unified=unified)) / 512
        step = true_cost(step_with_chunk(decode, k, attend, unified=unified))
        assert step <= FAIR_SLOWDOWN * lone_per_token * k * 1.05
        smaller = true_cost(step_with_chunk(decode, k - 8, attend, unified=unified))
        assert smaller > FAIR_SLOWDOWN * lone_per_token * (k - 8) * 0.95  # the fewest that do
    assert model.fair_chunk(decode, 3000, 10, 512, unified=unified) == 10  # none is fair enough
    assert model.fair_chunk(decode, 3000, 0, 512, unified=unified) == 0


def test_slow_decode_rows_stretch_the_first_chunk_up_to_twice_the_budget(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """110 ms of decode rows next to 5 ms a prompt token: a 250 ms chunk (48 tokens) would
    make the long prompt ~1.4x slower than alone (the fair chunk is about 88 tokens), so it
    gets the most that keeps the step within 2 x max_step_ms with room for a faster chunk's
    1.1x overrun (68 tokens: 0.455 s). With decode rows costing 410 ms the step may take
    twice those, over 1.1 (67 tokens: 0.745 s), though the fair chunk (over 300 tokens)
    would take longer still: the cap holds."""
    ctx, backend = make_fake(n_ctx=4096, n_batch=512)
    scheduler = ctx._engine.scheduler
    model = scheduler.step_cost

    def cost(f: StepFeatures, overhead: float) -> float:
        return overhead + 0.005 * f.num_tokens

    for overhead, expect_min, expect_max in ((0.1, 66, 70), (0.4, 65, 69)):
        model.__init__()  # type: ignore[misc]
        ctx.clear_cache()  # no prefix hits from the previous round
        for n, cells in itertools.product((1, 2, 50, 100, 300, 512) * 4, (10, 1000, 3000)):
            f = micro_batch(n, n * cells)  # attention costs nothing here
            model.observe(f, cost(f, overhead))
        monkeypatch.setattr(model, "observe", lambda *_: None)  # the fake itself is fast
        chunk = first_chunk_beside_two_streams(ctx, backend, 1500, stream_tokens=60)
        budget_chunk = 250 // 5 - 2  # what max_step_ms alone would give
        assert budget_chunk < chunk and expect_min <= chunk <= expect_max
        monkeypatch.undo()


def test_a_row_that_only_finishes_a_prompt_leaves_the_step_unbudgeted(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A memory cut at checkpoints computes a prompt's last token alone, a step after the
    rest: that row streams nothing yet, so it does not hold the other prompts to the budget
    (a 4-conversation agent run on a hybrid model went 1.12x slower for it, issue 59); once
    it streams, it does."""
    ctx, backend = make_fake(n_ctx=4096, n_batch=512, recurrent=True)
    model = ctx._engine.scheduler.step_cost
    for n, cells in itertools.product((1, 2, 50, 100, 300, 512) * 4, (10, 1000, 3000)):
        model.observe(micro_batch(n, n * cells), 0.005 * n)  # a slow machine: 5 ms a token
    monkeypatch.setattr(model, "observe", lambda *_: None)  # the fake itself is fast
    short = ctx.add_request("y" * 100, llamax.SamplingParams(max_tokens=4))
    long = ctx.add_request("x" * 1500, llamax.SamplingParams(max_tokens=1))
    steps = []
    for _ in range(3):
        ctx.process()
        steps.append(sorted(len(item.token_ids) for item in backend.decode_log[-1]))
    assert steps[0][0] == 99  # the short prompt up to its last token, which goes alone:
    assert steps[1][0] == 1 and steps[1][1] >= 256  # beside it, no budget (not ~50 tokens)
    assert steps[2][0] == 1 and 40 <= steps[2][1] <= 52  # it streams: 250 ms at 5 ms a token
    assert short.result().finish_reason == "length"
    assert long.result().finish_reason == "length"
    while ctx.has_work():
        ctx.process()


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
    for n, cells in itertools.product((1, 2, 50, 100, 300, 512) * 4, (10, 1000, 3000)):
        model.observe(micro_batch(n, n * cells), 0.1 + 0.005 * n)  # attention costs nothing
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


def cliff_cost(f: StepFeatures) -> float:
    """ggml's CPU flash attention: rows of micro-batches under TILE_ROWS cost more."""
    return 0.004 + 0.0035 * f.num_tokens + 1.1e-6 * f.attention + 2e-6 * f.row_attention


def test_a_chunk_that_fills_a_tile_beats_a_smaller_one_computed_row_by_row() -> None:
    """At 3,400 cells (unified), 4 decode rows plus 60 prompt tokens fill a tile and cost
    less than 4 plus 40 row by row: the chunk search finds the larger chunk, where a
    bisection (cost assumed to grow with the chunk) would stop below the cliff."""
    model = fitted(seed=4, cost=cliff_cost)
    decode = micro_batch(4, 4 * 3400)
    below = step_with_chunk(decode, 40, 3404, unified=True)
    above = step_with_chunk(decode, TILE_ROWS - 4, 3404, unified=True)
    assert cliff_cost(above) < 0.5 < cliff_cost(below)
    k = model.largest_chunk(decode, 3404, 512, 0.5, unified=True)
    assert k >= TILE_ROWS - 4
    assert cliff_cost(step_with_chunk(decode, k, 3404, unified=True)) <= 0.5 * 1.05
    # the long prompt is not slowed down much either: its fair chunk fills a tile
    fair = model.fair_chunk(decode, 3404, 512, 512, unified=True)
    assert fair >= TILE_ROWS - 4


def late_cost(f: StepFeatures) -> float:
    """Like :func:`cliff_cost`, with row-by-row attention a little cheaper: late in a long
    prompt 32 tokens row by row cost a little less than 60 tiled (measured 0.55-0.68 s
    against 0.60-0.75 s on the 2-core EPYC, beside 4 decode rows at ~3,000 cells)."""
    return 0.004 + 0.0035 * f.num_tokens + 1.1e-6 * f.attention + 1.4e-6 * f.row_attention


def test_when_nothing_fits_a_much_faster_chunk_beats_the_cheapest() -> None:
    """Nothing fits the budget: the step is over it whatever the chunk, so a chunk of 60
    tiled tokens, predicted 1.07x the cheapest step (32 tokens row by row) and making
    progress 1.75x faster, is taken: the gap grows 7%, the prompt's tail goes in half as
    many steps. A chunk more than 1.1x the cheapest is not."""
    model = fitted(seed=4, cost=late_cost)
    decode = micro_batch(4, 4 * 3400)

    def step_s(n: int) -> float:
        return late_cost(step_with_chunk(decode, n, 3404, unified=True))

    assert step_s(MIN_CHUNK) < step_s(TILE_ROWS - 4) < 1.1 * step_s(MIN_CHUNK)
    k = model.largest_chunk(decode, 3404, 512, 0.3, unified=True)
    assert k >= TILE_ROWS - 4
    assert step_s(k) <= 1.1 * step_s(MIN_CHUNK) * 1.02
    assert model.largest_chunk(decode, 3404, 512, 0.3, unified=True, overrun=False) == MIN_CHUNK
    # row by row 1.3e-6 a cell: 60 tiled is 1.105x the cheapest, past the allowance
    slower = fitted(seed=4, cost=lambda f: late_cost(f) - 1e-7 * f.row_attention)
    assert slower.largest_chunk(decode, 3404, 512, 0.3, unified=True) == MIN_CHUNK


def test_the_fit_tells_row_by_row_attention_apart() -> None:
    model = fitted(seed=5, cost=cliff_cost)
    for f in (micro_batch(40, 40 * 3400), micro_batch(64, 64 * 3400), micro_batch(4, 4 * 100)):
        assert model.predict(f) == pytest.approx(cliff_cost(f), rel=0.1)


def tiles(rows: int, n_head: int = 9) -> int:
    """Tiles of a micro-batch of ``rows`` rows on 2 threads, from the waste table."""
    return round((tile_waste_table(512, n_head, 2)[rows] + 1) * rows * n_head / TILE_ROWS)


@pytest.mark.parametrize(
    ("rows", "n_tiles"), [(64, 16), (65, 18), (84, 21), (96, 22), (128, 24), (512, 72)]
)
def test_the_waste_table_counts_ggml_tiles(rows: int, n_tiles: int) -> None:
    """9 heads on 2 threads: 8 work chunks of ``ceil(9 x rows / 8)`` query rows, each cut
    into tiles at its end and at every head's end (counted by hand from
    ``ggml_compute_forward_flash_attn_ext_f16``)."""
    assert tiles(rows) == n_tiles


def test_the_waste_table_is_zero_where_tiles_are_full_or_absent() -> None:
    waste = tile_waste_table(512, 9, 2)
    assert not waste[:TILE_ROWS].any()  # row by row: no tiles
    assert waste[512] == pytest.approx(0.0)  # 4,608 rows in 8 chunks of 9 whole tiles
    one_thread = tile_waste_table(512, 8, 1)  # one chunk: tiles cut only at heads
    assert one_thread[64] == pytest.approx(0.0) and one_thread[65] > 0.5
    # 16 tiles of 64 rows for 64 x 9 rows: 7/9 more
    assert micro_batch(64, 64_000, waste=waste).tile_waste == pytest.approx(64_000 * 7 / 9, abs=1)
    assert micro_batch(40, 40 * 1000, waste=waste).tile_waste == 0


def tiled_cost(f: StepFeatures) -> float:
    """A CPU whose tiled attention computes the padded rows of every tile."""
    return 0.006 + 0.003 * f.num_tokens + 1e-6 * (f.attention + f.tile_waste)


def test_the_chunk_search_knows_which_chunks_fill_their_tiles() -> None:
    """Beside 4 decode rows at 3,400 cells, the largest chunk within the budget is taken
    by its tiles: a step of 128 rows costs as many tiles as one of 108, so the search
    lands where the tiles are full, and the prediction holds at every size."""
    waste = tile_waste_table(512, 9, 2)
    model = StepCostModel(waste=waste)
    rng = random.Random(6)
    for _ in range(200):
        n = rng.randint(1, 512)
        f = micro_batch(n, n * rng.randint(10, 3000), waste=waste)
        model.observe(f, tiled_cost(f))
    decode = micro_batch(4, 4 * 3400, waste=waste)
    for k in (40, 60, 80, 100, 124, 200):
        step = step_with_chunk(decode, k, 3404, unified=True, waste=waste)
        assert model.predict(step) == pytest.approx(tiled_cost(step), rel=0.05)
    budget = tiled_cost(step_with_chunk(decode, 124, 3404, unified=True, waste=waste)) * 1.01
    k = model.largest_chunk(decode, 3404, 512, budget, unified=True)
    assert 120 <= k <= 124
    blind = StepCostModel()  # the same steps, tiles unknown
    rng = random.Random(6)
    for _ in range(200):
        n = rng.randint(1, 512)
        cells = n * rng.randint(10, 3000)
        blind.observe(micro_batch(n, cells), tiled_cost(micro_batch(n, cells, waste=waste)))
    for k in (60, 80, 124):
        truth = tiled_cost(step_with_chunk(decode, k, 3404, unified=True, waste=waste))
        errors = [
            abs(m.predict(step_with_chunk(decode, k, 3404, unified=True, waste=w)) / truth - 1)
            for m, w in ((model, waste), (blind, None))
        ]
        assert errors[0] < 0.05 < errors[1]


@pytest.mark.parametrize("tiles", [(9, 2), None])
def test_the_scheduler_counts_the_tiles_its_backend_reports(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch, tiles: tuple[int, int] | None
) -> None:
    """A 100-token prompt is one micro-batch of 100 rows: 23 tiles for 900 query rows on a
    9-head, 2-thread CPU, so its padded rows add 23 x 64 / 900 - 1 of its attention."""
    ctx, _ = make_fake(n_ctx=1024, n_batch=512, attention_tiles=tiles)
    seen: list[StepFeatures] = []
    model = ctx._engine.scheduler.step_cost
    monkeypatch.setattr(model, "observe", lambda features, _s: seen.append(features))
    handle = ctx.add_request("x" * 100, llamax.SamplingParams(max_tokens=1))
    while ctx.has_work():
        ctx.process()
    assert handle.result().finish_reason == "length"
    prefill = max(seen, key=lambda f: f.num_tokens)
    assert prefill.num_tokens == 100, seen
    expected = prefill.attention * (23 * 64 / 900 - 1) if tiles else 0
    assert prefill.tile_waste == pytest.approx(expected, abs=1)


def tiled_row_cost(f: StepFeatures) -> float:
    """About SmolLM2 on this 2-core CPU: 3 ms a token, padded tiles, and rows computed one
    by one (micro-batches under 64 rows) costing five times a tiled row."""
    return (
        0.006
        + 0.003 * f.num_tokens
        + 2.2e-7 * (f.attention + f.tile_waste)
        + (1.1e-6 * f.row_attention)
    )


@pytest.mark.parametrize(("prompt", "stretched"), [(3400, True), (1000, False)])
def test_a_prompt_that_will_need_the_stretch_has_it_from_its_first_chunk(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch, prompt: int, stretched: bool
) -> None:
    """Beside 2 streams, a 250 ms chunk (about 80 tokens) is fair early in a prompt; near
    the end of a 3,400-token one, where the budget leaves 33 tokens computed row by row,
    it is not (the fair chunk is about 60). So a 3,400-token prompt gets the stretched step
    (2 x 250 ms, about 160 tokens) from its first chunk, not only once it is late, where
    most of its slowdown could not be won back. A 1,000-token prompt stays fair to its end
    and keeps 250 ms steps."""
    ctx, backend = make_fake(n_ctx=8192, n_batch=512, attention_tiles=(9, 2))
    model = ctx._engine.scheduler.step_cost
    assert model.waste is not None
    rng = random.Random(6)
    for _ in range(200):
        n = rng.randint(1, 512)
        f = micro_batch(n, n * rng.randint(10, 3000), waste=model.waste)
        model.observe(f, tiled_row_cost(f))
    monkeypatch.setattr(model, "observe", lambda *_: None)  # the fake itself is fast
    chunk = first_chunk_beside_two_streams(ctx, backend, prompt, stream_tokens=90)
    if stretched:
        assert 145 <= chunk <= 165
    else:
        assert 75 <= chunk <= 85


@pytest.mark.parametrize("max_step_ms", [250, 300])
def test_a_stretched_step_leaves_the_overrun_as_margin(max_step_ms: int) -> None:
    """A long prompt's every chunk beside 4 decode rows, priced by the cliff (tiles from 64
    rows, rows under them dearer). A stretched chunk used to fill 2 x max_step_ms (0.497-0.5
    s predicted at 250 ms), so what the machine adds made every such gap longer than that
    (0.53-0.67 s measured on the 2-core EPYC, issue 59). Now it fills 2 x max_step_ms over
    the 1.1x overrun, and only a chunk making progress 1.5x faster (the tile filled at the
    prompt's end) may use that margin: no step is predicted over 2 x max_step_ms."""
    budget = ChunkBudget(512, max_step_ms)
    budget.cost = fitted(seed=4, cost=cliff_cost)
    ceiling = MAX_STRETCH * max_step_ms / 1000
    pending, computed, steps = 3400, 0, []
    while pending:
        streams = [60 + len(steps)] * 4
        fixed = budget.start_step(streams, unified=True)
        assert fixed is not None
        take, step = budget.chunk(
            fixed,
            min(pending, 508),
            num_pending=pending,
            num_computed=computed,
            num_cells_used=sum(streams) + computed,
            num_decode=4,
            unified=True,
        )
        assert take > 0 and step is not None
        steps.append((computed, budget.cost.predict(step)))
        pending, computed = pending - take, computed + take
    assert max(s for _, s in steps) <= ceiling + 1e-9
    # before the prompt's last 1,400 tokens no tiled chunk is 1.5x faster: the stretch binds
    stretched = [s for computed, s in steps if computed < 2000]
    assert stretched and max(stretched) <= ceiling / OVERRUN + 1e-9
    assert max(stretched) > 0.95 * ceiling / OVERRUN  # the stretch is used


def test_the_last_chunks_split_evenly_where_a_small_one_would_go_row_by_row() -> None:
    """4 decode rows at 3,400 cells, 122 prompt tokens left, 70 fitting the budget: 70 then
    52 leaves 56 rows computed row by row; 61 and 61 fill tiles and cost less. With 110
    left, 55 and 55 would both go row by row, so the largest chunk stays first."""
    model = fitted(seed=4, cost=cliff_cost)
    decode = micro_batch(4, 4 * 3400)

    def plan_s(chunks: list[int]) -> float:
        total, attend = 0.0, 3404
        for chunk in chunks:
            total += cliff_cost(step_with_chunk(decode, chunk, attend, unified=True))
            attend += chunk + 4
        return total

    assert plan_s([61, 61]) < plan_s([70, 52])
    assert model.last_chunks(decode, 3404, 70, 122, 0.6, unified=True) == 61
    assert plan_s([64, 46]) < plan_s([55, 55])
    assert model.last_chunks(decode, 3404, 64, 110, 0.6, unified=True) == 64
    # the even chunk must fit the budget; more than 3 steps away is not the tail yet
    assert model.last_chunks(decode, 3404, 70, 122, 0.3, unified=True) == 70
    assert model.last_chunks(decode, 3404, 70, 400, 0.6, unified=True) == 70
    assert model.last_chunks(decode, 3404, 60, 60, 0.6, unified=True) == 60
