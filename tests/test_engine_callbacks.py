"""Regression tests for the engine's two seams that broke under servers: done-callbacks
that call back into the context (a deadlock), and ``stats()`` polled from another thread
(a race). Fake backend; every wait has a timeout so a regression fails instead of hanging."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from adversaries import in_thread

import llamax
from llamax.testing import FakeBackend, assert_idle

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]
PARAMS = llamax.SamplingParams(max_tokens=6, temperature=0)


@pytest.mark.parametrize("autostart", [True, False])
@pytest.mark.parametrize("call", ["clear_cache", "session", "add_request", "stats", "audit"])
def test_done_callback_may_call_the_context(
    make_fake: MakeFake, autostart: bool, call: str
) -> None:
    ctx, _ = make_fake(autostart=autostart)
    seen: list[object] = []

    def callback(_future: object) -> None:
        if call == "session":
            with ctx.session() as session:
                seen.append(session.token_ids)
        elif call == "add_request":
            seen.append(ctx.add_request("again", PARAMS))
        else:
            seen.append(getattr(ctx, call)())

    def scenario() -> None:
        handle = ctx.add_request("hello", PARAMS)
        handle.future.add_done_callback(callback)
        handle.result()
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        if call == "add_request":
            assert isinstance(seen[0], llamax.RequestHandle)
            seen[0].result()

    in_thread(scenario)
    assert len(seen) == 1
    assert_idle(ctx)


@pytest.mark.parametrize("autostart", [True, False])
def test_close_from_a_done_callback(make_fake: MakeFake, autostart: bool) -> None:
    ctx, _ = make_fake(autostart=autostart)
    first = ctx.add_request("one", PARAMS)
    pending = ctx.add_request("two", llamax.SamplingParams(max_tokens=200, temperature=0))
    first.future.add_done_callback(lambda _f: ctx.close())
    in_thread(first.result)
    assert in_thread(pending.result).finish_reason in ("cancelled", "length")
    assert ctx.closed


@pytest.mark.parametrize("autostart", [True, False])
def test_waiting_on_the_loop_thread_raises_instead_of_hanging(
    make_fake: MakeFake, autostart: bool
) -> None:
    ctx, _ = make_fake(autostart=autostart, n_ctx=4096)
    registered, called = threading.Event(), threading.Event()
    late: list[str] = []

    def gate(_ids: Any, _row: Any) -> None:
        # the loop cannot finish ``short`` before its callback is added; if the wait ran
        # out, ``short`` finished first, the callback ran on this test's thread and the
        # checks below would read a failure of the test's timing as one of the library
        if not registered.wait(60):
            late.append("the callback was not added within 60 s")

    long = ctx.add_request("long", llamax.SamplingParams(max_tokens=3000, temperature=0))
    short = ctx.add_request(
        "short", llamax.SamplingParams(max_tokens=2, temperature=0, logits_processors=[gate])
    )
    errors: list[BaseException] = []

    def callback(_future: object) -> None:
        for wait in (long.result, lambda: list(long)):
            try:
                wait()
            except BaseException as exc:
                errors.append(exc)
        called.set()

    def scenario() -> None:
        short.future.add_done_callback(callback)
        registered.set()
        short.result()
        assert called.wait(60)
        long.cancel()
        long.result()

    in_thread(scenario, timeout=120)
    assert not late, late
    assert len(errors) == 2, errors
    assert all(isinstance(e, llamax.DeadlockError) for e in errors), errors
    assert "loop thread" in str(errors[0])
    assert_idle(ctx)


def test_a_done_request_may_be_read_on_the_loop_thread(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(autostart=True)
    texts: list[str] = []
    handle = ctx.add_request("abc", PARAMS)
    handle.future.add_done_callback(lambda _f: texts.append(handle.result().text))
    in_thread(handle.result)
    deadline = time.monotonic() + 60
    while not texts and time.monotonic() < deadline:
        time.sleep(0.001)
    assert texts == [handle.result().text]


def test_stats_from_another_thread_never_raise_and_are_consistent(make_fake: MakeFake) -> None:
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so a race shows up at once
    ctx, backend = make_fake(autostart=True, n_seq_max=64, n_ctx=4096, n_batch=512)
    stop = threading.Event()
    problems: list[str] = []
    polls = 0

    def poll() -> None:
        nonlocal polls
        while not stop.is_set():
            try:
                s = ctx.stats()
            except Exception as exc:  # the bug: "dictionary changed size during iteration"
                problems.append(repr(exc))
                return
            polls += 1
            sessions = getattr(s, "num_sessions", 0)
            held = s.num_running + s.num_retained + s.num_free_seq_ids + sessions
            if held != backend.facts.n_seq_max or not 0 <= s.kv_cells_used <= s.kv_cells_total:
                problems.append(f"inconsistent snapshot {s}")
                return

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        for burst in range(30):
            handles = [
                ctx.add_request(f"prefix {burst % 3} request {i}", PARAMS) for i in range(40)
            ]
            for handle in handles:
                handle.result(timeout=60)
            ctx.clear_cache()
    finally:
        stop.set()
        poller.join(60)
        sys.setswitchinterval(old_interval)
    assert not problems, problems
    assert polls > 0
    assert_idle(ctx)


def test_stats_snapshot_follows_operations(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    assert ctx.stats().num_sessions == 0
    with ctx.session():
        assert ctx.stats().num_sessions == 1
    handle = ctx.add_request("abc", PARAMS)
    assert ctx.stats().num_unsettled == 1
    handle.result()
    stats = ctx.stats()
    assert stats.num_unsettled == 0 and stats.num_retained == 1
    assert ctx.clear_cache() == 1
    assert ctx.stats().num_retained == 0


def test_duplicate_live_request_ids_are_refused(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    first = ctx.add_request("abc", PARAMS, request_id="same")
    with pytest.raises(llamax.InvalidRequestError, match="already in use"):
        ctx.add_request("abc", PARAMS, request_id="same")
    first.result()
    ctx.add_request("abc", PARAMS, request_id="same").result()  # free again once settled


def test_kv_operation_inside_a_logits_processor_raises(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    errors: list[BaseException] = []

    def processor(_ids: Any, logits: Any) -> None:
        try:
            ctx.clear_cache()
        except llamax.DeadlockError as exc:
            errors.append(exc)

    params = llamax.SamplingParams(max_tokens=2, temperature=0, logits_processors=[processor])
    ctx.add_request("abc", params).result()
    assert errors and all(isinstance(e, llamax.DeadlockError) for e in errors)
