"""Session as a state machine (open → idle ⇄ running → closed) against the fake backend.
Fork, rewind, save and load with prefix reuse are in test_prefix_cache.py."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import pytest

import llamax
from llamax.testing import FakeBackend, assert_idle

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]


@pytest.fixture(params=["unified", "streams"])
def kv_layout(request: pytest.FixtureRequest) -> str:
    """Every test here runs with both KV layouts."""
    return str(request.param)


GREEDY = llamax.SamplingParams(max_tokens=6, temperature=0)


def test_idle_running_idle_then_closed_refuses_everything(make_fake: MakeFake) -> None:
    ctx, backend = make_fake()
    session = ctx.session()
    assert ctx.stats().num_sessions == 1 and session.token_ids == ()
    handle = session.add_request("hello", GREEDY)
    for op in (lambda: session.add_request("x"), session.fork, lambda: session.rewind(1)):
        with pytest.raises(llamax.SessionBusyError):
            op()
    with pytest.raises(llamax.SessionBusyError):
        session.shift(0, 1)
    handle.result()  # a manual context steps in this thread
    assert len(session.token_ids) == len("hello") + 6 - 1  # the last token is not computed yet
    session.close()
    assert session.closed and ctx.stats().num_sessions == 0 and backend.num_cells_used == 0
    for op in (
        lambda: session.add_request("x"),
        session.fork,
        lambda: session.rewind(0),
        lambda: session.token_ids,
        lambda: session.shift(0, 0),
    ):
        with pytest.raises(llamax.SessionError, match="closed"):
            op()
    session.close()  # idempotent


def test_close_cancels_a_running_request_without_waiting(make_fake: MakeFake) -> None:
    ctx, backend = make_fake()
    session = ctx.session()
    handle = session.add_request("hello", llamax.SamplingParams(max_tokens=100, temperature=0))
    ctx.process()
    session.close()
    assert handle.done() and handle.result().finish_reason == "cancelled"
    assert backend.num_cells_used == 0 and ctx.stats().num_sessions == 0


def test_close_of_a_queued_request_session(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    session = ctx.session()
    handle = session.add_request("hello", GREEDY)
    session.close()  # the request never reached a step
    assert handle.result().finish_reason == "cancelled"


def test_rewind_bounds_name_the_length(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    with ctx.session() as session:
        session.add_request("hello", GREEDY).result()
        held = len(session.token_ids)
        with pytest.raises(llamax.InvalidParameterError, match=f"holds {held}"):
            session.rewind(held + 1)
        for bad in (-1, 1.5, True):
            with pytest.raises(llamax.InvalidParameterError, match="num_tokens"):
                session.rewind(bad)  # type: ignore[arg-type]
        session.rewind(held)
        assert session.token_ids == ()


def test_shift_removes_a_span_and_keeps_the_rest(make_fake: MakeFake) -> None:
    ctx, backend = make_fake()
    with ctx.session() as session:
        session.add_request("abcdefgh", llamax.SamplingParams(max_tokens=1)).result()
        before = session.token_ids
        assert session.shift(2, 5)
        assert session.token_ids == before[:2] + before[5:]
        assert backend.num_cells_used == len(before) - 3
        with pytest.raises(ValueError, match="cannot shift out"):
            session.shift(0, 100)


def test_close_from_a_done_callback(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(autostart=True)
    session = ctx.session()
    handle = session.add_request("hello", GREEDY)
    closed = threading.Event()

    def close(_f: object) -> None:
        session.close()
        closed.set()

    handle.future.add_done_callback(close)
    handle.result(timeout=60)
    # concurrent.futures wakes result() waiters before it runs done-callbacks: wait for ours.
    assert closed.wait(60)
    llamax.testing.assert_idle(ctx)
    assert session.closed


def test_session_operation_right_after_a_result_never_deadlocks() -> None:
    """Regression: a session's done-callback took the session lock on the loop thread while
    ``rewind`` held it and waited for that thread. Reproduced within ~2,000 turns with a
    tiny GIL switch interval; the turns run in a watchdog thread."""
    ctx = llamax.Context(backend=FakeBackend(n_ctx=4096, n_seq_max=4))
    params = llamax.SamplingParams(max_tokens=2, temperature=0)
    finished = threading.Event()

    def turns() -> None:
        with ctx.session() as session:
            for _ in range(2000):
                session.add_request("ab" * 3, params).result(timeout=60)
                session.rewind(1)
        finished.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        worker = threading.Thread(target=turns, daemon=True)
        worker.start()
        worker.join(240)  # a deadlock waits forever; 2,000 turns take seconds, even under load
    finally:
        sys.setswitchinterval(interval)
    assert finished.is_set(), "session.rewind deadlocked with the loop thread"
    assert_idle(ctx)
    ctx.close()


def test_stats_count_a_session_closed_on_a_running_loop_as_closed(make_fake: MakeFake) -> None:
    """Regression: the loop applied a ``close()`` (and let it return), but published the
    stats only at the end of that step, after its decode; a caller reading ``stats()``
    right after ``close()`` still counted the session (``assert_idle``: "1 sessions still
    open", seen under load). Here the step that applies the close is held in its decode."""
    ctx, _ = make_fake(autostart=True)
    engine = ctx._engine
    start, held, release = threading.Event(), threading.Event(), threading.Event()

    def hold(token_ids: object, logits: object) -> None:
        assert start.wait(60), "the test never let the first step end"
        if engine.scheduler.sessions.num_open == 0 and not held.is_set():  # closed this step
            held.set()
            assert release.wait(60), "the test never let the held step end"

    session = ctx.session()
    other = ctx.add_request("held", llamax.SamplingParams(max_tokens=4, logits_processors=[hold]))
    closer = threading.Thread(target=session.close)
    closer.start()
    deadline = time.monotonic() + 60
    while not engine._ops and closer.is_alive():  # the close is queued for the next step
        assert time.monotonic() < deadline, "session.close() never queued its operation"
        time.sleep(0.001)
    start.set()
    try:
        assert held.wait(60), "no step applied the close"
        closer.join(60)
        assert session.closed and not closer.is_alive(), "close() did not return"
        num_sessions = ctx.stats().num_sessions
    finally:
        release.set()
    other.result(timeout=60)
    assert num_sessions == 0
