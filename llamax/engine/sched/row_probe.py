"""Whether one-token decode rows may share a decode in the reproducible mode, and whether
its prompt chunks need the grid at all (:func:`chunks_batch_invariant`): measured on the
loaded model, at start-up.

A row's logits must not depend on the rows beside it. Without flash attention the
attention sums of one sequence do not (measured, ``benchmarks/results/issue60``), but some
of llama.cpp's CPU kernels compute a row differently in a batch of several. Measured here
(AMD EPYC, AVX-512; ``tests/test_model_reproducible_kinds.py``): F16 weights and Q4_K
moved logprobs by up to 0.08 nats beside other rows, as did a recurrent (Mamba2) and a sliding-
window (Gemma 3) model, the last two only now and then (a few rows in a hundred) or only
past the window; Q4_1, Q8_0 and Q6_K never did. Which types do depends on the CPU and the
build, so it is measured, not listed: :func:`rows_batch_invariant` decodes two steps of
one-token rows of up to eight sequences (all, then all but one) each alone, cuts them off,
decodes the same rows together, and compares the logits bit for bit. A memory that is not
one plain KV cache (recurrent, hybrid) or that slides decodes its rows alone without a
probe: their differences are too rare, or appear too far into a sequence, for a probe of
start-up size to see.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from ...backend.base import Backend, BatchItem

__all__ = ["MAX_ROWS", "chunks_batch_invariant", "rows_batch_invariant"]

_log = logging.getLogger(__name__)

MAX_ROWS = 8
"""The probe's sequences (at most the context's ``n_seq_max``)."""


def _prompt(index: int, n_vocab: int, room: int) -> list[int]:
    """Sequence ``index``'s prompt: ``2 + index`` ordinary token ids (none below 32,
    where control tokens live, in a vocabulary that large), so the sequences sit at unequal
    positions; shorter where a sequence has less ``room``."""
    low = 32 if n_vocab > 64 else 0
    length = max(1, min(2 + index, room))
    return [low + (7919 * (index + 1) * (j + 3)) % (n_vocab - low) for j in range(length)]


def _decode(backend: Backend, items: list[BatchItem]) -> None:
    if backend.decode(items) != 0:
        raise RuntimeError("decode failed while probing decode rows")


def _steps(prompts: list[list[int]]) -> list[list[BatchItem]]:
    """Two steps of one-token rows after the prompts: every sequence's, then all but the
    last one's (an odd count where the first is even)."""
    count = len(prompts)
    return [
        [BatchItem(i, [prompts[i][(step + i) % len(prompts[i])]], len(prompts[i]) + step,
                   rows=(row,)) for row, i in enumerate(range(count - step))]
        for step in range(2)
    ]  # fmt: skip


def _probe(backend: Backend) -> bool:
    """The prompts decoded alone, in chunks of the batch size; then each step's rows alone,
    the rows cut off again, and the same rows together: every row's logits compared."""
    facts = backend.facts
    count = min(MAX_ROWS, facts.n_seq_max)
    if count < 2:
        return True  # rows never share a decode
    room = backend.n_ctx_stream - 2  # the two rows after the prompt fit too
    prompts = [_prompt(i, facts.n_vocab, room) for i in range(count)]
    steps = _steps(prompts)
    n_batch = backend.n_batch
    try:
        for seq_id, tokens in enumerate(prompts):
            for start in range(0, len(tokens), n_batch):
                _decode(backend, [BatchItem(seq_id, tokens[start : start + n_batch], start)])
        alone = []
        for items in steps:
            for item in items:
                _decode(backend, [BatchItem(item.seq_id, item.token_ids, item.start_pos, (0,))])
                alone.append(backend.logits(0).copy())
        for seq_id, tokens in enumerate(prompts):  # a plain KV cache: cut back to the prompt
            backend.seq_rm(seq_id, len(tokens), -1)
        together = []
        for items in steps:
            _decode(backend, items)
            together += [backend.logits(row).copy() for row in range(len(items))]
    finally:
        for seq_id in range(count):
            backend.seq_rm(seq_id)
    return all(np.array_equal(a, b) for a, b in zip(alone, together, strict=True))


def rows_batch_invariant(backend: Backend) -> bool:
    """Whether decode rows computed together get the very bits they get alone: measured
    on rows of up to :data:`MAX_ROWS` sequences (at most the context's ``n_seq_max``),
    ``False`` without a probe for a memory that is not one plain KV cache or that slides
    (see the module's text).

    A probe whose decode fails says ``False`` (rows apart are always exact).
    """
    return _verdict(backend, _probe, _VERDICTS, "could not probe decode rows; each goes alone")


