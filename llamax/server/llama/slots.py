"""llama-server's slots on llamax: ``GET /slots`` and ``POST /slots/{id}?action=save|
restore|erase``.

llama-server runs every request in one of ``--parallel`` fixed slots, each a KV sequence
that keeps its last prompt. llamax has no fixed slots: any request takes a free sequence,
and finished ones stay in a shared prefix cache. So a slot here is a name the native
routes give a sequence:

- ``n_seq_max`` slots, ids ``0 .. n_seq_max - 1``, per model.
- A request that names ``id_slot`` runs on that slot's :class:`~llamax.Session` (opened on
  first use): its KV stays resident between requests, and a later request on the same slot
  computes only what differs, as llama-server's ``id_slot`` with ``cache_prompt`` does.
  Requests on one slot run one at a time (a second waits, as llama-server defers it).
- A slot never locks other clients out (any client may name any slot): its session
  *yields* (``Context.session(yields=True)``), so while it is idle and another request
  lacks the sequence id or cells it holds, its KV becomes an ordinary retained prefix
  (least recently used slot first), which its next request reuses if it survived. A slot
  idle for ``SlotPolicy.idle_seconds`` is closed (``--slot-idle-seconds``).
- A request that names no slot runs as an ordinary llamax request (any sequence, the
  shared prefix cache); while it runs it shows in ``GET /slots`` under the first slot that
  is neither busy nor holding a session.
- ``save`` writes the slot's session with :meth:`~llamax.Session.save` (llamax's session
  file, validated on load; not llama.cpp's state file), ``restore`` loads one into the
  slot with :meth:`~llamax.Context.load_session`, ``erase`` closes the slot's session
  (with or without a save folder). Files live in ``--slot-save-path``; a file name is
  checked as llama-server checks it (no separators, no ``..``, no control characters), so
  no path leaves that folder, and errors name the file, never the folder.
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import llamax

from ..schemas import parse_object
from ..state import ServerState, read_body
from .errors import LlamaError, as_llama_error, llama_error_response

__all__ = [
    "Slot",
    "SlotPolicy",
    "SlotTable",
    "SlotTables",
    "leased",
    "slot_routes",
    "slot_tables",
    "table_of",
    "valid_filename",
]


@asynccontextmanager
async def leased(state: ServerState, model: object) -> AsyncIterator[llamax.Context]:
    """The context ``model`` names (``None``: the default), held (an admission slot taken,
    the model pinned) until the block ends.

    Raises:
        APIError: 503 when the server is busy or the model unavailable, 404 for an unknown
            model, as :meth:`~llamax.server.state.ServerState.lease`.
    """
    state.admit()
    try:
        lease = state.lease(model)
    except BaseException:
        state.release()
        raise
    try:
        yield await lease.context()
    finally:
        lease.release()


@dataclass(frozen=True, slots=True)
class SlotPolicy:
    """How long slots keep their sessions."""

    idle_seconds: float = 300.0
    """A slot whose session has run nothing for this long is closed (its KV freed)."""
    clock: Callable[[], float] = time.monotonic
    """What idle time is measured with (seconds; tests pass their own)."""

    def __post_init__(self) -> None:
        if not self.idle_seconds > 0:
            raise ValueError(f"idle_seconds must be > 0, got {self.idle_seconds!r}")


@dataclass(eq=False)
class Slot:
    """One slot: its session (when a request named it, or a file was restored into it)
    and the request running on it."""

    id: int
    session: llamax.Session | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by the request or action on the slot's session."""
    task: dict[str, Any] | None = None
    """What ``GET /slots`` shows of the running (or last) request."""
    is_processing: bool = False
    num_tasks: int = 0
    last_used: float = 0.0
    """When a request or action last used the slot (:attr:`SlotPolicy.clock`)."""


