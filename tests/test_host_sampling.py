"""Host sampling (issue 62): the chains :mod:`llamax.backend.host_sampling` samples on the
host, many rows at once, pick the token llama.cpp's own chain picks, for the same seed,
bit for bit. The reference is llama.cpp's chain itself (its samplers need no model),
applied to the same rows step after step, so each sequence's generator is compared over
its whole life; equal logits (rounded rows) send rows through the tie fallback."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import numpy as np
import pytest

from llamax.backend import host_sampling
from llamax.backend.host_sampling import ChainRng, expf, host_chain, host_sampling_enabled, pick
from llamax.backend.native import NativeSampler, bindings, sample_on_host
from llamax.backend.sampler_chain import new_sampler
from llamax.errors import InvalidParameterError
from llamax.params import SamplingParams

C = bindings()
MIXES = {
    "default": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    "top-k": {"temperature": 0.8, "top_k": 40, "top_p": 1.0, "min_p": 0.0},
    "temperature": {"temperature": 1.0, "top_k": 40, "top_p": 1.0, "min_p": 0.0},
    "top-k, top-p": {"temperature": 0.7, "top_k": 60, "top_p": 0.9, "min_p": 0.0},
    "top-k, min-p": {"temperature": 1.3, "top_k": 50, "top_p": 1.0, "min_p": 0.1},
    "wide top-k": {"temperature": 0.6, "top_k": 300, "top_p": 0.9, "min_p": 0.02},
    "peaked": {"temperature": 0.5, "top_k": 5, "top_p": 0.5, "min_p": 0.5},
    "one": {"temperature": 0.9, "top_k": 1, "top_p": 1.0, "min_p": 0.0},
}
BIAS = {3: 4.0, 7: float("-inf"), 11: 2.5, 12: -1.5}


class Rows:
    """What a sampler reads from a context: one logits row."""

    def __init__(self, row: np.ndarray) -> None:
        self.row = row

    def logits(self, row: int, n_vocab: int) -> np.ndarray:
        return self.row


def sampler(params: SamplingParams, seed: int, n_vocab: int, *, host: bool) -> NativeSampler:
    built = new_sampler(
        C, None, params, seed, [], None,
        eog=frozenset({0}), n_vocab=n_vocab, n_ctx=4096, host=host,
    )  # fmt: skip
    assert (built.host is not None) == host
    return built


def chain_token(native: NativeSampler, row: np.ndarray) -> int:
    """llama.cpp's chain on ``row``, as ``llama_sampler_sample`` runs it."""
    kept, selected = native.draw(Rows(row.copy()), 0)  # type: ignore[arg-type]
    return int(kept["id"][selected])


def random_rows(rng: np.random.Generator, n: int, n_vocab: int, step: int) -> np.ndarray:
    rows = rng.normal(0, rng.choice([1.0, 3.0, 8.0]), (n, n_vocab)).astype(np.float32)
    if step % 4 == 3:  # few distinct values: equal logits among the candidates
        rows = np.round(rows).astype(np.float32)
    return rows


@pytest.mark.parametrize("bias", [{}, BIAS], ids=["no bias", "bias"])
@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
def test_rows_sampled_together_equal_the_chain_step_after_step(
    mix: dict[str, Any], bias: dict[int, float]
) -> None:
    n_rows, n_vocab = 8, 12_800  # 200 blocks of 64: top-k 5 and 40 search blocks, 300 not
    params = SamplingParams(**mix, logit_bias=bias)
    rng = np.random.default_rng(62)
    seeds = [int(s) for s in rng.integers(0, 2**32 - 1, n_rows)]
    natives = [sampler(params, s, n_vocab, host=False) for s in seeds]
    hosts = [sampler(params, s, n_vocab, host=True) for s in seeds]
    try:
        for step in range(24):
            rows = random_rows(rng, n_rows, n_vocab, step)
            want = [chain_token(n, row) for n, row in zip(natives, rows, strict=True)]
            got = sample_on_host(hosts, list(rows))
            assert got == want, (step, mix, bias)
    finally:
        for s in natives + hosts:
            s.close()


