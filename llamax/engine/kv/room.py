"""The room each sequence has now, beside the idle open sessions.

:class:`Room` counts the open sessions no running sequence uses (their slots, ids and cells,
which no eviction or preemption frees) once a step, and answers from them what a sequence
may hold and, for one that can never fit, why; the numbers are
:class:`~llamax.engine.kv.session_room.SessionRoom`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator

from ...backend.base import Backend
from ..sequence import TERMINAL_STATES, SequenceState
from ..sequence import Sequence as Seq
from .kvcache import KVCache, Slot
from .relayout import Relayout
from .session_room import SessionRoom
from .session_table import SessionTable

__all__ = ["Room", "num_cells"]


class Room:
    """Capacities beside the idle open sessions (counted by :meth:`count_idle`)."""

    def __init__(
        self, backend: Backend, kv: KVCache, relayout: Relayout, sessions: SessionTable
    ) -> None:
        facts = backend.facts
        self.policy = SessionRoom(facts.n_ctx, facts.n_ctx_seq, facts.n_seq_max)
        self._kv = kv
        self._relayout = relayout
        self._sessions = sessions
        self._idle: list[Slot] = []  # pinned slots no running sequence uses
        self._idle_cells = 0

    def count_idle(self, running: Iterable[Seq]) -> None:
        """Note the open sessions no sequence of ``running`` uses, and their cells."""
        busy = {id(s.slot) for s in running if s.slot is not None}
        self._idle = [slot for slot in self._kv.slots() if slot.pinned and id(slot) not in busy]
        self._idle_cells = num_cells(self._idle)

    @property
    def are_ids_held(self) -> bool:
        """Whether idle open sessions hold every sequence id."""
        return self.policy.are_ids_held(len(self._idle))

    def never_fit(self, sequences: Iterable[Seq]) -> Iterator[tuple[Seq, Callable[[], str]]]:
        """The unfinished sequences of ``sequences`` that can never get the cells they need
        (or, outside a session, a sequence id) beside the idle open sessions, each with
        what says why. Read lazily: ending one may end its siblings."""
        no_ids = self.are_ids_held
        for seq in sequences:
            if seq.state in TERMINAL_STATES:
                continue
            is_session = self._own_session_slot(seq) is not None  # not one that yielded
            waits_for_id = no_ids and not is_session and seq.state is SequenceState.WAITING
            if waits_for_id or len(seq.token_ids) > self.capacity(seq):
                yield seq, functools.partial(self.no_room_reason, seq)

    def needs_idle_sessions(self, sequences: Iterable[Seq]) -> bool:
        """Whether a sequence of ``sequences`` can never fit now (:meth:`never_fit`) but
        would beside no idle session: only their room would save it."""
        alone = self.policy.capacity(
            0,
            unified=self._kv.is_unified,
            stream_cells=self._relayout.stream_cells,
            can_relayout=self._kv.can_relayout,
        )
        return any(len(seq.token_ids) <= alone for seq, _ in self.never_fit(sequences))

    def capacity(self, seq: Seq) -> int:
        """The most tokens ``seq`` may hold now (:meth:`SessionRoom.capacity`)."""
        return self.policy.capacity(
            self._num_held(seq),
            unified=self._kv.is_unified,
            stream_cells=self._relayout.stream_cells,
            can_relayout=self._kv.can_relayout,
        )

    def no_room_reason(self, seq: Seq) -> str:
        """Why ``seq`` can never get the room it needs."""
        own = self._own_session_slot(seq)
        idle = [slot for slot in self._idle if slot is not own]
        fixed = not self._kv.is_unified and not self._kv.can_relayout
        return self.policy.no_room_reason(
            len(seq.token_ids),
            session_ids=self._sessions.ids_of(idle),
            num_held=num_cells(idle),
            capacity=self.capacity(seq),
            is_session=own is not None,
            fixed_stream_cells=self._kv.cells_per_seq if fixed else None,
            relayout_failure=self._kv.relayout_failure,
        )

    def outgrew_streams(self, sequences: Iterable[Seq]) -> Iterator[tuple[Seq, str]]:
        """The unfinished sequences of ``sequences`` that outgrew a stream while the move
        to the unified layout failed, each with why. Read lazily: ending one may end its
        siblings."""
        cap = self._relayout.policy.stream_cells
        for seq in sequences:
            if len(seq.token_ids) > cap and seq.state not in TERMINAL_STATES:
                reason = self.policy.stream_reason(
                    len(seq.token_ids), cap, self._kv.relayout_failure
                )
                yield seq, reason

    def _own_session_slot(self, seq: Seq) -> Slot | None:
        session_id = seq.request.session_id
        return None if session_id is None else self._sessions.slot_or_none(session_id)

    def _num_held(self, seq: Seq) -> int:
        """Cells the idle open sessions other than the one of ``seq`` hold."""
        own = self._own_session_slot(seq)
        if own is None or own not in self._idle:
            return self._idle_cells
        return num_cells([slot for slot in self._idle if slot is not own])


def num_cells(slots: list[Slot]) -> int:
    """Distinct cells ``slots`` hold (slots that share a prefix share its cells)."""
    return len({cell for slot in slots for cell in slot.cells})