class SlotTable:
    """The slots of one context.

    Args:
        ctx: The context the slots' sessions live in.
        policy: When idle slots are closed.
    """

    def __init__(self, ctx: llamax.Context, policy: SlotPolicy | None = None) -> None:
        self.ctx = ctx
        self.policy = policy or SlotPolicy()
        self.slots = [Slot(i) for i in range(ctx.n_seq_max)]
        self._next_task = 0

    def get(self, id_slot: object) -> Slot:
        """The slot ``id_slot`` names.

        Raises:
            LlamaError: 400 ``Invalid slot ID`` (llama-server's words) for anything else.
        """
        if isinstance(id_slot, str) and id_slot.lstrip("-").isdigit():
            id_slot = int(id_slot)
        if isinstance(id_slot, bool) or not isinstance(id_slot, int):
            raise LlamaError(400, "Invalid slot ID")
        if not 0 <= id_slot < len(self.slots):
            raise LlamaError(400, f"Invalid slot ID: {id_slot} (slots are 0 .. "
                             f"{len(self.slots) - 1})")  # fmt: skip
        return self.slots[id_slot]

    def idle(self) -> Slot | None:
        """The first slot free to show a request that names none."""
        return next((s for s in self.slots if not s.is_processing and s.session is None), None)

    def begin(self, slot: Slot | None, params: dict[str, Any], num_prompt: int) -> int:
        """Mark ``slot`` busy with a new task; returns the task's id."""
        self._next_task += 1
        if slot is not None:
            slot.last_used = self.policy.clock()
            slot.is_processing = True
            slot.num_tasks += 1
            slot.task = {"id_task": self._next_task, "params": params,
                         "n_prompt_tokens": num_prompt, "n_decoded": 0,
                         "n_remain": params.get("n_predict", -1)}  # fmt: skip
        return self._next_task

    def end(self, slot: Slot | None) -> None:
        """The task on ``slot`` has finished."""
        if slot is not None:
            slot.is_processing = False
            slot.last_used = self.policy.clock()

    def session_of(self, slot: Slot) -> llamax.Session:
        """``slot``'s session, opened when it has none: one that yields, so it never
        holds a sequence id or cells another request needs while it is idle (opening it
        takes no id when none is free; its request waits for one as any request does).

        Raises:
            ContextClosedError: the context is closed.
        """
        if slot.session is None or slot.session.closed:
            slot.session = self.ctx.session(yields=True)
        slot.last_used = self.policy.clock()
        return slot.session

    async def close_idle(self) -> int:
        """Close the sessions of the slots idle for :attr:`SlotPolicy.idle_seconds` (none
        running or locked by an action); how many were closed. Closing waits for the
        engine, in a worker."""
        now = self.policy.clock()
        stale = [
            slot for slot in self.slots
            if slot.session is not None and not slot.is_processing and not slot.lock.locked()
            and now - slot.last_used >= self.policy.idle_seconds
        ]  # fmt: skip
        sessions = []
        for slot in stale:
            sessions.append(slot.session)
            slot.session, slot.task = None, None
        for session in sessions:
            if session is not None:
                await run_in_threadpool(session.close)
        return len(sessions)

    def to_json(self) -> list[dict[str, Any]]:
        """``GET /slots``: llama-server's fields, filled with what llamax knows."""
        out = []
        for slot in self.slots:
            entry: dict[str, Any] = {
                "id": slot.id,
                "n_ctx": self.ctx.n_ctx_seq,
                "speculative": False,
                "is_processing": slot.is_processing,
            }
            task = slot.task
            if task is not None:
                remain = task["n_remain"]
                entry |= {
                    "id_task": task["id_task"],
                    "n_prompt_tokens": task["n_prompt_tokens"],
                    "n_prompt_tokens_processed": task.get("n_prompt_tokens_processed", 0),
                    "n_prompt_tokens_cache": task.get("n_prompt_tokens_cache", 0),
                    "params": task["params"],
                    "next_token": [{
                        "has_next_token": slot.is_processing,
                        "has_new_line": False,
                        "n_remain": -1 if remain < 0 else max(0, remain - task["n_decoded"]),
                        "n_decoded": task["n_decoded"],
                    }],
                }  # fmt: skip
            if slot.session is not None and not slot.session.closed and not slot.is_processing:
                entry["n_cached_tokens"] = len(slot.session.token_ids)
            out.append(entry)
        return out

    def close(self) -> None:
        """Close every slot's session."""
        for slot in self.slots:
            if slot.session is not None:
                slot.session.close()
                slot.session = None


