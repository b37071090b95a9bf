"""Prefixes with images in the disk prefix tier, on SmolLM2 and the random projectors of
scripts/make_vision_model.py (issue 42): a prefix holding an image, evicted to disk and
restored (in the context that wrote it and in the next one on the directory), gives what a
KV hit of the same prefix gives; a context with another projector never reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import vision_files
from vision_files import pixels, png

import llamax
from llamax.testing import assert_idle

pytestmark = [pytest.mark.model, pytest.mark.integration]
GREEDY = llamax.SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
TIMEOUT = 300
OPTIONS: dict[str, Any] = {"n_ctx": 1024, "n_seq_max": 1, "n_batch": 256, "n_threads": 2}


SYSTEM = (
    "<|im_start|>system\nYou are a careful assistant. You describe pictures in plain words, "
    "briefly, and say so when you cannot tell what they show.<|im_end|>\n<|im_start|>user\n"
)  # a tier stores and restores only prefixes of 32 tokens or more


def prompt(seed: int, question: str) -> list[Any]:
    image = llamax.Image(png(pixels(seed, 48, 64)))
    return [SYSTEM, image, f" {question}<|im_end|>\n<|im_start|>assistant\n"]


def answer(ctx: llamax.Context, parts: list[Any]) -> llamax.Completion:
    return ctx.add_request(parts, GREEDY).result(TIMEOUT)


def shape(out: llamax.Completion) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """The tokens and each position's top logprobs."""
    lp = out.choices[0].logprobs
    assert lp
    return out.choices[0].token_ids, [[(t.token_id, t.logprob) for t in p.top_logprobs] for p in lp]


def context(model_path: Path, projector: str, **options: Any) -> llamax.Context:
    path = vision_files.script().cached_vision_model(projector=projector)
    return llamax.Context(model_path, mmproj=str(path), **OPTIONS, **options)


@pytest.mark.parametrize("projector", ["gemma3", "janus_pro"])
def test_an_image_prefix_restored_from_disk_gives_the_output_of_a_kv_hit(
    model_path: Path, tmp_path: Path, projector: str
) -> None:
    first, second = prompt(1, "What is in the picture?"), prompt(1, "What colour is it?")

    kv_hit = context(model_path, projector, prefix_ram_bytes=0)
    answer(kv_hit, first)
    reference = answer(kv_hit, second)
    assert reference.usage.cached_tokens > 40  # the image and the text before it
    kv_hit.close()

    disk = {"prefix_ram_bytes": 0, "prefix_disk_dir": str(tmp_path), "prefix_disk_bytes": 1 << 30}
    ctx = context(model_path, projector, **disk)
    answer(ctx, first)
    ctx.add_request("Hello there, how are you today?", GREEDY).result(TIMEOUT)  # evicts it
    assert ctx.stats().num_prefix_disk_stores == 1
    restored = answer(ctx, second)
    stats = ctx.stats()
    assert (stats.num_prefix_disk_restores, stats.num_prefix_disk_refused) == (1, 0)
    assert restored.usage.cached_tokens == reference.usage.cached_tokens
    assert shape(restored) == shape(reference)
    assert_idle(ctx, timeout=60, clear_cache=False)  # clearing would delete the files
    ctx.close()

    again = context(model_path, projector, **disk)  # a restart: the files stayed
    try:
        assert again.stats().prefix_disk_entries >= 1
        restarted = answer(again, second)
        assert again.stats().num_prefix_disk_restores == 1
        assert shape(restarted) == shape(reference)
        assert_idle(again, timeout=60)
    finally:
        again.close()

    other = "janus_pro" if projector == "gemma3" else "gemma3"
    foreign = context(model_path, other, **disk)  # another projector: its own folder
    try:
        assert foreign.stats().prefix_disk_entries == 0
        out = answer(foreign, second)
        assert out.usage.cached_tokens == 0
        assert foreign.stats().num_prefix_disk_restores == 0
    finally:
        foreign.close()
