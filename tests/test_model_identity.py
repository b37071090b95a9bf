"""A model's identity includes its weights (issue 36, item 3), on SmolLM2 and a copy of it
with one tensor changed (``blk.0.attn_norm.weight`` scaled by noise): the same name,
description, sizes and vocabulary, another model. A session saved with one is refused
by the other, and the disk tier of one never restores the other's entries, also across
restarts on the same directory."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_model_prefix_cache import QUESTIONS, SYS, user
from test_model_prefix_ram import GREEDY, OTHER, TIMEOUT

import llamax
from llamax.backend.gguf_file import read_header
from llamax.testing import assert_idle

pytestmark = [pytest.mark.model, pytest.mark.integration]

MakeCtx = Callable[..., llamax.Context]
OPTIONS = {"n_ctx": 2048, "n_seq_max": 2, "kv_layout": "unified", "n_batch": 512}


@pytest.fixture(scope="module")
def tuned_path(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with the first block's attention norm scaled by noise: a "fine-tune" whose
    metadata is the original's, byte for byte."""
    path = tmp_path_factory.mktemp("tuned") / model_path.name
    shutil.copy(model_path, path)
    header = read_header(path)
    (norm,) = [t for t in header.tensors if t.name == "blk.0.attn_norm.weight"]
    assert norm.type_name == "F32"
    weights = np.memmap(path, "<f4", "r+", header.data_offset + norm.offset, norm.shape)
    weights *= np.random.default_rng(0).uniform(0.2, 3.0, norm.shape).astype("f4")
    weights.flush()
    del weights
    return path


@pytest.fixture
def make_ctx() -> Iterator[MakeCtx]:
    """Build contexts of a given model; each is leak-checked and closed after the test."""
    made: list[llamax.Context] = []

    def make(path: Path, **options: Any) -> llamax.Context:
        ctx = llamax.Context(path, **options)
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        if not ctx.closed:
            assert_idle(ctx, timeout=60)
        ctx.close()


def test_the_identity_differs_in_the_weights_alone(
    make_ctx: MakeCtx, model_path: Path, tuned_path: Path
) -> None:
    base = make_ctx(model_path, n_ctx=512, n_seq_max=1)
    tuned = make_ctx(tuned_path, n_ctx=512, n_seq_max=1)
    a, b = base._backend.model_identity, tuned._backend.model_identity
    assert {k: v for k, v in a.items() if k != "weights"} == {
        k: v for k, v in b.items() if k != "weights"
    }
    assert a["weights"] != b["weights"]
    assert a["kv_cache"] == "F16/F16"
    prompt = SYS + user(QUESTIONS[0])
    assert (
        base.add_request(prompt, GREEDY).result(TIMEOUT).token_ids
        != tuned.add_request(prompt, GREEDY).result(TIMEOUT).token_ids
    )


def test_a_session_saved_with_one_model_is_refused_by_its_fine_tune(
    make_ctx: MakeCtx, model_path: Path, tuned_path: Path, tmp_path: Path
) -> None:
    """Regression: the identity was the metadata alone, so the fine-tune loaded the
    original's KV and answered from it."""
    path = tmp_path / "s.llamax"
    base = make_ctx(model_path, n_ctx=1024, n_seq_max=1)
    with base.session() as session:
        session.add_request(SYS + user(QUESTIONS[0]), GREEDY).result(TIMEOUT)
        session.save(path)
    base.close()
    tuned = make_ctx(tuned_path, n_ctx=1024, n_seq_max=1)
    with pytest.raises(llamax.SessionLoadError, match="was saved with model"):
        tuned.load_session(path)
    assert tuned.add_request("Hi", GREEDY).result(TIMEOUT).text  # still serving
    again = make_ctx(model_path, n_ctx=1024, n_seq_max=1)
    with again.load_session(path) as loaded:
        assert len(loaded.token_ids) > 200


def test_the_disk_tier_of_a_fine_tune_never_restores_the_original_entries(
    make_ctx: MakeCtx, model_path: Path, tuned_path: Path, tmp_path: Path
) -> None:
    """Regression: both models' entries were in one directory (the key hashed the
    metadata alone), so the fine-tune restored the original's KV, across restarts."""
    disk = {"prefix_ram_bytes": 0, "prefix_disk_dir": str(tmp_path), "prefix_disk_bytes": 1 << 30}
    first, second = SYS + user(QUESTIONS[0]), SYS + user(QUESTIONS[1])
    base = make_ctx(model_path, **disk, **OPTIONS)
    base.add_request(first, GREEDY).result(TIMEOUT)
    for other in OTHER[:2]:  # two more prompts: the first one's slot is evicted to disk
        base.add_request(other + "Hi", GREEDY).result(TIMEOUT)
    assert base.stats().num_prefix_disk_stores >= 1
    base.close()

    tuned = make_ctx(tuned_path, **disk, **OPTIONS)
    assert tuned.stats().prefix_disk_entries == 0
    done = tuned.add_request(second, GREEDY).result(TIMEOUT)
    assert tuned.stats().num_prefix_disk_restores == 0
    assert done.usage.cached_tokens == 0
    tuned.close()

    again = make_ctx(model_path, **disk, **OPTIONS)  # its entries are still there
    assert again.stats().prefix_disk_entries >= 1
    again.add_request(second, GREEDY).result(TIMEOUT)
    assert again.stats().num_prefix_disk_restores == 1
