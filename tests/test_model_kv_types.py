"""Quantized KV (issue 61) on SmolLM2, with flash attention on: generation, prefix sharing
(``n > 1`` and shared prompts), sessions (a round trip, and an f16 session refused by a
q8_0 context), the host-RAM tier and ``kv_layout="auto"``'s move to the unified layout work
at ``q8_0`` and ``q4_0``, a cell takes what ``kv_bytes_per_cell`` says at every type, and a
quantized K alone keeps the reproducible mode's replies bit-identical to their solo runs.
Outputs are compared with a probe of the same types (quantization moves logits: an f16
run's greedy tokens may part from a q4_0 run's at a near tie, so only same-type runs
are compared). Options and refusals without a model: tests/test_kv_types.py."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from near_tie import assert_greedy_agrees

import llamax
from llamax.backend.base import BatchItem
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.config import KV_TYPES, ContextConfig, kv_row_bytes

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]
TIMEOUT = 240.0
SMOLLM2_CELL = {  # 30 layers, K and V of 192 values (3 KV heads of 64), each at its type
    kv_type: 30 * 2 * kv_row_bytes(kv_type, 192) for kv_type in KV_TYPES
}
HEAD = (
    "<|im_start|>system\nYou are the archivist of a small museum of clocks. You answer "
    "visitors' questions about pendulums, escapements and sundials in two plain sentences."
    "<|im_end|>\n"
)
QUESTIONS = (
    "Who built the first pendulum clock?",
    "What is an escapement?",
    "How old are sundials?",
)
QUANTIZED = pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])


def user(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def greedy(max_tokens: int = 8, **extra: Any) -> llamax.SamplingParams:
    return llamax.SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def counting(ctx: llamax.Context, start: int, n: int) -> list[int]:
    return list(ctx.tokenize(", ".join(str(start + k) for k in range(n)) + ","))


def tokens(done: llamax.Completion, index: int = 0) -> list[int]:
    return list(done.choices[index].token_ids)


def options(kv_type: str, **more: Any) -> dict[str, Any]:
    return {"kv_type": kv_type, "flash_attn": True, "n_threads": 2, "calibrate": False, **more}


def test_a_cell_takes_what_kv_bytes_per_cell_says_at_every_type(model_path: Path) -> None:
    """Measured: a sequence's saved state grows by ``kv_bytes_per_cell`` and the cell's
    position and sequence id (12 bytes) a token; f16 23,040 bytes, q8_0 12,240, q4_0 6,480
    (the numbers of docs/kv-cache.md#quantized-kv)."""
    measured = {}
    for kv_type in KV_TYPES:
        config = ContextConfig(
            str(model_path), n_ctx=256, n_seq_max=1, n_threads=2, kv_type=kv_type
        )
        backend = LlamaCppBackend(config)
        try:
            ids = backend.tokenize("One, two, three, four, five, six, seven, eight")
            assert backend.decode([BatchItem(0, ids[:4], 0)]) == 0
            before = len(backend.state_seq_get(0))
            assert backend.decode([BatchItem(0, ids[4:8], 4)]) == 0
            measured[kv_type] = (len(backend.state_seq_get(0)) - before) // 4 - 12
            assert backend.kv_bytes_per_cell == measured[kv_type]
            assert backend.model_identity["kv_cache"] == f"{kv_type}/{kv_type}".upper()
        finally:
            backend.close()
    assert measured == SMOLLM2_CELL
    assert (measured["f16"], measured["q8_0"], measured["q4_0"]) == (23040, 12240, 6480)


@QUANTIZED
def test_generation_and_prefix_sharing_work_at_a_quantized_type(
    make_real: MakeReal, kv_type: str
) -> None:
    ctx = make_real(**options(kv_type, n_ctx=1024, n_seq_max=4, kv_layout="unified"))
    probe = make_real(**options(kv_type, n_ctx=512, n_seq_max=1, prefix_cache=False))
    assert ctx.stats().kv.bytes_total == ctx.stats().kv.cells_total * SMOLLM2_CELL[kv_type]
    first, second = HEAD + user(QUESTIONS[0]), HEAD + user(QUESTIONS[1])
    done = ctx.add_request(first, greedy(12)).result(TIMEOUT)
    assert re.fullmatch(r"[\w ,.'!?-]{20,}", done.text), done.text  # words, not noise
    shared = ctx.add_request(second, greedy()).result(TIMEOUT)  # reuses HEAD's cells
    assert shared.usage.cached_tokens >= len(ctx.tokenize(HEAD)) - 1
    twice = ctx.add_request(first, greedy(n=2)).result(TIMEOUT)  # n > 1: a forked prompt
    assert tokens(twice, 0) == tokens(twice, 1)
    for prompt, got in ((first, tokens(done)), (second, tokens(shared)), (first, tokens(twice))):
        ids = ctx.tokenize(prompt)
        solo = probe.add_request(ids, greedy(len(got))).result(TIMEOUT)
        assert_greedy_agrees(probe, ids, tokens(solo), got)
    assert ctx.audit() == []


@QUANTIZED
def test_a_session_round_trips_at_a_quantized_type_and_f16_sessions_are_refused(
    make_real: MakeReal, model_path: Path, tmp_path: Path, kv_type: str
) -> None:
    ctx = make_real(**options(kv_type, n_ctx=512, n_seq_max=2))
    path = tmp_path / "chat.session"
    prompt = HEAD + user(QUESTIONS[2])
    with ctx.session() as session:
        reply = session.add_request(prompt, greedy()).result(TIMEOUT)
        session.save(path)
        more = prompt + reply.text + "<|im_end|>\n" + user("And the oldest one?")
        expected = session.add_request(more, greedy()).result(TIMEOUT)
    loaded_ctx = make_real(**options(kv_type, n_ctx=512, n_seq_max=2))
    with loaded_ctx.load_session(path) as loaded:
        again = loaded.add_request(more, greedy()).result(TIMEOUT)
        assert again.usage.cached_tokens >= len(loaded_ctx.tokenize(prompt))
    assert tokens(again) == tokens(expected)  # the same cells, the same batch shapes

    f16_path = tmp_path / "f16.session"
    f16 = make_real(n_ctx=512, n_seq_max=1, n_threads=2)
    with f16.session() as session:
        session.add_request(prompt, greedy(2)).result(TIMEOUT)
        session.save(f16_path)
    with pytest.raises(llamax.SessionLoadError, match="KV cache of types F16/F16") as caught:
        loaded_ctx.load_session(f16_path)
    assert "kv_type='f16'" in str(caught.value)
    with pytest.raises(llamax.SessionLoadError, match=f"{kv_type.upper()}/{kv_type.upper()}"):
        f16.load_session(path)  # and the other way round
    assert loaded_ctx.add_request(prompt, greedy(2)).result(TIMEOUT).text  # still serving


@QUANTIZED
def test_the_ram_tier_keeps_and_restores_a_quantized_prefix(
    make_real: MakeReal, kv_type: str
) -> None:
    ctx = make_real(**options(kv_type, n_ctx=512, n_seq_max=1, prefix_ram_bytes=64 << 20))
    first, second = HEAD + user(QUESTIONS[0]), HEAD + user(QUESTIONS[1])
    ctx.add_request(first, greedy(4)).result(TIMEOUT)
    ctx.add_request("<|im_start|>system\nReply in one word.<|im_end|>\n", greedy(2)).result(
        TIMEOUT
    )  # takes the only sequence id: ``first`` goes to RAM
    ram = ctx.stats().prefix_ram
    assert ram.num_stored == 1 and ram.num_entries == 1
    held = len(ctx.tokenize(first)) + 3  # the prompt, and the reply but its last token
    assert held * SMOLLM2_CELL[kv_type] < ram.num_bytes < held * (SMOLLM2_CELL[kv_type] + 12) + 1024
    restored = ctx.add_request(second, greedy()).result(TIMEOUT)
    assert ctx.stats().prefix_ram.num_restores == 1
    assert restored.usage.cached_tokens >= len(ctx.tokenize(HEAD)) - 1
    probe = make_real(**options(kv_type, n_ctx=512, n_seq_max=1, prefix_cache=False))
    ids = ctx.tokenize(second)
    solo = probe.add_request(ids, greedy()).result(TIMEOUT)
    assert_greedy_agrees(probe, ids, tokens(solo), tokens(restored))


@QUANTIZED
def test_auto_moves_quantized_streams_to_unified_and_keeps_them(
    make_real: MakeReal, kv_type: str
) -> None:
    ctx = make_real(**options(kv_type, n_ctx=1024, n_seq_max=4))
    probe = make_real(**options(kv_type, n_ctx=1024, n_seq_max=1, prefix_cache=False))
    assert ctx.kv_layout == "streams" and ctx.stats().kv.cells_per_stream == 256
    short = counting(ctx, 10, 6)
    running = ctx.add_request(short, greedy(24, ignore_eos=True))
    next(iter(running))  # decoding in its own stream
    long_prompt = counting(ctx, 1000, 50)  # ~300 tokens: more than a stream holds
    assert len(long_prompt) > 256
    long = ctx.add_request(long_prompt, greedy(6, ignore_eos=True))
    outputs = [tokens(running.result(TIMEOUT)), tokens(long.result(TIMEOUT))]
    assert ctx.stats().kv.num_relayouts >= 1
    for prompt, got in zip((short, long_prompt), outputs, strict=True):
        solo = probe.add_request(prompt, greedy(len(got), ignore_eos=True)).result(TIMEOUT)
        assert_greedy_agrees(probe, prompt, tokens(solo), got)
    assert ctx.audit() == []


def _replies(done: llamax.Completion) -> tuple[object, ...]:
    """The token ids and logprobs (with alternatives) of every choice, bit for bit."""
    out: list[object] = []
    for choice in done.choices:
        assert choice.logprobs is not None
        out.append(
            tuple(
                (lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top_logprobs))
                for lp in choice.logprobs
            )
        )
    return tuple(out)


def test_a_quantized_k_alone_keeps_the_reproducible_mode_exact(make_real: MakeReal) -> None:
    """Without flash attention (the mode turns it off), K in q8_0: each reply of a burst
    equals its solo run on a fresh context, logprobs included."""
    mode = {
        "reproducible": True, "kv_type_k": "q8_0", "n_ctx": 1024, "n_seq_max": 4,
        "n_ctx_seq": 256, "n_batch": 64, "n_threads": 2, "calibrate": False,
    }  # fmt: skip
    ctx = make_real(**mode)
    params = greedy(6, logprobs=2)
    prompts: Sequence[str] = [HEAD + user(q) for q in QUESTIONS]
    burst = [ctx.add_request(p, params) for p in prompts]
    got = [_replies(h.result(TIMEOUT)) for h in burst]
    for prompt, reply in zip(prompts, got, strict=True):
        solo = make_real(**mode)
        assert _replies(solo.add_request(prompt, params).result(TIMEOUT)) == reply
        solo.close()
