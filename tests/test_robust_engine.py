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
