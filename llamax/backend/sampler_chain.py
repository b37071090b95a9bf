"""A sequence's native sampler, built from its :class:`~llamax.SamplingParams`, and the
grammar mask applied before it samples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import RequestFailedError
from ..params import SamplingParams
from .host_sampling import ChainRng, host_chain
from .native import NativeModel, NativeSampler

__all__ = ["constrain", "new_sampler"]


def new_sampler(
    C: Any,
    model: NativeModel,
    params: SamplingParams,
    seed: int,
    history: Sequence[int],
    grammar: str | None,
    *,
    eog: frozenset[int],
    n_vocab: int,
    n_ctx: int,
    host: bool = False,
    graph: bool = False,
) -> NativeSampler:
    """The native sampler chain for one sequence (none for greedy with at most a bias:
    see :class:`~llamax.backend.native.NativeSampler`); penalties have seen ``history``.
    With ``host``, a chain :mod:`~llamax.backend.host_sampling` can sample is sampled
    there: llama.cpp's filters are built without ``dist``, whose generator lives on the host.
    With ``graph``, a chain whose every sampler llama.cpp can run in the graph and draws
    there what the host chain draws (greedy, or top-k then top-p; no grammar or typical-p) is
    built whole, greedy ones too, for :mod:`~llamax.backend.graph_sampling`.

    Raises:
        RequestFailedError: llama.cpp could not parse ``grammar``.
    """
    bias = dict(params.logit_bias)
    if params.ignore_eos:
        bias.update(dict.fromkeys(eog, float("-inf")))
    bias = {t: b for t, b in bias.items() if t < n_vocab}
    # the graph draws the host chain's token only where its candidates are few and sorted
    # as the host's: top-k (without it the whole vocabulary is softmaxed with other sums),
    # then top-p (which sorts them; ggml's top-k leaves them in no order). Others stay here.
    graph = graph and grammar is None and params.typical_p >= 1
    graph = graph and (params.is_greedy or (params.top_k > 0 and params.top_p < 1))
    if params.is_greedy and not params.has_penalties and grammar is None and not graph:
        return NativeSampler(C, None, None, [], n_vocab, argmax=True, bias=bias)
    chain_on_host = host_chain(params, bias, grammar) if host and not graph else None
    chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
    if bias:
        arr = (C.llama_logit_bias * len(bias))(*(C.llama_logit_bias(t, b) for t, b in bias.items()))
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_logit_bias(n_vocab, len(bias), arr))
    if params.has_penalties:
        last_n = n_ctx if params.penalty_last_n == -1 else params.penalty_last_n
        penalties = C.llama_sampler_init_penalties(
            n_vocab,
            last_n,
            params.repeat_penalty,
            params.frequency_penalty,
            params.presence_penalty,
        )
        C.llama_sampler_chain_add(chain, penalties)
        for token in history[-last_n:]:
            C.llama_sampler_accept(penalties, token)
    if params.is_greedy:
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
    else:
        if params.top_k > 0:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_k(params.top_k))
        if params.typical_p < 1:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_typical(params.typical_p, 1))
        if params.top_p < 1:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_min_p(params.min_p, 1))
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(params.temperature))
        if chain_on_host is not None:  # and llama.cpp's own, for a step of few rows
            rng = ChainRng(seed)
            full = C.llama_sampler_clone(chain)
            C.llama_sampler_chain_add(full, C.llama_sampler_init_dist(rng.seed))
            return NativeSampler(
                C, chain, None, [], n_vocab, host=chain_on_host, rng=rng, full=full
            )
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(seed))
    constraint = None
    if grammar is not None:
        constraint = model.grammar_sampler(grammar)
        if not constraint:  # checked at add_request; never hand llama.cpp a NULL sampler
            C.llama_sampler_free(chain)
            raise RequestFailedError("llama.cpp could not parse the grammar")
    banned = [t for t, b in bias.items() if b == float("-inf")]
    return NativeSampler(
        C, chain, constraint, banned, n_vocab, is_greedy=params.is_greedy, graph=graph
    )


def constrain(C: Any, sampler: NativeSampler, logits: npt.NDArray[np.float32]) -> None:
    """Write the grammar's mask into ``logits`` (a row the chain then samples from).

    Raises:
        RequestFailedError: no token survives the mask, the bans and the processors.
    """
    candidates = sampler.candidates
    assert candidates is not None
    candidates["logit"] = logits
    data = C.llama_token_data_array(
        candidates.ctypes.data_as(C.llama_token_data_p), sampler.n_vocab, -1, False
    )
    sampler.apply_grammar(data)
    kept = candidates[: data.size]
    logits[kept["id"][np.isneginf(kept["logit"])]] = -np.inf
    alive = np.isfinite(logits)
    alive[sampler.banned] = False
    if not alive.any():
        raise RequestFailedError(
            "the grammar allows no token here (are its end-of-generation tokens banned by "
            "ignore_eos or logit_bias, or did a logits processor remove every allowed token?)"
        )
