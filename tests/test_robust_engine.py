"""Regression tests for issue 22's engine items: KV pressure under ``kv_layout="auto"``,
a request failing in the middle of a split step, requests blocked by sessions, and
fairness between a huge-``n`` request and a short one.

Each test failed on the code before its fix (the failure is quoted in its docstring).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import llamax
from llamax.testing import FakeBackend, assert_idle

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]
N = 70  # decode rows per step: above ggml's 64-row tile, so a unified step is split


def greedy(max_tokens: int = 24, **options: object) -> llamax.SamplingParams:
    return llamax.SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.0,
        **options,  # type: ignore[arg-type]
    )


def drive(ctx: llamax.Context, handles: list[llamax.RequestHandle], bound: int = 10_000) -> int:
    """Step a manual context until every handle settles; return the steps taken."""
    for step in range(bound):
        if all(h.done() for h in handles):
            return step
        ctx.process()
    raise AssertionError(
        f"{sum(not h.done() for h in handles)} requests unsettled after {bound} steps"
    )


# ---------------------------------------------------------------- item 2: split steps
def test_a_request_failing_in_the_first_part_of_a_split_step_ends_alone() -> None:
    """Before: ``EngineError: decode at 14, KV holds 0`` and every bystander failed, since
    the failed request's released sequences were still decoded in the step's next part."""
    backend = FakeBackend(n_ctx=8192, n_seq_max=N + 8, n_batch=512)
    ctx = llamax.Context(backend=backend, autostart=False, max_step_ms=None)

    def explode(token_ids: object, logits: object) -> None:
        if len(backend.decode_log) > 10:  # once every choice decodes in split steps
            raise ValueError("processor failed")

    with ctx:
        first = [
            ctx.add_request(f"request {i:03d} asks about something", greedy()) for i in range(32)
        ]
        # the n>1 request's choices sit in rows 32-39: across the first two parts of a step
        bad = ctx.add_request("the failing one", greedy(n=8, logits_processors=[explode], seed=1))
        rest = [
            ctx.add_request(f"request {i:03d} asks about something", greedy()) for i in range(32, N)
        ]
        bystanders = first + rest
        drive(ctx, [*bystanders, bad])
        assert max(sum(len(i.token_ids) == 1 for i in items) for items in backend.decode_log) < 64
        with pytest.raises(llamax.RequestFailedError):
            bad.result()
        assert all(h.result().finish_reason == "length" for h in bystanders)
        assert ctx.audit() == []
        after = ctx.add_request("after", greedy(4))
        drive(ctx, [after])
        assert after.result().finish_reason == "length"
        assert_idle(ctx)


# ---------------------------------------------------------------- item 1: KV pressure
def auto_backend(**options: object) -> FakeBackend:
    """Like llama.cpp's ``Context(n_ctx=1024, n_seq_max=8)``: 8 streams of 256 cells (each
    padded to 256) hold twice what the 1,024-cell unified layout does."""
    settings: dict[str, object] = dict(n_ctx=1024, n_seq_max=8, n_batch=512, stream_cells=256)
    settings.update(options)
    return FakeBackend(kv_layout="auto", **settings)  # type: ignore[arg-type]


def test_auto_layout_preempts_what_the_unified_layout_cannot_hold() -> None:
    """Before: ``RequestFailedError: the request needs 257 KV cells, one stream holds 256,
    and the unified layout could not be made: the new KV layout refused sequence 4``."""
    prompts = [f"{i} " + "the same words again and again " * 3 for i in range(8)]
    backend = auto_backend()
    ctx = llamax.Context(backend=backend, autostart=False, max_step_ms=None)
    with ctx:
        handles = [ctx.add_request(p, greedy(200)) for p in prompts]
        drive(ctx, handles)
        done = [h.result() for h in handles]
        assert [c.finish_reason for c in done] == ["length"] * 8
        assert ctx.stats().num_preemptions > 0 and ctx.kv_layout == "unified"
        assert_idle(ctx)
    for prompt, completion in zip(prompts, done, strict=True):
        alone = llamax.Context(backend=auto_backend(), autostart=False, max_step_ms=None)
        with alone:
            h = alone.add_request(prompt, greedy(200))
            drive(alone, [h])
            assert h.result().token_ids == completion.token_ids
