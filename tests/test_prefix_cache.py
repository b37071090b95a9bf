"""Prefix reuse, in-flight sharing, n > 1, LRU retention and sessions against the fake backend."""

from __future__ import annotations

import os
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from adversaries import deadline

import llamax
from llamax.engine.kv.admission import SHORT_TAIL
from llamax.testing import FakeBackend

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]


@pytest.fixture(params=["unified", "streams"])
def kv_layout(request: pytest.FixtureRequest) -> str:
    """Every test here runs with both KV layouts."""
    return str(request.param)


GREEDY = llamax.SamplingParams(max_tokens=6, temperature=0)
SYSTEM = "You are a helpful assistant. " * 4  # 116 tokens on the byte-level fake


def run(ctx: llamax.Context) -> None:
    while ctx.has_work():
        ctx.process()


def cold(prompt: str, params: llamax.SamplingParams = GREEDY) -> llamax.Completion:
    ctx = llamax.Context(backend=FakeBackend(n_ctx=2048, n_seq_max=1), autostart=False)
    handle = ctx.add_request(prompt, params)
    run(ctx)
    ctx.close()
    return handle.result(0)


def test_cache_hit_skips_the_prefix_and_matches_cold_output(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_ctx=1024)
    first = ctx.add_request(SYSTEM + "A1", GREEDY)
    run(ctx)
    before = ctx.stats().num_prefill_tokens
    second = ctx.add_request(SYSTEM + "B2?", GREEDY)
    run(ctx)
    assert ctx.stats().num_prefill_tokens - before == 3  # only "B2?" was computed
    assert second.result(0).usage.cached_tokens == len(SYSTEM)
    assert first.result(0).token_ids == cold(SYSTEM + "A1").token_ids
    assert second.result(0).token_ids == cold(SYSTEM + "B2?").token_ids
    assert backend.num_copies == 1


def test_identical_prompt_recomputes_only_its_last_token(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=1024)
    ctx.add_request(SYSTEM, GREEDY)
    run(ctx)
    before = ctx.stats().num_prefill_tokens
    again = ctx.add_request(SYSTEM, GREEDY)
    run(ctx)
    assert ctx.stats().num_prefill_tokens - before == 1
    assert again.result(0).token_ids == cold(SYSTEM).token_ids


def test_burst_with_shared_prefix_prefills_it_once(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=2048, n_seq_max=16, n_batch=64)
    questions = [f"{chr(ord('A') + i)}: question {i}?" for i in range(16)]
    handles = [ctx.add_request(SYSTEM + q, GREEDY) for q in questions]
    run(ctx)
    stats = ctx.stats()
    assert stats.num_prefill_tokens == len(SYSTEM) + sum(len(q) for q in questions)
    assert stats.num_cached_tokens == 15 * len(SYSTEM)
    for q, handle in zip(questions, handles, strict=True):
        assert handle.result(0).token_ids == cold(SYSTEM + q).token_ids


@pytest.mark.parametrize("n_batch", [128, 512])
def test_a_burst_computes_its_prefix_then_every_suffix_in_one_decode(
    make_fake: MakeFake, n_batch: int
) -> None:
    """The first request's prompt chunks stop where the others' shared prefix ends, so its
    suffix and theirs go in one decode with nobody decoding yet (the raw loop's shape);
    before, its last chunk carried its own suffix, it decoded from the next step on, and
    the others' suffixes went beside its row, as the step's time budget let them (issue
    59). With ``n_batch=128`` the prefix takes two chunks."""
    ctx, backend = make_fake(n_ctx=2048, n_seq_max=16, n_batch=n_batch)
    system = SYSTEM * 2  # 232 tokens
    questions = [f"{chr(ord('A') + i)}: q{i:02d}?" for i in range(16)]  # 7 tokens each
    handles = [ctx.add_request(system + q, GREEDY) for q in questions]
    run(ctx)
    log = [[(i.start_pos, len(i.token_ids)) for i in items] for items in backend.decode_log]
    suffixes = [i for i, items in enumerate(log) if any(p >= len(system) for p, _ in items)]
    first = suffixes[0]
    assert log[first] == [(len(system), 7)] * 16, log  # every suffix whole, nobody decoding
    assert all(p < len(system) and n > 1 for items in log[:first] for p, n in items), log
    assert all(n == 1 for items in log[first + 1 :] for _, n in items), log
    assert ctx.stats().num_prefill_tokens == len(system) + 16 * 7
    for q, handle in zip(questions, handles, strict=True):
        assert handle.result(0).token_ids == cold(system + q).token_ids