def test_a_row_of_one_sequence_alone_follows_the_same_generator() -> None:
    """:meth:`NativeSampler.draw` (``logprobs_after_sampling``) on one row and
    :func:`sample_on_host` on many draw from the same generator: a sequence may change
    between them at any step. (A step of few rows, llama.cpp's whole chain on the context,
    is tested on SmolLM2: ``test_model_host_sampling.py``.)"""
    params = SamplingParams(temperature=0.9, top_k=20)
    native, host = sampler(params, 7, 500, host=False), sampler(params, 7, 500, host=True)
    rng = np.random.default_rng(1)
    try:
        for step in range(40):
            row = random_rows(rng, 1, 500, step)[0]
            want = chain_token(native, row)
            if step % 2:
                kept, selected = host.draw(Rows(row), 0)  # type: ignore[arg-type]
                assert int(kept["id"][selected]) == want
            else:
                assert sample_on_host([host], [row]) == [want]
    finally:
        native.close()
        host.close()


@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
def test_the_drawn_distribution_is_the_chains_bit_for_bit(mix: dict[str, Any]) -> None:
    """``logprobs_after_sampling``'s source: the kept candidates, their probabilities (as
    float32 bits) and the selected one, for a host chain as for llama.cpp's."""
    params = SamplingParams(**mix, logit_bias=BIAS)
    native, host = sampler(params, 99, 2000, host=False), sampler(params, 99, 2000, host=True)
    rng = np.random.default_rng(2)
    try:
        for step in range(20):
            row = random_rows(rng, 1, 2000, step)[0]
            kept, selected = native.draw(Rows(row.copy()), 0)  # type: ignore[arg-type]
            got, chosen = host.draw(Rows(row.copy()), 0)  # type: ignore[arg-type]
            assert np.array_equal(kept["id"], got["id"])
            assert np.array_equal(kept["p"].view(np.uint32), got["p"].view(np.uint32))
            assert selected == chosen
    finally:
        native.close()
        host.close()


def test_top_p_stops_where_the_float32_running_sum_reaches_p() -> None:
    """A row made so that top-p's running sum reaches ``p`` at the second candidate in
    float32 (llama.cpp's) but not in double: llama.cpp keeps two candidates, and so must
    the host path, whatever the draw (a double sum would keep a third, often drawn)."""
    top = np.array([2.0, 1.0, 0.0, -1.0, -2.0], np.float32)  # descending, as top-k leaves it
    for second in np.linspace(1.0, 1.9, 2000, dtype=np.float32):
        top[1] = second
        p = expf(top - top[0])
        p /= np.cumsum(p, dtype=np.float32)[-1]
        two = p[0] + p[1]
        if float(p[0]) + float(p[1]) < float(two):  # float32 rounded the sum up
            break
    else:
        pytest.fail("no row whose float32 sum rounds up")
    params = SamplingParams(temperature=1.0, top_k=5, top_p=float(two), min_p=0.0)
    row = np.full(64, -30.0, np.float32)
    row[[9, 3, 40, 22, 7]] = top
    for seed in range(60):
        native = sampler(params, seed, 64, host=False)
        host = sampler(params, seed, 64, host=True)
        try:
            kept, selected = native.draw(Rows(row.copy()), 0)  # type: ignore[arg-type]
            assert len(kept) == 2
            assert sample_on_host([host], [row]) == [int(kept["id"][selected])]
        finally:
            native.close()
            host.close()


def test_the_draw_compares_running_sums_in_double() -> None:
    """``dist`` sums the float32 probabilities in double: with a draw between where a
    double and a float32 running sum put the boundary, the double's side wins."""
    for a in np.linspace(-0.5, -0.01, 500, dtype=np.float32):
        top = np.array([0.0, a, a - 1], np.float32)
        p = expf(top)
        double = np.cumsum(p, dtype=np.float64)
        single = np.cumsum(p, dtype=np.float32).astype(np.float64)
        low, high = sorted((double[0] / double[-1], single[0] / single[-1]))
        if low < high:
            u = (low + high) / 2
            break
    else:
        pytest.fail("no row where the sums differ")
    row = np.full(64, -30.0, np.float32)
    row[[5, 17, 33]] = top
    want = [5, 17][int(not double[0] >= double[-1] * u)]  # llama.cpp: sum_run >= sum * u
    chain = host_chain(SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0), {}, None)
    assert chain is not None
    assert host_sampling.sample_rows([chain], row[None].copy(), [u]) == [want]
    assert pick(top, u)[0] == [5, 17].index(want)


