"""Host sampling (issue 62) on SmolLM2: the rows a step samples together on the host get
the tokens llama.cpp's own chain (``llama_sampler_sample`` on the same context) picks,
sequence after sequence and step after step, for many seeds and the common parameter
mixes; and a seeded reply through the public API is the same with the host path on
(the default) or off (``LLAMAX_HOST_SAMPLING=0``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import llamax
from llamax.backend.base import BatchItem
from llamax.backend.host_sampling import HOST_SAMPLING_ENV
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.config import ContextConfig
from llamax.params import SamplingParams

pytestmark = pytest.mark.model

MIXES: dict[str, dict[str, Any]] = {
    "temperature 0.8, top-p 0.95, min-p 0.05": {"temperature": 0.8, "top_p": 0.95, "min_p": 0.05},
    "top-k 40": {"temperature": 0.8, "top_k": 40, "top_p": 1.0, "min_p": 0.0},
    "temperature only": {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0},
    "top-k 200, top-p 0.9": {"temperature": 0.9, "top_k": 200, "top_p": 0.9, "min_p": 0.0},
    "a logit bias": {"temperature": 1.1, "logit_bias": {28: 3.0, 30: -2.0, 2: float("-inf")}},
}
"""The host path's mixes (llamax's default top-k 40 where none is given); the public API
test adds chains that stay on llama.cpp (no top-k, penalties) beside them."""
NATIVE_MIXES: tuple[dict[str, Any], ...] = (
    {"temperature": 0.9, "top_k": 0},
    {"temperature": 0.8, "repeat_penalty": 1.1},
)
ENGINE_MIXES: tuple[dict[str, Any], ...] = ({"temperature": 0.7, "ignore_eos": True},)
"""Only through the engine: end-of-generation tokens banned by a bias of -inf."""
PROMPTS = (
    "Once upon a time",
    "The three primary colours are",
    "def fibonacci(n):",
    "Dear diary, today I",
)
N_SEQ = 8
STEPS = 32


@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
def test_rows_sampled_together_get_the_chains_tokens(model_path: Path, mix: dict[str, Any]) -> None:
    backend = LlamaCppBackend(
        ContextConfig(model_path=str(model_path), n_ctx=4096, n_seq_max=N_SEQ)
    )
    params = SamplingParams(**mix)
    try:
        for seeds in ([7 * i + 1 for i in range(N_SEQ)], [2**32 - 2 - i for i in range(N_SEQ)]):
            run_trajectories(backend, params, seeds)
    finally:
        backend.close()


def run_trajectories(backend: LlamaCppBackend, params: SamplingParams, seeds: list[int]) -> None:
    """Each sequence decodes the chain's tokens; at every step the host samplers of the
    same seeds, all in one ``sample_rows``, must pick them too."""
    backend._host_sampling = False  # the reference: llama.cpp's chain, dist included
    chains = [backend.new_sampler(params, seed, []) for seed in seeds]
    backend._host_sampling = True
    hosts = [backend.new_sampler(params, seed, []) for seed in seeds]
    assert all(s.host is None for s in chains) and all(s.host is not None for s in hosts)
    prompts = []
    for seq_id in range(N_SEQ):
        backend.seq_rm(seq_id)
        prompts.append(backend.tokenize(PROMPTS[seq_id % len(PROMPTS)], parse_special=False))
    items = batch([(seq_id, tokens, 0) for seq_id, tokens in enumerate(prompts)])
    try:
        for step in range(STEPS):
            assert backend.decode(items) == 0
            rows = [item.rows[0] for item in items]
            want = [backend.sample(s, row) for s, row in zip(chains, rows, strict=True)]
            got = backend.sample_rows(hosts, rows)
            assert got == want, (step, params)
            items = batch(
                [
                    (item.seq_id, [token], item.start_pos + len(item.token_ids))
                    for item, token in zip(items, want, strict=True)
                ]
            )
    finally:
        for sampler in chains + hosts:
            backend.free_sampler(sampler)


def batch(parts: list[tuple[int, list[int], int]]) -> list[BatchItem]:
    """One item per ``(seq_id, tokens, start_pos)``, laid out in order, each wanting the
    logits of its last token (its batch index)."""
    items, offset = [], 0
    for seq_id, tokens, start in parts:
        offset += len(tokens)
        items.append(BatchItem(seq_id, tokens, start, (offset - 1,)))
    return items


def test_a_seeded_reply_is_the_same_on_the_chain(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``llamax.Context``: concurrent seeded requests (several rows a step, ``n``
    forks) give the same tokens with the host path on and off."""
    replies: dict[str, list[tuple[tuple[int, ...], ...]]] = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(HOST_SAMPLING_ENV, switch)
        with llamax.Context(model_path, n_ctx=4096, n_seq_max=12, calibrate=False) as ctx:
            replies[switch] = run_requests(ctx.add_request)
    assert replies["1"] == replies["0"]


