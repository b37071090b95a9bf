"""Decoding image embeddings into sequences: a ``llama_batch`` whose rows carry embeddings
instead of token ids, as ``mtmd_helper_decode_image_chunk`` builds it.

A batch holds token ids or embeddings, never both (``llama_batch_allocr::init`` refuses a
mix, in the extended batch API too), so an image's rows take a ``llama_decode`` of their
own: several sequences' image rows may share it, nobody's text may. Non-causal images
(Gemma 3) flip the context's attention for that decode and back, and must sit in one
micro-batch whole: llama.cpp asserts ``n_ubatch >= n_tokens`` and aborts the process
otherwise, so :func:`decode_embeddings` refuses such a batch first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..native import NativeContext

__all__ = ["EmbeddingItem", "NativeEmbdBatch", "decode_embeddings", "decode_image"]


@dataclass(frozen=True, slots=True)
class EmbeddingItem:
    """One sequence's rows of embeddings at positions ``start_pos...``; ``rows`` are the
    batch indices (within the whole decode) whose logits are wanted."""

    seq_id: int
    embeddings: npt.NDArray[np.float32]
    """``(n, n_embd)`` float32: a whole image's :meth:`Projector.encode` output or a slice."""
    start_pos: int
    rows: tuple[int, ...] = ()


class NativeEmbdBatch:
    """A ``llama_batch`` of up to ``capacity`` embedding rows ``n_embd`` wide, one sequence
    id each, with numpy views of its arrays; freed by :meth:`close`, before its context."""

    __slots__ = ("C", "capacity", "embd", "logits", "n_embd", "pos", "ptr", "seq_rows")

    def __init__(self, C: Any, capacity: int, n_embd: int) -> None:
        self.C, self.capacity, self.n_embd = C, capacity, n_embd
        self.ptr = ptr = C.llama_batch_init(capacity, n_embd, 1)
        self.embd = np.ctypeslib.as_array(ptr.embd, shape=(capacity, n_embd))
        self.pos = np.ctypeslib.as_array(ptr.pos, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(ptr.logits, shape=(capacity,))
        np.ctypeslib.as_array(ptr.n_seq_id, shape=(capacity,))[:] = 1
        self.seq_rows = [ptr.seq_id[i] for i in range(capacity)]

    def close(self) -> None:
        """``llama_batch_free``; idempotent."""
        ptr, self.ptr = self.ptr, None
        if ptr is not None:
            self.C.llama_batch_free(ptr)


def decode_embeddings(
    context: NativeContext,
    batch: NativeEmbdBatch,
    items: Sequence[EmbeddingItem],
    *,
    non_causal: bool = False,
) -> int:
    """Lay ``items`` out in ``batch`` and ``llama_decode`` them: llama.cpp's status
    (0: done, 1: no KV slot ...), as for token batches. With ``non_causal``, attention is
    non-causal for this decode only (each row sees every row of its own sequence).

    Raises:
        ValueError: more rows than ``batch`` holds, embeddings of another width or type,
            or a non-causal batch larger than one micro-batch (``llama_n_ubatch``).
    """
    C, ctx = context.C, context.ptr
    n = sum(len(item.embeddings) for item in items)
    if not n or n > batch.capacity:
        raise ValueError(f"an embedding batch holds 1 to {batch.capacity} rows, got {n}")
    n_ubatch = int(C.llama_n_ubatch(ctx))
    if non_causal and n > n_ubatch:
        raise ValueError(
            f"{n} non-causal embedding rows do not fit one micro-batch of {n_ubatch} "
            "(raise n_ubatch to the image's token count)"
        )
    row = 0
    batch.logits[:n] = 0
    for item in items:
        e = item.embeddings
        if e.ndim != 2 or e.shape[1] != batch.n_embd or e.dtype != np.float32:
            raise ValueError(
                f"embeddings must be (n, {batch.n_embd}) float32, got {e.shape} {e.dtype}"
            )
        end = row + len(e)
        batch.embd[row:end] = e
        batch.pos[row:end] = np.arange(item.start_pos, item.start_pos + len(e))
        for i in range(row, end):
            batch.seq_rows[i][0] = item.seq_id
        row = end
    for item in items:
        for wanted in item.rows:
            batch.logits[wanted] = 1
    batch.ptr.n_tokens = n
    if not non_causal:
        return int(C.llama_decode(ctx, batch.ptr))
    causal = bool(C.llama_get_causal_attn(ctx))
    C.llama_set_causal_attn(ctx, False)
    try:
        return int(C.llama_decode(ctx, batch.ptr))
    finally:
        C.llama_set_causal_attn(ctx, causal)


def decode_image(
    context: NativeContext,
    batch: NativeEmbdBatch,
    seq_id: int,
    embeddings: npt.NDArray[np.float32],
    start_pos: int,
    *,
    non_causal: bool = False,
    logits_last: bool = False,
) -> int:
    """Decode one image's embeddings into ``seq_id`` from ``start_pos``: in pieces of the
    batch's capacity when causal, in one piece when not (see :func:`decode_embeddings`).
    With ``logits_last``, the last row's logits are kept (row ``len(piece) - 1`` of the
    last decode). Returns the first non-zero status, or 0.

    Raises:
        ValueError: as :func:`decode_embeddings`.
    """
    step = len(embeddings) if non_causal else batch.capacity
    for first in range(0, len(embeddings), step):
        piece = embeddings[first : first + step]
        is_last = first + step >= len(embeddings)
        rows = (len(piece) - 1,) if logits_last and is_last else ()
        item = EmbeddingItem(seq_id, piece, start_pos + first, rows)
        status = decode_embeddings(context, batch, [item], non_causal=non_causal)
        if status:
            return status
    return 0
