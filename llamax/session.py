"""Persistent sessions: a KV sequence that stays resident between requests.

A session owns one pinned slot. Each request gives the session its whole prompt; the
engine keeps the longest common prefix with what the slot holds, drops the diverging
tail (``seq_rm``) and computes only the rest, as ExLlama's ``gen_begin_reuse`` does.
Generated tokens stay in the slot, so the next turn reuses them too.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Protocol, TypeVar

from typing_extensions import Self

from .adapters import AdapterSet
from .backend.vision.chunks import MAX_PLACEHOLDER_DIGITS, placeholder_problem
from .engine.kv.kvops import (
    ForkSession,
    KVOp,
    ReadSession,
    ReleaseSession,
    RestoreSession,
    RewindSession,
    SaveSession,
    ShiftSession,
)
from .errors import (
    ContextClosedError,
    DeadlockError,
    InvalidParameterError,
    SessionBusyError,
    SessionError,
    SessionLoadError,
)
from .handle import RequestHandle
from .params import SamplingParams
from .prompts import Prompt

__all__ = ["Session", "SessionLoader", "SessionPort", "restore_session"]

T = TypeVar("T")
_MAGIC = b"LLAMAXS1"
_MAX_ID_DIGITS = MAX_PLACEHOLDER_DIGITS  # an image's placeholder id, as JSON (the longest)
_HEADER = struct.Struct("<8sI")


class SessionPort(Protocol):
    """All a :class:`Session` may ask of the context that opened it.

    The context builds one and hands it to each session (``Context.session()``,
    :meth:`Session.load`), so a session never reaches into the context's engine or backend.
    """

    @property
    def ended(self) -> bool:
        """Whether the context has closed or failed (which released every session)."""
        ...

    @property
    def model_identity(self) -> dict[str, object]:
        """What identifies the model, written by :meth:`Session.save` and checked on load.

        Raises:
            ContextClosedError: the context is closed.
        """
        ...

    @property
    def projector_identity(self) -> dict[str, object] | None:
        """What identifies the context's projector (``mmproj``), None without one:
        :meth:`Session.save` writes it for a session whose KV holds images, and a load of
        such a session checks it (the same pixels through another projector give other
        cells)."""
        ...

    @property
    def adapter_weights(self) -> dict[str, str]:
        """The LoRA adapters the context has loaded, name -> fingerprint of the file's
        weights: :meth:`Session.save` writes those of the session's adapter set, and a
        load checks them."""
        ...

    def run(self, op: KVOp[T]) -> T:
        """Apply the KV operation ``op`` between two steps and return its result.

        Raises:
            ContextClosedError: the context is closed (or, for most operations, closing).
            DeadlockError: called inside a step (a logits processor).
        """
        ...

    def submit(
        self, prompt: Prompt, params: SamplingParams | None, *, session_id: int
    ) -> RequestHandle:
        """Submit a request that runs on the sequence ``session_id``; never waits for the loop.

        Raises:
            ContextClosedError, InvalidRequestError ...: as ``Context.add_request``.
        """
        ...


class SessionLoader(Protocol):
    """What :meth:`Session.load` needs of the context it restores into: a
    :class:`~llamax.Context` (this module does not import the facade, which imports it)."""

    def load_session(self, path: str | os.PathLike[str]) -> Session:
        """Restore a session saved by :meth:`Session.save`."""
        ...


class Session:
    """A resident KV sequence for multi-turn use. Create with ``ctx.session()``.

    Pinned: never evicted while open (unless opened with ``yields=True``: then its
    sequence goes back to the shared prefix cache while it is idle and others need it, and
    :attr:`token_ids` is empty until its next request). One request at a time. Close it
    (or use ``with``) to free its sequence id and cells. Every change to its cache (fork,
    rewind, shift, save, load, close) is an operation the engine applies between two steps.

    Thread-safe, and no method holds a lock while it waits for the engine, so a
    done-callback (which runs on the engine's loop thread) may call any of them. After the
    context closes, every method but :meth:`close` raises :class:`ContextClosedError`.
    """

    def __init__(self, port: SessionPort, session_id: int) -> None:
        self._port = port
        self._id: int | None = session_id
        # guards _id, _running and _num_ops; never held while waiting for the engine
        self._lock = threading.Lock()
        self._running: RequestHandle | None = None
        self._num_ops = 0  # KV operations of this session on their way to the engine

    # ------------------------------------------------------------------ facts
    @property
    def token_ids(self) -> tuple[int, ...]:
        """The tokens the session holds in KV now; at an image's positions, its placeholder
        ids (negative, derived from its pixels: ``Context.prompt_token_ids`` gives a
        prompt's the same way).

        Raises:
            SessionError: the session is closed.
            ContextClosedError: the context is closed.
        """
        with self._lock:
            session_id = self._session_id()
        return self._port.run(ReadSession(session_id))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called, or the context closed (which releases every
        session)."""
        return self._id is None or self._port.ended

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Run a request on this session. Give the whole conversation so far as ``prompt``.

        Raises:
            SessionBusyError: a request of this session is still running, or one of its
                operations (fork, rewind, shift, save) is under way.
            SessionError: the session is closed.
            ContextClosedError: the context is closed.
        """
        with self._lock:
            session_id = self._check_idle()
            if self._num_ops:
                raise SessionBusyError(
                    "an operation on the session (fork, rewind, shift, save) is under way"
                )
            # submitting never waits for the loop, so it may happen under the lock
            handle = self._port.submit(prompt, params, session_id=session_id)
            self._running = handle
        # No done-callback clears ``_running``: ``_check_idle`` asks the handle instead.
        return handle

    # ------------------------------------------------------------------ KV operations
    def fork(self) -> Session:
        """A new session that shares (copies, cell-free) everything this one holds.

        Raises:
            SessionError: the session is closed or no sequence id is free.
            SessionBusyError: a request of this session is running.
            ContextClosedError: the context is closed.
        """
        return Session(self._port, self._apply(ForkSession))

    def rewind(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens from the session's cache.

        Raises:
            InvalidParameterError: ``num_tokens`` is not an int, negative, or more than the
                session holds (the message names its length).
            SessionError: the session is closed.
            SessionBusyError: a request of this session is running.
            ContextClosedError: the context is closed.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidParameterError(
                f"num_tokens must be an int >= 0, got {num_tokens!r}", param="num_tokens"
            )
        self._apply(lambda session_id: RewindSession(session_id, num_tokens))

    def shift(self, start: int, end: int) -> bool:
        """Remove tokens ``[start, end)`` and move the later cells back by ``end - start``
        positions (``seq_rm`` + ``seq_add``), so they are reused instead of recomputed.

        Returns False, changing nothing, when the memory cannot remove part of a sequence.

        Raises:
            InvalidParameterError: ``start``/``end`` are not ints, the span is not within
                what the session holds, or it cuts through an image (``start`` inside one,
                or ``end`` inside one whose rest would move): shift whole images only.
            SessionError: the session is closed.
            SessionBusyError: a request of this session is running.
            ContextClosedError: the context is closed.
        """
        for value in (start, end):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidParameterError(
                    f"start and end must be ints, got {value!r}",
                    param="start" if value is start else "end",
                )
        return self._apply(lambda session_id: ShiftSession(session_id, start, end))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the session's tokens, KV state, model identity (with the KV cache's
        types, ``kv_type``: a context of other types refuses the file) and the LoRA adapter set
        its cells were computed under (each adapter's name, scale and weights' fingerprint)
        to ``path``; for a session holding images, also the projector's identity (the
        tokens then hold each image's placeholder ids, as :attr:`token_ids` shows them).

        The file is written next to ``path`` and renamed into place, so a crash never
        leaves a half-written session under that name.

        Raises:
            SessionError: the session is closed.
            SessionBusyError: a request of this session is running.
            ContextClosedError: the context is closed.
            OSError: the file cannot be written.
        """
        tokens, state, adapters = self._apply(SaveSession)
        weights = self._port.adapter_weights
        fields: dict[str, object] = {
            "model": self._port.model_identity,
            "tokens": list(tokens),
            "adapters": [
                {"name": name, "scale": scale, "weights": weights.get(name)}
                for name, scale in adapters
            ],
        }
        if any(token < 0 for token in tokens):  # images: their cells are the projector's
            fields["projector"] = self._port.projector_identity
        header = json.dumps(fields).encode()
        target = Path(path)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, len(header)) + header + state)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, ctx: SessionLoader, path: str | os.PathLike[str]) -> Session:
        """Restore a session saved by :meth:`save` into ``ctx``: the same as
        ``ctx.load_session(path)``, where the checks a file must pass are listed
        (:meth:`Context.load_session <llamax.Context.load_session>`).

        Raises:
            SessionLoadError: the file is damaged, lies about its contents, or was saved
                with a different model or under LoRA adapters the context has not loaded.
            ContextClosedError: the context is closed.
            OSError: the file cannot be read.
        """
        return ctx.load_session(path)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Cancel a running request and free the session's cells and sequence id.

        Idempotent; also while the context is closing (``close(drain=True)``), where it
        frees room for the requests still draining. Holds no lock while the engine applies
        it, so a done-callback may call it.

        Raises:
            DeadlockError: called inside a step (a logits processor); the session stays open.
        """
        with self._lock:
            session_id, self._id = self._id, None
        if session_id is None:
            return
        try:
            self._port.run(ReleaseSession(session_id))
        except DeadlockError:
            with self._lock:
                self._id = session_id
            raise
        except ContextClosedError:
            pass  # the context released every session when it closed

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _apply(self, make: Callable[[int], KVOp[T]]) -> T:
        """Run the operation ``make(session_id)`` on the engine, without holding the lock
        while it waits; meanwhile the session refuses new requests (SessionBusyError)."""
        with self._lock:
            session_id = self._check_idle()
            self._num_ops += 1
        try:
            return self._port.run(make(session_id))
        finally:
            with self._lock:
                self._num_ops -= 1

    def _session_id(self) -> int:
        if self._port.ended:
            raise ContextClosedError("the session's context has been closed")
        if self._id is None:
            raise SessionError("the session is closed")
        return self._id

    def _check_idle(self) -> int:
        session_id = self._session_id()
        if self._running is not None and not self._running.done():
            raise SessionBusyError("the session is running a request; wait for it or cancel it")
        return session_id

    def __repr__(self) -> str:
        return f"<llamax.Session {'closed' if self.closed else self._id}>"


def _open_nonblocking(path: str, flags: int) -> int:
    """An ``open`` opener that never blocks: a FIFO in a session's place opens at once."""
    return os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))


