"""``kv_layout="auto"``: one KV stream per sequence while every sequence fits one, the
unified layout while one does not, and back (see ``Scheduler._adapt_layout``). Fake backend:
its model is batch-invariant, so every run must give the unified layout's tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import llamax
from llamax.engine.kv.layout_policy import RELAYOUT_COOLDOWN_STEPS, SHARING_KEEPS_UNIFIED
from llamax.errors import RequestFailedError
from llamax.testing import FakeBackend, assert_idle

GREEDY = llamax.SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
LONG = "a long prompt that does not fit in one stream of sixty-four cells at all"  # 72


def make(layout: str = "auto", **options: object) -> tuple[llamax.Context, FakeBackend]:
    backend = FakeBackend(n_ctx=256, n_seq_max=4, n_batch=64, kv_layout=layout, **options)  # type: ignore[arg-type]
    return llamax.Context(backend=backend, autostart=False, max_step_ms=None), backend


def drain(ctx: llamax.Context) -> None:
    while ctx.has_work():
        ctx.process()
        assert ctx.audit() == []


def run(
    ctx: llamax.Context, prompts: list[str], params: llamax.SamplingParams = GREEDY
) -> list[str]:
    handles = [ctx.add_request(p, params) for p in prompts]
    drain(ctx)
    return [h.result().text for h in handles]


def test_starts_in_streams_and_stays_there_while_sequences_fit() -> None:
    ctx, backend = make()
    with ctx:
        assert ctx.kv_layout == "streams" and ctx.n_ctx_seq == 256
        stats = ctx.stats()
        assert stats.kv_cells_per_stream == 64 and stats.kv_cells_per_seq == 256
        texts = run(ctx, [f"short prompt {i}" for i in range(6)])
        assert ctx.kv_layout == "streams" and backend.num_relayouts == 0
        assert_idle(ctx)
    unified, _ = make("unified")
    with unified:
        assert run(unified, [f"short prompt {i}" for i in range(6)]) == texts


def test_a_prompt_longer_than_a_stream_moves_the_cache_to_unified() -> None:
    prompts = ["short one", LONG, "short two"]
    ctx, _ = make()
    with ctx:
        handles = [ctx.add_request(p, GREEDY) for p in prompts[::2]]
        ctx.process()  # the short ones hold cells in their streams
        assert ctx.kv_layout == "streams"
        handles.insert(1, ctx.add_request(LONG, GREEDY))
        drain(ctx)
        assert ctx.kv_layout == "unified" and ctx.stats().num_relayouts == 1
        texts = [h.result().text for h in handles]
        assert_idle(ctx)
    unified, _ = make("unified")
    with unified:
        assert run(unified, prompts) == texts


def test_a_sequence_that_outgrows_its_stream_moves_mid_decode() -> None:
    prompt = "x" * 50
    params = llamax.SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
    ctx, backend = make()
    with ctx:
        (text,) = run(ctx, [prompt], params)
        assert backend.num_relayouts == 1 and ctx.kv_layout == "unified"
        assert_idle(ctx)
    unified, _ = make("unified")
    with unified:
        assert run(unified, [prompt], params) == [text]


def test_back_to_streams_when_everything_fits_again() -> None:
    ctx, backend = make()
    with ctx:
        run(ctx, [LONG])  # moves to unified, and stays retained
        assert ctx.kv_layout == "unified" and ctx.stats().num_retained == 1
        long_params = llamax.SamplingParams(
            max_tokens=RELAYOUT_COOLDOWN_STEPS + 8, ignore_eos=True, temperature=0.0
        )
        handles = [ctx.add_request(f"s{i}", long_params) for i in range(2)]
        while ctx.kv_layout == "unified" and ctx.has_work():
            ctx.process()
            assert ctx.audit() == []
        assert ctx.kv_layout == "streams" and ctx.stats().num_steps >= RELAYOUT_COOLDOWN_STEPS
        assert ctx.stats().num_retained == 0  # the long prefix did not fit a stream
        drain(ctx)
        texts = [h.result().text for h in handles]
        assert backend.num_relayouts == 2
        assert_idle(ctx)
    unified, _ = make("unified")
    with unified:
        assert run(unified, ["s0", "s1"], long_params) == texts


def test_shared_cells_are_counted_per_stream_after_moving_back() -> None:
    ctx, backend = make()
    with ctx:
        run(ctx, [LONG])
        params = llamax.SamplingParams(
            n=3, max_tokens=RELAYOUT_COOLDOWN_STEPS + 4, ignore_eos=True, temperature=0.0
        )
        handle = ctx.add_request("one prompt, three forks", params)
        while ctx.kv_layout == "unified":
            ctx.process()
            assert ctx.audit() == []  # the fake counts cells as llama.cpp does
        assert ctx.stats().kv_cells_used == backend.num_cells_used
        drain(ctx)
        assert len(handle.result().choices) == 3
        assert_idle(ctx)


PREFIX = "The one system prompt that every request of the burst starts with, " * 2  # 134


def make_wide(layout: str = "auto") -> tuple[llamax.Context, FakeBackend]:
    """Streams of 256 cells: the burst's prompts fit one, and a prefix hit copies it."""
    backend = FakeBackend(n_ctx=1024, n_seq_max=4, n_batch=256, kv_layout=layout)  # type: ignore[arg-type]
    return llamax.Context(backend=backend, autostart=False, max_step_ms=None), backend


