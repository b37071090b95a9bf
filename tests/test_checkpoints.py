"""Checkpoints (issue 40): prefix reuse on a memory that cannot be cut, against the fake.

``FakeBackend(recurrent=True)`` models a recurrent memory as llama.cpp has it: a sequence
has a state that holds every token it consumed; ``seq_rm`` refuses to cut before it,
``seq_cp`` shares it whatever the range, and a partial state (``state_seq_get/set`` with
``partial``) sets it back. At every decode the fake checks that each sequence's state is
the one its own cells' tokens lead to, so a reuse that forgot to set a checkpoint back
fails loudly instead of answering from the wrong history.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import llamax
from llamax.backend.base import BatchItem
from llamax.engine.kv import checkpoints
from llamax.engine.kv.checkpoints import (
    MAX_CHECKPOINTS,
    checkpoint_positions,
    interval_for,
    least_needed,
    next_checkpoint,
    pack_state,
    planned_checkpoint,
    unpack_state,
)
from llamax.engine.kv.kvcache import KVCache
from llamax.testing import FakeBackend

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]
GREEDY = llamax.SamplingParams(max_tokens=6, temperature=0)
SYSTEM = "You are a helpful assistant. " * 4  # 116 tokens on the byte-level fake


@pytest.fixture(params=["unified", "streams"])
def kv_layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def run(ctx: llamax.Context) -> None:
    while ctx.has_work():
        ctx.process()


def cold(prompt: str, params: llamax.SamplingParams = GREEDY) -> list[int]:
    with llamax.Context(backend=FakeBackend(n_ctx=2048, n_seq_max=1), autostart=False) as ctx:
        handle = ctx.add_request(prompt, params)
        run(ctx)
        return handle.result(0).token_ids


def complete(ctx: llamax.Context, prompt: str, params: llamax.SamplingParams = GREEDY) -> Any:
    handle = ctx.add_request(prompt, params)
    run(ctx)
    return handle.result(0)


# ---------------------------------------------------------------------- positions
def test_a_prompt_takes_checkpoints_every_interval_and_at_its_last_token_but_one() -> None:
    assert checkpoint_positions(10, 4) == [4, 8, 9]
    assert checkpoint_positions(9, 4) == [4, 8]
    assert checkpoint_positions(2, 4) == [1]
    assert checkpoint_positions(1, 4) == [] == checkpoint_positions(0, 4)
    chunk_ends = []
    done = 0
    while (end := next_checkpoint(done, 10, 4)) is not None:
        chunk_ends.append(end)
        done = end
    assert chunk_ends == checkpoint_positions(10, 4)
    assert next_checkpoint(5, 10, 4) == 8 and next_checkpoint(9, 10, 4) is None
    assert [planned_checkpoint(n, 10, 4) for n in (0, 3, 4, 7, 8, 9, 10)] == [0, 0, 4, 4, 8, 9, 9]


def test_interval_checkpoints_count_from_where_the_prompt_starts_computing() -> None:
    """A prompt that reused 300 tokens takes its interval checkpoints 256, 512... tokens
    past them, not at multiples of 256: one adding less than an interval takes none (it is
    cut only at its last token but one), and a waiting prompt plans on the same positions."""
    assert checkpoint_positions(500, 256, start=300) == [499]
    assert next_checkpoint(300, 500, 256, start=300) == 499  # no cut at 512 nor 256
    assert checkpoint_positions(900, 256, start=300) == [556, 812, 899]
    assert [next_checkpoint(n, 900, 256, start=300) for n in (300, 400, 556, 812)] == [
        556, 556, 812, 899,
    ]  # fmt: skip
    planned = [planned_checkpoint(n, 900, 256, start=300) for n in (300, 555, 556, 811, 898)]
    assert planned == [0, 0, 556, 556, 812]
    assert planned_checkpoint(899, 900, 256, start=300) == 899
    for start in (0, 1, 37, 255, 256, 700):  # every chunk end is a position, in order
        ends, done = [], start
        while (end := next_checkpoint(done, 1000, 64, start=start)) is not None:
            ends.append(end)
            done = end
        assert ends == [p for p in checkpoint_positions(1000, 64, start=start) if p > start]
        gaps = [b - a for a, b in itertools.pairwise([start, *ends])]
        assert max(gaps, default=0) <= 64, start


def test_a_long_prompt_spreads_a_slots_checkpoints_over_it() -> None:
    """At least CHECKPOINT_INTERVAL apart, and no more checkpoints than a slot keeps: the
    gaps stay even instead of whatever dropping the extra ones leaves
    (benchmarks/checkpoint_interval.py measured why)."""
    step = checkpoints.CHECKPOINT_INTERVAL
    assert [interval_for(n) for n in (2, 2049, 2050, 4096, 16384)] == [
        step,
        step,
        2 * step,
        2 * step,
        8 * step,
    ]
    for n in range(0, 50_000, 37):
        positions = checkpoint_positions(n)
        assert len(positions) <= MAX_CHECKPOINTS, n
        gaps = [b - a for a, b in zip([0, *positions], positions, strict=False)]
        assert max(gaps, default=0) <= interval_for(n), n
        smaller = interval_for(n) - step
        assert smaller == 0 or len(checkpoint_positions(n, smaller)) > MAX_CHECKPOINTS, n


# ---------------------------------------------------------------------- the fake's memory
def _decode(backend: FakeBackend, seq_id: int, tokens: list[int], start: int) -> None:
    assert backend.decode([BatchItem(seq_id, tokens, start, (len(tokens) - 1,))]) == 0


def test_the_fake_recurrent_memory_refuses_a_cut_and_catches_a_stale_state() -> None:
    backend = FakeBackend(recurrent=True)
    _decode(backend, 0, [5, 6, 7, 8], 0)
    assert not backend.seq_rm(0, 2, -1)  # its state holds all four tokens
    checkpoint = json.loads(backend.state_seq_get(0, partial=True))
    assert checkpoint["r"][0] == 4
    backend.seq_cp(0, 1, 0, 2)  # the cells [0, 2), and the state at 4, shared
    with pytest.raises(AssertionError, match="recurrent state is at 4"):
        _decode(backend, 1, [9], 2)


def test_a_checkpoint_set_back_cuts_the_fake_exactly() -> None:
    backend = FakeBackend(recurrent=True)
    kv = KVCache(backend, backend.facts.n_seq_max)
    slot = kv.allocate()
    assert slot is not None
    _decode(backend, slot.seq_id, [5, 6], 0)
    kv.append(slot, [5, 6])
    kv.checkpoint(slot, 8)
    _decode(backend, slot.seq_id, [7, 8], 2)
    kv.append(slot, [7, 8])
    assert kv.usable(slot, 3) == 2 and kv.usable(slot, 4) == 4 and kv.usable(slot, 1) == 0
    assert not kv.truncate(slot, 3) and slot.tokens == [5, 6, 7, 8]  # no checkpoint at 3
    assert kv.truncate(slot, 2) and slot.tokens == [5, 6]
    _decode(backend, slot.seq_id, [9], 2)  # continues from the checkpoint's state
    assert kv.num_checkpoint_restores == 1 and kv.checkpoint_bytes > 0
    kv.release(slot)
    assert kv.checkpoint_bytes == 0


# ---------------------------------------------------------------------- the engine
def test_a_shared_system_prompt_is_reused_from_a_checkpoint(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=1024, recurrent=True)
    first = complete(ctx, SYSTEM + "A1")
    second = complete(ctx, SYSTEM + "B2?")
    assert first.token_ids == cold(SYSTEM + "A1")
    assert second.token_ids == cold(SYSTEM + "B2?")
    # the first prompt's checkpoints: at its last token but one, nothing shorter
    assert second.usage.cached_tokens == 0
    stats = ctx.stats()
    assert stats.num_checkpoints >= 1 and stats.checkpoint_bytes > 0


def test_a_third_prompt_with_the_same_head_reuses_it_where_the_second_parted(
    make_fake: MakeFake,
) -> None:
    """The second prompt finds the first one's cells share its head but hold no
    checkpoint there: it takes one where the two part, and every later prompt with that
    head reuses it (the regression: on the old code the third computed everything)."""
    ctx, _ = make_fake(n_ctx=1024, recurrent=True)
    head = len(ctx.tokenize(SYSTEM))
    complete(ctx, SYSTEM + "A1")
    second = complete(ctx, SYSTEM + "B2?")
    taken = ctx.stats().num_checkpoints
    third = complete(ctx, SYSTEM + "C3!")
    fourth = complete(ctx, SYSTEM + "D4.")
    assert second.usage.cached_tokens == 0
    assert third.usage.cached_tokens == fourth.usage.cached_tokens == head
    assert third.token_ids == cold(SYSTEM + "C3!")
    assert fourth.token_ids == cold(SYSTEM + "D4.")
    assert ctx.stats().num_checkpoint_restores >= 2 and taken >= 3


def test_a_short_shared_head_takes_no_branch_checkpoint(make_fake: MakeFake) -> None:
    """A head shorter than MIN_BRANCH_GAIN is cheaper to recompute than to hold."""
    ctx, _ = make_fake(n_ctx=1024, recurrent=True)
    head = "Be brief. "  # 10 tokens on the byte-level fake
    complete(ctx, head + "A1" * 40)
    before = ctx.stats().num_checkpoints
    complete(ctx, head + "B2" * 40)
    third = complete(ctx, head + "C3" * 40)
    assert ctx.stats().num_checkpoints - before == 2  # each prompt's own, nothing at the head
    assert third.usage.cached_tokens == 0


def test_least_needed_keeps_the_head_and_the_newest_and_thins_the_densest() -> None:
    assert least_needed([300, 1024, 2048, 2100, 3000]) == 2100  # 52 after 2048
    assert least_needed([300, 1024, 1100, 2048, 3000]) == 1100
    assert least_needed([5, 6, 7]) == 6  # never the first or the last
    assert least_needed([300, 3000]) == 300 and least_needed([42]) == 42


def test_a_full_slot_drops_the_least_needed_checkpoint_not_the_head(make_fake: MakeFake) -> None:
    """A conversation that outgrows MAX_CHECKPOINTS keeps the shared head it branched at
    (the old code dropped the lowest first)."""
    ctx, _ = make_fake(n_ctx=2048, recurrent=True)
    complete(ctx, SYSTEM + "A1")
    text = SYSTEM + "B2?"
    for turn in range(12):  # each turn adds its last token but one
        text += complete(ctx, text).text + f" turn {turn} " * 6
    kv = ctx._engine.scheduler.kv
    longest = max(kv.slots(), key=lambda slot: len(slot.tokens))
    assert len(longest.checkpoints) == checkpoints.MAX_CHECKPOINTS
    assert len(ctx.tokenize(SYSTEM)) in longest.checkpoints


def test_a_chat_turn_reuses_the_whole_previous_turn(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=1024, recurrent=True)
    turn1 = SYSTEM + "Q1"
    first = complete(ctx, turn1)
    turn2 = turn1 + first.text + "Q2"
    second = complete(ctx, turn2)
    assert second.usage.cached_tokens >= len(turn1) - 1
    assert second.token_ids == cold(turn2)


def test_the_same_prompt_again_recomputes_only_its_last_token(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=1024, recurrent=True)
    complete(ctx, SYSTEM)
    again = complete(ctx, SYSTEM)
    assert again.usage.cached_tokens == len(SYSTEM) - 1
    assert again.token_ids == cold(SYSTEM)
    assert ctx.stats().num_checkpoint_restores >= 1


def test_a_long_shared_prefix_is_reused_up_to_its_last_interval(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoints, "CHECKPOINT_INTERVAL", 32)
    ctx, _ = make_fake(n_ctx=1024, recurrent=True)
    complete(ctx, SYSTEM + "A1")
    second = complete(ctx, SYSTEM + "B2?")
    assert second.usage.cached_tokens == len(SYSTEM) // 32 * 32  # 96 of the 116 shared
    assert second.token_ids == cold(SYSTEM + "B2?")


def test_a_prompt_sharing_part_of_a_long_one_recomputes_at_most_one_interval(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 700-token document, then prompts that share 30-90% of it: each reuses all but at
    most one interval of what it shares (on the old rule, a checkpoint every 32 tokens of
    which the slot kept 8 of 22, the prompt sharing 210 reused 160)."""
    monkeypatch.setattr(checkpoints, "CHECKPOINT_INTERVAL", 32)
    ctx, _ = make_fake(n_ctx=4096, n_seq_max=8, recurrent=True)
    doc = "".join(f"Record {i}: the valve reads {i * 7 % 100}. " for i in range(40))[:700]
    complete(ctx, doc)
    for fraction in (0.3, 0.5, 0.7, 0.9):
        shared = int(len(doc) * fraction)
        prompt = doc[:shared] + f"|Q{fraction}?"
        done = complete(ctx, prompt)
        assert done.usage.cached_tokens >= shared - interval_for(len(doc)), (fraction, done.usage)
        assert done.token_ids == cold(prompt)