def test_a_backlog_asks_no_waiting_request_which_prefix_it_waits_for(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While every sequence id is taken and no retained slot can give one up, nobody
    waiting can start next step: the scheduler does not ask the waiting requests which
    in-flight prefix they wait for (a cost every step of a backlog), and holds no chunk."""
    ctx, _ = make_fake(n_ctx=2048, n_seq_max=2, n_batch=32)
    placer = ctx._engine.scheduler.placer
    asked: list[int] = []
    real = placer.wait_target
    monkeypatch.setattr(placer, "wait_target", lambda *a, **k: asked.append(1) or real(*a, **k))
    prompts = [SYSTEM + "A?", "Another long prompt, shared with nobody. " * 3, SYSTEM + "C?"]
    handles = [ctx.add_request(p, GREEDY) for p in prompts]
    kv, prefix = ctx._engine.scheduler.kv, ctx._engine.scheduler.prefix
    backlog_steps = 0
    while ctx.has_work():
        backlog = kv.num_free_seq_ids == 0 and prefix.num_retained == 0
        before = len(asked)
        ctx.process()
        if backlog:  # the second prefills beside the first's decode; the third waits
            backlog_steps += 1
            assert len(asked) == before
    assert backlog_steps >= 3
    run(ctx)
    assert [h.result(0).finish_reason for h in handles] == ["length"] * 3


def test_n_choices_prefill_the_prompt_once_and_differ(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=1024, n_seq_max=8)
    params = llamax.SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=8)
    handle = ctx.add_request(SYSTEM, params)
    run(ctx)
    done = handle.result(0)
    assert len(done.choices) == 8
    assert [c.index for c in done.choices] == list(range(8))
    assert len({c.token_ids for c in done.choices}) == 8
    assert ctx.stats().num_prefill_tokens == len(SYSTEM)
    assert done.usage.prompt_tokens == len(SYSTEM)
    assert done.usage.completion_tokens == 64
    assert done.text == done.choices[0].text
    events = list(handle)
    for i in range(8):
        assert "".join(e.text for e in events if e.index == i) == done.choices[i].text


def test_n_greater_than_sequence_ids_still_completes(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=1024, n_seq_max=2)
    handle = ctx.add_request("abc", llamax.SamplingParams(max_tokens=4, temperature=1, n=5))
    run(ctx)
    assert [c.finish_reason for c in handle.result(0).choices] == ["length"] * 5


def test_retained_prefixes_are_evicted_lru_never_in_use(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=1024, n_seq_max=3)
    for c in "abc":
        ctx.add_request(c * 20, GREEDY)
        run(ctx)
    assert ctx.stats().num_retained == 3
    busy = ctx.add_request("d" * 20, llamax.SamplingParams(max_tokens=50, temperature=0))
    ctx.process()  # evicts "a" (least recently used)
    hit = ctx.add_request("b" * 20 + "!", GREEDY)
    run(ctx)
    assert hit.result(0).usage.cached_tokens == 20
    miss = ctx.add_request("a" * 20 + "!", GREEDY)
    run(ctx)
    assert miss.result(0).usage.cached_tokens == 0
    assert busy.result(0).finish_reason == "length"


def test_memory_without_partial_ops_falls_back_to_recompute(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_ctx=1024, can_share_prefix=False)
    ctx.add_request(SYSTEM + "A", GREEDY)
    run(ctx)
    second = ctx.add_request(SYSTEM + "B", GREEDY)
    run(ctx)
    assert backend.num_copies == 0 and second.result(0).usage.cached_tokens == 0
    assert second.result(0).token_ids == cold(SYSTEM + "B").token_ids


def test_slid_window_cells_are_never_reused(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_ctx=1024, sliding_window=32)
    ctx.add_request(SYSTEM + "A", GREEDY)
    run(ctx)
    second = ctx.add_request(SYSTEM + "B", GREEDY)
    run(ctx)
    assert backend.num_copies == 0
    assert second.result(0).token_ids == cold(SYSTEM + "B").token_ids


def test_a_slot_past_its_window_serves_a_continuation_within_it(make_fake: MakeFake) -> None:
    """Regression (issue 40): a slot whose window cache has dropped its first cells still
    holds what a continuation from its end reads (the last ``sliding_window`` positions);
    it was reused only if it held position 0."""
    ctx, _ = make_fake(n_ctx=1024, sliding_window=32)
    first = ctx.add_request(SYSTEM + "A", GREEDY)
    run(ctx)
    held = SYSTEM + "A" + first.result(0).text[:-1]  # the last token was never computed
    turn = ctx.add_request(held + "!B", GREEDY)
    run(ctx)
    assert turn.result(0).usage.cached_tokens == len(held)
    assert turn.result(0).token_ids == cold(held + "!B").token_ids


def test_cancelled_sequences_are_not_retained(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_ctx=1024)
    handle = ctx.add_request(SYSTEM, GREEDY)
    ctx.process()
    handle.cancel()
    ctx.process()
    assert backend.num_cells_used == 0 and ctx.stats().num_retained == 0


# ---------------------------------------------------------------------- sessions
def test_session_turns_compute_only_new_tokens(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=1024)
    with ctx.session() as session:
        first = session.add_request(SYSTEM + "U1", GREEDY)
        run(ctx)
        transcript = SYSTEM + "U1" + first.result(0).text
        assert len(session.token_ids) == len(SYSTEM) + 2 + 5  # the last sampled token is pending
        before = ctx.stats().num_prefill_tokens
        second = session.add_request(transcript + "U2", GREEDY)
        run(ctx)
        assert ctx.stats().num_prefill_tokens - before == 3  # last reply token + "U2"
        assert second.result(0).usage.cached_tokens == len(transcript) - 1
        assert second.result(0).token_ids == cold(transcript + "U2").token_ids


def test_session_divergent_edit_drops_the_tail(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=1024)
    with ctx.session() as session:
        session.add_request(SYSTEM + "first question", GREEDY)
        run(ctx)
        edited = session.add_request(SYSTEM + "second", GREEDY)
        run(ctx)
        assert edited.result(0).usage.cached_tokens == len(SYSTEM)
        assert edited.result(0).token_ids == cold(SYSTEM + "second").token_ids


def test_session_fork_rewind_and_busy(make_fake: MakeFake, kv_layout: str) -> None:
    ctx, backend = make_fake(n_ctx=1024)
    with ctx.session() as session:
        session.add_request(SYSTEM, GREEDY)
        run(ctx)
        cells = backend.num_cells_used
        with session.fork() as fork:
            assert fork.token_ids == session.token_ids
            # unified: shared, not duplicated; streams: the fork's stream is a copy
            assert backend.num_cells_used == cells * (1 if kv_layout == "unified" else 2)
            branch = fork.add_request(SYSTEM + "fork", GREEDY)
            with pytest.raises(llamax.SessionBusyError):
                fork.add_request(SYSTEM + "again", GREEDY)
            run(ctx)
            assert branch.result(0).token_ids == cold(SYSTEM + "fork").token_ids
        session.rewind(10)
        assert len(session.token_ids) == len(SYSTEM) + 5 - 10
        with pytest.raises(ValueError, match="num_tokens"):
            session.rewind(-1)
    with pytest.raises(llamax.SessionError, match="closed"):
        session.add_request("x", GREEDY)


def test_session_is_never_evicted_and_rejects_n(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=1024, n_seq_max=2)
    with ctx.session() as session:
        session.add_request(SYSTEM, GREEDY)
        run(ctx)
        held = session.token_ids
        for c in "abcd":
            ctx.add_request(c * 30, GREEDY)
            run(ctx)
        assert session.token_ids == held
        with pytest.raises(llamax.InvalidParameterError, match="n must be 1"):
            session.add_request(SYSTEM, llamax.SamplingParams(n=2))


def test_sessions_beyond_sequence_ids_raise(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_seq_max=1)
    with ctx.session(), pytest.raises(llamax.SessionError, match="n_seq_max"):
        ctx.session()


@pytest.mark.parametrize("spelling", ["Session.load", "Context.load_session"])
def test_session_save_and_load_round_trip(
    make_fake: MakeFake, tmp_path: Path, spelling: str
) -> None:
    ctx, _ = make_fake(n_ctx=1024)
    path = tmp_path / "chat.llamax"
    with ctx.session() as session:
        session.add_request(SYSTEM, GREEDY)
        run(ctx)
        session.save(path)
        expected = session.add_request(SYSTEM + "next", GREEDY)
        run(ctx)
    load = llamax.Session.load if spelling == "Session.load" else type(ctx).load_session
    with load(ctx, path) as loaded:
        before = ctx.stats().num_prefill_tokens
        again = loaded.add_request(SYSTEM + "next", GREEDY)
        run(ctx)
        assert ctx.stats().num_prefill_tokens - before == len("next")
        assert again.result(0).token_ids == expected.result(0).token_ids


def test_loading_into_another_model_is_refused(make_fake: MakeFake, tmp_path: Path) -> None:
    ctx, _ = make_fake()
    path = tmp_path / "s.llamax"
    with ctx.session() as session:
        session.add_request("abc", GREEDY)
        run(ctx)
        session.save(path)
    other, _ = make_fake(model_name="other-model")
    with pytest.raises(llamax.SessionLoadError, match="other-model"):
        llamax.Session.load(other, path)
    (tmp_path / "junk").write_bytes(b"not a session")
    with pytest.raises(llamax.SessionLoadError, match="not a llamax session"):
        llamax.Session.load(ctx, tmp_path / "junk")


def test_a_fifo_or_device_as_a_session_file_is_refused_without_blocking(
    make_fake: MakeFake, tmp_path: Path
) -> None:
    ctx, _ = make_fake()
    fifo = tmp_path / "s.llamax"
    os.mkfifo(fifo)  # nobody writes to it: reading would wait forever
    with deadline(30), pytest.raises(llamax.SessionLoadError, match="not a regular file"):
        ctx.load_session(fifo)  # an open that waits for a writer would wait forever
    with pytest.raises(llamax.SessionLoadError, match="not a regular file"):
        ctx.load_session("/dev/zero")  # would be read until memory runs out


def test_a_session_header_too_long_for_the_model_is_refused_unread(
    make_fake: MakeFake, tmp_path: Path
) -> None:
    ctx, _ = make_fake()
    path = tmp_path / "big.llamax"
    size = 32 << 20
    with open(path, "wb") as file:  # the magic, a 32 MiB "header", nothing else
        file.write(b"LLAMAXS1" + struct.pack("<I", size) + b" " * size)
    tracemalloc.start()
    try:
        with pytest.raises(llamax.SessionLoadError, match="header"):
            ctx.load_session(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated to refuse it"


def test_single_sequence_id_reuses_its_retained_prefix(make_fake: MakeFake) -> None:
    # With one sequence id, the retained slot is both the prefix source and the only id:
    # the new request must take it over rather than wait for it forever.
    ctx, _ = make_fake(n_ctx=1024, n_seq_max=1)
    ctx.add_request(SYSTEM + "A1", GREEDY)
    run(ctx)
    second = ctx.add_request(SYSTEM + "B2?", GREEDY)
    steps = 0
    while ctx.has_work() and steps < 100:
        ctx.process()
        steps += 1
    assert second.done()
    assert second.result(0).usage.cached_tokens == len(SYSTEM)
    assert second.result(0).token_ids == cold(SYSTEM + "B2?").token_ids


def test_request_takes_over_its_prefix_slot_when_the_cells_run_out(make_fake: MakeFake) -> None:
    # The retained first conversation fills most of the cells; the second shares only the
    # system prefix with it and fits only if that slot gives up its tail. It used to wait
    # forever: admission never evicts the slot it copies its prefix from.
    ctx, _ = make_fake(n_ctx=512, n_seq_max=4)
    first = ctx.add_request(SYSTEM + "x" * 300, GREEDY)
    run(ctx)
    second = ctx.add_request(SYSTEM + "y" * 300, GREEDY)
    for _ in range(200):
        if not ctx.has_work():
            break
        ctx.process()
    assert not ctx.has_work(), "the second request was never admitted"
    assert second.result(0).usage.cached_tokens == len(SYSTEM)
    assert second.result(0).token_ids == cold(SYSTEM + "y" * 300).token_ids
    assert first.result(0).finish_reason == "length"


# ---------------------------------------------------------------------- next turns in place
def ask(
    ctx: llamax.Context, prompt: str, params: llamax.SamplingParams = GREEDY
) -> llamax.Completion:
    handle = ctx.add_request(prompt, params)
    run(ctx)
    return handle.result(0)


@pytest.mark.parametrize("recurrent", [False, True])
def test_a_next_turn_parting_in_the_reply_goes_on_in_the_same_slot(
    make_fake: MakeFake, recurrent: bool
) -> None:
    """Issue 59: an agent's next turn holds the last turn's whole prompt and its reply as
    the client renders it back, which tokenizes differently (here: its first byte). It
    takes the last turn's slot over and cuts the short reply in place, as llama-server
    does: no copy, one slot retained, no eviction. The old code copied the prefix into a
    second slot every turn (a stream's worth of cells in the streams layout; on the hybrid,
    17 ms and a forced queue run) and evicted, with a spill, once the ids ran out."""
    ctx, backend = make_fake(n_ctx=1024, n_seq_max=2, recurrent=recurrent)
    prompt = SYSTEM + "Q0?"
    num_last = 1
    for turn in range(1, 6):
        done = ask(ctx, prompt)
        assert done.token_ids == cold(prompt).token_ids
        # all the last prompt (on the recurrent memory, but its last token)
        assert done.usage.cached_tokens >= num_last - 1, turn
        assert ctx.stats().num_retained == 1, turn
        num_last = len(ctx.tokenize(prompt))
        prompt += "X" + done.text[1:] + f" Q{turn}?"
    assert backend.num_copies == 0
    assert ctx.stats().num_evictions == 0


@pytest.mark.parametrize("recurrent", [False, True])
def test_the_same_prompt_again_or_a_long_reply_is_copied_and_kept(
    make_fake: MakeFake, recurrent: bool
) -> None:
    """What a next turn does not take over: the same prompt again (a retry, or another
    client's: the first reply is kept), a prompt parting inside the last one's prompt, and
    a turn whose cut would drop SHORT_TAIL reply tokens or more."""
    ctx, backend = make_fake(n_ctx=1024, n_seq_max=4, recurrent=recurrent)
    first = ask(ctx, SYSTEM + "Q0?")
    assert ask(ctx, SYSTEM + "Q0?").token_ids == first.token_ids
    assert ctx.stats().num_retained == 2 and backend.num_copies == 1
    ask(ctx, SYSTEM + "Q1? and more")  # parts at "1", inside the prompts: a slot of its own
    # (the recurrent memory holds no checkpoint where they part: it computes all, no copy)
    assert ctx.stats().num_retained == 3 and backend.num_copies == (1 if recurrent else 2)
    ctx.close()
    ctx, backend = make_fake(n_ctx=1024, n_seq_max=4, recurrent=recurrent)
    long = llamax.SamplingParams(max_tokens=SHORT_TAIL + 2, temperature=0, ignore_eos=True)
    reply = ask(ctx, SYSTEM + "Q0?", long).text
    turn = SYSTEM + "Q0?" + "X" + reply[1:] + " Q1?"
    done = ask(ctx, turn)
    assert done.usage.cached_tokens >= len(SYSTEM)
    assert done.token_ids == cold(turn).token_ids
    assert ctx.stats().num_retained == 2 and backend.num_copies == 1
