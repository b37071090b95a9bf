"""Typed KV-cache operations: the only way code outside the scheduler changes the cache.

A :class:`Session`, a :class:`~llamax.Chat` or ``Context.clear_cache`` builds one of these
and hands it to the engine, which applies it on the loop thread between two steps
(``Scheduler.apply``) and returns its result to the caller. The scheduler then emits the
backend calls. So the KV layout is known in one place, and no step ever sees a cache that
another thread is halfway through changing.

Each operation names its result type (``KVOp[int]`` ...), so ``engine.run(op)`` is typed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ...adapters import NO_ADAPTERS, AdapterSet

__all__ = [
    "Audit",
    "ClearCache",
    "ForkSession",
    "KVOp",
    "OpenSession",
    "ReadSession",
    "ReleaseSession",
    "RestoreSession",
    "RewindSession",
    "SaveSession",
    "ShiftSession",
]

T_co = TypeVar("T_co", covariant=True)


class KVOp(Generic[T_co]):
    """Base of every operation; its type argument is what applying it returns."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class OpenSession(KVOp[int]):
    """Pin a fresh, empty sequence for a session; returns the session id."""

    yields: bool = False
    """Whether the session gives its sequence back when others need it (see
    :meth:`~llamax.engine.kv.session_table.SessionTable.yield_idle`)."""


@dataclass(frozen=True, slots=True)
class ForkSession(KVOp[int]):
    """A new session sharing everything ``session_id`` holds; returns its id."""

    session_id: int


@dataclass(frozen=True, slots=True)
class RewindSession(KVOp[None]):
    """Drop the last ``num_tokens`` tokens of a session (it must hold that many)."""

    session_id: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ShiftSession(KVOp[bool]):
    """Remove tokens ``[start, end)`` of a session and move the rest back (history shift).
    Returns False, changing nothing, when the memory refuses a partial removal."""

    session_id: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class ReadSession(KVOp[tuple[int, ...]]):
    """The tokens a session holds in KV."""

    session_id: int


@dataclass(frozen=True, slots=True)
class SaveSession(KVOp[tuple[tuple[int, ...], bytes, AdapterSet]]):
    """A session's tokens, serialised KV state, and the LoRA adapter set its cells were
    computed under (``()``: the base model)."""

    session_id: int


@dataclass(frozen=True, slots=True)
class RestoreSession(KVOp[int]):
    """Open a session holding ``tokens`` from a state saved by :class:`SaveSession`, its
    cells marked as computed under ``adapters`` (so a request under another set never
    reuses them)."""

    tokens: tuple[int, ...]
    state: bytes = field(repr=False)
    adapters: AdapterSet = NO_ADAPTERS
    yields: bool = False
    """As :attr:`OpenSession.yields`."""


@dataclass(frozen=True, slots=True)
class ReleaseSession(KVOp[None]):
    """Free a session's cells and sequence id (its request must have ended)."""

    session_id: int


@dataclass(frozen=True, slots=True)
class ClearCache(KVOp[int]):
    """Evict every retained prefix; returns how many sequences were freed."""


@dataclass(frozen=True, slots=True)
class Audit(KVOp[list[str]]):
    """Compare the bookkeeping with the backend's memory; returns every inconsistency."""
