"""Checkpoints (issue 40) through the public API, on random hybrid and recurrent models.

``scripts/make_memory_model.py`` writes an LFM2 (hybrid) and a Mamba2 (recurrent) model
with SmolLM2's tokenizer. On each, in both KV layouts: a prompt that shares part of an
earlier one is served from the earlier one's checkpoints, and its greedy output agrees
with a context that has nothing cached (:mod:`near_tie`; random weights make a wrong state
show at once); ``n > 1`` forks; a session continues across turns.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import memory_model_files
import numpy as np
import pytest
from near_tie import assert_greedy_agrees

import llamax
from llamax.engine.kv import checkpoints
from llamax.testing import assert_idle

pytest.importorskip("gguf")
pytestmark = pytest.mark.model

INTERVAL = 64
GREEDY = llamax.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


# the hybrid (recurrent blocks and attention) in the default run, the recurrent one and the
# streams layout in the integration run
@pytest.fixture(
    scope="module", params=["hybrid", pytest.param("recurrent", marks=pytest.mark.integration)]
)
def memory_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> Path:
    kind = str(request.param)
    return memory_model_files.shared(tmp_path_factory, kind, model_path)


@pytest.fixture(params=["unified", pytest.param("streams", marks=pytest.mark.integration)])
def ctx(
    request: pytest.FixtureRequest, memory_model: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[llamax.Context]:
    monkeypatch.setattr(checkpoints, "CHECKPOINT_INTERVAL", INTERVAL)
    made = llamax.Context(
        memory_model, n_ctx=4096, n_seq_max=4, n_batch=256, n_threads=1, kv_layout=request.param
    )
    yield made
    assert_idle(made)
    made.close()


@pytest.fixture
def probe(memory_model: Path) -> Iterator[llamax.Context]:
    made = llamax.Context(memory_model, n_ctx=2048, n_seq_max=1, n_threads=1, prefix_cache=False)
    yield made
    made.close()


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40_000, n).tolist()


def test_a_prompt_sharing_part_of_another_is_served_from_its_checkpoint(
    ctx: llamax.Context, probe: llamax.Context
) -> None:
    first = _tokens(1, 300)
    ctx.add_request(first, GREEDY).result(timeout=120)
    second = first[:250] + _tokens(2, 40)
    done = ctx.add_request(second, GREEDY).result(timeout=120)
    assert done.usage.cached_tokens == 192  # the last checkpoint before token 250
    assert_greedy_agrees(probe, second, probe_run(probe, second), done.token_ids)
    stats = ctx.stats()
    assert stats.num_checkpoints >= 5 and stats.num_checkpoint_restores >= 1


def test_a_head_two_prompts_share_is_reused_from_where_they_part(
    ctx: llamax.Context, probe: llamax.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second prompt of a head takes a checkpoint where it parts from the first; the
    third is served from it, and agrees with a cold run."""
    monkeypatch.setattr(checkpoints, "MIN_BRANCH_GAIN", 16)  # 250 - 192 reused by the interval
    head = _tokens(5, 250)
    ctx.add_request(head + _tokens(6, 30), GREEDY).result(timeout=120)
    second = ctx.add_request(head + _tokens(7, 30), GREEDY).result(timeout=120)
    third_prompt = head + _tokens(8, 30)
    third = ctx.add_request(third_prompt, GREEDY).result(timeout=120)
    assert second.usage.cached_tokens == 192 and third.usage.cached_tokens == 250
    assert_greedy_agrees(probe, third_prompt, probe_run(probe, third_prompt), third.token_ids)


def probe_run(probe: llamax.Context, prompt: list[int]) -> list[int]:
    return probe.add_request(prompt, GREEDY).result(timeout=120).token_ids


def test_the_same_prompt_again_and_a_next_turn_reuse_it(
    ctx: llamax.Context, probe: llamax.Context
) -> None:
    prompt = _tokens(3, 200)
    first = ctx.add_request(prompt, GREEDY).result(timeout=120)
    again = ctx.add_request(prompt, GREEDY).result(timeout=120)
    assert again.usage.cached_tokens == len(prompt) - 1
    assert_greedy_agrees(probe, prompt, first.token_ids, again.token_ids)
    turn = [*prompt, *first.token_ids, *_tokens(4, 30)]
    done = ctx.add_request(turn, GREEDY).result(timeout=120)
    assert done.usage.cached_tokens >= len(prompt) - 1
    assert_greedy_agrees(probe, turn, probe_run(probe, turn), done.token_ids)


def test_a_next_turn_shorter_than_an_interval_takes_one_checkpoint(
    ctx: llamax.Context, probe: llamax.Context
) -> None:
    """Issue 59: a turn adding 50 tokens past a multiple of the interval (64) is cut only at
    its last token but one (one checkpoint; the old rule took one more at 256, inside the
    turn, which nothing reuses), and still agrees with a cold run."""
    prompt = _tokens(9, 220)
    first = ctx.add_request(prompt, GREEDY).result(timeout=120)
    turn = [*prompt, *first.token_ids, *_tokens(10, 50)]  # 228 reused, 278 tokens
    assert any(p % INTERVAL == 0 for p in range(len(prompt) + 1, len(turn) - 1))
    before = ctx.stats().checkpoints.num_taken
    done = ctx.add_request(turn, GREEDY).result(timeout=120)
    assert done.usage.cached_tokens >= len(prompt) - 1
    assert ctx.stats().checkpoints.num_taken - before == 1
    assert_greedy_agrees(probe, turn, probe_run(probe, turn), done.token_ids)


