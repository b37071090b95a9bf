"""Quantized KV (issue 61) on SmolLM2, with flash attention on: generation, prefix sharing
(``n > 1`` and shared prompts), sessions (a round trip, and an f16 session refused by a
q8_0 context), the host-RAM tier and ``kv_layout="auto"``'s move to the unified layout work
at ``q8_0`` and ``q4_0``, a cell takes what ``kv_bytes_per_cell`` says at every type, a
quantized K alone keeps the reproducible mode's replies bit-identical to their solo runs,
and every other path that moves KV works at ``q8_0``: calibration's filler cells, the disk
tier (and an f16 context never sees its files), a history shift (``Session.shift`` and a
chat's), a fork and a rewind, prompt lookup's drafts, a LoRA adapter's cells, checkpoints
on the random hybrid model, and an image (the random projector).
Outputs are compared with a probe of the same types (quantization moves logits: an f16
run's greedy tokens may part from a q4_0 run's at a near tie, so only same-type runs
are compared). Options and refusals without a model: tests/test_kv_types.py."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from near_tie import assert_greedy_agrees, assert_teacher_forced
from script_modules import load_script

import llamax
from llamax.backend.base import BatchItem
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.config import KV_TYPES, ContextConfig, kv_row_bytes
from llamax.testing import assert_idle

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
def test_calibrations_filler_cells_are_written_at_a_quantized_type(
    model_path: Path, kv_type: str
) -> None:
    """``calibrate`` (on by default) times steps over a long context by tiling a
    sequence's saved state (``fill_cells``, :func:`~llamax.backend.seq_state.tile`): at a
    quantized type too, and a decode after it reads them."""
    config = ContextConfig(
        str(model_path), n_ctx=512, n_seq_max=1, n_threads=2, kv_type=kv_type, flash_attn=True
    )
    backend = LlamaCppBackend(config)
    try:
        ids = backend.tokenize("One, two, three, four, five, six, seven, eight")
        assert backend.decode([BatchItem(0, ids, 0)]) == 0
        assert backend.fill_cells(0, 300)
        assert (backend.seq_pos_min(0), backend.seq_pos_max(0)) == (0, 299)
        state = backend.state_seq_get(0)
        assert 300 * SMOLLM2_CELL[kv_type] < len(state) < 300 * (SMOLLM2_CELL[kv_type] + 12) + 1024
        assert backend.decode([BatchItem(0, ids[:4], 300, (3,))]) == 0
        assert np.isfinite(backend.logits(3)).all()
    finally:
        backend.close()


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


# ---------------------------------------------------------------------- every path that moves KV
OTHER = "<|im_start|>system\nReply in one word.<|im_end|>\n"
DISK_OPTIONS = {"n_ctx": 512, "n_seq_max": 1}


def _disk_restore(ctx: llamax.Context, prompt: str) -> llamax.Completion:
    """``prompt`` served by one restore from disk, refused nowhere."""
    before = ctx.stats()
    done = ctx.add_request(prompt, greedy()).result(TIMEOUT)
    after = ctx.stats()
    assert after.num_prefix_disk_restores - before.num_prefix_disk_restores == 1, after
    assert after.num_prefix_disk_refused == 0
    return done


def test_the_disk_tier_restores_a_q8_0_prefix_and_an_f16_context_never_sees_it(
    make_real: MakeReal, tmp_path: Path
) -> None:
    """A q8_0 prefix written to disk restores, in the context that wrote it and in the
    next one on the folder, to what a KV hit of it gives (the same cells: the same
    tokens); an f16 context on the same folder keeps a folder of its own."""
    first, second = HEAD + user(QUESTIONS[0]), HEAD + user(QUESTIONS[1])
    hit_ctx = make_real(**options("q8_0", prefix_ram_bytes=0, **DISK_OPTIONS))
    hit_ctx.add_request(first, greedy()).result(TIMEOUT)
    hit = hit_ctx.add_request(second, greedy()).result(TIMEOUT)  # SECOND on HEAD's cells
    assert hit.usage.cached_tokens >= len(hit_ctx.tokenize(HEAD)) - 1
    hit_ctx.close()

    disk = {"prefix_ram_bytes": 0, "prefix_disk_dir": str(tmp_path), "prefix_disk_bytes": 1 << 30}
    ctx = make_real(**options("q8_0", **disk, **DISK_OPTIONS))
    ctx.add_request(first, greedy()).result(TIMEOUT)
    ctx.add_request(OTHER, greedy(2)).result(TIMEOUT)  # takes the only sequence id: to disk
    assert ctx.stats().num_prefix_disk_stores == 1
    (folder,) = tmp_path.iterdir()
    (entry,) = folder.glob("*.kv")
    n = len(ctx.tokenize(first))  # held: the prompt, and at most 7 tokens of the reply
    assert n * SMOLLM2_CELL["q8_0"] < entry.stat().st_size < (n + 8) * SMOLLM2_CELL["q8_0"] * 1.1
    restored = _disk_restore(ctx, second)
    assert restored.usage.cached_tokens == hit.usage.cached_tokens
    assert (tokens(restored), restored.text) == (tokens(hit), hit.text)
    ctx.close()

    again = make_real(**options("q8_0", **disk, **DISK_OPTIONS))  # the file stayed
    assert again.stats().prefix_disk_entries >= 1
    restarted = _disk_restore(again, second)
    assert restarted.usage.cached_tokens == hit.usage.cached_tokens
    assert (tokens(restarted), restarted.text) == (tokens(hit), hit.text)
    again.close()

    f16 = make_real(n_threads=2, calibrate=False, **disk, **DISK_OPTIONS)
    assert f16.stats().prefix_disk_entries == 0  # a folder of its own
    done = f16.add_request(second, greedy()).result(TIMEOUT)
    stats = f16.stats()
    assert done.usage.cached_tokens == 0
    assert (stats.num_prefix_disk_restores, stats.num_prefix_disk_refused) == (0, 0)
    f16.close()
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2  # one folder per type


def turn(question: str, answer: str) -> str:
    return f"{user(question)}{answer}<|im_end|>\n"


DROPPED = turn(QUESTIONS[0], "Christiaan Huygens built it in 1656, after Galileo's studies.")
KEPT = turn(QUESTIONS[1], "It is the part that lets the gear train advance one tooth a swing.")


def _shifted_turns(ctx: llamax.Context) -> tuple[list[int], list[int], list[int]]:
    """A session holding HEAD, DROPPED, KEPT and a question with its reply; DROPPED shifted
    out; a next turn on the shifted cells. Returns the replies and the next turn's prompt."""
    head, dropped, kept = (
        ctx.tokenize(HEAD),
        ctx.tokenize(DROPPED, add_special=False),
        ctx.tokenize(KEPT, add_special=False),
    )
    ask = ctx.tokenize(user(QUESTIONS[2]), add_special=False)
    assert head + dropped + kept + ask == ctx.tokenize(HEAD + DROPPED + KEPT + user(QUESTIONS[2]))
    with ctx.session() as session:
        asked = head + dropped + kept + ask
        first = tokens(session.add_request(asked, greedy(ignore_eos=True)).result(TIMEOUT))
        assert session.shift(len(head), len(head) + len(dropped))
        assert list(session.token_ids) == head + kept + ask + first[:-1]
        more = ctx.tokenize("<|im_end|>\n" + user("And the oldest one?"), add_special=False)
        prompt = head + kept + ask + first + more
        done = session.add_request(prompt, greedy()).result(TIMEOUT)
        assert done.usage.cached_tokens == len(head + kept + ask + first) - 1  # nothing redone
    return first, tokens(done), prompt


