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


def test_the_default_threads_are_every_core_and_adapt_unless_turned_off(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMAX_ADAPT_THREADS", raising=False)
    with llamax.Context(model_path, n_ctx=512, n_seq_max=2) as ctx:
        assert ctx.config.n_threads is None and ctx.config.adapts_threads
        assert ctx.stats().n_threads == ctx.config.resolved_n_threads
        ctx.add_request(PROMPT, GREEDY).result()
        stats = ctx.stats()
    assert 1 <= stats.n_threads <= ctx.config.resolved_n_threads
    monkeypatch.setenv("LLAMAX_ADAPT_THREADS", "0")
    with llamax.Context(model_path, n_ctx=512, n_seq_max=2) as ctx:
        assert not ctx.config.adapts_threads
    with llamax.Context(model_path, n_ctx=512, n_seq_max=2, adapt_threads=True) as ctx:
        assert ctx.config.adapts_threads


@pytest.mark.integration
def test_a_machine_the_os_calls_quiet_keeps_its_threads(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the real machine's load, when the OS says only this process runs, no step
    is judged and no probe runs: 64 decode steps of 4 streams at full threads."""
    from llamax.engine.timing import threads

    monkeypatch.setattr(threads, "runnable_tasks", lambda: 1)
    params = llamax.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    with llamax.Context(model_path, n_ctx=1024, n_seq_max=4, adapt_threads=True) as ctx:
        handles = [ctx.add_request(f"{PROMPT} {i}", params) for i in range(4)]
        for handle in handles:
            handle.result(timeout=600)
        stats = ctx.stats()
    assert stats.num_thread_changes == 0 and not stats.is_contended
    assert stats.n_threads == ctx.config.resolved_n_threads
