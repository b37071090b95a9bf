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

import numpy as np

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


def forced_regrets(
    probe: llamax.Context,
    prompt: Sequence[int],
    tokens: Sequence[int],
    *,
    lora: dict[str, float] | None = None,
    banned: Sequence[int] = (),
) -> list[float]:
    """For each token of ``tokens``: how many nats the probe's best pick beats it by, given
    ``prompt`` and the tokens before it (0 where it is the probe's own greedy pick).

    The probe (a context with nothing cached; left idle) is teacher-forced along
    ``tokens``: a logits processor records each row's log-probabilities and then allows
    only the next token of ``tokens``. ``banned`` tokens (the end-of-generation tokens of
    an ``ignore_eos`` reply) are never a best pick.
    """
    regrets: dict[int, float] = {}

    def force(ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
        k = len(ids) - len(prompt)
        row = logits.astype(np.float64)
        row[list(banned)] = -np.inf
        row -= row.max()
        row -= np.log(np.exp(row).sum())
        regrets[k] = float(row.max() - row[tokens[k]])
        forced = np.full_like(logits, -np.inf)
        forced[tokens[k]] = 0.0
        return forced

    params = llamax.SamplingParams(
        max_tokens=len(tokens),
        temperature=0.0,
        ignore_eos=True,  # the forced tokens decide; the recorded rows are unbanned
        speculative=False,
        lora=lora,
        logits_processors=[force],
    )
    probe.add_request(list(prompt), params).result(timeout=240)
    probe.clear_cache()
    assert sorted(regrets) == list(range(len(tokens))), sorted(regrets)
    return [regrets[k] for k in range(len(tokens))]


def assert_teacher_forced(
    probe: llamax.Context,
    prompt: Sequence[int],
    tokens: Sequence[int],
    *,
    nats: float,
    lora: dict[str, float] | None = None,
    banned: Sequence[int] = (),
) -> None:
    """Every token of the greedy reply ``tokens`` is, given what came before it, within
    ``nats`` of the cold probe's best pick (see :func:`forced_regrets`).

    Stronger than :func:`assert_greedy_agrees`: it checks every position of the reply,
    not only the first where two runs part, and a batch-noise parting does not make the
    rest of the comparison chaotic (both sides follow the reply's own tokens). A reply
    computed on another prompt's or another adapter's KV puts tokens the cold model finds
    clearly worse: measured on SmolLM2, another prompt's reply 1.6-17 nats, a base reply
    under a 0.1-strength test adapter up to 2.5 (``benchmarks/lora_noise.py``).

    Raises:
        AssertionError: some token is worse than that, naming where and by how much.
    """
    regrets = forced_regrets(probe, prompt, tokens, lora=lora, banned=banned)
    assert_regrets_below(regrets, tokens, nats=nats, lora=lora)


def assert_regrets_below(
    regrets: Sequence[float],
    tokens: Sequence[int],
    *,
    nats: float,
    lora: dict[str, float] | None = None,
) -> None:
    """:func:`assert_teacher_forced` on regrets already measured by :func:`forced_regrets`."""
    worst = max(range(len(regrets)), key=regrets.__getitem__, default=None)
    assert worst is None or regrets[worst] < nats, (
        f"token {worst} of the reply ({tokens[worst]}) is {regrets[worst]:.3f} nats below "
        f"the cold probe's best pick; every position's regret: "
        f"{[round(r, 3) for r in regrets]} (lora {lora})"
    )


def assert_top_logprobs_agree(
    rows: Sequence[Sequence[tuple[int, float]]],
    other_rows: Sequence[Sequence[tuple[int, float]]],
    tolerance: float,
) -> None:
    """Two runs' top log-probabilities, position by position, agree within ``tolerance``:
    a token in both rows has log-probabilities that close; a token in only one row sat at
    its cut-off, within ``tolerance`` of the other row's lowest (two alternatives nearly
    tied for the last place may swap in and out of the top k)."""
    assert len(rows) == len(other_rows)
    for pos, (row, other) in enumerate(zip(rows, other_rows, strict=True)):
        mine, theirs = dict(row), dict(other)
        for token in mine.keys() & theirs.keys():
            gap = abs(mine[token] - theirs[token])
            assert gap < tolerance, f"position {pos}: token {token} differs by {gap:.4f} nats"
        for ours, floor in ((mine, min(theirs.values())), (theirs, min(mine.values()))):
            for token in ours.keys() - (mine.keys() & theirs.keys()):
                gap = floor - ours[token]
                assert abs(gap) < tolerance, (
                    f"position {pos}: token {token} is in one top-k only, {gap:.4f} nats "
                    "from the other's last"
                )