@pytest.mark.parametrize("kv_layout", ["unified", "streams"])
def test_a_history_shift_at_q8_0_goes_on_from_the_kept_turns(
    make_real: MakeReal, kv_layout: str
) -> None:
    """llama.cpp re-rotates a quantized K by dequantizing it, rotating and quantizing it
    again. The same operations on a fresh context give the same tokens, and each token
    after the shift is one a cold run of the shortened conversation finds about as good
    as its own pick (a shifted cache is not bit-identical to a cold prefill, at any type:
    docs/chat.md; a wrong cache puts tokens 1.6-17 nats worse, tests/near_tie.py)."""
    made = {"n_ctx": 512, "n_seq_max": 2, "kv_layout": kv_layout}
    first, after, prompt = _shifted_turns(make_real(**options("q8_0", **made)))
    assert (first, after, prompt) == _shifted_turns(make_real(**options("q8_0", **made)))
    probe = make_real(**options("q8_0", n_ctx=512, n_seq_max=1, prefix_cache=False))
    assert_teacher_forced(probe, prompt, after, nats=1.0)


def test_a_chats_history_shift_at_q8_0_drops_whole_turns_and_keeps_answering(
    make_real: MakeReal,
) -> None:
    ctx = make_real(**options("q8_0", n_ctx=512, n_seq_max=2))
    assert ctx.can_shift
    params = greedy(12)
    with ctx.chat(system="Answer in one short sentence.", max_context=160, params=params) as chat:
        shifted = []
        for i in range(12):
            reply = chat.send(f"Tell me fact number {i} about clocks.")
            assert chat.last_turn is not None
            if chat.last_turn.shifted_tokens:
                shifted.append(reply.text)
            if len(shifted) == 2:
                break
    assert len(shifted) == 2  # two turns on shifted cells, neither recomputed from scratch
    for text in shifted:
        assert re.search(r"[A-Za-z]{3,}", text), text