def test_expf_is_glibcs_bit_for_bit() -> None:
    libm = ctypes.CDLL("libm.so.6")
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    rng = np.random.default_rng(3)
    x = np.concatenate([
        rng.uniform(-110, 0, 60_000), rng.uniform(-1, 0, 20_000), rng.uniform(-104, -87, 20_000),
        [-np.inf, 0.0, -0.0, -103.97, -103.98, -88.0, -87.33, 1.0, 88.0, 88.8, 100.0],
    ]).astype(np.float32)  # fmt: skip
    want = np.array([libm.expf(float(v)) for v in x], dtype=np.float32)
    assert np.array_equal(expf(x).view(np.uint32), want.view(np.uint32))
    # NumPy's own exp, even in double then rounded, is not glibc's: the test can tell
    with np.errstate(over="ignore"):
        rounded = np.exp(x.astype(np.float64)).astype(np.float32)
    assert not np.array_equal(rounded.view(np.uint32), want.view(np.uint32))


def test_the_generator_is_std_mt19937() -> None:
    """The C++ standard fixes the 10000th output of a default-seeded ``std::mt19937``."""
    assert ChainRng(5489)._bits.random_raw(10_000)[-1] == 4123659995


def test_a_single_candidate_still_consumes_a_draw() -> None:
    """llama.cpp's ``dist`` draws for a one-candidate row too: the next rows agree."""
    one = np.zeros(50, np.float32)
    one[4] = 30.0  # min-p 0.5 keeps it alone
    params = SamplingParams(temperature=1.0, top_k=10, top_p=1.0, min_p=0.5)
    native, host = sampler(params, 5, 50, host=False), sampler(params, 5, 50, host=True)
    rng = np.random.default_rng(4)
    try:
        for step in range(30):
            row = one if step % 3 == 0 else rng.normal(0, 0.3, 50).astype(np.float32)
            assert sample_on_host([host], [row]) == [chain_token(native, row)]
    finally:
        native.close()
        host.close()


def test_pick_takes_the_first_candidate_whose_running_sum_reaches_the_draw() -> None:
    logits = np.log(np.array([0.5, 0.25, 0.25], np.float32))
    assert pick(logits, 0.0)[0] == 0
    assert pick(logits, 0.4999)[0] == 0
    assert pick(logits, 0.5)[0] == 0  # reached exactly: the sum is at least the target
    assert pick(logits, 0.5001)[0] == 1
    assert pick(logits, 0.9999)[0] == 2


@pytest.mark.parametrize(
    "change",
    [
        {"temperature": 0.0},
        {"top_k": 0},
        {"repeat_penalty": 1.1},
        {"frequency_penalty": 0.5},
        {"typical_p": 0.9},
    ],
)
def test_chains_with_other_samplers_stay_native(change: dict[str, Any]) -> None:
    params = dataclasses.replace(SamplingParams(), **change)
    assert host_chain(params, {}, None) is None


def test_a_grammar_stays_native_and_the_rest_goes_to_the_host() -> None:
    assert host_chain(SamplingParams(), {}, "root ::= [a-z]") is None
    chain = host_chain(SamplingParams(), {5: -1.0}, None)
    assert chain is not None
    assert (chain.top_k, chain.top_p, chain.min_p) == (40, np.float32(0.95), np.float32(0.05))


def test_the_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(host_sampling.HOST_SAMPLING_ENV, raising=False)
    assert host_sampling_enabled()
    monkeypatch.setenv(host_sampling.HOST_SAMPLING_ENV, "0")
    assert not host_sampling_enabled()
    monkeypatch.setenv(host_sampling.HOST_SAMPLING_ENV, "maybe")
    with pytest.raises(InvalidParameterError, match="LLAMAX_HOST_SAMPLING"):
        host_sampling_enabled()