def test_a_next_turn_parting_in_the_reply_is_cut_in_its_slot(
    ctx: llamax.Context, probe: llamax.Context
) -> None:
    """Issue 59: an agent's next turn renders the last reply back differently; it goes on
    in the last turn's slot from the prompt's last-token-but-one checkpoint (no second
    slot, no copy), and agrees with a cold run."""
    prompt = _tokens(11, 200)
    first = ctx.add_request(prompt, GREEDY).result(timeout=120)
    reply = [first.token_ids[0] + 1, *first.token_ids[1:]]  # tokenized differently
    turn = [*prompt, *reply, *_tokens(12, 30)]
    done = ctx.add_request(turn, GREEDY).result(timeout=120)
    assert done.usage.cached_tokens == len(prompt) - 1
    assert ctx.stats().num_retained == 1
    assert_greedy_agrees(probe, turn, probe_run(probe, turn), done.token_ids)


def test_n_choices_share_the_prompt(ctx: llamax.Context, probe: llamax.Context) -> None:
    prompt = _tokens(5, 120)
    params = llamax.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=3)
    done = ctx.add_request(prompt, params).result(timeout=120)
    expected = probe_run(probe, prompt)
    for choice in done.choices:
        assert_greedy_agrees(probe, prompt, expected, choice.token_ids)
    assert done.usage.prompt_tokens == len(prompt)
    assert ctx.stats().num_prefill_tokens == len(prompt)  # computed once, then forked


def test_a_session_is_reused_across_turns(ctx: llamax.Context, probe: llamax.Context) -> None:
    session = ctx.session()
    prompt = _tokens(6, 150)
    first = session.add_request(prompt, GREEDY).result(timeout=120)
    turn = [*prompt, *first.token_ids, *_tokens(7, 20)]
    second = session.add_request(turn, GREEDY).result(timeout=120)
    assert second.usage.cached_tokens >= len(prompt) + len(first.token_ids) - 1
    assert_greedy_agrees(probe, turn, probe_run(probe, turn), second.token_ids)
    session.close()


def test_a_history_shift_is_refused_on_a_recurrent_state(
    ctx: llamax.Context, probe: llamax.Context
) -> None:
    """Regression: llama.cpp accepts removing a span from the middle of a recurrent or
    hybrid sequence but keeps the span in its recurrent state; ``Session.shift`` returned
    True and the conversation went on from the dropped tokens."""
    session = ctx.session()
    prompt = _tokens(8, 120)
    session.add_request(prompt, GREEDY).result(timeout=120)
    assert not session.shift(10, 40)
    shortened = prompt[:10] + prompt[40:]
    done = session.add_request(shortened, GREEDY).result(timeout=120)
    assert_greedy_agrees(probe, shortened, probe_run(probe, shortened), done.token_ids)
    session.close()


SYSTEM = (
    "You are the archivist of a small museum of clocks. You answer visitors' questions about "
    "pendulums, escapements, chronometers, water clocks and sundials in two plain sentences, "
    "naming a maker and a year where you can. Visitors are often children, so you keep every "
    "word simple and explain each technical term the first time you use it."
)


def test_a_shifted_chat_reuses_its_system_prompt(ctx: llamax.Context) -> None:
    """The first prompt of a chat takes a checkpoint where its system message ends (its
    first ``<|im_end|>``): the same chat with its oldest turns dropped, and a new chat with
    the same system prompt, reuse the system prompt from it (on the old code, computed
    again: the system prompt is shorter than the checkpoint interval)."""
    system = {"role": "system", "content": SYSTEM}
    turns = [
        {"role": "user", "content": "Who built the first pendulum clock?"},
        {"role": "assistant", "content": "Christiaan Huygens, in 1656."},
        {"role": "user", "content": "What is an escapement?"},
        {"role": "assistant", "content": "The part that lets the gear train advance."},
        {"role": "user", "content": "How old are sundials?"},
    ]
    ids = ctx.chat_prompt([system, *turns])
    head = ids.index(ctx.tokenize("<|im_end|>", add_special=False, parse_special=True)[0]) + 1
    assert checkpoints.MIN_BRANCH_GAIN <= head < INTERVAL * 4
    params = {"max_tokens": 4, "temperature": 0.0}
    ctx.chat_completion([system, *turns], **params)
    before = ctx.stats().num_cached_tokens
    ctx.chat_completion([system, *turns[4:]], **params)  # the oldest two turns dropped
    assert ctx.stats().num_cached_tokens - before >= head
    before = ctx.stats().num_cached_tokens
    ctx.chat_completion([system, {"role": "user", "content": "What is a tourbillon?"}], **params)
    assert ctx.stats().num_cached_tokens - before >= head