class SlotTables(weakref.WeakKeyDictionary[llamax.Context, SlotTable]):
    """Context -> its slots, each table made with ``policy``.

    Args:
        policy: When idle slots are closed (the default policy if None).
    """

    def __init__(self, policy: SlotPolicy | None = None) -> None:
        super().__init__()
        self.policy = policy or SlotPolicy()


def slot_tables(policy: SlotPolicy | None = None) -> SlotTables:
    """A fresh map of context -> its slots (one per app, so apps share nothing)."""
    return SlotTables(policy)


def table_of(tables: SlotTables, ctx: llamax.Context) -> SlotTable:
    """``ctx``'s slots, made on first use."""
    slots = tables.get(ctx)
    if slots is None:
        slots = tables[ctx] = SlotTable(ctx, tables.policy)
    return slots


_FORBIDDEN = set(':*?"<>|/\\') | {"\ufffd", "\ufeff", "\uff0e", "\u2215", "\u2216"}


def valid_filename(name: object) -> bool:
    """Whether ``name`` is a plain file name, as llama.cpp's ``fs_validate_filename``
    checks it: 1 to 255 bytes, no path separator, no ``..``, no control or look-alike
    characters, no leading or trailing space, no trailing dot."""
    if not isinstance(name, str) or not name or len(name.encode("utf-8", "replace")) > 255:
        return False
    for ch in name:
        code = ord(ch)
        if code <= 0x1F or 0x7F <= code <= 0x9F or 0xD800 <= code <= 0xDFFF or ch in _FORBIDDEN:
            return False
    if name[0] == " " or name[-1] in " .":
        return False
    return ".." not in name and name != "."


def slot_routes(state: ServerState, tables: SlotTables, save_path: Path | None) -> APIRouter:
    """``GET /slots`` and ``POST /slots/{id_slot}``."""

    def require_key(request: Request) -> None:  # 401 in OpenAI's shape, as every route
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    @router.get("/slots")
    async def get_slots(request: Request) -> Response:
        try:
            ctx = _serving(state, request.query_params.get("model"))
            slots = []
            if ctx is not None:
                table = table_of(tables, ctx)
                await table.close_idle()
                # reading a session's tokens waits for the loop's next step: in a worker
                slots = await run_in_threadpool(table.to_json)
        except Exception as exc:
            return llama_error_response(as_llama_error(exc))
        if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in slots):
            return llama_error_response(LlamaError(503, "no slot available"))
        return JSONResponse(slots)

    @router.post("/slots/{id_slot}")
    async def post_slot(request: Request, id_slot: str) -> Response:
        try:
            raw = await read_body(request, state.config.max_body_bytes)
            body = parse_object(raw) if raw.strip() else {}
            model = body.get("model") or request.query_params.get("model")
            async with leased(state, model) as ctx:
                table = table_of(tables, ctx)
                await table.close_idle()
                answer = await _act(table, id_slot, request, body, save_path)
            return JSONResponse(answer)
        except Exception as exc:
            return llama_error_response(as_llama_error(exc))

    return router


def _serving(state: ServerState, model: str | None) -> llamax.Context | None:
    """The context whose slots ``GET /slots`` lists, without an admission slot or a load
    (monitoring must answer while the server is busy): with several models, the one named
    (the default for ``None``) while it is loaded, else ``None`` (no slots).

    Raises:
        APIError: 503 while the one model loads, 404 for a model the pool does not hold.
    """
    pool = state.pool
    if pool is None:
        return state.context()
    if model is not None and model not in pool.names:
        raise LlamaError(404, f"model {model!r} is not served here")
    return pool.loaded(model)


