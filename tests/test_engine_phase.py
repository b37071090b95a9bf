"""The engine's lifecycle state machine (llamax.engine.phase) and the engine's walk through it."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest

import llamax
from llamax.engine.loop import Engine, EngineState
from llamax.engine.phase import MOVES, LoopPhase, next_phase
from llamax.testing import FakeBackend

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]
P = llamax.SamplingParams
Ph = LoopPhase

LEGAL = {
    (Ph.RUNNING, Ph.CLOSING),
    (Ph.RUNNING, Ph.DRAINING),
    (Ph.RUNNING, Ph.FAILED),
    (Ph.CLOSING, Ph.CLOSING),
    (Ph.CLOSING, Ph.DRAINING),
    (Ph.CLOSING, Ph.TEARING_DOWN),
    (Ph.CLOSING, Ph.FAILED),
    (Ph.DRAINING, Ph.CLOSING),
    (Ph.DRAINING, Ph.DRAINING),
    (Ph.DRAINING, Ph.TEARING_DOWN),
    (Ph.DRAINING, Ph.FAILED),
    (Ph.TEARING_DOWN, Ph.CLOSED),
    (Ph.TEARING_DOWN, Ph.FAILED_TEARDOWN),
    (Ph.FAILED, Ph.FAILED_TEARDOWN),
}


@pytest.mark.parametrize(("current", "new"), sorted(LEGAL, key=str))
def test_legal_moves(current: LoopPhase, new: LoopPhase) -> None:
    assert next_phase(current, new) is new


@pytest.mark.parametrize(
    ("current", "new"),
    [pair for pair in itertools.product(LoopPhase, LoopPhase) if pair not in LEGAL],
)
def test_illegal_moves_are_refused(current: LoopPhase, new: LoopPhase) -> None:
    with pytest.raises(RuntimeError, match="cannot move from"):
        next_phase(current, new)


def test_the_table_is_the_one_tested_and_ends_in_the_terminal_phases() -> None:
    assert {(a, b) for a, targets in MOVES.items() for b in targets} == LEGAL
    assert {phase for phase, targets in MOVES.items() if not targets} == {
        Ph.CLOSED,
        Ph.FAILED_TEARDOWN,
    }
    # nothing leads back to RUNNING, and a failed engine never shows as merely closed
    assert all(Ph.RUNNING not in targets for targets in MOVES.values())
    assert Ph.CLOSED not in MOVES[Ph.FAILED]


def test_public_states() -> None:
    assert {phase: phase.state for phase in LoopPhase} == {
        Ph.RUNNING: EngineState.RUNNING,
        Ph.CLOSING: EngineState.CLOSING,
        Ph.DRAINING: EngineState.CLOSING,
        Ph.TEARING_DOWN: EngineState.CLOSING,
        Ph.CLOSED: EngineState.CLOSED,
        Ph.FAILED: EngineState.FAILED,
        Ph.FAILED_TEARDOWN: EngineState.FAILED,
    }
    assert {p for p in LoopPhase if p.is_torn_down} == {
        Ph.TEARING_DOWN,
        Ph.CLOSED,
        Ph.FAILED_TEARDOWN,
    }


def _recorded(engine: Engine) -> list[LoopPhase]:
    """Record every phase the engine moves to (through ``Engine._move``)."""
    seen: list[LoopPhase] = []
    move = engine._move

    def record(phase: LoopPhase) -> None:
        move(phase)
        seen.append(phase)

    engine._move = record  # type: ignore[method-assign]
    return seen


def test_close_walks_closing_teardown_closed(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    seen = _recorded(ctx._engine)
    handle = ctx.add_request("abc", P(max_tokens=50))
    ctx.close()
    assert seen == [Ph.CLOSING, Ph.TEARING_DOWN, Ph.CLOSED]
    assert ctx.closed and ctx.stats().state == "closed"
    assert handle.result(60).finish_reason == "cancelled"


def test_a_drain_then_a_cancelling_close(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    engine = ctx._engine
    seen = _recorded(engine)
    handle = ctx.add_request("abc", P(max_tokens=3))
    with engine._lock:  # as close(drain=True) marks it, without draining here
        engine._move(Ph.DRAINING)
    assert ctx.stats().state == "closing"
    ctx.process()  # a drained step runs; the request is not cancelled
    ctx.close()  # close() again cancels what is left
    assert seen == [Ph.DRAINING, Ph.CLOSING, Ph.TEARING_DOWN, Ph.CLOSED]
    assert handle.done()


def test_close_with_drain_finishes_pending_requests(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    seen = _recorded(ctx._engine)
    handle = ctx.add_request("abc", P(max_tokens=3))
    ctx.close(drain=True)
    assert handle.result(60).finish_reason == "length"
    assert seen == [Ph.DRAINING, Ph.TEARING_DOWN, Ph.CLOSED]


def test_a_failed_step_fails_then_tears_down_and_stays_failed(make_fake: MakeFake) -> None:
    ctx, backend = make_fake()
    seen = _recorded(ctx._engine)
    handle = ctx.add_request("abc", P(max_tokens=3))

    def fail(where: str) -> None:
        if where == "decode":
            raise RuntimeError("decode failed")

    backend.fault = fail
    with pytest.raises(llamax.EngineError):
        ctx.process()
    assert seen == [Ph.FAILED, Ph.FAILED_TEARDOWN]
    assert ctx.stats().state == "failed" and backend.closed
    with pytest.raises(llamax.EngineError):
        handle.result(60)
    ctx.close()  # nothing left to move: a failed engine stays failed
    assert seen == [Ph.FAILED, Ph.FAILED_TEARDOWN] and ctx.stats().state == "failed"
    with pytest.raises(llamax.ContextClosedError, match="failed and is closed") as info:
        ctx.audit()
    assert isinstance(info.value.__cause__, llamax.EngineError)


def test_a_background_engine_walks_the_same_phases(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(autostart=True)
    seen = _recorded(ctx._engine)
    ctx.add_request("abc", P(max_tokens=2)).result(60)
    closer = threading.Thread(target=ctx.close)
    closer.start()
    closer.join(60)
    assert seen == [Ph.CLOSING, Ph.TEARING_DOWN, Ph.CLOSED]
