"""The step budget on a real hybrid model (the random LFM2 of ``make_memory_model.py``):
its memory is cut only at checkpoints, so a prompt's last token is computed alone, a step
after the rest. No reply streams in that step, so the other prompts beside it are not held
to ``max_step_ms``; once the first reply streams, they are (issue 59: four hybrid agent
conversations went 1.16x slower while those rows budgeted the step)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import memory_model_files
import numpy as np
import pytest

import llamax
from llamax.backend.base import BatchItem
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.engine.timing.step_budget import micro_batch
from llamax.testing import assert_idle

pytest.importorskip("gguf")
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    return memory_model_files.shared(tmp_path_factory, "hybrid", model_path)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40_000, n).tolist()


def test_beside_a_prompts_last_token_the_other_prompt_is_not_budgeted(
    hybrid: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[list[tuple[int, int, int]]] = []
    decode = LlamaCppBackend.decode

    def logged(backend: LlamaCppBackend, items: Sequence[BatchItem]) -> Any:
        steps.append([(i.seq_id, i.start_pos, len(i.token_ids)) for i in items])
        return decode(backend, items)

    monkeypatch.setattr(LlamaCppBackend, "decode", logged)
    ctx = llamax.Context(hybrid, n_ctx=4096, n_seq_max=2, n_threads=1, autostart=False)
    # the step cost of a slow machine, 5 ms a token (the random model is fast, and a fit of
    # its own steps would give even a budgeted step the checkpoint interval's 256 tokens):
    # 250 ms then buys a budgeted chunk of about 50 tokens
    model = ctx._engine.scheduler.step_cost
    for n, cells in itertools.product((1, 2, 50, 100, 300, 512) * 4, (10, 1000, 3000)):
        model.observe(micro_batch(n, n * cells), 0.005 * n)
    monkeypatch.setattr(model, "observe", lambda *_: None)
    try:
        short_prompt, long_prompt = tokens(1, 100), tokens(2, 1500)
        params = llamax.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        short = ctx.add_request(short_prompt, params)
        long = ctx.add_request(long_prompt, params)
        while ctx.has_work():
            ctx.process()
        assert len(short.result(timeout=60).token_ids) == 6
        assert len(long.result(timeout=60).token_ids) == 6
        short_id = steps[0][0][0]
        # the step that computes the short prompt's last token alone
        last = next(s for s in steps if (short_id, len(short_prompt) - 1, 1) in s and len(s) == 2)
        beside = max(n for seq_id, _, n in last if seq_id != short_id)
        # the steps where the short one streams and the long prompt still prefills
        streaming = [
            max(n for seq_id, _, n in s if seq_id != short_id)
            for s in steps
            if len(s) == 2
            and any(seq_id == short_id and pos >= len(short_prompt) for seq_id, pos, _ in s)
            and any(seq_id != short_id and n > 1 for seq_id, _, n in s)
        ]
        assert streaming, steps
        assert beside >= 128 and beside > 2 * max(streaming), (beside, streaming)
        assert_idle(ctx)
    finally:
        ctx.close()
