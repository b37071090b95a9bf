"""Persistent sessions: a KV sequence that stays resident between requests.

A session owns one pinned slot. Each request gives the session its whole prompt; the
engine keeps the longest common prefix with what the slot holds, drops the diverging
tail (``seq_rm``) and computes only the rest, as ExLlama's ``gen_begin_reuse`` does.
Generated tokens stay in the slot, so the next turn reuses them too.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from typing_extensions import Self

from .errors import InvalidParameterError, SessionBusyError, SessionError, SessionLoadError
from .handle import RequestHandle
from .kvops import (
    ForkSession,
    ReadSession,
    ReleaseSession,
    RestoreSession,
    RewindSession,
    SaveSession,
    ShiftSession,
)
from .params import SamplingParams
from .prompts import Prompt

if TYPE_CHECKING:
    from .context import Context

__all__ = ["Session"]

_MAGIC = b"LLAMAXS1"
_HEADER = struct.Struct("<8sI")


class Session:
    """A resident KV sequence for multi-turn use. Create with ``ctx.session()``.

    Pinned: never evicted while open. One request at a time. Close it (or use ``with``) to
    free its sequence id and cells. Every change to its cache (fork, rewind, shift, save,
    load, close) is an operation the engine applies between two steps.
    """

    def __init__(self, ctx: Context, session_id: int) -> None:
        self._ctx = ctx
        self._id: int | None = session_id
        self._lock = threading.Lock()
        self._running: RequestHandle | None = None

    # ------------------------------------------------------------------ facts
    @property
    def token_ids(self) -> tuple[int, ...]:
        """The tokens the session holds in KV now.

        Raises:
            SessionError: the session is closed.
        """
        return self._ctx._engine.run(ReadSession(self._session_id()))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._id is None

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Run a request on this session. Give the whole conversation so far as ``prompt``.

        Raises:
            SessionBusyError: a request of this session is still running.
            SessionError: the session is closed.
        """
        with self._lock:
            session_id = self._check_idle()
            handle = self._ctx._submit(prompt, params, session_id=session_id)
            self._running = handle
        # No done-callback clears ``_running``: the loop thread would run it and need
        # ``_lock``, which rewind/shift/fork/save hold while they wait for that very thread
        # (a deadlock when the caller saw the result before the callback ran).
        # ``_check_idle`` asks the handle instead.
        return handle

    # ------------------------------------------------------------------ KV operations
    def fork(self) -> Session:
        """A new session that shares (copies, cell-free) everything this one holds.

        Raises:
            SessionError: the session is closed or no sequence id is free.
            SessionBusyError: a request of this session is running.
        """
        with self._lock:
            session_id = self._check_idle()
            return Session(self._ctx, self._ctx._engine.run(ForkSession(session_id)))

    def rewind(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens from the session's cache.

        Raises:
            InvalidParameterError: ``num_tokens`` is not an int, negative, or more than the
                session holds (the message names its length).
            SessionError: the session is closed.
            SessionBusyError: a request of this session is running.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidParameterError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        with self._lock:
            self._ctx._engine.run(RewindSession(self._check_idle(), num_tokens))

    def shift(self, start: int, end: int) -> bool:
        """Remove tokens ``[start, end)`` and move the later cells back by ``end - start``
        positions (``seq_rm`` + ``seq_add``), so they are reused instead of recomputed.

        Returns False, changing nothing, when the memory cannot remove part of a sequence.

        Raises:
            InvalidParameterError: ``start``/``end`` are not ints, or the span is not
                within what the session holds.
            SessionError: the session is closed.
            SessionBusyError: a request of this session is running.
        """
        for value in (start, end):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidParameterError(f"start and end must be ints, got {value!r}")
        with self._lock:
            return self._ctx._engine.run(ShiftSession(self._check_idle(), start, end))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the session's tokens, KV state and model identity to ``path``."""
        with self._lock:
            tokens, state = self._ctx._engine.run(SaveSession(self._check_idle()))
        identity = self._ctx._backend.model_identity
        header = json.dumps({"model": identity, "tokens": list(tokens)}).encode()
        Path(path).write_bytes(_HEADER.pack(_MAGIC, len(header)) + header + state)

    @classmethod
    def load(cls, ctx: Context, path: str | os.PathLike[str]) -> Session:
        """Restore a session saved by :meth:`save` into ``ctx``.

        Raises:
            SessionLoadError: the file is damaged or was saved with a different model.
        """
        data = Path(path).read_bytes()
        try:
            magic, size = _HEADER.unpack_from(data)
            header = json.loads(data[_HEADER.size : _HEADER.size + size])
            tokens = tuple(int(t) for t in header["tokens"])
            saved_model = header["model"]
        except (struct.error, ValueError, KeyError, TypeError) as exc:
            raise SessionLoadError(f"{path} is not a llamax session file") from exc
        if magic != _MAGIC:
            raise SessionLoadError(f"{path} is not a llamax session file")
        current = ctx._backend.model_identity
        if saved_model != current:
            raise SessionLoadError(
                f"{path} was saved with model {saved_model} but this context runs {current}"
            )
        state = data[_HEADER.size + size :]
        return cls(ctx, ctx._engine.run(RestoreSession(tokens, state)))

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Cancel a running request and free the session's cells and sequence id.

        Never waits on the loop, so a done-callback may call it.
        """
        with self._lock:
            session_id, self._id = self._id, None
        if session_id is not None and not self._ctx.closed:
            self._ctx._engine.run(ReleaseSession(session_id))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _session_id(self) -> int:
        if self._id is None:
            raise SessionError("the session is closed")
        return self._id

    def _check_idle(self) -> int:
        session_id = self._session_id()
        if self._running is not None and not self._running.done():
            raise SessionBusyError("the session is running a request; wait for it or cancel it")
        return session_id

    def __repr__(self) -> str:
        return f"<llamax.Session {'closed' if self._id is None else self._id}>"
