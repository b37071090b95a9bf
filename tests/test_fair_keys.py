"""Fair turns between fairness keys (issue 54, finding 9): requests submitted with one
``fair_key`` hold one share of the sequence ids together, so a batch of many requests
cannot keep another key's request waiting. Counted in engine steps on the fake, never in
seconds."""

from __future__ import annotations

import pytest

import llamax
from llamax.testing import FakeBackend, assert_idle


def greedy(max_tokens: int, **options: object) -> llamax.SamplingParams:
    return llamax.SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.0,
        **options,  # type: ignore[arg-type]
    )


def drive(ctx: llamax.Context, handles: list[llamax.RequestHandle], bound: int = 20_000) -> int:
    """Step a manual context until every handle settles; return the steps taken."""
    for step in range(bound):
        if all(h.done() for h in handles):
            return step
        ctx.process()
    raise AssertionError(f"{sum(not h.done() for h in handles)} unsettled after {bound} steps")


def manual(n_seq_max: int = 4) -> llamax.Context:
    backend = FakeBackend(n_ctx=4096, n_seq_max=n_seq_max, n_batch=512)
    return llamax.Context(backend=backend, autostart=False, max_step_ms=None)


@pytest.mark.parametrize("n", [1, 4])
def test_a_bystander_starts_within_steps_of_a_200_sequence_batch(n: int) -> None:
    """Before: the bystander waited until every one of the batch's requests had been
    admitted (hundreds of steps); ``add_request`` had no ``fair_key``."""
    with manual() as ctx:
        batch = [ctx.add_request(f"prompt {i}", greedy(16, n=n), fair_key="batch")
                 for i in range(200 // n)]  # fmt: skip
        for _ in range(3):
            ctx.process()
        bystander = ctx.add_request("quick", greedy(1))
        steps = drive(ctx, [bystander])
        assert steps <= 3, f"the bystander waited {steps} steps"
        drive(ctx, batch)
        assert all(len(h.result().choices) == n for h in batch)
        assert_idle(ctx)


def test_two_keys_take_turns() -> None:
    """Key ``a`` submits 12 requests before key ``b`` submits 12: the first four to finish
    are two of each (first come, first served would finish four of ``a``'s)."""
    with manual() as ctx:
        handles = [(key, ctx.add_request(f"{key} {i}", greedy(8), fair_key=key))
                   for key in "ab" for i in range(12)]  # fmt: skip
        finished: list[str] = []
        for _ in range(1_000):
            finished = [key for key, h in handles if h.done()]
            if len(finished) >= 4:
                break
            ctx.process()
        assert sorted(finished[:4]) == ["a", "a", "b", "b"], finished
        drive(ctx, [h for _, h in handles])
        assert_idle(ctx)


def test_one_key_is_first_come_first_served() -> None:
    """A single key changes nothing: requests start in the order they came."""
    with manual() as ctx:
        handles = [ctx.add_request(f"p {i}", greedy(4), fair_key="me") for i in range(8)]
        order: list[int] = []
        for _ in range(1_000):
            order += [i for i, h in enumerate(handles) if h.done() and i not in order]
            if len(order) == len(handles):
                break
            ctx.process()
        assert order == sorted(order)
        assert_idle(ctx)


@pytest.mark.parametrize("key", ["", 3, b"x"])
def test_a_fair_key_must_be_a_non_empty_str(key: object) -> None:
    with manual() as ctx, pytest.raises(llamax.InvalidRequestError, match="fair_key"):
        ctx.add_request("x", greedy(1), fair_key=key)  # type: ignore[arg-type]