@pytest.mark.parametrize("kv_layout", ["unified", "streams"])
def test_a_fork_and_a_rewind_at_q8_0_agree_with_cold_runs(
    make_real: MakeReal, kv_layout: str
) -> None:
    """A fork shares the session's cells (in streams, a copy of the whole stream); each
    goes on on its own, and a rewind goes back to the bare prompt."""
    ctx = make_real(**options("q8_0", n_ctx=1024, n_seq_max=4, kv_layout=kv_layout))
    probe = make_real(**options("q8_0", n_ctx=512, n_seq_max=1, prefix_cache=False))
    prompt = ctx.tokenize(HEAD + user(QUESTIONS[0]))

    def next_turn(question: str) -> list[int]:
        return ctx.tokenize("<|im_end|>\n" + user(question), add_special=False)

    with ctx.session() as session:
        reply = tokens(session.add_request(prompt, greedy(10)).result(TIMEOUT))
        held = session.token_ids
        transcript = prompt + reply
        with session.fork() as fork:
            assert fork.token_ids == held
            branch_prompt = transcript + next_turn(QUESTIONS[1])
            branch = fork.add_request(branch_prompt, greedy()).result(TIMEOUT)
            assert branch.usage.cached_tokens == len(held)
            main_prompt = transcript + next_turn(QUESTIONS[2])
            main = session.add_request(main_prompt, greedy()).result(TIMEOUT)
            assert main.usage.cached_tokens == len(held)
        session.rewind(len(session.token_ids) - len(prompt))
        assert session.token_ids == tuple(prompt)
        again = session.add_request(prompt, greedy(10)).result(TIMEOUT)
        assert again.usage.cached_tokens == len(prompt) - 1
    for ids, got in ((branch_prompt, branch), (main_prompt, main)):
        solo = probe.add_request(ids, greedy()).result(TIMEOUT)
        assert_greedy_agrees(probe, ids, tokens(solo), tokens(got))
    assert_greedy_agrees(probe, prompt, reply, tokens(again))
    assert ctx.audit() == []