def _prompt_chunk_ends(backend: FakeBackend) -> list[int]:
    """Where the logged decodes' prompt chunks (more than one token) ended."""
    return [i.start_pos + len(i.token_ids) for d in backend.decode_log for i in d
            if len(i.token_ids) > 1]  # fmt: skip


def _turn_crossing(ctx: llamax.Context, before: str, interval: int, extra: int) -> str:
    """``before`` plus a user line so that the next prompt adds ``extra`` tokens or more
    past ``before`` and its new part crosses a multiple of ``interval``."""
    for pad in range(4 * interval):
        turn = before + "Q" + "." * pad + "?"
        new = range(len(ctx.tokenize(before)), len(ctx.tokenize(turn)) - 1)
        if len(new) >= extra and any(p % interval == 0 for p in new[1:]):
            return turn
    raise AssertionError("no such turn")


def test_a_turn_adding_less_than_an_interval_is_cut_only_at_its_end(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 59: an agent's or a chat's next turn adds fewer tokens than an interval to the
    prefix it reuses; its prompt went in two chunks plus the last token where the new part
    crossed a multiple of the interval (a checkpoint no later prompt reuses: the next turn
    restores the last token but one's), and now in one chunk plus the last token."""
    monkeypatch.setattr(checkpoints, "CHECKPOINT_INTERVAL", 32)
    ctx, backend = make_fake(n_ctx=1024, recurrent=True)
    turn1 = SYSTEM + "Q1"
    first = complete(ctx, turn1)
    turn2 = _turn_crossing(ctx, turn1 + first.text, 32, extra=20)
    backend.decode_log.clear()
    second = complete(ctx, turn2)
    reused = second.usage.cached_tokens
    assert reused >= len(turn1) - 1
    last = len(ctx.tokenize(turn2)) - 1
    assert interval_for(last + 1) == 32 and last - reused < 32
    assert _prompt_chunk_ends(backend) == [last]  # one chunk, then the last token alone
    assert second.token_ids == cold(turn2)
    backend.decode_log.clear()
    third = complete(ctx, turn2 + second.text + "Q3")  # and the next turn reuses it all
    assert third.usage.cached_tokens >= last
    assert third.token_ids == cold(turn2 + second.text + "Q3")


def test_a_turn_adding_more_than_an_interval_recomputes_at_most_one_of_it(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn adding several intervals takes checkpoints every interval past the prefix
    it reused, so a prompt sharing any part of its new tokens recomputes at most one."""
    monkeypatch.setattr(checkpoints, "CHECKPOINT_INTERVAL", 32)
    ctx, backend = make_fake(n_ctx=1024, recurrent=True)
    turn1 = SYSTEM + "Q1"
    first = complete(ctx, turn1)
    before = turn1 + first.text
    turn2 = before + "".join(f"Line {i} of the pasted log. " for i in range(6))
    backend.decode_log.clear()
    second = complete(ctx, turn2)
    reused = second.usage.cached_tokens
    last = len(ctx.tokenize(turn2)) - 1
    interval = interval_for(last + 1)  # 64 for these 280 tokens
    assert _prompt_chunk_ends(backend) == [*range(reused + interval, last, interval), last]
    for shared in range(reused + 5, last - 1, 23):
        prompt = ctx.detokenize(ctx.tokenize(turn2)[:shared]) + "|edited?"
        done = complete(ctx, prompt)
        assert done.usage.cached_tokens >= shared - interval, (shared, done.usage)
        assert done.token_ids == cold(prompt)


def test_n_choices_fork_from_the_leader(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_ctx=1024, recurrent=True)
    params = llamax.SamplingParams(max_tokens=6, temperature=0, n=3)
    done = complete(ctx, SYSTEM + "n?", params)
    expected = cold(SYSTEM + "n?")
    assert [c.token_ids for c in done.choices] == [expected] * 3
    assert backend.num_copies >= 2
    assert done.usage.prompt_tokens == len(SYSTEM + "n?")


def test_a_session_continues_and_rewinds_to_its_checkpoints(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=1024, recurrent=True)
    session = ctx.session()
    first = session.add_request(SYSTEM + "Q1", GREEDY)
    run(ctx)
    turn2 = SYSTEM + "Q1" + first.result(0).text + "Q2"
    second = session.add_request(turn2, GREEDY)
    run(ctx)
    assert second.result(0).usage.cached_tokens >= len(SYSTEM + "Q1") - 1
    assert second.result(0).token_ids == cold(turn2)
    held = len(session.token_ids)
    session.rewind(3)  # no checkpoint there: back to the last one before it
    assert len(session.token_ids) < held - 3
    third = session.add_request(turn2, GREEDY)
    run(ctx)
    assert third.result(0).token_ids == cold(turn2)
    session.close()


def test_a_lost_checkpoint_only_costs_the_reuse(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_ctx=1024, recurrent=True)

    def refuse_checkpoints(where: str) -> object:
        return "refused" if where == "state_seq_set" else None

    complete(ctx, SYSTEM)
    backend.fault = refuse_checkpoints
    again = complete(ctx, SYSTEM)
    backend.fault = None
    assert again.token_ids == cold(SYSTEM)
    assert again.usage.cached_tokens == 0


def test_a_checkpoint_that_cannot_be_taken_only_costs_the_reuse(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_ctx=1024, recurrent=True)

    def fail_reads(where: str) -> object:
        if where == "state_seq_get":
            raise RuntimeError("no memory for the checkpoint")
        return None

    backend.fault = fail_reads
    first = complete(ctx, SYSTEM)
    backend.fault = None
    again = complete(ctx, SYSTEM)
    assert first.token_ids == again.token_ids == cold(SYSTEM)
    assert ctx.stats().num_checkpoints == 1  # only the second prompt's


# ---------------------------------------------------------------------- saved states
def test_a_saved_state_carries_its_checkpoints() -> None:
    blob = pack_state(b"state", {7: b"seven", 3: b"three"})
    assert unpack_state(blob) == (b"state", {3: b"three", 7: b"seven"})
    assert unpack_state(b"a bare state") == (b"a bare state", {})
    for damaged in (blob[:-1], blob + b"x", blob[:12], blob.replace(b'"state"', b'"stat"')):
        with pytest.raises(ValueError, match="damaged"):
            unpack_state(damaged)


def test_an_evicted_conversation_comes_back_from_ram_to_its_checkpoint(
    kv_layout: str,
) -> None:
    backend = FakeBackend(
        n_ctx=1024 if kv_layout == "unified" else 2048,
        n_seq_max=2,
        recurrent=True,
        kv_layout=kv_layout,
    )
    with llamax.Context(backend=backend, autostart=False, prefix_ram_bytes=1 << 20) as ctx:
        turn1 = SYSTEM + "Q1"
        first = complete(ctx, turn1)
        for other in ("B", "C", "D"):  # two slots: the first conversation's goes to RAM
            complete(ctx, other * 40)
        assert ctx.stats().prefix_ram_entries >= 1
        turn2 = turn1 + first.text[:-2] + "!Q2"  # parts inside the reply: a cut is needed
        second = complete(ctx, turn2)
        assert second.usage.cached_tokens == len(turn1) - 1  # the prompt's checkpoint
        assert second.token_ids == cold(turn2)
        assert ctx.stats().num_prefix_ram_restores == 1


def test_a_saved_session_loads_with_its_checkpoints(make_fake: MakeFake, tmp_path: Path) -> None:
    ctx, _ = make_fake(n_ctx=1024, recurrent=True)
    session = ctx.session()
    session.add_request(SYSTEM + "Q1", GREEDY)
    run(ctx)
    session.save(tmp_path / "s.llamax")
    held = session.token_ids
    session.close()
    loaded = ctx.load_session(tmp_path / "s.llamax")
    assert loaded.token_ids == held
    loaded.rewind(len(held) - len(SYSTEM + "Q1") + 1)  # to the prompt's checkpoint
    assert len(loaded.token_ids) == len(SYSTEM + "Q1") - 1
    again = loaded.add_request(SYSTEM + "Q1", GREEDY)
    run(ctx)
    assert again.result(0).usage.cached_tokens == len(SYSTEM + "Q1") - 1
    assert again.result(0).token_ids == cold(SYSTEM + "Q1")
    loaded.close()


def test_checkpoints_stay_within_the_ram_budget(kv_layout: str) -> None:
    options = {"n_ctx": 2048} if kv_layout == "unified" else {"n_ctx": 4096}
    backend = FakeBackend(n_seq_max=4, recurrent=True, kv_layout=kv_layout, **options)
    one = len(backend.state_seq_get(0, partial=True)) + 40  # a checkpoint's size, at most
    with llamax.Context(backend=backend, autostart=False, prefix_ram_bytes=3 * one) as ctx:
        for i in range(6):
            complete(ctx, f"{i}" * 20 + SYSTEM)
            assert 0 < ctx.stats().checkpoint_bytes <= 3 * one
        again = complete(ctx, "5" * 20 + SYSTEM)  # the newest prompt kept its checkpoint
        assert again.usage.cached_tokens == len(SYSTEM) + 19


def test_a_history_shift_is_refused_where_the_state_would_keep_the_dropped_tokens(
    make_fake: MakeFake,
) -> None:
    """Regression: llama.cpp's recurrent memory accepts a ``seq_rm`` in the middle of a
    sequence and leaves its state as it is, so ``Session.shift`` returned True and the
    next decode read a state that still held the dropped tokens (the fake now answers as
    llama.cpp does, and caught it). A shift is refused instead; the next request computes
    the shortened history."""
    ctx, _ = make_fake(n_ctx=1024, recurrent=True)
    session = ctx.session()
    session.add_request(SYSTEM + "Q1", GREEDY)
    run(ctx)
    held = session.token_ids
    assert not session.shift(10, 40)
    assert session.token_ids == held
    shortened = SYSTEM[:10] + SYSTEM[40:] + "Q1"
    again = session.add_request(shortened, GREEDY)
    run(ctx)
    assert again.result(0).token_ids == cold(shortened)
    session.close()


@pytest.mark.parametrize("recurrent", [False, True])
def test_conversations_on_every_sequence_id_each_go_on_in_their_own_slot(
    make_fake: MakeFake, recurrent: bool
) -> None:
    """Two chats on two sequence ids, turns alternating: each next turn goes on in the slot
    its last turn left, and never evicts the other chat's (the old code evicted the other
    chat to copy this one's slot, so every turn but the first of each computed all)."""
    ctx, _ = make_fake(n_ctx=1024, n_seq_max=2, recurrent=recurrent)
    texts = ["Chat A says hello. ", "Chat B has a question. "]
    held = [0, 0]  # what each chat's last turn left computed: its prompt and reply
    for turn in range(4):
        for c in range(2):
            done = complete(ctx, texts[c])
            if turn:  # all of it, but on the recurrent memory the last reply token
                assert done.usage.cached_tokens >= held[c] - 1, (turn, c)
            held[c] = done.usage.prompt_tokens + done.usage.completion_tokens - 1
            texts[c] += done.text + f" turn {turn} of chat {c}. "
    assert ctx.stats().num_evictions == 0


# ---------------------------------------------------------------------- the head
END = 300
"""An end-of-turn token of the fake below (``<|im_end|>``), as ChatML closes a message."""


def chat(system: str, *turns: str) -> str:
    """A ChatML-shaped prompt: the system message, the turns, an open assistant turn."""
    parts = [f"<|im_start|>system\n{system}<|im_end|>\n"]
    parts += [f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in
              zip(itertools.cycle(("user", "assistant")), turns)]  # fmt: skip
    return "".join(parts) + "<|im_start|>assistant\n"


def make_chat_fake(make_fake: MakeFake) -> tuple[llamax.Context, FakeBackend]:
    return make_fake(
        n_ctx=2048, recurrent=True, special_tokens={"<|im_end|>": END, "<|im_start|>": END + 1},
        eog_token_ids=(0, END),
    )  # fmt: skip


def test_a_shifted_conversation_reuses_its_system_prompt_from_a_head_checkpoint(
    make_fake: MakeFake,
) -> None:
    """A conversation whose oldest turns are dropped (a history shift, truncation) keeps its
    system prompt: the first prompt took a checkpoint where the system message ends (its
    first end-of-turn token), so the shifted one reuses it. On the old code the system
    prompt (below the 256-token interval) held no checkpoint: computed again, 0 cached."""
    ctx, _ = make_chat_fake(make_fake)
    ids = ctx.tokenize(chat(SYSTEM, "Where is the museum?"))
    head = ids.index(END) + 1
    assert checkpoints.MIN_BRANCH_GAIN <= head < checkpoints.CHECKPOINT_INTERVAL
    long_turns = ("Tell me about clocks. " * 3, "Clocks tick. " * 4, "And sundials? " * 3)
    first = complete(ctx, chat(SYSTEM, *long_turns))
    shifted = chat(SYSTEM, "And sundials? " * 3)  # the first two turns dropped
    second = complete(ctx, shifted)
    assert second.usage.cached_tokens == head
    assert second.token_ids == cold(shifted) and first.token_ids == cold(chat(SYSTEM, *long_turns))
    assert ctx.stats().num_checkpoint_restores >= 1


def test_a_new_conversation_with_the_same_system_prompt_reuses_it_at_once(
    make_fake: MakeFake,
) -> None:
    """The second conversation with a system prompt reuses it (without the head checkpoint
    only the third did, through the branch checkpoint the second took)."""
    ctx, _ = make_chat_fake(make_fake)
    head = ctx.tokenize(chat(SYSTEM, "q")).index(END) + 1
    complete(ctx, chat(SYSTEM, "What is a pendulum?"))
    second = complete(ctx, chat(SYSTEM, "Who made the first watch?"))
    assert second.usage.cached_tokens == head
    assert second.token_ids == cold(chat(SYSTEM, "Who made the first watch?"))


def test_the_head_costs_one_chunk_cut_once(make_fake: MakeFake) -> None:
    """The first prompt's chunk ends at the head (one decode more); a next turn that reuses
    past the head cuts nothing there; a head shorter than MIN_BRANCH_GAIN takes none."""
    ctx, backend = make_chat_fake(make_fake)
    prompt = chat(SYSTEM, "What is a pendulum?")
    head = ctx.tokenize(prompt).index(END) + 1
    first = complete(ctx, prompt)
    chunk_ends = [i.start_pos + len(i.token_ids) for d in backend.decode_log for i in d
                  if len(i.token_ids) > 1]  # fmt: skip
    assert head in chunk_ends
    backend.decode_log.clear()
    turn = prompt + first.text + "<|im_end|>\n<|im_start|>user\nAnd a spring?<|im_end|>\n"
    second = complete(ctx, turn + "<|im_start|>assistant\n")
    assert second.usage.cached_tokens > head
    starts = [i.start_pos for d in backend.decode_log for i in d]
    assert min(starts) >= second.usage.cached_tokens
    short = chat("Be brief.", "What is a pendulum?")
    assert ctx.tokenize(short).index(END) + 1 < checkpoints.MIN_BRANCH_GAIN
    before = ctx.stats().num_checkpoints
    complete(ctx, short)
    assert ctx.stats().num_checkpoints - before == 1  # its last token but one only


def test_head_point() -> None:
    def eog(token: int) -> bool:
        return token == 9

    prompt = [1] * 100 + [9] + [2] * 50 + [9] + [3] * 5
    assert checkpoints.head_point(prompt, eog, 0) == 101
    assert checkpoints.head_point(prompt, eog, 101) == 0  # reused already
    assert checkpoints.head_point(prompt, eog, 100) == 101
    assert checkpoints.head_point([1] * 10 + [9] + [2] * 100, eog, 0) == 0  # too short
    assert checkpoints.head_point([1] * 100 + [9, 2], eog, 0) == 0  # the prompt's own
    assert checkpoints.head_point([1] * 200, eog, 0) == 0  # no end of turn
