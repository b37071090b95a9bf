"""Whether one-token decode rows may share a decode in the reproducible mode: measured on
the loaded model, at start-up.

A row's logits must not depend on the rows beside it. Without flash attention the
attention sums of one sequence do not (measured, ``benchmarks/results/issue60``), but some
of llama.cpp's CPU kernels compute a row differently in a batch of several. Measured here
(AMD EPYC, AVX-512; ``tests/test_model_reproducible_kinds.py``): F16 weights and Q4_K
moved logprobs by up to 4e-3 beside other rows, as did a recurrent (Mamba2) and a
sliding-window (Gemma 3) model, the last two only now and then (a few rows in a hundred)
or only past the window; Q4_1, Q8_0 and Q6_K never did. Which types do depends on the CPU
and the build, so it is measured, not listed: :func:`rows_batch_invariant` decodes rows of
up to eight sequences alone and then together, joining one by one, and compares the logits
bit for bit. A memory that is not one plain KV cache (recurrent, hybrid) or that slides
decodes its rows alone without a probe: their differences are too rare, or appear too far
into a sequence, for a probe of start-up size to see.
"""

from __future__ import annotations

import numpy as np

from ...backend.base import Backend, BatchItem

__all__ = ["MAX_ROWS", "rows_batch_invariant"]

MAX_ROWS = 8
"""The probe's sequences (at most the context's ``n_seq_max``): rows 1 to 8 in a decode."""
_STEPS = 2
"""Decode steps after the last sequence joins: the rows of all of them together, twice."""


def _prompt(index: int, n_vocab: int, room: int) -> list[int]:
    """Sequence ``index``'s prompt: ``8 + 3 * index`` ordinary token ids (none below 32,
    where control tokens live, in a vocabulary that large), so the sequences sit at unequal
    positions; shorter where a sequence has less ``room``."""
    low = 32 if n_vocab > 64 else 0
    length = max(1, min(8 + 3 * index, room))
    return [low + (7919 * (index + 1) * (j + 3)) % (n_vocab - low) for j in range(length)]


def _decode(backend: Backend, items: list[BatchItem]) -> None:
    if backend.decode(items) != 0:
        raise RuntimeError("decode failed while probing decode rows")


def _run(backend: Backend, prompts: list[list[int]], together: bool) -> list[np.ndarray]:
    """Each prompt decoded alone, in chunks of the batch size; then sequence ``i`` joins at
    step ``i`` and decodes a one-token row each step until :data:`_STEPS` steps after the
    last joined (rows 1, 2 ... all of them together): each step's rows in one decode, or
    each alone. Every row's logits, in order; no cell is left behind."""
    n_batch = backend.n_batch
    out: list[np.ndarray] = []
    try:
        for seq_id, tokens in enumerate(prompts):
            for start in range(0, len(tokens), n_batch):
                _decode(backend, [BatchItem(seq_id, tokens[start : start + n_batch], start)])
        for step in range(len(prompts) + _STEPS - 1):
            active = [i for i in range(len(prompts)) if step >= i]
            items = [
                BatchItem(i, [prompts[i][(step + i) % len(prompts[i])]], len(prompts[i]) + step - i,
                          rows=(row if together else 0,))
                for row, i in enumerate(active)
            ]  # fmt: skip
            if together:
                _decode(backend, items)
                out += [backend.logits(row).copy() for row in range(len(items))]
            else:
                for item in items:
                    _decode(backend, [item])
                    out.append(backend.logits(0).copy())
    finally:
        for seq_id in range(len(prompts)):
            backend.seq_rm(seq_id)
    return out


def rows_batch_invariant(backend: Backend) -> bool:
    """Whether decode rows computed together get the very bits they get alone: measured
    on rows of up to :data:`MAX_ROWS` sequences (at most the context's ``n_seq_max``),
    ``False`` without a probe for a memory that is not one plain KV cache or that slides
    (see the module's text).

    Raises:
        RuntimeError: a probe decode failed.
    """
    if not backend.can_share_prefix or backend.sliding_window:
        return False
    keyer = getattr(backend, "calibration_key", None)  # model, build, CPU and settings
    key = keyer() if callable(keyer) else None
    if key is not None and key in _VERDICTS:
        return _VERDICTS[key]
    verdict = _probe(backend)
    if key is not None:
        _VERDICTS[key] = verdict
    return verdict


_VERDICTS: dict[str, bool] = {}
"""The verdicts of this process, by :meth:`~llamax.backend.base.Calibratable.calibration_key`:
another context on the same model, build, CPU and settings probes nothing."""


def _probe(backend: Backend) -> bool:
    facts = backend.facts
    count = min(MAX_ROWS, facts.n_seq_max)
    if count < 2:
        return True  # rows never share a decode
    room = backend.n_ctx_stream - count - _STEPS  # the rows after the prompt fit too
    prompts = [_prompt(i, facts.n_vocab, room) for i in range(count)]
    alone = _run(backend, prompts, together=False)
    together = _run(backend, prompts, together=True)
    return all(np.array_equal(a, b) for a, b in zip(alone, together, strict=True))