async def _act(
    slots: SlotTable, id_slot: str, request: Request, body: dict[str, Any],
    save_path: Path | None,
) -> dict[str, Any]:  # fmt: skip
    """One action on one slot, checked as llama-server checks it (``erase`` needs no save
    folder: it only frees the slot)."""
    slot = slots.get(id_slot)
    action = request.query_params.get("action")
    if action == "erase":
        return await _erase(slot)
    if action not in ("save", "restore"):
        raise LlamaError(400, "Invalid action")
    if save_path is None:
        raise LlamaError(501, "This server does not support slots action. Start it "
                         "with `--slot-save-path`")  # fmt: skip
    filename = body.get("filename")
    if not valid_filename(filename):
        raise LlamaError(400, "Invalid filename")
    assert isinstance(filename, str)
    path = save_path / filename
    if action == "save":
        return await _save(slot, path, filename)
    return await _restore(slots, slot, path, filename)


async def _erase(slot: Slot) -> dict[str, Any]:
    async with slot.lock:
        session, slot.session, slot.task = slot.session, None, None
        num_erased = 0
        if session is not None and not session.closed:
            num_erased = len(await run_in_threadpool(lambda: session.token_ids))
            await run_in_threadpool(session.close)
    return {"id_slot": slot.id, "n_erased": num_erased}


async def _num_tokens(session: llamax.Session) -> int:
    """Tokens ``session`` holds (reading them waits for the loop: in a worker)."""
    return len(await run_in_threadpool(lambda: session.token_ids))


async def _save(slot: Slot, path: Path, filename: str) -> dict[str, Any]:
    async with slot.lock:
        session = slot.session
        # a slot that yielded its sequence to other requests holds nothing either
        if session is None or session.closed or not await _num_tokens(session):
            raise LlamaError(
                400,
                f"slot {slot.id} holds no tokens to save (run a request with "
                f"id_slot={slot.id} first, or restore a file into it)",
            )
        start = time.perf_counter()
        try:
            await run_in_threadpool(session.save, path)
        except OSError as exc:  # its strerror only: the message must not name the folder
            raise LlamaError(500, f"Unable to save slot: {exc.strerror or 'write failed'}"
                             ) from exc  # fmt: skip
        num_saved = await _num_tokens(session)
    return {"id_slot": slot.id, "filename": filename, "n_saved": num_saved,
            "n_written": os.path.getsize(path),
            "timings": {"save_ms": (time.perf_counter() - start) * 1000}}  # fmt: skip


async def _restore(slots: SlotTable, slot: Slot, path: Path, filename: str) -> dict[str, Any]:
    async with slot.lock:
        start = time.perf_counter()
        old, slot.session, slot.task = slot.session, None, None
        if old is not None:
            await run_in_threadpool(old.close)
        try:
            session = await run_in_threadpool(lambda: slots.ctx.load_session(path, yields=True))
        except (OSError, llamax.SessionError) as exc:  # a bad file: 400; no room now: 503
            bad = isinstance(exc, (OSError, llamax.SessionLoadError))
            raise LlamaError(400 if bad else 503, f"Unable to restore slot: "
                             f"{_reason(exc, path, filename)}") from exc  # fmt: skip
        slot.session = session
        slot.last_used = slots.policy.clock()
        num_restored = len(await run_in_threadpool(lambda: session.token_ids))
    return {"id_slot": slot.id, "filename": filename, "n_restored": num_restored,
            "n_read": os.path.getsize(path),
            "timings": {"restore_ms": (time.perf_counter() - start) * 1000}}  # fmt: skip


def _reason(exc: OSError | llamax.SessionError, path: Path, filename: str) -> str:
    """Why a restore failed, naming the file as the client named it: never the folder
    (llamax's messages name the path they were given; an OSError's its file name)."""
    if isinstance(exc, FileNotFoundError):
        return f"{filename}: no such file"
    if isinstance(exc, OSError):
        return f"{filename}: {exc.strerror or 'cannot read the file'}"
    return str(exc).replace(str(path), filename).replace(str(path.parent), "<slot folder>")
