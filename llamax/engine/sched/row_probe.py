"""Whether one-token decode rows may share a decode in the reproducible mode: measured on the
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

import numpy as np

from ...backend.base import Backend, BatchItem

__all__ = ["MAX_ROWS", "rows_batch_invariant"]

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
    if not backend.can_share_prefix or backend.sliding_window:
        return False
    keyer = getattr(backend, "calibration_key", None)  # model, build, CPU and settings
    key = keyer() if callable(keyer) else None
    if key is not None and key in _VERDICTS:
        return _VERDICTS[key]
    try:
        verdict = _probe(backend)
    except RuntimeError:  # a decode refused (no room?): apart is always exact
        _log.warning("could not probe decode rows; each goes alone", exc_info=True)
        return False
    if key is not None:
        _VERDICTS[key] = verdict
    return verdict


_VERDICTS: dict[str, bool] = {}
"""The verdicts of this process, by :meth:`~llamax.backend.base.Calibratable.calibration_key`:
another context on the same model, build, CPU and settings probes nothing."""
