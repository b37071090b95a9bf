"""Thread changes between steps on the real model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

from pathlib import Path

import pytest

import llamax
from llamax.backend.llama_cpp import LlamaCppBackend

pytestmark = pytest.mark.model

GREEDY = llamax.SamplingParams(max_tokens=16, temperature=0.0)
PROMPT = "The capital of France is"


def test_set_n_threads_between_steps_keeps_greedy_tokens(model_path: Path) -> None:
    config = llamax.ContextConfig(str(model_path), n_ctx=512, n_seq_max=1, n_threads=2)
    backend = LlamaCppBackend(config)
    try:
        options = {"calibrate": False, "n_threads": 2, "prefix_cache": False}
        with llamax.Context(backend=backend, **options) as ctx:
            assert backend.n_threads == 2 and ctx.stats().n_threads == 2
            full = ctx.add_request(PROMPT, GREEDY).result().token_ids
            backend.set_n_threads(1)
            assert backend.n_threads == 1
            one = ctx.add_request(PROMPT, GREEDY).result().token_ids
            assert ctx.stats().n_threads == 1  # published after the steps at one thread
            backend.set_n_threads(2)
            again = ctx.add_request(PROMPT, GREEDY).result().token_ids
    finally:
        backend.close()
    assert one == full == again


def test_the_default_threads_are_every_core_and_adapt_only_when_asked(model_path: Path) -> None:
    with llamax.Context(model_path, n_ctx=512, n_seq_max=2) as ctx:
        assert ctx.config.n_threads is None and not ctx.config.adapts_threads
        assert ctx.stats().n_threads == ctx.config.resolved_n_threads
    with llamax.Context(model_path, n_ctx=512, n_seq_max=2, adapt_threads=True) as ctx:
        assert ctx.config.n_threads is None and ctx.config.adapts_threads
        ctx.add_request(PROMPT, GREEDY).result()
        stats = ctx.stats()
    assert stats.n_threads >= 1 and stats.n_threads <= ctx.config.resolved_n_threads
