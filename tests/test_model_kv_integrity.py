"""KV integrity on SmolLM2: a request reads only KV computed from its own tokens.

With one KV stream per sequence, llama.cpp's ``seq_cp`` between streams only queues the
buffer copy until the next decode, while state reads and writes act at once. Each test
here puts one of those calls between a copy and the decode that runs it, in the order
the engine really produced it (``autostart=False``: the caller drives the steps, so the
order is fixed), and checks the answer against a cold run of the same prompt, up to
llama.cpp's near ties (tests/near_tie.py). Before the fix each one answered from the
wrong KV: another user's prompt, or a buffer the copy had not filled yet.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from near_tie import assert_greedy_agrees, assert_teacher_forced, forced_regrets

import llamax

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]
TIMEOUT = 240.0


def greedy(max_tokens: int, **more: object) -> llamax.SamplingParams:
    return llamax.SamplingParams(temperature=0.0, max_tokens=max_tokens, **more)  # type: ignore[arg-type]


# the answers copy a list from the prompt: wrong KV gives another list, not a near tie
LIST_A = (
    "List A: apple, river, candle, tiger, violin, mountain, pencil, ocean, garden, rocket, "
    "window, silver, dragon, basket, thunder, lemon.\n"
)
LIST_B = (
    "List B: orange, desert, hammer, falcon, guitar, valley, marker, island, castle, comet, "
    "mirror, golden, wizard, bucket, lightning, cherry.\n"
)
OTHER = "Zebras live in Africa. They have black and white stripes. Count: one two three."


def run(
    ctx: llamax.Context, prompt: str | list[int], params: llamax.SamplingParams
) -> llamax.Completion:
    handle = ctx.add_request(prompt, params)
    while not handle.done():
        ctx.process()
    return handle.result(0)


def cold(probe: llamax.Context, prompt: str, max_tokens: int) -> tuple[list[int], list[int]]:
    tokens = list(probe.tokenize(prompt))
    done = probe.add_request(tokens, greedy(max_tokens)).result(TIMEOUT)
    probe.clear_cache()
    return tokens, list(done.token_ids)


@pytest.mark.integration
def test_a_tier_restore_never_changes_what_a_queued_copy_gives(make_real: MakeReal) -> None:
    # X copies its prefix from the retained slot P (the copy is queued); in the same round
    # a RAM-tier restore for Y evicts P and writes Y's state into P's stream; the queued
    # copy then gave X Y's cells, and X answered from list B.
    ctx = make_real(
        n_ctx=1024, n_seq_max=2, kv_layout="streams", prefix_ram_bytes=64 << 20, autostart=False
    )
    run(ctx, LIST_B + "Repeat list B: orange,", greedy(4))  # slot 0
    run(ctx, LIST_A + "Repeat list A: apple,", greedy(4))  # slot 1
    run(ctx, OTHER, greedy(4))  # evicts list B's slot to RAM
    x_prompt = LIST_A + "Repeat list A: apple, river,"
    y_prompt = LIST_B + "Repeat list B: orange, desert,"
    before = ctx.stats()
    x = ctx.add_request(x_prompt, greedy(12))
    y = ctx.add_request(y_prompt, greedy(12))
    while not (x.done() and y.done()):
        ctx.process()
    after = ctx.stats()
    assert after.num_prefix_ram_restores - before.num_prefix_ram_restores >= 1  # Y's
    assert x.result(0).usage.cached_tokens > 40  # X copied list A from P
    probe = make_real(n_ctx=1024, n_seq_max=1, prefix_cache=False)
    for handle, prompt in ((x, x_prompt), (y, y_prompt)):
        tokens, expected = cold(probe, prompt, 12)
        assert_greedy_agrees(probe, tokens, expected, list(handle.result(0).token_ids), nats=0.2)


@pytest.mark.integration
def test_n_choices_survive_a_layout_move_right_after_the_fork(make_real: MakeReal) -> None:
    # n=2 forks the second choice after the prefill (a queued stream copy); a long prompt
    # then moved the layout before any decode, reading the fork's state before its copy
    # ran: the second greedy choice was garbage where the first read '\n\nA:'.
    ctx = make_real(n_ctx=2048, n_seq_max=4, autostart=False)
    assert ctx.kv_layout == "streams"
    prompt = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
    handle = ctx.add_request(prompt, greedy(8, n=2, ignore_eos=True))
    ctx.process()  # the prefill, and the fork
    long_prompt = ", ".join(str(1000 + k) for k in range(150))  # more than a stream holds
    long = ctx.add_request(long_prompt, greedy(2))
    while not (handle.done() and long.done()):
        ctx.process()
    assert ctx.stats().num_relayouts >= 1
    first, second = (list(c.token_ids) for c in handle.result(0).choices)
    probe = make_real(n_ctx=1024, n_seq_max=1, prefix_cache=False)
    tokens = list(probe.tokenize(prompt))
    assert_greedy_agrees(probe, tokens, first, second, nats=0.2)


@pytest.mark.parametrize(
    "kv_layout", ["streams", pytest.param("unified", marks=pytest.mark.integration)]
)
def test_a_fork_saved_at_once_holds_the_forks_kv(
    make_real: MakeReal, tmp_path: Path, kv_layout: str
) -> None:
    # Session.fork() queued the stream copy; save() on the fork at once wrote the state of
    # a buffer the copy had not filled, so the loaded session answered differently.
    ctx = make_real(n_ctx=1024, n_seq_max=4, kv_layout=kv_layout)
    question = LIST_A + "Repeat list A: apple, river,"  # a session prompt is the whole text
    with ctx.session() as session:
        session.add_request(LIST_A, greedy(1)).result(TIMEOUT)
        with session.fork() as fork:
            fork.save(tmp_path / "fork.session")
            from_fork = fork.add_request(question, greedy(12)).result(TIMEOUT)
    with llamax.Session.load(ctx, tmp_path / "fork.session") as loaded:
        from_file = loaded.add_request(question, greedy(12)).result(TIMEOUT)
    assert from_file.token_ids == from_fork.token_ids
    assert "tiger" in from_fork.text  # the fork itself copies list A


@pytest.mark.integration
def test_the_teacher_forced_check_passes_a_cold_reply_and_refuses_another_prompts(
    make_real: MakeReal,
) -> None:
    # the soak's comparison of its replies with cold runs: a reply is scored, token by
    # token, against what a cold probe would have picked there
    probe = make_real(n_ctx=1024, n_seq_max=1, prefix_cache=False)
    greedy = llamax.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    mine, other = "List three colours: red,", "The capital of France is"
    own = probe.add_request(mine, greedy).result(240).token_ids
    theirs = probe.add_request(other, greedy).result(240).token_ids
    probe.clear_cache()
    ids = probe.tokenize(mine)
    assert max(forced_regrets(probe, ids, own)) == 0.0  # its own greedy picks, exactly
    with pytest.raises(AssertionError, match="nats below the cold probe's best pick"):
        assert_teacher_forced(probe, ids, theirs, nats=0.3)
