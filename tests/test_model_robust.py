"""Issue 22's engine items on the real model (SmolLM2): KV pressure in the default layout,
a request failing inside a split step, requests blocked by sessions."""

from __future__ import annotations

from collections.abc import Callable

from near_tie import assert_greedy_agrees

import llamax
from llamax.testing import assert_idle

MakeReal = Callable[..., llamax.Context]


def greedy(max_tokens: int, **options: object) -> llamax.SamplingParams:
    return llamax.SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        **options,  # type: ignore[arg-type]
    )


def test_default_layout_preempts_under_kv_pressure(
    make_real: MakeReal, real_ctx: llamax.Context
) -> None:
    """4 prompts of 100 tokens x 200 new tokens in ``n_ctx=512, n_seq_max=4``: 4 streams
    of 256 cells hold more than the 512-cell unified layout (the issue's case is 8 in
    ``n_ctx=1024``). Before: every one failed with ``RequestFailedError: the request needs
    257 KV cells, one stream holds 256, and ... the new KV layout refused sequence 2``."""
    ctx = make_real(n_ctx=512, n_seq_max=4)
    assert ctx.kv_layout == "streams"
    body = ctx.tokenize(" The river ran past the old mill and on to the sea." * 8)[:99]
    prompts = [[*body[:-1], body[-1] + i] for i in range(4)]
    handles = [ctx.add_request(p, greedy(200)) for p in prompts]
    done = [h.result(timeout=600) for h in handles]
    assert [c.finish_reason for c in done] == ["length"] * 4
    stats = ctx.stats()
    assert stats.num_preemptions > 0 and stats.kv_layout == "unified"
    assert_idle(ctx)
    # the newest is one of those preempted (recomputed later): each equals the request alone
    for prompt, completion in list(zip(prompts, done, strict=True))[-1:]:
        alone = real_ctx.add_request(prompt, greedy(200)).result(timeout=600)
        real_ctx.clear_cache()
        assert_greedy_agrees(real_ctx, prompt, alone.token_ids, completion.token_ids)