def test_greedy_drafts_at_q8_0_equal_the_plain_run(make_real: MakeReal) -> None:
    """Prompt lookup's verification batches, and the rejected cells removed, at q8_0: the
    plain run's tokens (or a parting at a near tie, tests/test_model_speculative.py)."""
    from test_model_speculative import COPY_PROMPTS, check_agrees, drafting, solo

    ctx = drafting(make_real(**options("q8_0", n_ctx=1024, n_seq_max=2)))
    params = llamax.SamplingParams(max_tokens=64, temperature=0.0, logprobs=5)
    plain = solo(ctx, COPY_PROMPTS[1], params)
    spec = solo(ctx, COPY_PROMPTS[1], dataclasses.replace(params, speculative=True))
    check_agrees(plain, spec)
    assert plain.usage.drafted_tokens == 0
    assert spec.usage.accepted_tokens > 0.25 * spec.usage.drafted_tokens > 0, spec.usage


LORA_PROMPT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


def test_an_adapter_at_q8_0_moves_the_output_and_its_kv_is_shared_and_saved_under_it(
    make_real: MakeReal, tmp_path: Path
) -> None:
    write = load_script("make_lora_adapter").write_lora_adapter
    lora = {"warm": str(write(tmp_path / "warm.gguf", seed=1))}
    warm = {"warm": 1.0}
    ctx = make_real(**options("q8_0", n_ctx=1024, n_seq_max=4, lora=lora))
    probe = make_real(**options("q8_0", n_ctx=512, n_seq_max=1, prefix_cache=False, lora=lora))
    ids = ctx.tokenize(LORA_PROMPT)
    base = ctx.add_request(ids, greedy(12)).result(TIMEOUT)
    under = ctx.add_request(ids, greedy(12, lora=warm)).result(TIMEOUT)
    assert under.usage.cached_tokens == 0  # the base model's cells are not the adapter's
    assert tokens(under) != tokens(base)
    solo = probe.add_request(ids, greedy(12, lora=warm)).result(TIMEOUT)
    assert_greedy_agrees(probe, ids, tokens(solo), tokens(under), lora=warm)

    first, second = HEAD + user(QUESTIONS[0]), HEAD + user(QUESTIONS[1])
    ctx.add_request(first, greedy(4, lora=warm)).result(TIMEOUT)
    shared = ctx.add_request(second, greedy(lora=warm)).result(TIMEOUT)
    assert shared.usage.cached_tokens >= len(ctx.tokenize(HEAD)) - 1
    second_ids = ctx.tokenize(second)
    solo = probe.add_request(second_ids, greedy(lora=warm)).result(TIMEOUT)
    assert_greedy_agrees(probe, second_ids, tokens(solo), tokens(shared), lora=warm)

    path = tmp_path / "warm.session"
    with ctx.session() as session:
        reply = session.add_request(first, greedy(lora=warm)).result(TIMEOUT)
        session.save(path)
        more = first + reply.text + "<|im_end|>\n" + user("And the oldest one?")
        expected = session.add_request(more, greedy(lora=warm)).result(TIMEOUT)
    loaded_ctx = make_real(**options("q8_0", n_ctx=1024, n_seq_max=4, lora=lora))
    with loaded_ctx.load_session(path) as loaded:
        again = loaded.add_request(more, greedy(lora=warm)).result(TIMEOUT)
        assert again.usage.cached_tokens >= len(loaded_ctx.tokenize(first))
    assert tokens(again) == tokens(expected)
    assert ctx.audit() == [] and loaded_ctx.audit() == []


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    """LFM2 with random weights (scripts/make_memory_model.py): heads of 32 values, which
    a quantized type takes."""
    pytest.importorskip("gguf")
    import memory_model_files

    return memory_model_files.shared(tmp_path_factory, "hybrid", model_path)


def _random_tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40_000, n).tolist()


