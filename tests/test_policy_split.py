"""The CPU decode split policy on plain numbers (:mod:`llamax.engine.sched.split_policy`)."""

from __future__ import annotations

from llamax.engine.sched.split_policy import SPLIT_SPAN_RATIO, SplitPolicy
from llamax.engine.timing.step_budget import TILE_ROWS

CPU = SplitPolicy(cpu_attention=True)


def test_64_short_rows_in_a_long_span_split_into_two_decodes() -> None:
    groups = CPU.groups([1] * 64, [79] * 64, num_cells_used=64 * 80, unified=True)
    assert groups == [list(range(32)), list(range(32, 64))]


def test_every_group_stays_under_a_tile_and_sizes_are_near_even() -> None:
    for num_rows in (TILE_ROWS, 100, 127, 128, 200, 512):
        groups = CPU.groups([1] * num_rows, [10] * num_rows, 100_000, unified=True)
        assert groups is not None
        assert sorted(i for g in groups for i in g) == list(range(num_rows))
        assert all(len(g) < TILE_ROWS for g in groups)
        assert max(map(len, groups)) - min(map(len, groups)) < len(groups)  # near-even


def test_prompt_chunks_go_in_one_last_group() -> None:
    tokens = [1] * 70 + [40, 1, 12]
    groups = CPU.groups(tokens, [5] * len(tokens), 50_000, unified=True)
    assert groups is not None and groups[-1] == [70, 72]
    assert sum(len(g) for g in groups[:-1]) == 71


def test_no_split_below_a_tile_of_rows() -> None:
    assert CPU.groups([1] * (TILE_ROWS - 1), [0] * (TILE_ROWS - 1), 10**6, unified=True) is None


def test_no_split_when_rows_attend_to_most_of_the_span() -> None:
    """Rows that share a long prefix attend to most of the span: the tiled kernel wins."""
    computed = 1000
    span = SPLIT_SPAN_RATIO * (computed + 1) - TILE_ROWS - 1  # just under the ratio
    assert CPU.groups([1] * TILE_ROWS, [computed] * TILE_ROWS, span, unified=True) is None
    assert CPU.groups([1] * TILE_ROWS, [computed] * TILE_ROWS, span + 1, unified=True)


def test_no_split_with_streams_or_off_the_cpu() -> None:
    args = ([1] * 128, [10] * 128, 100_000)
    assert CPU.groups(*args, unified=False) is None
    assert SplitPolicy(cpu_attention=False).groups(*args, unified=True) is None
