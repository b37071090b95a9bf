"""On SmolLM2 (CPU flash attention), the step cost model counts the tiles ggml pads, seen
through the ``llamax.engine.timing.step_budget`` debug log: steps of 64 rows or more carry
padded-tile attention, smaller ones none; with ``flash_attn=False`` no step does.

The chunks are fixed (``max_step_ms=None``, ``n_batch=100``) so the step sizes do not
depend on how fast the machine is: a timed budget on a slow CI machine chose chunks under
64 rows, where no tile is padded either way."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

import llamax

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]
# ~170 tokens: one chunk of 100 rows (tiled), then one under 64 (not), beside the stream
LONG = " ".join(f"Note {i}: the lighthouse keeper logged the weather at dawn." for i in range(13))


@pytest.mark.integration
@pytest.mark.parametrize("flash_attn", [None, False])
def test_steps_beside_a_stream_count_padded_tiles(
    make_real: MakeReal, caplog: pytest.LogCaptureFixture, flash_attn: bool | None
) -> None:
    ctx = make_real(
        n_ctx=2048,
        n_seq_max=2,
        n_threads=2,
        kv_layout="unified",
        flash_attn=flash_attn,
        max_step_ms=None,
        n_batch=100,
    )
    stream_params = llamax.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with caplog.at_level(logging.DEBUG, logger="llamax.engine.timing.step_budget"):
        stream = ctx.add_request("Count: 1, 2, 3,", stream_params)
        next(iter(stream))  # decoding before the long prompt arrives
        long = ctx.add_request(LONG, llamax.SamplingParams(max_tokens=1))
        assert long.result(timeout=120).finish_reason == "length"
        stream.cancel()
        stream.result(timeout=60)
    steps = [r.args for r in caplog.records if r.name == "llamax.engine.timing.step_budget"]
    assert isinstance(steps[0], tuple)
    tiled = [s for s in steps if isinstance(s, tuple) and s[0] >= 64]
    small = [s for s in steps if isinstance(s, tuple) and s[0] < 64]
    assert tiled and small
    assert all(s[3] == 0 for s in small)
    if flash_attn is False:
        assert all(s[3] == 0 for s in tiled)
    else:  # 9 heads on 2 threads: every size from 64 to 512 rows pads some tiles but 512
        assert all(s[3] > 0 for s in tiled if s[0] != 512)
