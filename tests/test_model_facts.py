"""``llamax.ModelFacts`` on SmolLM2 (issue 58): what the llama.cpp backend computes at load
equals what llama.cpp says of the file (``model_info``, read another way) and of the
context, stays the same across a move between KV layouts, and is frozen; the embedder's
too. tests/test_facts.py checks them on the fake backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

import llamax
from llamax.embeddings import Embedder

pytestmark = pytest.mark.model

ONE = llamax.SamplingParams(max_tokens=1, temperature=0.0)


def test_the_backend_computes_what_llama_cpp_says(real_ctx: llamax.Context) -> None:
    facts = real_ctx.facts
    info = real_ctx.model_info()  # read from the file, not from the context
    assert (facts.model_name, facts.n_vocab, facts.n_embd, facts.n_ctx_train) == (
        info.name,
        info.n_vocab,
        info.n_embd,
        info.context_length,
    )
    assert (facts.n_vocab, facts.n_embd) == (49152, 576)
    # the shared context: n_ctx=4096, n_seq_max=16, kv_layout="auto" without n_ctx_seq
    assert (facts.n_ctx, facts.n_ctx_seq, facts.n_seq_max) == (4096, 4096, 16)
    assert not facts.sees_images and not facts.fim_tokens.can_infill  # SmolLM2: no FIM
    native = real_ctx._backend._model  # type: ignore[attr-defined]  # what the old properties read
    bos = native.bos() if native.add_bos() else -1
    assert (facts.bos_token_id, facts.eos_token_id) == (
        bos if bos >= 0 else None,
        native.eos() if native.eos() >= 0 else None,
    )
    assert facts.eos_token_id is not None
    for name in ("n_ctx", "n_ctx_seq", "n_seq_max", "n_vocab", "model_name", "fim_tokens"):
        assert getattr(real_ctx, name) == getattr(facts, name), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.n_vocab = 1  # type: ignore[misc]
    assert all(0 <= t < facts.n_vocab for t in real_ctx.tokenize("Hello, world"))


def test_a_move_to_the_unified_layout_keeps_n_ctx(
    make_real: Callable[..., llamax.Context],
) -> None:
    """``n_ctx`` is the unified cache's cells in every layout (the backend no longer
    re-reads them after a move): after ``kv_layout="auto"`` moves to the unified layout,
    the cache holds exactly ``facts.n_ctx`` cells."""
    ctx = make_real(n_ctx=512, n_seq_max=2, n_batch=512)
    facts = ctx.facts
    assert ctx.kv_layout == "streams" and (facts.n_ctx, facts.n_ctx_seq) == (512, 512)
    prompt = " ".join(f"word{i}" for i in range(150))  # more than a stream's 256 cells
    assert len(ctx.tokenize(prompt)) > 256
    ctx.add_request(prompt, ONE).result(timeout=120)
    assert ctx.kv_layout == "unified" and ctx.stats().num_relayouts == 1
    assert ctx.facts is facts and ctx.stats().kv_cells_total == facts.n_ctx == 512


def test_the_embedder_holds_its_backends_facts(model_path: Path) -> None:
    with Embedder(model_path, n_ctx=256, n_seq_max=2, n_threads=1) as embedder:
        facts = embedder.facts
        assert (facts.n_ctx, facts.n_ctx_seq, facts.n_seq_max, facts.n_embd) == (256, 256, 2, 576)
        assert (embedder.n_ctx, embedder.n_seq_max, embedder.n_embd) == (256, 2, 576)
        assert embedder.model_name == facts.model_name and facts.n_vocab == 49152
        assert embedder.embed(["hello"]).shape == (1, facts.n_embd)
    assert embedder.facts is facts  # answers after close
