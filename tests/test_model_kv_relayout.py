"""``kv_layout="auto"`` on SmolLM2: short sequences run in streams of their own; a long
prompt moves every sequence's cells into the unified layout mid-stream (with
``llama_state_seq_get/set_data``), and many short ones move them back. Outputs agree with
a solo greedy run up to llama.cpp's near ties, and sessions save and load across layouts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from near_tie import assert_greedy_agrees

import llamax
from llamax.engine.kv import relayout

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]


def greedy(max_tokens: int) -> llamax.SamplingParams:
    return llamax.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def counting(ctx: llamax.Context, start: int, n: int) -> list[int]:
    return list(ctx.tokenize(", ".join(str(start + k) for k in range(n)) + ","))


@pytest.mark.integration
def test_long_prompt_moves_running_streams_to_unified_and_back(
    make_real: MakeReal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a cooldown of 4 steps (32 in use): the move back is forced with 12-token replies
    cooldown = 4
    monkeypatch.setattr(relayout, "RELAYOUT_COOLDOWN_STEPS", cooldown)
    # streams of 256 cells (llama.cpp's smallest): a ~300-token prompt outgrows one
    ctx = make_real(n_ctx=1024, n_seq_max=4, n_threads=2)
    stats = ctx.stats()
    assert ctx.kv_layout == "streams" and ctx.n_ctx_seq == 1024
    assert stats.kv_cells_per_stream == 256 and stats.kv_cells_total == 1024
    probe = make_real(n_ctx=1024, n_seq_max=1, n_threads=2)

    with ctx.session() as session:  # saved in streams, loaded after the move
        session.add_request(counting(ctx, 500, 6), greedy(4)).result(timeout=300)
        session.save(tmp_path / "short.session")

    shorts = [counting(ctx, 10 * i, 5) for i in (1, 7)]
    long_prompt = counting(ctx, 1000, 50)  # ~300 tokens: more than a stream holds
    assert len(long_prompt) > 256
    handles = [ctx.add_request(t, greedy(32)) for t in shorts]
    for handle in handles:
        next(iter(handle))  # both are decoding, in their own streams
    long = ctx.add_request(long_prompt, greedy(8))  # admitted at the next step
    outputs = [list(h.result(timeout=300).choices[0].token_ids) for h in handles]
    long_output = list(long.result(timeout=300).choices[0].token_ids)
    # moved to unified for the long prompt; maybe back already, once it was done
    moves = ctx.stats().num_relayouts
    assert moves in (1, 2) and ctx.kv_layout == ("unified" if moves == 1 else "streams")
    for prompt, got in zip([*shorts, long_prompt], [*outputs, long_output], strict=True):
        solo = probe.add_request(prompt, greedy(len(got))).result(timeout=300)
        assert_greedy_agrees(probe, prompt, list(solo.choices[0].token_ids), got)

    with llamax.Session.load(ctx, tmp_path / "short.session") as restored:
        more = restored.add_request(counting(ctx, 506, 2), greedy(4)).result(timeout=300)
        assert more.choices[0].token_ids

    # many short ones, long enough to outlast the cooldown (counted in steps, not seconds):
    # back to streams
    again = [counting(ctx, 100 * i, 5) for i in range(1, 4)]
    handles = [ctx.add_request(t, greedy(cooldown + 8)) for t in again]
    outputs = [list(h.result(timeout=300).choices[0].token_ids) for h in handles]
    assert ctx.kv_layout == "streams" and ctx.stats().num_relayouts == 2
    assert ctx.stats().kv_cells_total == 1024
    for prompt, got in zip(again, outputs, strict=True):
        solo = probe.add_request(prompt, greedy(len(got))).result(timeout=300)
        assert_greedy_agrees(probe, prompt, list(solo.choices[0].token_ids), got)


def test_auto_picks_streams_only_within_twice_the_memory(make_real: MakeReal) -> None:
    # llama.cpp rounds each stream up to 256 cells: 64 x 256 = 2 x 8192, still adapts
    wide = make_real(n_ctx=8192, n_seq_max=64, n_threads=2)
    assert wide.kv_layout == "streams" and wide.stats().kv_cells_per_stream == 256
    assert wide.n_ctx == 8192 and wide.n_ctx_seq == 8192
    assert wide.stats().kv_cells_total == 16384
    # 66 x 256 > 2 x 4096: stays unified
    narrow = make_real(n_ctx=4096, n_seq_max=66, n_threads=2)
    assert narrow.kv_layout == "unified" and narrow.stats().kv_cells_per_stream == 4096


def test_a_prefix_kept_beside_its_longer_slot_shares_cells_after_the_move(
    make_real: MakeReal,
) -> None:
    """A retried prompt's shorter reply, kept in its own stream beside the first reply,
    is tagged on the first reply's cells when a long prompt moves the cache to the
    unified layout (``seq_cp`` after the states moved), not copied; both then go on
    reading their own K/V (the old code held the prefix twice)."""
    ctx = make_real(n_ctx=1024, n_seq_max=4, n_threads=2)
    probe = make_real(n_ctx=1024, n_seq_max=1, n_threads=2)
    assert ctx.kv_layout == "streams" and ctx.stats().kv_cells_per_stream == 256
    prompt = counting(ctx, 10, 8)
    first = list(ctx.add_request(prompt, greedy(12)).result(timeout=300).choices[0].token_ids)
    again = list(ctx.add_request(prompt, greedy(4)).result(timeout=300).choices[0].token_ids)
    assert again == first[:4]  # a counting prompt: no near tie among its next tokens
    assert ctx.stats().num_retained == 2
    long_prompt = counting(ctx, 500, 60)  # shares no token with ``prompt``
    assert len(long_prompt) > 256 and long_prompt[0] != prompt[0]
    ctx.add_request(long_prompt, greedy(4)).result(timeout=300)
    stats = ctx.stats()
    assert ctx.kv_layout == "unified" and stats.num_relayouts == 1 and stats.num_retained == 3
    held = len(prompt) + 11 + len(prompt) + 3 + len(long_prompt) + 3
    assert stats.kv_cells_used == held - (len(prompt) + 3)  # the retry's cells are shared
    assert ctx.audit() == []
    for reply in (again, first):  # the retry's slot first: it grows beside the shared cells
        more = [*prompt, *reply, *counting(ctx, 40, 3)]
        got = list(ctx.add_request(more, greedy(6)).result(timeout=300).choices[0].token_ids)
        solo = list(probe.add_request(more, greedy(6)).result(timeout=300).choices[0].token_ids)
        assert_greedy_agrees(probe, more, solo, got)
    assert ctx.audit() == []
