"""The disk prefix tier on the real model, in both KV layouts.

A prefix evicted from KV to disk (no RAM tier) and restored from its file holds the very
K/V values it held in KV, so a request served by that restore gives the same greedy tokens
as the same request served by a KV hit of the same prefix (see test_model_prefix_ram.py),
in the context that wrote the file and in the next context on the directory.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from adversaries import deadline
from test_model_prefix_cache import QUESTIONS, SYS, user
from test_model_prefix_ram import FIRST, GREEDY, OPTIONS, OTHER, SECOND, TIMEOUT, kv_hit

import llamax

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]


def _restore(ctx: llamax.Context, prompt: str) -> llamax.Completion:
    """Run ``prompt``, which must be served by one restore from disk computing only what
    follows the stored prefix."""
    before = ctx.stats()
    done = ctx.add_request(prompt, GREEDY).result(TIMEOUT)
    after = ctx.stats()
    assert after.num_prefix_disk_restores - before.num_prefix_disk_restores == 1, after
    assert after.num_prefix_disk_refused == 0
    computed = after.num_prefill_tokens - before.num_prefill_tokens
    assert computed == done.usage.prompt_tokens - done.usage.cached_tokens
    assert computed < 40  # only the question, not the ~290-token system prompt
    return done


@pytest.mark.integration  # the RAM tier's restore is the default run's tier contract
@pytest.mark.parametrize("kv_layout", ["unified", "streams"])
def test_a_prefix_restored_from_disk_gives_the_output_of_a_kv_hit(
    make_real: MakeReal, model_path: Path, kv_layout: str, tmp_path: Path
) -> None:
    options = {"kv_layout": kv_layout, **OPTIONS}
    reference = kv_hit(model_path, kv_layout)  # shared with test_model_prefix_ram.py

    disk = {"prefix_ram_bytes": 0, "prefix_disk_dir": str(tmp_path), "prefix_disk_bytes": 1 << 30}
    ctx = make_real(**disk, **options)
    ctx.add_request(FIRST, GREEDY).result(TIMEOUT)
    for other in OTHER[:2]:  # two more prompts: the first one's slot is evicted to disk
        ctx.add_request(other + "Hi", GREEDY).result(TIMEOUT)
    assert ctx.stats().num_prefix_disk_stores >= 1
    restored = _restore(ctx, SECOND)
    assert restored.usage.cached_tokens == reference.usage.cached_tokens
    assert (restored.token_ids, restored.text) == (reference.token_ids, reference.text)
    ctx.close()

    again = make_real(**disk, **options)  # a restart: the file stayed after the restore
    assert again.stats().prefix_disk_entries >= 1
    restarted = _restore(again, SECOND)
    assert restarted.usage.cached_tokens == reference.usage.cached_tokens
    assert (restarted.token_ids, restarted.text) == (reference.token_ids, reference.text)


@pytest.mark.integration
def test_a_fifo_in_a_files_place_is_refused_at_once_and_the_files_are_private(
    make_real: MakeReal, tmp_path: Path
) -> None:
    options = {"n_ctx": 2048, "n_seq_max": 2, "n_batch": 512, "prefix_ram_bytes": 0}
    prompt = SYS + user(QUESTIONS[1])
    cold = make_real(**options)
    reference = cold.add_request(prompt, GREEDY).result(TIMEOUT)
    cold.close()

    ctx = make_real(prefix_disk_dir=str(tmp_path / "tier"), prefix_disk_bytes=1 << 30, **options)
    ctx.add_request(SYS + user(QUESTIONS[0]), GREEDY).result(TIMEOUT)
    for other in OTHER[:2]:  # SYS's slot is evicted to disk
        ctx.add_request(other + "Hi", GREEDY).result(TIMEOUT)
    (folder,) = (tmp_path / "tier").iterdir()
    paths = sorted(folder.glob("*.kv"))
    assert paths and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in paths} == {0o600}
    for path in paths:  # nobody writes to them: a blocking open would stall the loop
        path.unlink()
        os.mkfifo(path)
    with deadline(TIMEOUT):  # an open that waits for a writer would wait forever
        done = ctx.add_request(prompt, GREEDY).result(TIMEOUT)
    assert ctx.stats().num_prefix_disk_refused == 1
    assert (done.token_ids, done.text) == (reference.token_ids, reference.text)
