"""How a llama.cpp context lays out its KV cells (one buffer, or one stream per sequence),
and moving sequences' states between the two (:mod:`~llamax.backend.seq_state`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..config import ContextConfig
from ..errors import RequestFailedError
from .base import SharedPrefix
from .native import NativeBatch, NativeContext
from .seq_state import cell_positions, restream

__all__ = [
    "MAX_STREAMS_MEMORY",
    "adapts_layout",
    "loadable_state",
    "move_states",
    "padded",
    "run_queued_copies",
]

MAX_STREAMS_MEMORY = 2
"""``kv_layout="auto"`` adapts (starting with one stream per sequence) only if the streams
cost at most this many times the unified cache's memory. llama.cpp rounds every stream up
to a multiple of 256 cells, so ``n_ctx=8192, n_seq_max=64`` holds 64 x 256 = 16,384 cells
in streams (as ``llama-server -c 8192 -np 64`` does) and 8,192 unified."""
_PAD = 256  # llama.cpp pads n_ctx, and each stream, to a multiple of this

_log = logging.getLogger("llamax.llama_cpp")


def padded(n: int) -> int:
    """``n`` cells as llama.cpp pads them."""
    return max(_PAD, -(-n // _PAD) * _PAD)


def adapts_layout(config: ContextConfig, movable_kv: bool) -> bool:
    """Whether ``kv_layout="auto"`` starts in streams and moves between layouts: the model
    has one full-attention KV cache, alone or beside a hybrid's recurrent state (its states
    can move, :func:`~llamax.backend.seq_state.restream`), and the streams' cells cost at
    most :data:`MAX_STREAMS_MEMORY` times the unified ones."""
    n_ctx, n_seq_max = config.n_ctx, config.n_seq_max
    streams_cells = padded(padded(n_ctx) // n_seq_max) * n_seq_max
    return (
        config.kv_layout == "auto"
        and config.resolved_kv_layout == "unified"
        and movable_kv
        and n_seq_max > 1
        and streams_cells <= MAX_STREAMS_MEMORY * max(n_ctx, _PAD)
    )


def move_states(
    old: NativeContext,
    new: NativeContext,
    n_seq_max: int,
    n_stream: int,
    shared: Sequence[SharedPrefix] = (),
    *,
    tail: bool = False,
) -> None:
    """Copy every sequence's state from ``old`` into ``new`` (of ``n_stream`` streams),
    except those of ``shared`` (into a unified ``new`` only): each is tagged on its
    source's first cells once the source has moved.

    Raises:
        RequestFailedError: a state could not be moved (a sequence that does not fit its
            stream).

    With ``tail`` (a hybrid model) each state's recurrent part follows its attention
    cells and moves as it is (:func:`~llamax.backend.seq_state.restream`).
    """
    sharers = {share.seq_id for share in shared}
    for seq_id in range(n_seq_max):
        if seq_id in sharers or old.seq_pos_max(seq_id) < 0:
            continue
        try:
            data = restream(old.state_seq_get(seq_id), n_stream, tail=tail)
        except ValueError as exc:
            raise RequestFailedError(f"sequence {seq_id}'s state: {exc}") from exc
        if not new.state_seq_set(seq_id, data):
            raise RequestFailedError(f"the new KV layout refused sequence {seq_id}")
    for share in shared:
        if share.source in sharers or new.seq_pos_max(share.source) + 1 < share.num_tokens:
            raise RequestFailedError(f"sequence {share.seq_id} shares a prefix not moved")
        new.seq_cp(share.source, share.seq_id, 0, share.num_tokens)


def loadable_state(data: bytes, n_stream: int, n_ctx_stream: int) -> bytes | None:
    """A saved state of a plain KV cache, rewritten for ``n_stream`` streams, once checked:
    whole (no byte missing or left over), cells of one sequence in one stream, at positions
    ``0 .. n-1`` exactly once each, fitting a stream of ``n_ctx_stream`` cells. None (and a
    warning logged): refused, so llama.cpp never reads a damaged state."""
    try:
        positions = cell_positions(data)
        data = restream(data, n_stream)
    except ValueError as exc:
        _log.warning("refused a saved sequence state: %s", exc)
        return None
    n = len(positions)
    if n > n_ctx_stream or sorted(positions) != list(range(n)):
        _log.warning("refused a saved sequence state: its positions are not 0..%d", n - 1)
        return None
    return data


def run_queued_copies(
    context: NativeContext,
    batch: NativeBatch,
    bos: int,
    seq_pos_max: Sequence[int],
    room: int,
    *,
    can_cut: bool = True,
) -> None:
    """Run the cross-stream copies llama.cpp has queued (see
    :mod:`~llamax.engine.kv.stream_copies`). llama.cpp runs them only at the start of a decode,
    so this decodes ``bos``, with no output, into an empty sequence (or past the end of one
    with room: fewer than ``room`` cells, by each sequence's ``seq_pos_max``) and removes it
    again. The last decode's logits are gone afterwards.

    A memory that cannot be cut (``can_cut`` False: a recurrent state, which would keep the
    token) gets the token in an empty sequence, removed whole; with none empty, in the
    shortest sequence, whose partial state is read before and set back after.

    Raises:
        RequestFailedError: no sequence has room for the token, the decode failed, or the
            token could not be removed again.
    """
    found = next(
        (
            (seq_id, pos + 1)
            for seq_id, pos in sorted(enumerate(seq_pos_max), key=lambda item: item[1])
            if pos + 1 < room
        ),
        None,
    )
    if found is None:
        raise RequestFailedError("no KV room to run llama.cpp's queued stream copies")
    seq_id, pos = found
    saved = None if can_cut or pos == 0 else context.state_seq_get(seq_id, partial=True)
    batch.tokens[0] = bos
    batch.pos[0] = pos
    batch.logits[0] = 0
    batch.seq_rows[0][0] = seq_id
    batch.set_n_tokens(1)
    status = context.decode(batch)
    if saved is not None and not context.state_seq_set(seq_id, saved, partial=True):
        raise RequestFailedError(f"could not set sequence {seq_id}'s state back")
    if not context.seq_rm(seq_id, pos if pos else -1, -1) and status in (0, 1, 2):
        raise RequestFailedError(f"could not remove the token from sequence {seq_id} again")
    if status not in (0, 1, 2):  # these three come after the memory update
        raise RequestFailedError(f"llama_decode failed with status {status}")
