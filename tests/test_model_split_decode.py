"""Many unrelated streams in a unified cache on SmolLM2: their decode rows run as several
``llama_decode`` calls of fewer than 64 rows, and greedy output agrees with one call per
step up to llama.cpp's near ties (the two kernels sum in different orders)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from near_tie import assert_greedy_agrees

import llamax
from llamax.engine.timing.step_budget import TILE_ROWS

pytestmark = [pytest.mark.model, pytest.mark.integration]

MakeReal = Callable[..., llamax.Context]
N = 66
# three decode steps of N rows each way: every one of them is split (N // 2 rows a call)
GREEDY = llamax.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def prompts(ctx: llamax.Context) -> list[list[int]]:
    # counting: a peaked continuation, so a flat distribution's near ties are rare; three
    # numbers (not five) keep the prefill of N prompts short
    texts = [", ".join(str(10 * i + k) for k in range(3)) + "," for i in range(N)]
    return [list(ctx.tokenize(t)) for t in texts]


def run(ctx: llamax.Context, tokens: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs, and how many decode rows each ``llama_decode`` carried."""
    rows: list[int] = []
    backend = ctx._engine.backend
    decode = backend.decode

    def counting(items):  # type: ignore[no-untyped-def]
        rows.append(sum(len(item.token_ids) == 1 for item in items))
        return decode(items)

    backend.decode = counting
    try:
        handles = [ctx.add_request(t, GREEDY) for t in tokens]
        outputs = [list(h.result(timeout=600).choices[0].token_ids) for h in handles]
    finally:
        backend.decode = decode
    return outputs, rows


def test_many_streams_decode_in_batches_under_a_tile(make_real: MakeReal) -> None:
    options = dict(n_ctx=4096, n_seq_max=N, n_batch=1024, n_threads=2, max_step_ms=None)
    split_ctx = make_real(**options)
    tokens = prompts(split_ctx)
    assert split_ctx.kv_layout == "unified"
    split, split_rows = run(split_ctx, tokens)
    whole_ctx = make_real(**options)
    whole_ctx._engine.scheduler.planner.split = lambda plan: [plan]  # type: ignore[method-assign]
    whole, whole_rows = run(whole_ctx, tokens)
    assert max(whole_rows) == N and max(split_rows) < TILE_ROWS and N // 2 in split_rows
    probe = make_real(n_ctx=256, n_seq_max=1, n_threads=2)
    for prompt, expected, got in zip(tokens, whole, split, strict=True):
        assert_greedy_agrees(probe, prompt, expected, got)
