"""Minimal reproductions of the bugs that the fault matrix, the stateful test and the soak
found (issue 22), one per cause, on the fake backend. Each fails on the code they were
found on; see docs/testing.md for the harnesses that found them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import llamax
from llamax.testing import FakeBackend, assert_idle

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]
P = llamax.SamplingParams


def _run(ctx: llamax.Context, steps: int = 500) -> None:
    for _ in range(steps):
        if not ctx.has_work():
            return
        ctx.process()


def test_load_evicts_retained_prefixes_to_make_room(make_fake: MakeFake, tmp_path: Path) -> None:
    """Retained prefixes (evictable) fill the cache: loading a valid session file must
    evict them, not be refused as "damaged"."""
    ctx, _ = make_fake(n_ctx=64, n_seq_max=4)
    with ctx.session() as session:
        session.add_request("hello", P(max_tokens=3, temperature=0))
        _run(ctx)
        session.save(tmp_path / "s.llamax")
        saved = session.token_ids
    for i in range(3):
        ctx.add_request(chr(97 + i) * 20, P(max_tokens=1))
        _run(ctx)
    assert ctx.stats().num_retained == 3
    with llamax.Session.load(ctx, tmp_path / "s.llamax") as loaded:
        assert loaded.token_ids == saved


def test_request_that_fits_is_not_held_behind_one_that_does_not(make_fake: MakeFake) -> None:
    """A session holds 124 of 160 cells; a second session's first request needs 41 and
    cannot fit beside it; a later 2-cell request fits and must not wait behind it."""
    ctx, _ = make_fake(n_ctx=160, n_seq_max=5)
    with ctx.session() as big, ctx.session() as other:
        big.add_request("w" * 120, P(max_tokens=4, temperature=0))
        _run(ctx)
        blocked = other.add_request("system prompt two, longer than one. x", P(max_tokens=4))
        small = ctx.add_request("x", P(max_tokens=1))
        _run(ctx)
        assert small.done(), "a 2-cell request waits behind one that cannot fit"
        blocked.cancel()
        _run(ctx)


def test_backend_close_failing_still_closes(make_fake: MakeFake) -> None:
    """``backend.close`` raising during teardown leaves the context "closing" for ever."""
    ctx, backend = make_fake(autostart=True)
    ctx.add_request("abc", P(max_tokens=2)).result(60)

    def fail(where: str) -> None:
        if where == "close":
            raise RuntimeError("close failed")

    backend.fault = fail

    def close() -> None:
        with pytest.raises(RuntimeError, match="close failed"):
            ctx.close()

    closer = threading.Thread(target=close)
    closer.start()
    closer.join(60)
    assert ctx.stats().state == "closed"


def test_failed_restore_does_not_leak_a_session(make_fake: MakeFake, tmp_path: Path) -> None:
    """``state_seq_set`` raising inside ``Session.load``: the caller gets the error and no
    Session, so the engine must not keep the pinned slot it opened for it."""
    ctx, backend = make_fake()
    with ctx.session() as session:
        session.add_request("hello", P(max_tokens=2, temperature=0))
        _run(ctx)
        session.save(tmp_path / "s.llamax")

    def fail(where: str) -> None:
        if where == "state_seq_set":
            raise RuntimeError("state_seq_set failed")

    backend.fault = fail
    with pytest.raises(Exception, match="state_seq_set failed"):
        llamax.Session.load(ctx, tmp_path / "s.llamax")
    backend.fault = None
    assert_idle(ctx)  # no session left open


def test_failed_shift_leaves_no_hole(make_fake: MakeFake) -> None:
    """``seq_add`` raising after ``seq_rm`` removed the span (``KVCache.shift_out``): the
    session's bookkeeping must still match the memory, and its next request must run."""
    ctx, backend = make_fake()
    with ctx.session() as session:
        session.add_request("abcdefgh", P(max_tokens=2, temperature=0))
        _run(ctx)

        def fail(where: str) -> None:
            if where == "seq_add":
                raise RuntimeError("seq_add failed")

        backend.fault = fail
        with pytest.raises(Exception, match="seq_add failed"):
            session.shift(2, 5)
        backend.fault = None
        assert ctx.audit() == []
        history = list(session.token_ids)
        done = session.add_request([*history, 106], P(max_tokens=2, temperature=0))
        _run(ctx)
        assert done.result(0).finish_reason == "length"