def _read_header(file: BinaryIO, path: object, max_size: int) -> tuple[dict[str, Any], int]:
    """The header of an open session file (its model identity, token list, adapter list
    and, with images, projector identity), and the size of the KV state that follows; the
    state is not read yet.

    Raises:
        SessionLoadError: not a regular file, not a session file, or its header is damaged,
            truncated, or longer than ``max_size`` bytes.
    """
    info = os.fstat(file.fileno())
    if not stat.S_ISREG(info.st_mode):
        raise SessionLoadError(f"{path} is not a llamax session file (not a regular file)")
    preamble = file.read(_HEADER.size)
    if len(preamble) < _HEADER.size:
        raise SessionLoadError(f"{path} is not a llamax session file (too short)")
    magic, size = _HEADER.unpack(preamble)
    if magic != _MAGIC:
        raise SessionLoadError(f"{path} is not a llamax session file")
    following = info.st_size - _HEADER.size
    if size > following:
        raise SessionLoadError(
            f"{path} is not a llamax session file (truncated: its header claims {size} "
            f"bytes, {following} follow)"
        )
    if size > max_size:
        raise SessionLoadError(
            f"{path} is not a session of this context: its header of {size} bytes is longer "
            f"than this model's name and n_ctx_seq tokens take ({max_size})"
        )
    try:
        header = json.loads(file.read(size))
    except (ValueError, RecursionError) as exc:
        raise SessionLoadError(f"{path} is not a llamax session file ({exc})") from None
    if (
        not isinstance(header, dict)
        or not isinstance(header.get("tokens"), list)
        or not isinstance(header.get("adapters"), list)
        or "model" not in header
    ):
        raise SessionLoadError(
            f"{path} is not a llamax session file (its header has no model, token list or "
            "adapter list)"
        )
    return header, following - size


