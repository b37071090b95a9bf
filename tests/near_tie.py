"""Comparing greedy outputs across batch shapes, up to llama.cpp's near ties.

llama.cpp on a CPU is not batch-invariant: a prompt prefilled in one chunk, in two, or
partly reused from the cache gives slightly different logits, and on some CPUs (this
AVX2 machine more than the AVX-512 ones) that flips a greedy pick where two tokens are
nearly tied. Two greedy outputs *agree* if they are equal, or if where they part a cold
probe of the common prefix puts the two picks less than :data:`NEAR_TIE_NATS` apart.
Wrong KV contents would instead put a clearly worse token first.
"""

from __future__ import annotations

from collections.abc import Sequence

import llamax

NEAR_TIE_NATS = 0.1


def parting(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a shorter one parts where it ends)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_agrees(
    probe: llamax.Context,
    prompt: Sequence[int],
    expected: Sequence[int],
    got: Sequence[int],
    *,
    nats: float = NEAR_TIE_NATS,
    lora: dict[str, float] | None = None,
) -> None:
    """``got`` equals ``expected`` (both greedy continuations of ``prompt``), or parts from
    it at a near tie measured on ``probe`` (a context with nothing cached; left idle).

    Raises:
        AssertionError: they part where the picks are not nearly tied.

    ``lora``: the adapters both outputs ran under (the probe runs under them too).
    """
    i = parting(expected, got)
    if i is None:
        return
    params = llamax.SamplingParams(
        max_tokens=1, temperature=0.0, logprobs=5, ignore_eos=False, lora=lora
    )
    done = probe.add_request([*prompt, *expected[:i]], params).result(timeout=240)
    probe.clear_cache()
    logprobs = done.choices[0].logprobs or ()
    top = {t.token_id: t.logprob for t in logprobs[0].top_logprobs} if logprobs else {}
    picks = [seq[i] if i < len(seq) else None for seq in (expected, got)]
    known = [top[p] for p in picks if p is not None and p in top]
    if None in picks:  # one output ended here: its pick was an end-of-generation token
        present = next(p for p in picks if p is not None)
        known.append(max(lp for t, lp in top.items() if t != present))
    note = f"greedy outputs part at token {i}: {picks}; cold probe's top logprobs {top}"
    assert len(known) == 2, note
    assert abs(known[0] - known[1]) < nats, note
