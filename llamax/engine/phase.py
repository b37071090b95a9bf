"""The engine's lifecycle as one state machine: :class:`LoopPhase` and its legal moves.

The public :class:`EngineState` (what ``Context.stats().state`` and the errors say) is a
coarser view of it: ``closing`` covers the three phases between ``close()`` and the native
memory being freed, and ``failed`` the two phases of a failed engine (before and after its
teardown began). Every change of phase goes through :func:`next_phase`, which refuses a move
the table does not list, so a flag can never contradict the state.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["EngineState", "LoopPhase", "next_phase"]


class EngineState(Enum):
    """Lifecycle of an engine (and its context)."""

    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"


class LoopPhase(Enum):
    """Where the engine is in its lifecycle; :attr:`state` is the public view."""

    RUNNING = "running"
    """Accepting requests and operations."""
    CLOSING = "closing"
    """``close()`` was called: no new requests; pending ones are cancelled at teardown."""
    DRAINING = "draining"
    """``close(drain=True)`` was called: no new requests; pending ones finish first."""
    TEARING_DOWN = "tearing down"
    """Teardown began: pending requests are cancelled, sessions released, the backend freed;
    no operation runs any more."""
    CLOSED = "closed"
    """Torn down: the native memory is freed."""
    FAILED = "failed"
    """A step failed: every pending request got the error; teardown is still to come."""
    FAILED_TEARDOWN = "failed, torn down"
    """A failed engine whose teardown began (or ended)."""

    @property
    def state(self) -> EngineState:
        """The public state this phase shows."""
        return _PUBLIC[self]

    @property
    def is_torn_down(self) -> bool:
        """Whether teardown began: operations that run while closing are refused too."""
        return self in _TORN_DOWN


_PUBLIC = {
    LoopPhase.RUNNING: EngineState.RUNNING,
    LoopPhase.CLOSING: EngineState.CLOSING,
    LoopPhase.DRAINING: EngineState.CLOSING,
    LoopPhase.TEARING_DOWN: EngineState.CLOSING,
    LoopPhase.CLOSED: EngineState.CLOSED,
    LoopPhase.FAILED: EngineState.FAILED,
    LoopPhase.FAILED_TEARDOWN: EngineState.FAILED,
}
_TORN_DOWN = frozenset({LoopPhase.TEARING_DOWN, LoopPhase.CLOSED, LoopPhase.FAILED_TEARDOWN})

MOVES: dict[LoopPhase, frozenset[LoopPhase]] = {
    # close(drain=...) chooses, and may choose again, between cancelling and draining
    LoopPhase.RUNNING: frozenset({LoopPhase.CLOSING, LoopPhase.DRAINING, LoopPhase.FAILED}),
    LoopPhase.CLOSING: frozenset(
        {LoopPhase.CLOSING, LoopPhase.DRAINING, LoopPhase.TEARING_DOWN, LoopPhase.FAILED}
    ),
    LoopPhase.DRAINING: frozenset(
        {LoopPhase.CLOSING, LoopPhase.DRAINING, LoopPhase.TEARING_DOWN, LoopPhase.FAILED}
    ),
    # a manual step that was already running when teardown began may still fail
    LoopPhase.TEARING_DOWN: frozenset({LoopPhase.CLOSED, LoopPhase.FAILED_TEARDOWN}),
    LoopPhase.FAILED: frozenset({LoopPhase.FAILED_TEARDOWN}),
    LoopPhase.CLOSED: frozenset(),
    LoopPhase.FAILED_TEARDOWN: frozenset(),
}
"""Each phase's legal next phases."""


def next_phase(current: LoopPhase, new: LoopPhase) -> LoopPhase:
    """``new``, once :data:`MOVES` allows ``current -> new``.

    Raises:
        RuntimeError: the move is illegal (a bug in the engine, never a user error).
    """
    if new not in MOVES[current]:
        raise RuntimeError(f"the engine cannot move from {current.value!r} to {new.value!r}")
    return new
