"""Every reuse feature in the per-sequence KV layout (``kv_layout="streams"``), on SmolLM2:
prefix hits (whole-stream copy, then the tail cut), in-flight bursts, ``n > 1`` forks,
sessions (fork, rewind, save, load), chat history shift, and the per-sequence limit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import llamax
from llamax.testing import assert_idle

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]
TIMEOUT = 240.0
GREEDY = llamax.SamplingParams(temperature=0.0, max_tokens=16)
SYS = (
    "<|im_start|>system\nYou are a careful assistant for a museum of clocks. You answer "
    "visitors' questions about the history of timekeeping, pendulums, escapements, "
    "chronometers and sundials, in one or two plain sentences.<|im_end|>\n<|im_start|>user\n"
)
QUESTIONS = [
    "Who built the first pendulum clock?",
    "What is an escapement?",
    "How old are sundials?",
]


def user(question: str) -> str:
    return f"{question}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def streams(make_real: MakeReal) -> llamax.Context:
    ctx = make_real(n_ctx=4096, n_seq_max=8, n_ctx_seq=512, n_threads=2)
    assert ctx.kv_layout == "streams" and ctx.n_ctx_seq == 512
    return ctx


def test_auto_starts_with_streams_and_says_what_each_sequence_may_hold(
    make_real: MakeReal,
) -> None:
    # n_ctx_seq defaults to n_ctx: auto adapts, starting with 4 streams of 256 cells
    adaptive = make_real(n_ctx=1024, n_seq_max=4)
    assert adaptive.kv_layout == "streams" and adaptive.n_ctx_seq == 1024
    stats = adaptive.stats()
    assert stats.kv_layout == "streams" and stats.kv_cells_per_seq == 1024
    assert stats.kv_cells_per_stream == 256 and stats.kv_cells_total == 1024
    assert stats.kv_bytes_total > 1024 * 1000  # SmolLM2: ~23 KB a cell
    # 16 streams would round up to 16 x 256 cells, over twice n_ctx: unified
    unified = make_real(n_ctx=1024, n_seq_max=16)
    stats = unified.stats()
    assert unified.kv_layout == "unified" and stats.kv_cells_per_stream == 1024
    assert stats.kv_cells_total == 1024 and stats.num_relayouts == 0
    with pytest.raises(llamax.InvalidParameterError, match="n_ctx_seq"):
        make_real(n_ctx=1024, n_seq_max=4, n_ctx_seq=512, kv_layout="streams")


@pytest.mark.integration
def test_prefix_hit_copies_the_stream_and_equals_a_split_cold_prefill(
    streams: llamax.Context, make_real: MakeReal
) -> None:
    ctx = streams
    n_sys = len(ctx.tokenize(SYS))
    ctx.add_request(SYS + user(QUESTIONS[0]), GREEDY).result(TIMEOUT)
    prompt = ctx.tokenize(SYS + user(QUESTIONS[1]))
    hit = ctx.add_request(prompt, GREEDY).result(TIMEOUT)
    assert hit.usage.cached_tokens == n_sys
    split = make_real(
        n_ctx=1024, n_seq_max=2, n_ctx_seq=512, prefix_cache=False, n_batch=n_sys, n_threads=2
    )
    assert split.kv_layout == "streams"
    reference = split.add_request(prompt, GREEDY).result(TIMEOUT)
    assert hit.token_ids == reference.token_ids
    assert ctx.audit() == []


@pytest.mark.integration
def test_burst_and_n_choices_share_the_prefix(streams: llamax.Context) -> None:
    ctx = streams
    n_sys = len(ctx.tokenize(SYS))
    before = ctx.stats()
    handles = [ctx.add_request(SYS + user(q), GREEDY) for q in QUESTIONS * 2]
    results = [h.result(TIMEOUT) for h in handles]
    cached = sum(r.usage.cached_tokens for r in results)
    assert cached >= (len(results) - 1) * (n_sys - 3)  # one leader prefilled the prefix
    prefilled = ctx.stats().num_prefill_tokens - before.num_prefill_tokens
    assert prefilled <= sum(r.usage.prompt_tokens for r in results) - cached
    n3 = ctx.add_request(
        SYS + user(QUESTIONS[2]), llamax.SamplingParams(max_tokens=8, n=3, seed=3)
    ).result(TIMEOUT)
    assert len(n3.choices) == 3 and n3.usage.cached_tokens > 0
    assert ctx.audit() == []


def test_sessions_fork_rewind_save_and_load(streams: llamax.Context, tmp_path: Path) -> None:
    ctx = streams
    prompt = ctx.tokenize(SYS + user(QUESTIONS[0]))
    with ctx.session() as session:
        reply = session.add_request(prompt, GREEDY).result(TIMEOUT)
        held = session.token_ids
        with session.fork() as fork:
            assert fork.token_ids == held
            again = fork.add_request(prompt, GREEDY).result(TIMEOUT)
            assert again.usage.cached_tokens == len(prompt) - 1
        session.rewind(len(held) - len(prompt))
        assert session.token_ids == tuple(prompt)
        session.save(tmp_path / "s.llamax")
    with llamax.Session.load(ctx, tmp_path / "s.llamax") as loaded:
        assert loaded.token_ids == tuple(prompt)
        resumed = loaded.add_request(prompt, GREEDY).result(TIMEOUT)
        assert resumed.usage.cached_tokens == len(prompt) - 1
        assert resumed.token_ids == reply.token_ids
    assert_idle(ctx)


@pytest.mark.integration
def test_chat_history_shift_within_a_stream(streams: llamax.Context) -> None:
    chat = streams.chat(
        system="Answer in one short sentence.",
        max_context=256,
        params=llamax.SamplingParams(max_tokens=24, temperature=0),
    )
    with chat:
        shifted = 0
        num_after = 0
        for i in range(12):  # until one turn after the history outgrew max_context
            chat.send(f"Tell me fact number {i} about clocks.")
            assert chat.last_turn is not None
            num_after += shifted > 0  # a turn on the shifted stream
            shifted += chat.last_turn.shifted_tokens
            if num_after:
                break
        assert shifted > 0  # old turns were dropped by shifting the stream, not recomputed


@pytest.mark.integration
def test_the_per_sequence_limit_is_n_ctx_seq(streams: llamax.Context) -> None:
    ctx = streams
    with pytest.raises(llamax.ContextLengthError, match="may hold 512"):
        ctx.add_request("word " * 600, GREEDY)
    long = ctx.add_request(  # a ~480-token prompt: the limit is reached after ~30 decodes
        "count " * 480, llamax.SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    ).result(TIMEOUT)
    assert long.finish_reason == "length"
    assert long.usage.prompt_tokens + len(long.token_ids) == 512
    assert ctx.stats().num_preemptions == 0