def test_a_hybrid_models_prefix_is_reused_through_a_checkpoint_at_q8_0(
    hybrid: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A checkpoint (the recurrent state alone) set back, the q8_0 attention cells past it
    removed: what a cold run gives; and a session of both, saved and loaded."""
    from llamax.engine.kv import checkpoints

    monkeypatch.setattr(checkpoints, "CHECKPOINT_INTERVAL", 64)
    params = llamax.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    made = options("q8_0", n_ctx=2048, n_batch=256)
    ctx = llamax.Context(hybrid, n_seq_max=4, **made)
    probe = llamax.Context(hybrid, n_seq_max=1, prefix_cache=False, **made)
    try:
        assert ctx.model_info().is_hybrid
        assert ctx._backend.model_identity["kv_cache"] == "Q8_0/Q8_0"
        first = _random_tokens(1, 300)
        ctx.add_request(first, params).result(TIMEOUT)
        second = first[:250] + _random_tokens(2, 40)
        done = ctx.add_request(second, params).result(TIMEOUT)
        assert done.usage.cached_tokens == 192  # the last checkpoint before token 250
        assert ctx.stats().num_checkpoint_restores >= 1
        cold = probe.add_request(second, params).result(TIMEOUT)
        assert_greedy_agrees(probe, second, tokens(cold), tokens(done))

        path = tmp_path / "hybrid.session"
        with ctx.session() as session:
            reply = tokens(session.add_request(first, params).result(TIMEOUT))
            session.save(path)
            turn = [*first, *reply, *_random_tokens(3, 20)]
            expected = session.add_request(turn, params).result(TIMEOUT)
        with ctx.load_session(path) as loaded:
            again = loaded.add_request(turn, params).result(TIMEOUT)
            assert again.usage.cached_tokens >= len(first) + len(reply) - 1
        assert tokens(again) == tokens(expected)
        assert_idle(ctx, timeout=60)
        assert ctx.audit() == []
    finally:
        ctx.close()
        probe.close()


def first_logprobs(done: llamax.Completion) -> list[tuple[int, float]]:
    logprobs = done.choices[0].logprobs
    assert logprobs
    return [(t.token_id, t.logprob) for t in logprobs[0].top_logprobs]


def test_an_image_prompt_at_q8_0_is_seen_reused_and_saved(
    make_real: MakeReal, tmp_path: Path
) -> None:
    import vision_files
    from vision_files import pixels, png

    projector = vision_files.script().cached_vision_model(projector="gemma3")
    made = options("q8_0", mmproj=str(projector), n_ctx=1024, n_batch=256)
    ctx = make_real(n_seq_max=2, **made)
    params = greedy(8, logprobs=3, ignore_eos=True)

    def prompt(seed: int) -> list[object]:
        image = llamax.Image(png(pixels(seed, 48, 64)))
        return ["<|im_start|>user\n", image, " What is in the picture?<|im_end|>\n"]

    asked = [*prompt(1), "<|im_start|>assistant\n"]
    cold = ctx.add_request(asked, params).result(TIMEOUT)
    warm = ctx.add_request(asked, params).result(TIMEOUT)
    assert warm.usage.cached_tokens >= ctx.prompt_positions([prompt(1)[1]])  # the image too
    assert tokens(warm) == tokens(cold)
    other = ctx.add_request([*prompt(2), "<|im_start|>assistant\n"], greedy(1, logprobs=3))
    assert first_logprobs(other.result(TIMEOUT)) != first_logprobs(cold)  # it sees the image

    path = tmp_path / "vision.session"
    with ctx.session() as session:
        reply = session.add_request(asked, params).result(TIMEOUT)
        session.save(path)
        held = session.token_ids
        follow = [
            *prompt(1),
            "<|im_start|>assistant\n" + reply.text + "<|im_end|>\n<|im_start|>user\nMore?"
            "<|im_end|>\n<|im_start|>assistant\n",
        ]
        original = session.add_request(follow, params).result(TIMEOUT)
    loaded_ctx = make_real(n_seq_max=2, **made)
    with loaded_ctx.load_session(path) as loaded:
        assert loaded.token_ids == held
        again = loaded.add_request(follow, params).result(TIMEOUT)
    assert again.usage.cached_tokens == original.usage.cached_tokens > len(held) // 2
    assert tokens(again) == tokens(original)
