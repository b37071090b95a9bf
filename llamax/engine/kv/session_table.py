"""The scheduler's side of sessions and cache-wide operations: it applies every
:mod:`llamax.engine.kv.kvops` operation on the loop thread, between steps.

A session is a pinned slot known by a session id. Its requests are admitted into that slot
(keeping the common prefix of what it holds); ``ReleaseSession`` first cancels a request
of the session that is still queued or running, so closing never waits on the loop.

A session opened to *yield* (``OpenSession(yields=True)``) gives its slot up while idle
when another sequence lacks the id or cells it holds (:meth:`SessionTable.yield_idle`,
least recently used first): the slot becomes an ordinary retained prefix, and the
session's next request is placed as any newcomer (reusing that prefix if it survived) and
pinned again. So sessions that yield never lock other requests out; their cache is a
preference, not a reservation.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Set
from typing import Protocol

from ...adapters import AdapterSet
from ...backend.base import Backend
from ...errors import InvalidParameterError, SessionError, SessionLoadError
from ..images import check_shift
from ..plan import StepResult
from ..sequence import Request, Sequence
from .audit import audit
from .kvcache import KVCache, Slot, SlotState
from .kvops import (
    Audit,
    ClearCache,
    ForkSession,
    KVOp,
    OpenSession,
    ReadSession,
    ReleaseSession,
    RestoreSession,
    RewindSession,
    SaveSession,
    ShiftSession,
)
from .prefix import PrefixCache

__all__ = ["SessionOwner", "SessionTable"]


class SessionOwner(Protocol):
    """What the session table needs of the scheduler that owns it."""

    kv: KVCache
    prefix: PrefixCache

    @property
    def backend(self) -> Backend:
        """The backend the scheduler drives."""
        ...

    @property
    def num_pending_tokens(self) -> int:
        """Tokens the running sequences still have to compute."""
        ...

    def all_sequences(self) -> list[Sequence]:
        """Every waiting and running sequence."""
        ...

    def abort(self, request: Request, result: StepResult) -> None:
        """Cancel every unfinished sequence of ``request``, freeing its KV cells now."""
        ...


class SessionTable:
    """Pinned slots by session id, and the operations that change the cache."""

    def __init__(self, scheduler: SessionOwner) -> None:
        self._scheduler = scheduler
        self._slots: dict[int, Slot] = {}  # open sessions holding a pinned slot
        self._yielders: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._yielded: set[int] = set()  # yielders whose slot went to the prefix cache
        self._ids = itertools.count(1)

    @property
    def num_open(self) -> int:
        """Open sessions."""
        return len(self._slots) + len(self._yielded)

    @property
    def ids(self) -> list[int]:
        """The open sessions' ids."""
        return [*self._slots, *sorted(self._yielded)]

    def slot(self, session_id: int) -> Slot:
        """The pinned slot of an open session (for one that yielded its slot, a fresh
        empty one pinned now).

        Raises:
            SessionError: the session is closed, or it yielded its slot and no sequence id
                is free for another.
        """
        if session_id in self._yielded:
            slot = self._scheduler.prefix.allocate(pinned=True)
            if slot is None:
                raise SessionError(
                    "the session gave its sequence to other requests, and every sequence id "
                    "is held by running sequences or sessions now; try again"
                )
            self._yielded.discard(session_id)
            self._slots[session_id] = slot
        try:
            return self._slots[session_id]
        except KeyError:
            raise SessionError("the session is closed") from None

    def is_yielded(self, session_id: int) -> bool:
        """Whether an open session gave its slot up (its next request is placed anew)."""
        return session_id in self._yielded

    def pin(self, session_id: int, slot: Slot) -> None:
        """Make ``slot`` (ACTIVE: just placed for the session's request) the pinned slot
        of the session ``session_id``, which had yielded its own."""
        slot.move(SlotState.PINNED)
        self._yielded.discard(session_id)
        self._slots[session_id] = slot

    def touch(self, session_id: int) -> None:
        """A request of ``session_id`` was admitted: it yields last."""
        if session_id in self._yielders:
            self._yielders.move_to_end(session_id)

    def can_yield(self, busy: Set[int | None]) -> bool:
        """Whether a session that yields holds a slot and is not among ``busy``."""
        return any(i in self._slots and i not in busy for i in self._yielders)

    def yield_idle(self, busy: Set[int | None]) -> bool:
        """Give the slot of the least recently used session that yields, holds one and is
        not among ``busy`` (sessions with a waiting or running sequence) to the prefix
        cache; whether there was one."""
        for session_id in self._yielders:
            if session_id in self._slots and session_id not in busy:
                self._yielded.add(session_id)
                self._scheduler.prefix.unpin(self._slots.pop(session_id))
                return True
        return False

    def slot_or_none(self, session_id: int) -> Slot | None:
        """The pinned slot of an open session, or None once it is closed."""
        return self._slots.get(session_id)

    def ids_of(self, slots: list[Slot]) -> list[int]:
        """The ids of the sessions holding ``slots``, in order of opening."""
        wanted = {id(slot) for slot in slots}
        return [i for i, slot in self._slots.items() if id(slot) in wanted]

    def apply(self, op: KVOp[object], result: StepResult) -> object:
        """Apply ``op``; events it causes (a cancelled session request) go into ``result``.

        Raises:
            SessionError: the session is closed, or no sequence id is free.
            SessionLoadError: llama.cpp refused a saved state.
            InvalidParameterError: a rewind or shift out of range, or a shift through an
                image.
        """
        kv = self._scheduler.kv
        match op:
            case OpenSession(yields):
                return self._open(yields=yields)
            case ForkSession(session_id):
                return self._fork(self.slot(session_id))
            case RewindSession(session_id, num_tokens):
                self._rewind(self.slot(session_id), num_tokens)
                return None
            case ShiftSession(session_id, start, end):
                slot = self.slot(session_id)
                check_shift(slot.tokens, start, end)
                return kv.shift_out(slot, start, end)
            case ReadSession(session_id):
                if session_id in self._yielded:
                    return ()
                return tuple(self.slot(session_id).tokens)
            case SaveSession(session_id):
                slot = self.slot(session_id)
                return tuple(slot.tokens), kv.save(slot), slot.adapters
            case RestoreSession(tokens, state, adapters, yields):
                return self._restore(tokens, state, adapters, yields=yields)
            case ReleaseSession(session_id):
                self._release(session_id, result)
                return None
            case ClearCache():
                return self._scheduler.prefix.evict_all()
            case Audit():
                scheduler = self._scheduler
                return (
                    audit(
                        scheduler.backend,
                        scheduler.kv,
                        scheduler.all_sequences(),
                        self._slots.values(),
                    )
                    + scheduler.prefix.audit()
                )
        raise TypeError(f"unknown KV operation {op!r}")

    # ------------------------------------------------------------------ operations
    def _fork(self, source: Slot) -> int:
        session_id = self._open(keep=source, purpose="the fork")
        self._slots[session_id].adapters = source.adapters  # the cells' mark goes with them
        if source.tokens:
            try:
                self._scheduler.kv.copy_prefix(source, self._slots[session_id], len(source.tokens))
            except BaseException:  # the caller gets no Session: nothing else could free it
                self._scheduler.kv.release(self._slots.pop(session_id))
                raise
        return session_id

    def _rewind(self, slot: Slot, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(slot.tokens):
            raise InvalidParameterError(
                f"cannot rewind {num_tokens} tokens: the session holds {len(slot.tokens)}",
                param="num_tokens",
            )
        kv = self._scheduler.kv
        keep = kv.usable(slot, len(slot.tokens) - num_tokens)  # a memory cut at checkpoints
        if not kv.truncate(slot, keep):  # goes back to the last one (the rest is recomputed)
            kv.clear(slot)

    def _restore(
        self, tokens: tuple[int, ...], state: bytes, adapters: AdapterSet, *, yields: bool
    ) -> int:
        session_id = self._open(purpose="the loaded session")
        slot = self._slots[session_id]
        slot.adapters = adapters
        try:
            self._make_room(len(tokens))
            restored = self._scheduler.kv.restore(slot, tokens, state)
        except BaseException:  # the caller gets no Session: nothing else could free it
            self._forget(session_id)
            raise
        if not restored:
            self._forget(session_id)
            raise SessionLoadError("llama.cpp refused the saved state (damaged file?)")
        if yields:  # only now: making room must not yield the slot being loaded
            self._yielders[session_id] = None
        return session_id

    def _make_room(self, num_cells: int) -> None:
        """Evict retained prefixes (and yield idle sessions that yield) until ``num_cells``
        more fit beside what runs and what the sessions hold (a unified cache; a stream
        holds its own).

        Raises:
            SessionError: they do not fit even then (the message says how many do).
        """
        scheduler, kv = self._scheduler, self._scheduler.kv
        if not kv.is_unified:
            return
        n_ctx = scheduler.backend.facts.n_ctx
        while kv.num_cells_used + scheduler.num_pending_tokens + num_cells > n_ctx:
            if not scheduler.prefix.evict_one() and not self.yield_idle(self._busy()):
                free = n_ctx - kv.num_cells_used - scheduler.num_pending_tokens
                raise SessionError(
                    f"no room to load a session of {num_cells} tokens: {max(0, free)} of "
                    f"{n_ctx} KV cells are free beside running requests and open sessions; "
                    "close a session or load it when requests have finished"
                )

    def _release(self, session_id: int, result: StepResult) -> None:
        if session_id not in self._slots and session_id not in self._yielded:
            return
        for seq in self._scheduler.all_sequences():
            if seq.request.session_id == session_id:
                self._scheduler.abort(seq.request, result)
        self._forget(session_id)

    def _busy(self) -> set[int | None]:
        """The sessions with a waiting or running sequence."""
        return {seq.request.session_id for seq in self._scheduler.all_sequences()}

    def _forget(self, session_id: int) -> None:
        """Drop an open session, releasing its slot if it holds one."""
        self._yielders.pop(session_id, None)
        self._yielded.discard(session_id)
        slot = self._slots.pop(session_id, None)
        if slot is not None:
            self._scheduler.kv.release(slot)

    def _open(
        self, *, keep: Slot | None = None, purpose: str = "a session", yields: bool = False
    ) -> int:
        slot = self._scheduler.prefix.allocate(pinned=True, keep=keep)
        if slot is None and keep is None and not yields and self.yield_idle(self._busy()):
            slot = self._scheduler.prefix.allocate(pinned=True, keep=keep)
        if slot is None and yields:  # it starts as if it had yielded: placed at its request
            session_id = next(self._ids)
            self._yielders[session_id] = None
            self._yielded.add(session_id)
            return session_id
        if slot is None:
            raise SessionError(
                f"no free sequence id for {purpose}: every one is held by running "
                "sequences or sessions; close a session or raise n_seq_max"
            )
        session_id = next(self._ids)
        self._slots[session_id] = slot
        if yields:
            self._yielders[session_id] = None
        return session_id