def _saved_adapters(saved: list[Any], port: SessionPort, path: object) -> AdapterSet:
    """The adapter set a session file's cells were computed under, each adapter checked
    against the context's: loaded under that name, from a file with the same weights.

    Design note: a session saved under adapters is refused where they are missing, rather
    than loaded with its cells marked for a set no request can name: its KV is worth
    nothing without them, and the error says what to load first.

    Raises:
        SessionLoadError: an entry is not ``{"name", "scale", "weights"}``, or the context
            has not loaded that adapter, or has loaded another file under its name.
    """
    loaded = port.adapter_weights
    adapters: dict[str, float] = {}
    for entry in saved:
        if (
            not isinstance(entry, dict)
            or set(entry) != {"name", "scale", "weights"}
            or not isinstance(entry["name"], str)
            or isinstance(entry["scale"], bool)
            or not isinstance(entry["scale"], (int, float))
            or entry["name"] in adapters
        ):
            raise SessionLoadError(f"{path} is damaged: its adapter list holds {entry!r}")
        name, scale = entry["name"], float(entry["scale"])
        if name not in loaded:
            raise SessionLoadError(
                f"{path} was saved under LoRA adapter {name!r} (scale {scale}), which this "
                "context has not loaded: load it under that name first (Context.load_adapter)"
            )
        if loaded[name] != entry["weights"]:
            raise SessionLoadError(
                f"{path} was saved under LoRA adapter {name!r}, but this context's "
                f"{name!r} is another file (other weights)"
            )
        adapters[name] = scale
    return AdapterSet.of(adapters.items())