def _verdict(
    backend: Backend, probe: Callable[[Backend], bool], verdicts: dict[str, bool], failed: str
) -> bool:
    """``probe``'s verdict on ``backend``, from ``verdicts`` where this process probed the
    same model, build, CPU and settings before; ``False`` without a probe for a memory that
    is not one plain KV cache or that slides, or where a decode fails (``failed`` is
    logged): the grid's rules and rows apart are always exact."""
    if not backend.can_share_prefix or backend.sliding_window:
        return False
    keyer = getattr(backend, "calibration_key", None)  # model, build, CPU and settings
    key = keyer() if callable(keyer) else None
    if key is not None and key in verdicts:
        return verdicts[key]
    try:
        verdict = probe(backend)
    except RuntimeError:  # a decode refused (no room?)
        _log.warning(failed, exc_info=True)
        return False
    if key is not None:
        verdicts[key] = verdict
    return verdict


_VERDICTS: dict[str, bool] = {}
"""The verdicts of this process, by :meth:`~llamax.backend.base.Calibratable.calibration_key`:
another context on the same model, build, CPU and settings probes nothing."""

_CHUNK_LENGTHS = (12, 5, 9)
"""The chunk probe's prompts: unequal, so llama.cpp's equal-split micro-batches cut them."""


Logits = dict[tuple[int, int], np.ndarray]
"""Rows' logits by ``(seq_id, position)``."""


def _chunk_probe(backend: Backend) -> bool:
    """Each prompt decoded as one chunk alone, every row's logits kept (the cold run);
    then the first one token at a time (a reply's cells), and, with room for several
    sequences, all of them again in two decodes that mix cut chunks of every sequence with
    a decode row of another: every row's logits compared bit for bit with the cold run's."""
    facts = backend.facts
    count = min(len(_CHUNK_LENGTHS), facts.n_seq_max)
    if backend.n_ctx_stream < max(_CHUNK_LENGTHS) + 2 or backend.n_batch < 16:
        return False  # too small a context to look: the grid's rules hold
    low = 32 if facts.n_vocab > 64 else 0
    prompts = [
        [low + (7919 * (i + 11) * (j + 3)) % (facts.n_vocab - low) for j in range(n)]
        for i, n in enumerate(_CHUNK_LENGTHS[:count])
    ]

    def rows(items: list[BatchItem]) -> Logits:
        _decode(backend, items)
        return {
            (item.seq_id, item.start_pos + k): backend.logits(row).copy()
            for item in items
            for k, row in enumerate(item.rows)
        }

    def chunk(seq_id: int, start: int, stop: int, at: int) -> BatchItem:
        tokens = prompts[seq_id][start:stop]
        return BatchItem(seq_id, tokens, start, tuple(range(at, at + len(tokens))))

    cold: Logits = {}
    got: Logits = {}
    try:
        for seq_id, tokens in enumerate(prompts):
            cold |= rows([chunk(seq_id, 0, len(tokens), 0)])
        if count > 1:  # the second sequence's one-token row after its prompt
            cold |= rows([BatchItem(1, [prompts[1][0]], len(prompts[1]), (0,))])
        for seq_id in range(count):
            backend.seq_rm(seq_id)
        for pos in range(len(prompts[0])):  # one token at a time, as a reply is computed
            got |= rows([chunk(0, pos, pos + 1, 0)])
        backend.seq_rm(0)
        if count > 1:  # else nothing ever shares a decode
            # unequal chunks: llama.cpp's equal-split micro-batches cut them again
            first = [chunk(0, 0, 7, 0), chunk(1, 0, len(prompts[1]), 7)]
            second = [chunk(0, 7, len(prompts[0]), 0)]
            second.append(BatchItem(1, [prompts[1][0]], len(prompts[1]), (5,)))
            if count > 2:
                first.append(chunk(2, 0, 3, 7 + len(prompts[1])))
                second.append(chunk(2, 3, len(prompts[2]), 6))
            got |= rows(first)
            got |= rows(second)
    finally:
        for seq_id in range(count):
            backend.seq_rm(seq_id)
    return all(np.array_equal(cold[key], logits) for key, logits in got.items())


def chunks_batch_invariant(backend: Backend) -> bool:
    """Whether the model computes a sequence's every row alike however its prompt is cut
    into chunks and whatever shares their decodes: one token at a time (a reply's cells)
    against one chunk, and cut chunks beside other sequences' chunks and rows. Measured on
    three short prompts, after :func:`rows_batch_invariant` said yes (the caller asks it
    first); ``False`` without a probe for a memory that is not one plain KV cache or that
    slides, or too small a context.

    On SmolLM2 Q4_1 here (AMD EPYC, AVX-512) it holds with flash attention row by row (a
    quantized or F32 V: ggml's one-row kernel, each row over its cells in order), and not
    without flash attention (a one-row attention product sums otherwise than a chunk's:
    ``benchmarks/results/issue60``). Where it holds, the reproducible mode needs no chunk
    grid: its chunks are cut and batched as in the default mode and every prefix is
    reused (docs/reproducible.md).
    """
    return _verdict(
        backend, _chunk_probe, _CHUNK_VERDICTS, "could not probe prompt chunks; grid kept"
    )


_CHUNK_VERDICTS: dict[str, bool] = {}
""":func:`chunks_batch_invariant`'s verdicts of this process, as :data:`_VERDICTS`."""
