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
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from typing_extensions import Self

from .errors import SessionBusyError, SessionError, SessionLoadError
from .handle import RequestHandle
from .kvcache import Slot
from .params import SamplingParams

if TYPE_CHECKING:
    from .context import Context

__all__ = ["Session"]

_MAGIC = b"LLAMAXS1"
_HEADER = struct.Struct("<8sI")


class Session:
    """A resident KV sequence for multi-turn use. Create with ``ctx.session()``.

    Pinned: never evicted while open. One request at a time. Close it (or use ``with``) to
    free its sequence id and cells.
    """

    def __init__(self, ctx: Context, slot: Slot) -> None:
        self._ctx = ctx
        self._slot: Slot | None = slot
        self._lock = threading.Lock()
        self._running: RequestHandle | None = None

    # ------------------------------------------------------------------ facts
    @property
    def slot(self) -> Slot:
        """The pinned slot (engine side)."""
        if self._slot is None:
            raise SessionError("the session is closed")
        return self._slot

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The tokens the session holds in KV now."""
        return tuple(self.slot.tokens)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._slot is None

    # ------------------------------------------------------------------ requests
    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> RequestHandle:
        """Run a request on this session. Give the whole conversation so far as ``prompt``.

        Raises:
            SessionBusyError: a request of this session is still running.
            SessionError: the session is closed.
        """
        with self._lock:
            self._check_idle()
            handle = self._ctx._submit(prompt, params, session=self)
            self._running = handle
        handle.future.add_done_callback(self._done)
        return handle

    def _done(self, _future: object) -> None:
        with self._lock:
            self._running = None

    # ------------------------------------------------------------------ KV operations
    def fork(self) -> Session:
        """A new session that shares (copies, cell-free) everything this one holds."""
        with self._lock:
            self._check_idle()
            return Session(self._ctx, self._ctx._engine.call(self._fork_now))

    def _fork_now(self) -> Slot:
        cache = self._ctx._engine.scheduler.cache
        slot = cache.allocate(pinned=True)
        if slot is None:
            raise SessionError(
                "no free sequence id for the fork; raise n_seq_max or close sessions"
            )
        if self.slot.tokens:
            cache.copy_prefix(self.slot, slot, len(self.slot.tokens))
        return slot

    def rewind(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens from the session's cache."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        with self._lock:
            self._check_idle()
            self._ctx._engine.call(self._rewind_now(num_tokens))

    def _rewind_now(self, num_tokens: int) -> Any:
        def run() -> None:
            cache = self._ctx._engine.scheduler.cache
            keep = max(0, len(self.slot.tokens) - num_tokens)
            if not cache.truncate(self.slot, keep):
                cache.clear(self.slot)

        return run

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the session's tokens, KV state and model identity to ``path``."""
        with self._lock:
            self._check_idle()
            backend = self._ctx._backend
            tokens, state = self._ctx._engine.call(
                lambda: (list(self.slot.tokens), backend.state_seq_get(self.slot.seq_id))
            )
        header = json.dumps({"model": backend.model_identity, "tokens": tokens}).encode()
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
            tokens = [int(t) for t in header["tokens"]]
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
        return cls(ctx, ctx._engine.call(lambda: _restore(ctx, tokens, state)))

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Cancel a running request and free the session's cells and sequence id."""
        with self._lock:
            running, slot = self._running, self._slot
        if slot is None:
            return
        if running is not None:
            running.cancel()
            while not running.done():  # wait until the engine has let go of the slot
                if self._ctx._engine.is_background:
                    running.future.exception()
                else:
                    self._ctx.process()
        if not self._ctx.closed:
            self._ctx._engine.call(lambda: self._ctx._engine.scheduler.cache.release(slot))
        self._slot = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_idle(self) -> None:
        if self._slot is None:
            raise SessionError("the session is closed")
        if self._running is not None and not self._running.done():
            raise SessionBusyError("the session is running a request; wait for it or cancel it")

    def __repr__(self) -> str:
        held = "closed" if self._slot is None else f"{len(self._slot.tokens)} tokens"
        return f"<llamax.Session {held}>"


def _restore(ctx: Context, tokens: list[int], state: bytes) -> Slot:
    scheduler = ctx._engine.scheduler
    slot = scheduler.cache.allocate(pinned=True)
    if slot is None:
        raise SessionError("no free sequence id to load the session into")
    if not ctx._backend.state_seq_set(slot.seq_id, state):
        scheduler.cache.release(slot)
        raise SessionLoadError("llama.cpp refused the saved state (damaged file?)")
    scheduler.cache.append(slot, tokens)
    return slot