def restore_session(
    port: SessionPort,
    path: str | os.PathLike[str],
    *,
    n_vocab: int,
    n_ctx_seq: int,
    yields: bool = False,
) -> Session:
    """Restore the session saved in ``path`` through ``port`` (the context's side of
    :meth:`Session.load`: it checks that the context is open and passes its vocabulary size and
    ``n_ctx_seq``); ``yields`` as ``Context.session``'s.

    Raises:
        SessionLoadError, ContextClosedError, OSError: as :meth:`Session.load`.
    """
    current = port.model_identity
    names = json.dumps({"model": current, "projector": port.projector_identity})
    max_header = 2 * len(names) + (_MAX_ID_DIGITS + 2) * n_ctx_seq
    with open(path, "rb", opener=_open_nonblocking) as file:
        header, state_size = _read_header(file, path, max_header + 1024)
        tokens = header["tokens"]
        _check_header(path, header["model"], tokens, current, n_vocab, n_ctx_seq)
        _check_images(path, tokens, header.get("projector"), port.projector_identity)
        adapters = _saved_adapters(header["adapters"], port, path)
        state = file.read(state_size)  # only now: a header that does not fit reads no state
    if len(state) != state_size:
        raise SessionLoadError(f"{path} changed while it was read")
    try:
        session_id = port.run(RestoreSession(tuple(tokens), state, adapters, yields))
    except SessionLoadError as exc:
        raise SessionLoadError(
            f"{path} is damaged: its KV state is not whole or does not hold exactly "
            f"the {len(tokens)} tokens its header lists"
        ) from exc
    return Session(port, session_id)


def _check_header(
    path: object,
    saved_model: object,
    tokens: list[Any],
    current: object,
    n_vocab: int,
    n_ctx_seq: int,
) -> None:
    """Raise SessionLoadError unless a session file's header fits this context."""
    _check_kv_types(path, saved_model, current)
    if saved_model != current:
        raise SessionLoadError(
            f"{path} was saved with model {saved_model} but this context runs {current}"
        )
    for token in tokens:  # a negative one is an image's placeholder id: _check_images
        if isinstance(token, bool) or not isinstance(token, int) or token >= n_vocab:
            raise SessionLoadError(
                f"{path} lists token {token!r}, not an id of this vocabulary [0, {n_vocab})"
            )
    if len(tokens) > n_ctx_seq:
        raise SessionLoadError(
            f"{path} lists {len(tokens)} tokens, more than one sequence may hold "
            f"(n_ctx_seq={n_ctx_seq})"
        )


def _kv_options(kv_cache: object) -> str:
    """The options that give a context the K/V types ``kv_cache`` names (``"Q8_0/F16"``:
    ``kv_type_k='q8_0'``), as a sentence's words."""
    k, _, v = str(kv_cache).lower().partition("/")
    if k == v:
        return f"kv_type={k!r}"
    return f"kv_type_k={k!r}, kv_type_v={v!r}"


def _check_kv_types(path: object, saved_model: object, current: object) -> None:
    """Raise SessionLoadError, saying which types, if a session file was saved by this
    model with a KV cache of other types than this context's (``kv_type``): llama.cpp
    cannot read its cells at these."""
    if not isinstance(saved_model, dict) or not isinstance(current, dict):
        return
    saved_kv, kv = saved_model.get("kv_cache"), current.get("kv_cache")
    if saved_kv == kv:
        return
    others = {k: v for k, v in saved_model.items() if k != "kv_cache"}
    if others != {k: v for k, v in current.items() if k != "kv_cache"}:
        return  # another model altogether: that is what the error says
    raise SessionLoadError(
        f"{path} holds a KV cache of types {saved_kv} (K/V) and this context's is {kv}: "
        f"its cells cannot be read at other types; load it into a context with "
        f"{_kv_options(saved_kv)}"
    )


def _check_images(
    path: object, tokens: list[int], saved: object, current: dict[str, object] | None
) -> None:
    """Raise SessionLoadError unless a session file's images (placeholder ids among its
    tokens) are well formed and were encoded by this context's projector."""
    if all(token >= 0 for token in tokens):
        return
    problem = placeholder_problem(tokens)
    if problem is not None:
        raise SessionLoadError(f"{path} is damaged: {problem}")
    if current is None:
        raise SessionLoadError(
            f"{path} holds images, and this context has no projector: load it into a "
            "context with the projector (mmproj) it was saved with"
        )
    if saved != current:
        raise SessionLoadError(
            f"{path} holds images encoded by another projector ({saved}) than this "
            f"context's ({current})"
        )