def test_a_burst_on_one_long_prefix_shares_it_in_the_unified_layout() -> None:
    """Streams would copy the whole source stream for each hit and hold the prefix four
    times: the burst moves to the unified layout first, and stays there while its
    sequences share the prefix, past the cooldown (the old code stayed in streams)."""
    params = llamax.SamplingParams(
        max_tokens=RELAYOUT_COOLDOWN_STEPS + 8, ignore_eos=True, temperature=0.0
    )
    prompts = [f"{PREFIX}q{i}" for i in range(4)]
    ctx, backend = make_wide()
    with ctx:
        assert ctx.kv_layout == "streams"
        handles = [ctx.add_request(p, params) for p in prompts]
        ctx.process()
        assert ctx.kv_layout == "unified" and backend.num_relayouts == 1
        while ctx.has_work():
            ctx.process()
            assert ctx.audit() == []
            assert ctx.kv_layout == "unified"  # past the cooldown: they still share
            stats = ctx.stats()
            if stats.num_running == 4:
                held = sum(len(backend.cells[i]) for i in range(4))
                assert held >= SHARING_KEEPS_UNIFIED * stats.kv_cells_used
        texts = [h.result().text for h in handles]
        assert ctx.stats().num_cached_tokens == 3 * len(PREFIX + "q")
        assert ctx.stats().num_steps > RELAYOUT_COOLDOWN_STEPS
        # independent traffic afterwards goes back to streams once the cooldown is over
        others = [ctx.add_request(f"own prompt {i}", params) for i in range(2)]
        while ctx.kv_layout == "unified" and ctx.has_work():
            ctx.process()
        assert ctx.kv_layout == "streams" and backend.num_relayouts == 2
        drain(ctx)
        assert all(h.result().finish_reason == "length" for h in others)
        assert_idle(ctx)
    unified, _ = make_wide("unified")
    with unified:
        assert run(unified, prompts, params) == texts


class HugeCells(FakeBackend):
    """A KV cache so large that a first move is expected to cost more than the copies."""

    @property
    def kv_bytes_per_cell(self) -> int:
        return 10**9


def test_a_burst_stays_in_streams_when_a_move_would_cost_more_than_its_copies() -> None:
    backend = HugeCells(n_ctx=1024, n_seq_max=4, n_batch=256, kv_layout="auto")
    with llamax.Context(backend=backend, autostart=False, max_step_ms=None) as ctx:
        run(ctx, [f"{PREFIX}q{i}" for i in range(4)])
        assert ctx.kv_layout == "streams" and backend.num_relayouts == 0
        assert backend.num_copies == 3  # whole streams, as before
        assert_idle(ctx)


def test_a_short_shared_prefix_stays_in_streams() -> None:
    prompts = [f"{PREFIX[:40]} q{i}" for i in range(4)]  # under a quarter stream (64)
    ctx, backend = make_wide()
    with ctx:
        run(ctx, prompts)
        assert ctx.kv_layout == "streams" and backend.num_relayouts == 0
        assert_idle(ctx)


def test_a_long_session_keeps_the_unified_layout_and_saves_across_layouts(tmp_path: Path) -> None:
    ctx, _ = make()
    with ctx:
        with ctx.session() as session:
            session.add_request(LONG, GREEDY).result()
            assert ctx.kv_layout == "unified"
            session.save(tmp_path / "long.session")
            held = session.token_ids
        with ctx.session() as short:
            short.add_request("brief", GREEDY).result()
            short.save(tmp_path / "short.session")
        assert_idle(ctx)
    fresh, fresh_backend = make()
    with fresh:
        with llamax.Session.load(fresh, tmp_path / "short.session") as short:
            assert fresh.kv_layout == "streams"
            short.add_request(" more", GREEDY).result()
        with llamax.Session.load(fresh, tmp_path / "long.session") as restored:
            assert fresh.kv_layout == "unified" and restored.token_ids == held
            restored.add_request(" and more", GREEDY).result()
        assert fresh_backend.num_relayouts == 1
        assert_idle(fresh)


