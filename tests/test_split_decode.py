"""Many decode rows of unrelated sequences in a unified cache run as several smaller
batches (see :meth:`llamax.engine.sched.scheduler.Scheduler.split`); everything else runs as one."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import llamax
from llamax.backend.base import BatchItem
from llamax.engine.plan import ScheduledSequence, StepPlan, split_plan
from llamax.engine.timing.step_budget import TILE_ROWS
from llamax.testing import FakeBackend, assert_idle

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]
N = 70


def run(ctx: llamax.Context, prompts: list[str], max_tokens: int = 24) -> list[str]:
    handles = [
        ctx.add_request(
            p, llamax.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        )
        for p in prompts
    ]
    while ctx.has_work():
        ctx.process()
        ctx.audit()
    texts = [h.result().text for h in handles]
    assert_idle(ctx)
    return texts


def unified(**options: object) -> tuple[llamax.Context, FakeBackend]:
    backend = FakeBackend(n_ctx=4096, n_seq_max=N, n_batch=512, **options)  # type: ignore[arg-type]
    return llamax.Context(backend=backend, autostart=False, max_step_ms=None), backend


def decode_sizes(backend: FakeBackend) -> list[int]:
    """Decode rows (single-token items) in each ``llama_decode``."""
    return [sum(len(i.token_ids) == 1 for i in items) for items in backend.decode_log]


def test_unrelated_decode_rows_run_in_batches_under_a_tile() -> None:
    prompts = [f"request {i:03d} asks about something" for i in range(N)]
    ctx, backend = unified()
    with ctx:
        split = run(ctx, prompts)
    whole_ctx, whole_backend = unified()
    whole_ctx._engine.scheduler.planner.split = lambda plan: [plan]  # type: ignore[method-assign]
    with whole_ctx:
        whole = run(whole_ctx, prompts)
    assert split == whole  # same tokens, sampled from the same logits
    assert max(decode_sizes(whole_backend)) == N
    sizes = decode_sizes(backend)
    assert max(sizes) < TILE_ROWS and N // 2 in sizes  # N rows: two even halves


def test_rows_that_share_a_long_prefix_keep_one_batch() -> None:
    head = "a shared system prompt " * 12
    ctx, backend = unified()
    with ctx:
        run(ctx, [f"{head} question {i:03d}" for i in range(N)])
    assert max(decode_sizes(backend)) == N


def test_a_batch_logits_processor_sees_every_row_of_a_step() -> None:
    seen: list[int] = []
    backend = FakeBackend(n_ctx=4096, n_seq_max=N, n_batch=512)
    ctx = llamax.Context(
        backend=backend,
        autostart=False,
        max_step_ms=None,
        batch_logits_processor=lambda rows, logits: seen.append(len(rows)),
    )
    with ctx:
        run(ctx, [f"request {i:03d} asks about something" for i in range(N)])
    assert max(seen) == N


def test_streams_never_split() -> None:
    backend = FakeBackend(n_ctx=N * 64, n_seq_max=N, n_batch=512, kv_layout="streams")
    with llamax.Context(backend=backend, autostart=False, max_step_ms=None) as ctx:
        run(ctx, [f"request {i:03d}" for i in range(N)])
    assert max(decode_sizes(backend)) == N


def test_attention_off_the_cpu_never_splits() -> None:
    backend = FakeBackend(n_ctx=4096, n_seq_max=N, n_batch=512, cpu_attention=False)
    with llamax.Context(backend=backend, autostart=False, max_step_ms=None) as ctx:
        run(ctx, [f"request {i:03d} asks about something" for i in range(N)])
    assert max(decode_sizes(backend)) == N


def test_split_plan_renumbers_rows() -> None:
    def entry(seq_id: int, n: int, rows: tuple[int, ...]) -> ScheduledSequence:
        return ScheduledSequence(None, BatchItem(seq_id, [1] * n, 0, rows))  # type: ignore[arg-type]

    plan = StepPlan((entry(0, 1, (0,)), entry(1, 5, ()), entry(2, 3, (8,)), entry(3, 1, (9,))))
    first, second = split_plan(plan, [[0, 3], [1, 2]])
    assert [e.item.rows for e in first.entries] == [(0,), (1,)]
    assert [e.item.rows for e in second.entries] == [(), (7,)]
    assert first.num_tokens + second.num_tokens == plan.num_tokens


@pytest.mark.parametrize("n", [TILE_ROWS, 2 * TILE_ROWS - 1, 130])
def test_groups_are_even_and_under_a_tile(n: int) -> None:
    backend = FakeBackend(n_ctx=8192, n_seq_max=n, n_batch=512)
    with llamax.Context(backend=backend, autostart=False, max_step_ms=None) as ctx:
        run(ctx, [f"request {i:03d} asks about something" for i in range(n)], max_tokens=40)
    groups = -(-n // (TILE_ROWS - 1))
    sizes = decode_sizes(backend)
    assert max(sizes) < TILE_ROWS and -(-n // groups) in sizes  # n rows: even groups
