"""What idle open sessions leave the other sequences: capacities and the no-room message.

An open session that no running sequence uses keeps its slot, its sequence id and its
cells; no eviction or preemption frees them. So a sequence may hold at most ``n_ctx_seq``
tokens, less (in a unified cache) the cells of the idle sessions other than its own; with
``kv_layout="auto"`` in streams, at least its own stream. A sequence that needs more, or a
non-session request waiting while sessions hold every sequence id, can never run: the
scheduler ends it, with :meth:`SessionRoom.no_room_reason` as the error.

:class:`SessionRoom` decides on numbers (cells, ids); the scheduler counts the idle
sessions and ends the sequences.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["SessionRoom"]


@dataclass(frozen=True, slots=True)
class SessionRoom:
    """The room the cache gives a sequence beside idle open sessions."""

    n_ctx: int
    """Cells of the unified cache."""
    n_ctx_seq: int
    """The most tokens one sequence may hold."""
    n_seq_max: int
    """Sequence ids in all."""

    def capacity(
        self, num_held: int, *, unified: bool, stream_cells: int, can_relayout: bool
    ) -> int:
        """The most tokens a sequence may hold now.

        Args:
            num_held: Cells the idle open sessions other than the sequence's own hold.
            unified: Whether the cache is one buffer now.
            stream_cells: Cells one sequence holds in its own stream.
            can_relayout: Whether the layout may move (``kv_layout="auto"``).
        """
        if not unified:
            if not can_relayout:
                return stream_cells
            return min(self.n_ctx_seq, max(stream_cells, self.n_ctx - num_held))
        return min(self.n_ctx_seq, self.n_ctx - num_held)

    def are_ids_held(self, num_idle_sessions: int) -> bool:
        """Whether idle open sessions hold every sequence id."""
        return num_idle_sessions >= self.n_seq_max

    def no_room_reason(
        self,
        num_tokens: int,
        *,
        session_ids: Sequence[int],
        num_held: int,
        capacity: int,
        is_session: bool,
        fixed_stream_cells: int | None,
        relayout_failure: str | None,
    ) -> str:
        """Why a sequence can never get the room it needs.

        Args:
            num_tokens: Tokens the sequence holds.
            session_ids: The idle open sessions other than its own.
            num_held: Cells those sessions hold.
            capacity: :meth:`capacity` of the sequence.
            is_session: Whether it belongs to an open session.
            fixed_stream_cells: Cells of its stream, if the cache is in streams for good.
            relayout_failure: Why the layout stays fixed, if a move failed.
        """
        names = _names(session_ids)
        if self.are_ids_held(len(session_ids)) and not is_session:
            return (
                f"every one of the {self.n_seq_max} sequence ids is held by an open "
                f"session (sessions {names}); close a session or raise n_seq_max"
            )
        if fixed_stream_cells is not None:
            return self.stream_reason(num_tokens, fixed_stream_cells, relayout_failure)
        return (
            f"the request needs {num_tokens} KV cells, but open sessions (sessions {names}) "
            f"hold {num_held} of the cache's {self.n_ctx}, leaving {capacity}; close a session "
            "or raise n_ctx"
        )

    def stream_reason(
        self, num_tokens: int, stream_cells: int, relayout_failure: str | None
    ) -> str:
        """Why a sequence of ``num_tokens`` cannot grow beyond its stream of
        ``stream_cells`` (the layout is fixed, or failed to move, as ``relayout_failure``
        says)."""
        why = f", and {relayout_failure}" if relayout_failure else ""
        return f"the request needs {num_tokens} KV cells, one stream holds {stream_cells}{why}"


def _names(session_ids: Iterable[int]) -> str:
    return ", ".join(str(i) for i in session_ids)
