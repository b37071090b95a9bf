"""The chunk budget on plain numbers (:mod:`llamax.engine.timing.chunk_budget`): no backend."""

from __future__ import annotations

import pytest

from llamax.engine.timing.chunk_budget import ChunkBudget, halve_newest_chunk
from llamax.engine.timing.step_budget import MIN_CHUNK, StepFeatures, step_with_chunk

DECODE = [100, 200, 300, 400]  # tokens each decoding sequence holds


def first_chunk(budget: ChunkBudget, limit: int = 512, *, unified: bool = True) -> int:
    fixed = budget.start_step(DECODE, unified=unified)
    take, _ = budget.chunk(
        fixed,
        limit,
        num_pending=limit,
        num_computed=0,
        num_cells_used=2000,
        num_decode=len(DECODE),
        unified=unified,
    )
    return take


def test_untimed_or_without_decode_rows_a_chunk_takes_the_limit() -> None:
    untimed = ChunkBudget(512, None)
    assert untimed.start_step(DECODE, unified=True) is None
    assert first_chunk(untimed, 300) == 300
    timed = ChunkBudget(512, 50)
    assert timed.start_step([], unified=True) is None  # nobody waits for a token
    # rows that only compute prompts' last tokens: no reply waits for its next one
    assert timed.start_step(DECODE, unified=True, streaming=False) is None


@pytest.mark.parametrize("unified", [True, False])
def test_a_chunk_stays_within_the_budget_or_its_stretch(unified: bool) -> None:
    budget = ChunkBudget(512, 200)
    fixed = budget.start_step(DECODE, unified=unified)
    assert fixed is not None and fixed.num_tokens == len(DECODE)
    decode_s = budget.cost.predict(fixed)
    take, step = budget.chunk(
        fixed,
        512,
        num_pending=4000,
        num_computed=0,
        num_cells_used=2000,
        num_decode=len(DECODE),
        unified=unified,
    )
    assert MIN_CHUNK < take < 512  # above the floor, which may exceed the budget
    assert step is not None and step.num_tokens == len(DECODE) + take
    stretch = max(0.2 + decode_s, 2 * max(0.2, decode_s))
    assert budget.cost.predict(step) <= stretch + 1e-9


def test_more_time_gives_larger_chunks() -> None:
    takes = [first_chunk(ChunkBudget(512, ms)) for ms in (320, 640, 1280)]
    assert takes == sorted(takes) and takes[0] < takes[-1]
    # where nothing of the floor fits, the chunk does not depend on the budget
    tight = {first_chunk(ChunkBudget(512, ms)) for ms in (5, 20, 80)}
    assert len(tight) == 1 and MIN_CHUNK <= tight.pop() <= takes[0] + 1


def cheapest_floor_step(budget: ChunkBudget, fixed: StepFeatures) -> float:
    """The cheapest predicted step with a chunk of at least ``MIN_CHUNK`` tokens."""
    return min(
        budget.cost.predict(step_with_chunk(fixed, n, 2000 + len(DECODE), unified=True))
        for n in range(MIN_CHUNK, 513)
    )


def test_the_first_chunk_advances_and_a_later_one_may_get_nothing() -> None:
    budget = ChunkBudget(512, 50)
    budget.note_pause(10.0)  # a pause beyond any budget: nothing fits
    fixed = budget.start_step(DECODE, unified=True)
    assert fixed is not None
    args = {"num_pending": 4000, "num_computed": 0, "num_cells_used": 2000}
    take, step = budget.chunk(fixed, 512, **args, num_decode=len(DECODE), unified=True)
    # at least the floor, and a step at most 1.1x the cheapest that has it (32 tokens row
    # by row, or 60 tiled making progress twice as fast: step_budget.largest_chunk)
    assert take >= MIN_CHUNK and step is not None
    assert budget.cost.predict(step) <= 1.1 * cheapest_floor_step(budget, fixed) + 1e-9
    take, _ = budget.chunk(step, 512, **args, num_decode=len(DECODE), unified=True)
    assert take == 0


def test_a_layout_pause_comes_off_one_step_only() -> None:
    budget = ChunkBudget(512, 1000)
    normal = first_chunk(budget)
    budget.note_pause(0.5)
    paused = first_chunk(budget)
    assert MIN_CHUNK <= paused < normal
    assert first_chunk(budget) == normal


def test_the_last_chunk_of_a_short_prompt_is_not_cut() -> None:
    """A prompt that fits the budget whole is taken whole."""
    budget = ChunkBudget(512, 500)
    assert first_chunk(budget, 40) == 40


def test_step_features_count_decode_rows_and_chunks() -> None:
    budget = ChunkBudget(512, 50)
    entries = [(1, 10, 10), (1, 20, 20), (30, 0, 0)]  # (fed, first position, computed)
    # unified: decode rows read their own cells, the chunk the whole span (100 + 32)
    unified = budget.step_features(entries, 100, unified=True)
    assert unified == StepFeatures(32, 11 + 21 + 30 * 132, 11 + 21 + 30 * 132)
    # streams: each sequence's rows attend to its own context
    streams = budget.step_features(entries, 100, unified=False)
    assert streams == StepFeatures(32, 10 + 20 + 30 * 15, 10 + 20 + 30 * 15)
    assert budget.decode_features([9, 19], unified=True) == StepFeatures(2, 30, 30)
    assert budget.decode_features([9, 19], unified=False) == StepFeatures(2, 30, 30)


def test_a_refused_decode_halves_the_newest_prompt_chunk() -> None:
    assert halve_newest_chunk([1, 1, 40, 1, 13]) == [1, 1, 40, 1, 6]
    assert halve_newest_chunk([2]) == [1]
    assert halve_newest_chunk([1, 1, 1]) is None  # decode rows only
    assert halve_newest_chunk([]) is None
