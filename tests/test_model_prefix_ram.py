"""The host-RAM prefix tier on the real model, in both KV layouts.

A prefix evicted from KV and restored from RAM holds the very K/V values it held in KV, so
a request served by a restore must give the same greedy tokens as the same request served
by a KV hit of the same prefix (same batch composition: the prefix computed as part of the
first prompt, the rest in one chunk), and a restore must compute only what follows the
prefix. Outputs are also checked against a cold run with the near-tie rule of
test_model_prefix_cache.py.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from near_tie import assert_greedy_agrees
from test_model_prefix_cache import QUESTIONS, SYS, user

import llamax
from llamax.testing import assert_idle

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]
TIMEOUT = 240.0
GREEDY = llamax.SamplingParams(temperature=0.0, max_tokens=8)  # a wrong cell shows at once
OTHER = [
    f"<|im_start|>system\nYou are helper {i}. Reply in one word.<|im_end|>\n" for i in range(3)
]


OPTIONS = {"n_ctx": 2048, "n_seq_max": 2, "n_batch": 512}
FIRST, SECOND = SYS + user(QUESTIONS[0]), SYS + user(QUESTIONS[1])
_KV_HITS: dict[tuple[Path, str], llamax.Completion] = {}


def kv_hit(model_path: Path, kv_layout: str) -> llamax.Completion:
    """``SECOND`` served by a KV hit of SYS (computed with ``FIRST``), no tier, in
    ``kv_layout``: what a restore of SYS must give. Computed once per session and layout;
    test_model_prefix_disk.py compares its restores with it too."""
    key = (model_path, kv_layout)
    if key not in _KV_HITS:
        with llamax.Context(model_path, prefix_ram_bytes=0, kv_layout=kv_layout, **OPTIONS) as ctx:
            ctx.add_request(FIRST, GREEDY).result(TIMEOUT)
            _KV_HITS[key] = ctx.add_request(SECOND, GREEDY).result(TIMEOUT)
            assert_idle(ctx)
    assert _KV_HITS[key].usage.cached_tokens > 200
    return _KV_HITS[key]


@pytest.mark.parametrize(
    "kv_layout", ["unified", pytest.param("streams", marks=pytest.mark.integration)]
)
def test_a_restored_prefix_gives_the_output_of_a_kv_hit(
    make_real: MakeReal, model_path: Path, kv_layout: str
) -> None:
    """Also: storing a state copies it once and builds nothing per byte (formerly
    test_storing_a_state_copies_it_and_builds_nothing_per_byte, merged here: the same
    eviction). llama_state_seq_get_data's buffer was read back by slicing the ctypes
    array, which builds a list of one int per byte (8 bytes of pointer each): 0.5 s and
    ~230 MB of Python objects to spill a 1,200-token prefix (28 MB), which made a RAM-tier
    hit 4x slower than llama-server's --cache-ram hit."""
    reference = kv_hit(model_path, kv_layout)
    ctx = make_real(prefix_ram_bytes=256 << 20, kv_layout=kv_layout, **OPTIONS)
    ctx.add_request(FIRST, GREEDY).result(TIMEOUT)
    tracemalloc.start()
    try:
        for other in OTHER[:2]:  # two more prompts: the first one's slot is evicted to RAM
            ctx.add_request(other + "Hi", GREEDY).result(TIMEOUT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    stats = ctx.stats()
    assert stats.num_prefix_ram_stores >= 1 and stats.prefix_ram_entries >= 1
    assert stats.prefix_ram_bytes > 4 << 20, stats  # ~23 KB a token of the ~290-token prefix
    assert peak < 4 * stats.prefix_ram_bytes, (stats.prefix_ram_bytes, peak)
    before = ctx.stats()
    restored = ctx.add_request(SECOND, GREEDY).result(TIMEOUT)
    after = ctx.stats()
    assert after.num_prefix_ram_restores - before.num_prefix_ram_restores == 1
    assert after.num_prefix_ram_refused == 0
    assert restored.usage.cached_tokens == reference.usage.cached_tokens
    computed = after.num_prefill_tokens - before.num_prefill_tokens
    assert computed == restored.usage.prompt_tokens - restored.usage.cached_tokens
    assert computed < 40  # only the question, not the ~290-token system prompt
    assert (restored.token_ids, restored.text) == (reference.token_ids, reference.text)

    cold = make_real(n_ctx=2048, n_seq_max=1, prefix_cache=False)
    prompt = cold.tokenize(SECOND)
    alone = cold.add_request(prompt, GREEDY).result(TIMEOUT)
    assert_greedy_agrees(cold, prompt, alone.token_ids, restored.token_ids, nats=0.2)