def run_requests(add: Callable[..., Any]) -> list[tuple[tuple[int, ...], ...]]:
    handles = []
    for i, mix in enumerate((*MIXES.values(), *NATIVE_MIXES, *ENGINE_MIXES)):
        params = SamplingParams(**mix, max_tokens=24, seed=1000 + i, n=2 if i % 2 else 1)
        handles.append(add(PROMPTS[i % len(PROMPTS)], params))
    return [tuple(c.token_ids for c in h.result(timeout=300).choices) for h in handles]


@pytest.mark.parametrize("mix", list(MIXES.values())[:3], ids=list(MIXES.keys())[:3])
def test_steps_of_few_rows_and_of_many_draw_from_one_generator(
    model_path: Path, mix: dict[str, Any]
) -> None:
    """A step of few rows is sampled by llama.cpp's whole chain, a step of many on the host
    (``FEW_ROW_VALUES``); a sequence that goes from one to the other (its neighbours come
    and go) keeps drawing llama.cpp's tokens: the host copy of the generator skips the
    draws the chain made."""
    backend = LlamaCppBackend(
        ContextConfig(model_path=str(model_path), n_ctx=4096, n_seq_max=N_SEQ)
    )
    params = SamplingParams(**mix)
    seeds = [5 * i + 2 for i in range(N_SEQ)]
    backend._host_sampling = False
    chains = [backend.new_sampler(params, seed, []) for seed in seeds]
    backend._host_sampling = True
    hosts = [backend.new_sampler(params, seed, []) for seed in seeds]
    prompts = [
        backend.tokenize(PROMPTS[i % len(PROMPTS)], parse_special=False) for i in range(N_SEQ)
    ]
    items = batch([(seq_id, tokens, 0) for seq_id, tokens in enumerate(prompts)])
    try:
        for step in range(STEPS):
            assert backend.decode(items) == 0
            rows = [item.rows[0] for item in items]
            want = [backend.sample(s, row) for s, row in zip(chains, rows, strict=True)]
            if step % 3 == 0:  # every row alone: llama.cpp's chain
                got = [backend.sample_rows([s], [r])[0] for s, r in zip(hosts, rows, strict=True)]
            elif step % 3 == 1:  # all together: the host
                got = backend.sample_rows(hosts, rows)
            else:  # two alone, the rest together
                got = [
                    backend.sample_rows([s], [r])[0]
                    for s, r in zip(hosts[:2], rows[:2], strict=True)
                ]
                got += backend.sample_rows(hosts[2:], rows[2:])
            assert got == want, (step, params)
            items = batch(
                [
                    (item.seq_id, [token], item.start_pos + len(item.token_ids))
                    for item, token in zip(items, want, strict=True)
                ]
            )
        assert all(s.full is not None for s in hosts)
    finally:
        for sampler in chains + hosts:
            backend.free_sampler(sampler)
        backend.close()
