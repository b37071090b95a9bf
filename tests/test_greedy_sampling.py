"""The greedy fast path: greedy with at most a logit bias builds no native sampler chain
and reads the biased row's first maximum, which must be the token llama.cpp's
``logit_bias`` + ``greedy`` chain picks (issue 24)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from llamax.backend.base import BatchItem
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.backend.native import NativeSampler, first_max
from llamax.config import ContextConfig
from llamax.params import SamplingParams

N_VOCAB = 50


def greedy(bias: dict[int, float] | None = None) -> NativeSampler:
    return NativeSampler(None, None, None, [], N_VOCAB, argmax=True, bias=bias)


def reference(logits: np.ndarray, bias: dict[int, float]) -> int:
    """What llama.cpp's chain does: add each bias, then keep the first strictly larger."""
    values = [float(v) + bias.get(i, 0.0) for i, v in enumerate(logits)]
    best = 0
    for i, value in enumerate(values):
        if value > values[best]:
            best = i
    return best


def test_ties_go_to_the_first_maximum() -> None:
    logits = np.zeros(N_VOCAB, np.float32)
    logits[[7, 3, 40]] = 2.0
    assert first_max(logits, greedy()) == 3
    assert first_max(logits, greedy({3: -1.0})) == 7  # the lowered max falls behind
    assert first_max(logits, greedy({3: float("-inf"), 7: float("-inf")})) == 40
    assert first_max(logits, greedy({40: 0.0})) == 3  # a zero bias changes nothing
    assert first_max(logits, greedy({45: 2.0})) == 3  # raised to a tie: the first max
    assert first_max(logits, greedy({45: 2.5})) == 45  # raised past it: overtakes
    assert first_max(logits, greedy({1: 2.0, 2: 2.0})) == 1


def test_a_row_that_is_all_banned_gives_the_first_token_as_the_chain_does() -> None:
    logits = np.full(N_VOCAB, -np.inf, np.float32)
    assert first_max(logits, greedy()) == reference(logits, {}) == 0


def test_random_rows_and_biases_match_the_chain_and_leave_the_row_unchanged() -> None:
    rng = np.random.default_rng(24)
    for trial in range(3000):
        # few distinct values, so ties are common
        logits = rng.integers(-3, 4, N_VOCAB).astype(np.float32)
        bias: dict[int, float] = {}
        for token in rng.choice(N_VOCAB, rng.integers(0, 6), replace=False):
            bias[int(token)] = float(rng.choice([-np.inf, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0]))
        if trial % 3 == 0:  # bans only, the common case (ignore_eos, banned tokens)
            bias = {t: -abs(b) - 0.5 for t, b in bias.items()}
        before = logits.copy()
        assert first_max(logits, greedy(bias)) == reference(logits, bias), (logits, bias)
        assert np.array_equal(logits, before)


@pytest.mark.model
def test_the_model_greedy_path_builds_no_chain_and_agrees_with_llama_cpp(
    model_path: Path,
) -> None:
    backend = LlamaCppBackend(ContextConfig(model_path=str(model_path), n_ctx=512))
    C = backend._C
    try:
        prompt = backend.tokenize("The capital of France is", parse_special=False)
        n_vocab = backend.facts.n_vocab
        eog = [t for t in range(n_vocab) if backend.is_eog(t)]
        assert backend.decode([BatchItem(0, prompt, 0, (len(prompt) - 1,))]) == 0
        row = len(prompt) - 1
        logits = backend.logits(row)
        top = [int(t) for t in np.argsort(-logits)[:3]]
        cases: list[dict[int, float]] = [
            {},
            dict.fromkeys(eog, float("-inf")),
            {top[0]: float("-inf")},
            {top[0]: -100.0, top[1]: -100.0},
            {top[2]: 50.0},
        ]
        for bias in cases:
            params = SamplingParams(temperature=0.0, logit_bias=bias)
            sampler = backend.new_sampler(params, seed=0, history=[])
            try:
                assert sampler.chain is None and sampler.argmax
                fast = backend.sample(sampler, row)
            finally:
                backend.free_sampler(sampler)
            chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
            try:
                if bias:
                    arr = (C.llama_logit_bias * len(bias))(
                        *(C.llama_logit_bias(t, b) for t, b in bias.items())
                    )
                    C.llama_sampler_chain_add(
                        chain, C.llama_sampler_init_logit_bias(n_vocab, len(bias), arr)
                    )
                C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
                native = int(C.llama_sampler_sample(chain, backend._context.ptr, row))
            finally:
                C.llama_sampler_free(chain)
            assert fast == native, bias
        sampled = backend.new_sampler(SamplingParams(temperature=0.8), seed=1, history=[])
        try:
            assert sampled.chain is not None and not sampled.argmax
        finally:
            backend.free_sampler(sampled)
        assert backend.num_live_samplers == 0
    finally:
        backend.close()


@pytest.mark.model
def test_the_logits_views_read_each_decodes_outputs_as_new_views_would(model_path: Path) -> None:
    """The context keeps one view per row address (a dictionary lookup instead of
    ``np.ctypeslib.as_array`` each step): through decodes with 1 to 24 output rows, the
    last of which makes llama.cpp grow its output buffer (new addresses), every row reads
    what a view made now reads; a row past the outputs is refused with a ValueError and
    the context decodes on."""
    backend = LlamaCppBackend(ContextConfig(model_path=str(model_path), n_ctx=1024, n_seq_max=4))
    C, context = backend._C, backend._context
    n_vocab = backend.facts.n_vocab
    try:
        text = backend.tokenize("One two three four five six seven eight", parse_special=False)
        prompts = [text[:5], text[:3], (text * 3)[:24], text[:2]]
        buffers = set()
        for seq_id, (prompt, rows) in enumerate(
            [(prompts[0], (4,)), (prompts[1], (0, 1, 2)), (prompts[3], (1,)), (prompts[2], None)]
        ):
            rows = tuple(range(len(prompt))) if rows is None else rows
            assert backend.decode([BatchItem(seq_id, prompt, 0, rows)]) == 0
            buffers.add(ctypes.cast(C.llama_get_logits(context.ptr), ctypes.c_void_p).value)
            for row in rows:
                fresh = np.ctypeslib.as_array(C.llama_get_logits_ith(context.ptr, row), (n_vocab,))
                view = backend.logits(row)
                assert view is backend.logits(row)  # kept
                assert view.dtype == np.float32 and view.shape == (n_vocab,)
                assert np.array_equal(view, fresh), (seq_id, row)
                view[0] += 1.0  # zero-copy, as before: an edit reaches llama.cpp's row
                assert fresh[0] == view[0]
        assert len(buffers) == 2  # the 24-row decode grew the output buffer
        with pytest.raises(ValueError, match="NULL"):
            backend.logits(10_000)
        assert backend.decode([BatchItem(0, text[5:6], 5, (0,))]) == 0
        assert int(np.argmax(backend.logits(0))) == int(
            np.argmax(np.ctypeslib.as_array(C.llama_get_logits_ith(context.ptr, 0), (n_vocab,)))
        )
    finally:
        backend.close()
