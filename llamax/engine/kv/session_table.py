"""The scheduler's side of sessions and cache-wide operations: it applies every
:mod:`llamax.engine.kv.kvops` operation on the loop thread, between steps.

A session is a pinned slot known by a session id. Its requests are admitted into that slot
(keeping the common prefix of what it holds); ``ReleaseSession`` first cancels a request
of the session that is still queued or running, so closing never waits on the loop.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from ...adapters import AdapterSet
from ...backend.base import Backend
from ...errors import InvalidParameterError, SessionError, SessionLoadError
from ..images import check_shift
from ..plan import StepResult
from ..sequence import Request, Sequence
from .audit import audit
from .kvcache import KVCache, Slot
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
        self._slots: dict[int, Slot] = {}
        self._ids = itertools.count(1)

    @property
    def num_open(self) -> int:
        """Open sessions."""
        return len(self._slots)

    @property
    def ids(self) -> list[int]:
        """The open sessions' ids."""
        return list(self._slots)

    def slot(self, session_id: int) -> Slot:
        """The pinned slot of an open session.

        Raises:
            SessionError: the session is closed.
        """
        try:
            return self._slots[session_id]
        except KeyError:
            raise SessionError("the session is closed") from None

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
            case OpenSession():
                return self._open()
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
                return tuple(self.slot(session_id).tokens)
            case SaveSession(session_id):
                slot = self.slot(session_id)
                return tuple(slot.tokens), kv.save(slot), slot.adapters
            case RestoreSession(tokens, state, adapters):
                return self._restore(tokens, state, adapters)
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
                f"cannot rewind {num_tokens} tokens: the session holds {len(slot.tokens)}"
            )
        kv = self._scheduler.kv
        keep = kv.usable(slot, len(slot.tokens) - num_tokens)  # a memory cut at checkpoints
        if not kv.truncate(slot, keep):  # goes back to the last one (the rest is recomputed)
            kv.clear(slot)

    def _restore(self, tokens: tuple[int, ...], state: bytes, adapters: AdapterSet) -> int:
        session_id = self._open(purpose="the loaded session")
        slot = self._slots[session_id]
        slot.adapters = adapters
        try:
            self._make_room(len(tokens))
            restored = self._scheduler.kv.restore(slot, tokens, state)
        except BaseException:  # the caller gets no Session: nothing else could free it
            self._scheduler.kv.release(self._slots.pop(session_id))
            raise
        if not restored:
            self._scheduler.kv.release(self._slots.pop(session_id))
            raise SessionLoadError("llama.cpp refused the saved state (damaged file?)")
        return session_id

    def _make_room(self, num_cells: int) -> None:
        """Evict retained prefixes until ``num_cells`` more fit beside what runs and what
        the sessions hold (a unified cache; a stream holds its own).

        Raises:
            SessionError: they do not fit even then (the message says how many do).
        """
        scheduler, kv = self._scheduler, self._scheduler.kv
        if not kv.is_unified:
            return
        n_ctx = scheduler.backend.n_ctx
        while kv.num_cells_used + scheduler.num_pending_tokens + num_cells > n_ctx:
            if not scheduler.prefix.evict_one():
                free = n_ctx - kv.num_cells_used - scheduler.num_pending_tokens
                raise SessionError(
                    f"no room to load a session of {num_cells} tokens: {max(0, free)} of "
                    f"{n_ctx} KV cells are free beside running requests and open sessions; "
                    "close a session or load it when requests have finished"
                )

    def _release(self, session_id: int, result: StepResult) -> None:
        if session_id not in self._slots:
            return
        for seq in self._scheduler.all_sequences():
            if seq.request.session_id == session_id:
                self._scheduler.abort(seq.request, result)
        self._scheduler.kv.release(self._slots.pop(session_id))

    def _open(self, *, keep: Slot | None = None, purpose: str = "a session") -> int:
        slot = self._scheduler.prefix.allocate(pinned=True, keep=keep)
        if slot is None:
            raise SessionError(
                f"no free sequence id for {purpose}: every one is held by running "
                "sequences or sessions; close a session or raise n_seq_max"
            )
        session_id = next(self._ids)
        self._slots[session_id] = slot
        return session_id
