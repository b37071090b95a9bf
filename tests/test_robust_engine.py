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


# ---------------------------------------------------------------- item 3: sessions
def hold_session(ctx: llamax.Context, num_tokens: int) -> llamax.Session:
    """A session holding about ``num_tokens`` cells (its prompt and one reply token)."""
    session = ctx.session()
    handle = session.add_request("s" * (num_tokens - 2), greedy(1))
    while not handle.done():
        ctx.process()
    handle.result()
    return session


def test_a_request_that_can_never_fit_beside_sessions_fails_and_names_them() -> None:
    """Before: the request never settled, every later request queued behind it, and the
    loop spun at 100% CPU (here: the step bound ran out)."""
    backend = FakeBackend(n_ctx=256, n_seq_max=4)
    ctx = llamax.Context(backend=backend, autostart=False, max_step_ms=None)
    with ctx:
        session = hold_session(ctx, 200)
        big = ctx.add_request("b" * 100, greedy(4))
        small = ctx.add_request("c" * 10, greedy(4))
        drive(ctx, [big, small], bound=50)
        with pytest.raises(llamax.KVCapacityError, match="session") as info:
            big.result()
        assert f"hold {len(session.token_ids)} of the cache's 256" in str(info.value)
        assert small.result().finish_reason == "length"
        session.close()
        again = ctx.add_request("b" * 100, greedy(4))
        drive(ctx, [again], bound=50)
        assert again.result().finish_reason == "length"
        assert_idle(ctx)


def test_a_reply_that_outgrows_the_room_sessions_leave_ends_with_length() -> None:
    """A request that fits beside the sessions at first but would grow past them ends with
    ``finish_reason == "length"`` where the room ends, as it would at ``n_ctx_seq``."""
    backend = FakeBackend(n_ctx=256, n_seq_max=4)
    ctx = llamax.Context(backend=backend, autostart=False, max_step_ms=None)
    with ctx:
        session = hold_session(ctx, 200)
        handle = ctx.add_request("b" * 20, greedy(100))
        drive(ctx, [handle], bound=200)
        done = handle.result()
        assert done.finish_reason == "length"
        room = 256 - len(session.token_ids)
        assert done.usage.prompt_tokens + done.usage.completion_tokens == room
        session.close()
        assert_idle(ctx)


def test_close_with_drain_finishes_beside_a_session_holding_the_cache() -> None:
    """Before: ``close(drain=True)`` never returned (a daemon thread runs it here)."""
    import threading

    backend = FakeBackend(n_ctx=256, n_seq_max=4)
    ctx = llamax.Context(backend=backend, max_step_ms=None)
    session = ctx.session()
    session.add_request("s" * 198, greedy(1)).result(timeout=60)
    big = ctx.add_request("b" * 100, greedy(4))
    small = ctx.add_request("c" * 10, greedy(4))
    closer = threading.Thread(target=lambda: ctx.close(drain=True), daemon=True)
    closer.start()
    closer.join(60)
    assert not closer.is_alive(), "close(drain=True) did not return"
    assert big.done() and small.done()
    assert small.result().finish_reason == "length"


def test_a_stuck_loop_sleeps_until_something_changes() -> None:
    """A request that cannot go on now (here: a scheduler that plans nothing) leaves the
    background loop asleep, not spinning. Before: thousands of empty steps a second."""
    import time

    backend = FakeBackend(n_ctx=256, n_seq_max=4)
    ctx = llamax.Context(backend=backend, max_step_ms=None)
    scheduler = ctx._engine.scheduler
    real_schedule = scheduler.schedule
    calls = 0
    blocked = True

    def schedule(result: object) -> object:
        nonlocal calls
        calls += 1
        if blocked:
            return llamax.engine.plan.StepPlan()
        return real_schedule(result)  # type: ignore[arg-type]

    scheduler.schedule = schedule  # type: ignore[method-assign,assignment]
    with ctx:
        handle = ctx.add_request("waits", greedy(4))
        time.sleep(0.3)
        assert calls <= 2
        blocked = False
        other = ctx.add_request("news", greedy(4))  # news wakes the loop
        assert other.result(timeout=60).finish_reason == "length"
        assert handle.result(timeout=60).finish_reason == "length"


# ---------------------------------------------------------------- item 8: fairness
@pytest.mark.parametrize("kv_layout", ["unified", "streams"])
def test_a_short_request_is_not_starved_by_a_huge_n_request(kv_layout: str) -> None:
    """Before: a 1-token request waited for the first 16 of 32 choices to finish (streams)
    or behind 1,601 preemptions (unified)."""
    n_ctx = 4096 if kv_layout == "unified" else 16 * 256
    backend = FakeBackend(n_ctx=n_ctx, n_seq_max=16, n_batch=512, kv_layout=kv_layout)
    ctx = llamax.Context(backend=backend, autostart=False, max_step_ms=None)
    with ctx:
        huge = ctx.add_request("a long story, many times over", greedy(200, n=32))
        for _ in range(3):
            ctx.process()
        short = ctx.add_request("quick", greedy(1))
        steps = drive(ctx, [short], bound=10_000)
        assert steps <= 3, f"the short request waited {steps} steps"
        drive(ctx, [huge])
        assert [c.finish_reason for c in huge.result().choices] == ["length"] * 32
        assert ctx.stats().num_preemptions <= 32
        assert_idle(ctx)
