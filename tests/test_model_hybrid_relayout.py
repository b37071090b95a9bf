"""``kv_layout="auto"`` on a hybrid model (the random LFM2 of ``make_memory_model.py``:
recurrent blocks and attention): like a plain model it starts in streams and moves every
sequence, its attention cells and its recurrent state, into the unified layout when a
prompt outgrows a stream, and back once short ones run again. Before, such a model stayed
unified under ``auto``, where every prompt token attends to every sequence's cells (4
agents on LFM2-350M's shape: 108-113 s against 81-84 s in streams, issue 59).

Greedy outputs agree with a lone run (:mod:`near_tie`; random weights make a wrong state
show at once), checkpoints still serve a prefix after the move, sessions load across
layouts, and the engine is idle after each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import memory_model_files
import numpy as np
import pytest
from near_tie import assert_greedy_agrees

import llamax
from llamax.engine.kv import checkpoints, relayout
from llamax.testing import assert_idle

pytest.importorskip("gguf")
pytestmark = pytest.mark.model


def greedy(max_tokens: int) -> llamax.SamplingParams:
    return llamax.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40_000, n).tolist()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    return memory_model_files.shared(tmp_path_factory, "hybrid", model_path)


@pytest.fixture
def probe(hybrid: Path) -> Iterator[llamax.Context]:
    made = llamax.Context(hybrid, n_ctx=2048, n_seq_max=1, n_threads=1, prefix_cache=False)
    yield made
    made.close()


def agrees(probe: llamax.Context, prompt: list[int], got: list[int]) -> None:
    solo = probe.add_request(prompt, greedy(len(got))).result(timeout=120)
    assert_greedy_agrees(probe, prompt, list(solo.token_ids), got)


def test_a_hybrid_moves_between_streams_and_unified(
    hybrid: Path, probe: llamax.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relayout, "RELAYOUT_COOLDOWN_STEPS", 4)
    monkeypatch.setattr(checkpoints, "CHECKPOINT_INTERVAL", 64)
    ctx = llamax.Context(hybrid, n_ctx=1024, n_seq_max=4, n_threads=1)  # streams of 256
    try:
        assert ctx.kv_layout == "streams" and ctx.stats().kv_cells_per_stream == 256
        with ctx.session() as session:  # saved in streams, loaded after the move
            session.add_request(tokens(9, 40), greedy(4)).result(timeout=120)
            session.save(tmp_path / "short.session")

        earlier = tokens(1, 200)  # a chat whose checkpoints are kept in its stream
        agrees(probe, earlier, ctx.add_request(earlier, greedy(6)).result(timeout=120).token_ids)
        shorts = [tokens(10 + i, 20) for i in range(2)]
        handles = [ctx.add_request(t, greedy(24)) for t in shorts]
        for handle in handles:
            next(iter(handle))  # both decode, in their own streams
        long_prompt = tokens(3, 300)  # more than a stream holds: the move
        long = ctx.add_request(long_prompt, greedy(8))
        for prompt, handle in zip(shorts, handles, strict=True):
            agrees(probe, prompt, handle.result(timeout=120).token_ids)
        agrees(probe, long_prompt, long.result(timeout=120).token_ids)
        assert ctx.stats().num_relayouts >= 1

        # the earlier chat's next turn, after its state and checkpoints moved
        turn = earlier[:190] + tokens(4, 30)
        done = ctx.add_request(turn, greedy(6)).result(timeout=120)
        assert done.usage.cached_tokens >= 128
        agrees(probe, turn, done.token_ids)

        with llamax.Session.load(ctx, tmp_path / "short.session") as restored:
            assert restored.add_request(tokens(5, 3), greedy(4)).result(timeout=120).token_ids

        # short ones outlast the cooldown: back to streams, and they agree there too
        again = [tokens(20 + i, 20) for i in range(3)]
        outs = [
            h.result(timeout=120).token_ids for h in [ctx.add_request(t, greedy(16)) for t in again]
        ]
        assert ctx.kv_layout == "streams" and ctx.stats().num_relayouts >= 2
        for prompt, got in zip(again, outs, strict=True):
            agrees(probe, prompt, got)
        assert_idle(ctx)
    finally:
        ctx.close()


def test_a_recurrent_model_stays_unified(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> None:
    """A recurrent-only model has no attention cells to keep apart: ``auto`` is unified."""
    path = memory_model_files.shared(tmp_path_factory, "recurrent", model_path)
    with llamax.Context(path, n_ctx=1024, n_seq_max=4, n_threads=1) as ctx:
        assert ctx.kv_layout == "unified"
