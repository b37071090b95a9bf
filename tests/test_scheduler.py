"""Scheduling, KV accounting, preemption and cancellation against the fake backend."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import llamax
from llamax.engine.plan import StepResult
from llamax.engine.sched.scheduler import Scheduler
from llamax.engine.sequence import Request, Sequence, SequenceState
from llamax.testing import FakeBackend

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]


@pytest.fixture(params=["unified", "streams"])
def kv_layout(request: pytest.FixtureRequest) -> str:
    """Every test here runs with both KV layouts."""
    return str(request.param)


GREEDY = llamax.SamplingParams(max_tokens=8, temperature=0)


def run(ctx: llamax.Context, max_steps: int = 10_000) -> int:
    steps = 0
    while ctx.has_work():
        ctx.process()
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return steps


def solo_output(prompt: str, params: llamax.SamplingParams) -> tuple[int, ...]:
    ctx = llamax.Context(backend=FakeBackend(n_ctx=4096, n_seq_max=1), autostart=False)
    handle = ctx.add_request(prompt, params)
    run(ctx)
    ctx.close()
    return handle.result(0).token_ids


def test_single_request_runs_prefill_then_one_token_per_step(make_fake: MakeFake) -> None:
    ctx, backend = make_fake()
    handle = ctx.add_request("abc", GREEDY)
    assert run(ctx) == 8
    done = handle.result(0)
    assert done.text == "defghijk"
    assert done.finish_reason == "length"
    assert done.usage == llamax.Usage(prompt_tokens=3, completion_tokens=8)
    assert [len(items[0].token_ids) for items in backend.decode_log] == [3] + [1] * 7


def test_admission_is_bounded_by_sequence_ids(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_seq_max=2)
    handles = [ctx.add_request("ab", GREEDY) for _ in range(5)]
    ctx.process()
    assert ctx.stats().num_running == 2
    assert ctx.stats().num_waiting == 3
    run(ctx)
    assert max(len(items) for items in backend.decode_log) == 2
    assert all(h.result(0).text == "cdefghij" for h in handles)


def test_admission_is_bounded_by_kv_cells(make_fake: MakeFake, kv_layout: str) -> None:
    ctx, backend = make_fake(n_ctx=40, n_seq_max=4)
    handles = [ctx.add_request(c * 15, GREEDY) for c in "xyz"]
    ctx.process()
    # unified: 15 + 15 fit in 40 shared cells, a third would not; streams: each sequence
    # owns 40 cells, so only sequence ids bound admission
    assert ctx.stats().num_running == (2 if kv_layout == "unified" else 3)
    run(ctx)
    assert all(h.result(0).finish_reason == "length" for h in handles)
    assert backend.num_cells_used == ctx.stats().kv_cells_used > 0  # retained prefixes
    ctx.clear_cache()
    assert backend.num_cells_used == 0


def test_long_prompt_is_chunked_while_others_keep_decoding(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_batch=16, n_ctx=512)
    short = ctx.add_request("ab", llamax.SamplingParams(max_tokens=20, temperature=0))
    ctx.process()
    long = ctx.add_request("y" * 50, GREEDY)
    run(ctx)
    for items in backend.decode_log:
        assert sum(len(i.token_ids) for i in items) <= 16
    # While the long prompt prefilled (4 chunks), the short stream got a token every step.
    chunked_steps = [
        items for items in backend.decode_log if any(len(i.token_ids) > 1 for i in items)
    ]
    assert len(chunked_steps) >= 4
    assert all(any(len(i.token_ids) == 1 for i in items) for items in chunked_steps[1:4])
    assert short.result(0).token_ids == solo_output("ab", short_params())
    assert long.result(0).token_ids == solo_output("y" * 50, GREEDY)


def short_params() -> llamax.SamplingParams:
    return llamax.SamplingParams(max_tokens=20, temperature=0)


def test_fcfs_order_with_priority(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_seq_max=1)
    first = ctx.add_request("a", GREEDY)
    ctx.process()  # "a" is running; the next two queue behind it
    late = ctx.add_request("b", GREEDY)
    urgent = ctx.add_request("c", GREEDY, priority=-1)
    run(ctx)
    order = []
    for items in backend.decode_log:
        for item in items:
            if item.start_pos == 0:
                order.append(item.token_ids[0])
    assert order == [ord("a") + 1, ord("c") + 1, ord("b") + 1]
    assert all(h.done() for h in (first, late, urgent))


def test_no_slot_shrinks_prefill_then_preempts_and_loses_nothing(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_seq_max=4, n_ctx=1024)
    params = llamax.SamplingParams(max_tokens=12, temperature=0)
    handles = [ctx.add_request(p, params) for p in ("hello", "world", "abc", "xyz")]
    ctx.process()
    ctx.process()
    backend.forced_statuses.extend([1, 1, 1, 1, 1])  # llama_decode: no KV slot, five times
    run(ctx)
    assert ctx.stats().num_preemptions >= 1
    for prompt, handle in zip(("hello", "world", "abc", "xyz"), handles, strict=True):
        assert handle.result(0).token_ids == solo_output(prompt, params)


def test_cell_pressure_preempts_newest_and_output_is_unchanged(
    make_fake: MakeFake, kv_layout: str
) -> None:
    ctx, _ = make_fake(n_ctx=48, n_seq_max=4)
    params = llamax.SamplingParams(max_tokens=20, temperature=0)
    prompts = ["aaaa", "bbbb", "cccc", "dddd"]
    handles = [ctx.add_request(p, params) for p in prompts]
    run(ctx)
    # only a shared buffer runs out of cells; streams never preempt
    assert (ctx.stats().num_preemptions >= 1) == (kv_layout == "unified")
    for prompt, handle in zip(prompts, handles, strict=True):
        assert handle.result(0).token_ids == solo_output(prompt, params)


def test_sequence_reaching_context_end_finishes_with_length(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=20)
    handle = ctx.add_request("a" * 15, llamax.SamplingParams(max_tokens=None, temperature=0))
    run(ctx)
    done = handle.result(0)
    assert done.finish_reason == "length"
    assert done.usage.prompt_tokens + done.usage.completion_tokens == 20


def test_eog_and_stop_token_end_with_stop(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(next_token=lambda h: 0 if len(h) > 5 else ord("z") + 1)
    eog = ctx.add_request("abc", GREEDY)
    ignore = ctx.add_request(
        "abc", llamax.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    stop_id = ctx.add_request(
        "a", llamax.SamplingParams(temperature=0, stop_token_ids=[ord("z") + 1])
    )
    run(ctx)
    assert (eog.result(0).text, eog.result(0).finish_reason) == ("zzz", "stop")
    assert eog.result(0).token_ids == tuple([ord("z") + 1] * 3)
    assert ignore.result(0).finish_reason == "length"
    assert len(ignore.result(0).token_ids) == 5
    assert (stop_id.result(0).text, stop_id.result(0).finish_reason) == ("", "stop")


def test_stop_string_spanning_tokens_is_held_back_and_trimmed(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    handle = ctx.add_request("a", llamax.SamplingParams(max_tokens=20, temperature=0, stop=["fgh"]))
    events = []
    while ctx.has_work():
        ctx.process()
    events = list(handle)
    done = handle.result(0)
    assert done.text == "bcde"
    assert done.finish_reason == "stop"
    assert "".join(e.text for e in events) == "bcde"
    assert all("f" not in e.text for e in events)
    assert events[-1].finish_reason == "stop"


def test_multibyte_text_streams_whole_characters(make_fake: MakeFake) -> None:
    emoji = "😀".encode()
    pieces = {300: emoji[:1], 301: emoji[1:3], 302: emoji[3:], 303: "漢".encode()}
    script = [300, 301, 302, 303, 0]
    ctx, _ = make_fake(
        extra_pieces=pieces, next_token=lambda h: script[min(len(h) - 1, len(script) - 1)]
    )
    handle = ctx.add_request("a", llamax.SamplingParams(temperature=0))
    run(ctx)
    deltas = [e.text for e in handle]
    assert "".join(deltas) == handle.result(0).text == "😀漢"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[:3] == ["", "", "😀"]


# ---------------------------------------------------------------- the scheduler by hand
# No engine and no threads: build requests, plan a step, feed the decode and the sampled
# tokens by hand, and check states, batch layout and events.


def _request(text: str, max_tokens: int, *, n: int = 1, arrival: int = 0) -> Request:
    params = llamax.SamplingParams(max_tokens=max_tokens, temperature=0, n=n)
    handle = llamax.RequestHandle(f"req-{arrival}")
    return Request(
        handle.request_id,
        [b + 1 for b in text.encode()],
        params,
        handle,
        token_to_piece=FakeBackend().token_to_piece,
        arrival=arrival,
        num_choices=n,
    )


def _step(scheduler: Scheduler, backend: FakeBackend, tokens: dict[Sequence, int]) -> StepResult:
    plan = scheduler.schedule(StepResult())
    assert backend.decode(plan.items) == 0
    result = StepResult()
    scheduler.update(plan, {e.seq: tokens[e.seq] for e in plan.sampled_entries()}, {}, result)
    return result


def test_hand_driven_steps_prefill_in_chunks_then_decode() -> None:
    backend = FakeBackend(n_batch=4)
    scheduler = Scheduler(backend)
    request = _request("abcdef", max_tokens=2)
    seq = request.sequences[0]
    scheduler.add(request)
    plan = scheduler.schedule(StepResult())
    assert [(e.seq, list(e.item.token_ids), e.item.rows) for e in plan.entries] == [
        (seq, [98, 99, 100, 101], ())  # a chunk of 4: no row to sample yet
    ]
    assert backend.decode(plan.items) == 0
    scheduler.update(plan, {}, {}, StepResult())
    assert seq.state is SequenceState.PREFILLING and seq.num_computed == 4
    result = _step(scheduler, backend, {seq: 120})  # the last two prompt tokens, then sample
    assert seq.state is SequenceState.DECODING and [e.text for _, e in result.events] == ["w"]
    result = _step(scheduler, backend, {seq: 121})
    assert seq.state is SequenceState.FINISHED_LENGTH and result.finished == [request]
    assert request.completion().text == "wx" and not scheduler.has_work


def test_hand_driven_forks_share_the_leader_row() -> None:
    backend = FakeBackend(n_seq_max=4)
    scheduler = Scheduler(backend)
    request = _request("abc", max_tokens=1, n=3)
    scheduler.add(request)
    plan = scheduler.schedule(StepResult())
    (entry,) = plan.entries
    assert entry.item.rows == (2,) and entry.forks == tuple(request.sequences[1:])
    assert backend.decode(plan.items) == 0
    result = StepResult()
    scheduler.update(plan, {s: 110 + s.index for s in request.sequences}, {}, result)
    assert [c.text for c in request.completion().choices] == ["m", "n", "o"]
    assert result.finished == [request] and scheduler.kv.num_cells_used == 3


def test_hand_driven_no_slot_halves_the_newest_chunk() -> None:
    backend = FakeBackend(n_batch=16)
    scheduler = Scheduler(backend)
    scheduler.add(_request("x" * 12, max_tokens=1))
    plan = scheduler.schedule(StepResult())
    assert plan.num_tokens == 12
    assert scheduler.shrink(plan).num_tokens == 6