def test_a_failed_move_fails_only_the_sequences_that_need_it() -> None:
    ctx, backend = make()

    def refuse(unified: bool, shared: object = ()) -> None:
        raise RequestFailedError("out of memory (injected)")

    backend.relayout = refuse  # type: ignore[method-assign]
    with ctx:
        short = ctx.add_request("short", GREEDY)
        ctx.process()
        long = ctx.add_request(LONG, GREEDY)
        drain(ctx)
        with pytest.raises(RequestFailedError, match="needs 72 KV cells, one stream holds 64"):
            long.result()
        assert len(short.result().text) == 12 and ctx.kv_layout == "streams"
        assert run(ctx, ["still serving"])[0]
        again = ctx.add_request(LONG + "!", GREEDY)
        drain(ctx)
        with pytest.raises(
            RequestFailedError,
            match="needs 73 KV cells, one stream holds 64, and the unified layout could not "
            r"be made: out of memory \(injected\)",
        ):
            again.result()
        assert_idle(ctx)


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_matches_the_unified_layout(seed: int) -> None:
    """Mixed prompt lengths, n > 1 and cancellations, arriving over time; audit every step."""
    rng = random.Random(seed)
    arrivals: list[tuple[int, str, llamax.SamplingParams, bool]] = []
    for i in range(24):
        length = rng.choice([4, 8, 20, 40, 60, 70, 100])
        prompt = "".join(rng.choice("abcdefgh ") for _ in range(length)) + str(i)
        params = llamax.SamplingParams(
            n=rng.choice([1, 1, 1, 2]),
            max_tokens=rng.choice([4, 16, 48]),
            ignore_eos=True,
            temperature=0.0,
        )
        arrivals.append((rng.randrange(120), prompt, params, rng.random() < 0.1))
    arrivals.sort(key=lambda a: a[0])

    def replay(layout: str) -> tuple[list[str | None], int]:
        ctx, backend = make(layout)
        results: list[str | None] = []
        with ctx:
            handles = []
            step = 0
            pending = list(arrivals)
            while pending or ctx.has_work():
                while pending and pending[0][0] <= step:
                    _, prompt, params, cancel = pending.pop(0)
                    handles.append((ctx.add_request(prompt, params), cancel))
                if handles and handles[-1][1]:
                    handles[-1][0].cancel()
                ctx.process()
                assert ctx.audit() == []
                step += 1
            for handle, cancelled in handles:
                results.append(
                    None if cancelled else "|".join(c.text for c in handle.result().choices)
                )
            assert_idle(ctx)
        return results, backend.num_relayouts

    auto, moves = replay("auto")
    unified, _ = replay("unified")
    assert auto == unified
    assert moves >= 1


def test_a_chats_next_turn_goes_on_in_its_slot_while_ids_are_free() -> None:
    """A prompt that continues a retained slot whole (an agent's next turn) computes in
    that slot. The old code copied it into a free sequence id each turn while one was
    free: a whole stream copied per turn, and a second, shorter copy of the conversation
    kept, which a move to the unified layout then held twice."""
    ctx, backend = make()
    with ctx:
        tokens = ctx.tokenize("turn one")
        for turn in range(3):
            handle = ctx.add_request(tokens, GREEDY)
            drain(ctx)
            result = handle.result()
            tokens = [*tokens, *result.choices[0].token_ids, *ctx.tokenize(f" next {turn}")]
            stats = ctx.stats()
            assert stats.num_retained == 1 and backend.num_copies == 0
            if turn:
                assert stats.num_cached_tokens > 0
        assert_idle(ctx)


def test_a_move_to_unified_shares_a_prefix_kept_beside_its_longer_slot() -> None:
    """A prompt whose reply begins another slot's (a retry with fewer tokens) is kept
    beside it in streams; the move to the unified layout gives it that slot's cells,
    not copies (the old code held them twice), and every reply is the unified layout's."""
    short = llamax.SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    ctx, backend = make()
    with ctx:
        first = run(ctx, ["a prompt asked twice"])
        again = run(ctx, ["a prompt asked twice"], short)
        assert again[0] == first[0][: len(again[0])] and ctx.stats().num_retained == 2
        kept = len(backend.cells[1])  # the prompt and 3 of its 4 tokens (the last is not)
        texts = run(ctx, [LONG])
        assert ctx.kv_layout == "unified" and backend.num_relayouts == 1
        stats = ctx.stats()
        assert stats.num_retained == 3 and stats.kv_cells_used == backend.num_cells_used
        held = sum(len(backend.cells[i]) for i in range(4))
        assert kept == len(ctx.tokenize("a prompt asked twice")) + 3
        assert held - backend.num_cells_used >= kept
        texts += run(ctx, ["a prompt asked twice and more"], short)
        assert_idle(ctx)
    unified, _ = make("unified")
    with unified:
        assert run(unified, ["a prompt asked twice"]) == first
        assert run(unified, [LONG, "a prompt asked twice and more"], short)[1] == texts[1]
