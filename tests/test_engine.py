"""Engine lifecycle, threads, cancellation and errors against the fake backend."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, wait

import pytest

import llamax
from llamax.backend import BatchItem
from llamax.testing import FakeBackend, alphabet_model, assert_idle

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]


@pytest.fixture(params=["unified", "streams"])
def kv_layout(request: pytest.FixtureRequest) -> str:
    """Every test here runs with both KV layouts."""
    return str(request.param)


PARAMS = llamax.SamplingParams(max_tokens=10, temperature=0)


def run(ctx: llamax.Context) -> None:
    while ctx.has_work():
        ctx.process()


@pytest.mark.parametrize("stage", ["queued", "prefill", "decode"])
def test_cancel_at_each_stage_frees_kv_at_once(make_fake: MakeFake, stage: str) -> None:
    ctx, backend = make_fake(n_batch=8)
    handle = ctx.add_request("x" * 20, PARAMS)
    steps = {"queued": 0, "prefill": 1, "decode": 4}[stage]
    for _ in range(steps):
        ctx.process()
    held = backend.num_cells_used
    assert handle.cancel()
    ctx.process()
    assert backend.num_cells_used == 0 and (held > 0) == (stage != "queued")
    assert_idle(ctx, timeout=0)
    done = handle.result(0)
    assert done.finish_reason == "cancelled"
    assert done.text == "".join(e.text for e in handle)
    assert len(done.token_ids) == {"queued": 0, "prefill": 0, "decode": 2}[stage]
    assert not handle.cancel()  # already over


def test_cancelling_the_future_while_queued_raises_cancelled(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    handle = ctx.add_request("abc", PARAMS)
    assert handle.future.cancel()
    run(ctx)
    with pytest.raises(CancelledError):
        handle.result(0)
    with pytest.raises(CancelledError):
        list(handle)


def test_fatal_decode_error_fails_every_request_and_closes(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(n_seq_max=2)
    handles = [ctx.add_request("abc", PARAMS) for _ in range(3)]
    ctx.process()
    queued_late = ctx.add_request("late", PARAMS)
    backend.forced_statuses.append(-3)
    with pytest.raises(llamax.EngineError, match="status -3"):
        ctx.process()
    for handle in [*handles, queued_late]:
        with pytest.raises(llamax.EngineError):
            handle.result(0)
        with pytest.raises(llamax.EngineError):
            list(handle)
    assert ctx.closed and backend.closed
    with pytest.raises(llamax.ContextClosedError):
        ctx.add_request("more", PARAMS)
    with pytest.raises(llamax.ContextClosedError):
        ctx.process()


def test_fatal_error_in_background_loop_reaches_every_future() -> None:
    gate = threading.Event()

    class FailingBackend(FakeBackend):
        def decode(self, items: Sequence[BatchItem]) -> int:
            gate.wait(60)  # fail only once every request is submitted
            return -1

    ctx = llamax.Context(backend=FailingBackend(), autostart=True)
    handles = [ctx.add_request("abc", PARAMS) for _ in range(3)]
    gate.set()
    for handle in handles:
        with pytest.raises(llamax.EngineError):
            handle.result(60)
    assert ctx.closed


def test_bug_in_a_step_becomes_engine_error(make_fake: MakeFake) -> None:
    def broken(history: Sequence[int]) -> int:
        raise ZeroDivisionError("model bug")

    ctx, _ = make_fake(next_token=broken)
    handle = ctx.add_request("abc", PARAMS)
    with pytest.raises(llamax.EngineError) as info:
        ctx.process()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(llamax.EngineError):
        handle.result(0)


def test_close_cancels_pending_and_drain_finishes_them(make_fake: MakeFake) -> None:
    ctx, backend = make_fake()
    cancelled = [ctx.add_request("abc", PARAMS) for _ in range(2)]
    ctx.process()
    ctx.close()
    assert all(h.result(0).finish_reason == "cancelled" for h in cancelled)
    assert backend.closed and backend.num_live_samplers == 0
    ctx.close()  # idempotent

    ctx2, _ = make_fake(autostart=True)
    drained = [ctx2.add_request("abc", PARAMS) for _ in range(3)]
    ctx2.close(drain=True)
    assert all(h.result(0).finish_reason == "length" for h in drained)
    with pytest.raises(llamax.ContextClosedError, match="closed"):
        ctx2.add_request("abc", PARAMS)


def test_context_manager_closes(make_fake: MakeFake) -> None:
    backend = FakeBackend()
    with llamax.Context(backend=backend) as ctx:
        assert ctx.add_request("abc", PARAMS).result(60).text == "defghijklm"
    assert ctx.closed and backend.closed


def test_process_is_refused_while_the_loop_runs(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(autostart=True)
    with pytest.raises(llamax.LoopOwnershipError, match="autostart=False"):
        ctx.process()


def test_process_is_refused_from_a_second_thread(make_fake: MakeFake) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(history: Sequence[int]) -> int:
        entered.set()
        release.wait(60)
        return alphabet_model(history)

    ctx, _ = make_fake(next_token=slow)
    handle = ctx.add_request("abc", llamax.SamplingParams(max_tokens=1, temperature=0))
    worker = threading.Thread(target=ctx.process)
    worker.start()
    assert entered.wait(60)
    with pytest.raises(llamax.LoopOwnershipError, match="another thread"):
        ctx.process()
    release.set()
    worker.join()
    assert handle.result(0).text == "d"


def test_idle_background_loop_does_not_spin(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(autostart=True)
    ctx.add_request("abc", PARAMS).result(60)
    steps = ctx.stats().num_steps
    cpu = time.thread_time(), time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu[1] < 0.1
    assert ctx.stats().num_steps == steps


@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        ("", llamax.EmptyPromptError),
        ([], llamax.EmptyPromptError),
        ("x" * 300, llamax.ContextLengthError),
        (b"bytes", llamax.InvalidRequestError),
        ([1, -5], llamax.InvalidRequestError),
        ([1, 10**6], llamax.InvalidRequestError),
        ([1, "a"], llamax.InvalidRequestError),
    ],
)
def test_bad_prompts_raise_typed_errors_and_engine_keeps_serving(
    make_fake: MakeFake, prompt: object, error: type[Exception]
) -> None:
    ctx, _ = make_fake(autostart=True)
    with pytest.raises(error):
        ctx.add_request(prompt, PARAMS)  # type: ignore[arg-type]
    assert ctx.add_request("abc", PARAMS).result(60).text == "defghijklm"


def test_context_length_error_reports_sizes(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=32)
    with pytest.raises(llamax.ContextLengthError) as info:
        ctx.add_request("x" * 32, PARAMS)
    assert (info.value.num_prompt_tokens, info.value.n_ctx) == (32, 32)
    assert "32 tokens" in str(info.value)


def test_bad_params_raise(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    with pytest.raises(llamax.InvalidRequestError, match="SamplingParams"):
        ctx.add_request("abc", {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(llamax.InvalidParameterError, match="logit_bias"):
        ctx.add_request("abc", llamax.SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(llamax.InvalidParameterError, match="stop_token_ids"):
        ctx.add_request("abc", llamax.SamplingParams(stop_token_ids=[10**6]))


def test_stream_can_be_consumed_once_and_late_consumers_lose_nothing(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    handle = ctx.add_request("abc", PARAMS)
    run(ctx)
    events = list(handle)
    assert "".join(e.text for e in events) == handle.result(0).text
    assert events[-1].finish_reason == "length"
    assert [t for e in events for t in e.token_ids] == list(handle.result(0).token_ids)
    with pytest.raises(RuntimeError, match="already being consumed"):
        iter(handle)


def test_many_threads_submit_and_cancel_with_background_loop(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(autostart=True, n_seq_max=8, n_ctx=512, n_batch=32)
    handles: list[llamax.RequestHandle] = []
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(16):
            handle = ctx.add_request(f"p{seed}-{i}", PARAMS)
            with lock:
                handles.append(handle)
            if rng.random() < 0.25:
                time.sleep(rng.random() * 0.002)
                handle.cancel()

    threads = [threading.Thread(target=client, args=(s,)) for s in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done, pending = wait([h.future for h in handles], timeout=30)
    assert not pending and len(done) == 256
    reasons = {h.result().finish_reason for h in handles}
    assert reasons <= {"length", "cancelled"}
    assert_idle(ctx)  # also drops the retained prefixes
    assert backend.num_cells_used == 0


def test_asyncio_await_and_async_for(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(autostart=True)

    async def main() -> tuple[llamax.Completion, list[llamax.TokenEvent]]:
        completion = await ctx.add_request("abc", PARAMS)
        events = [event async for event in ctx.add_request("abc", PARAMS)]
        return completion, events

    completion, events = asyncio.run(main())
    assert completion.text == "".join(e.text for e in events) == "defghijklm"


def test_user_callback_errors_do_not_break_the_engine(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(autostart=True)
    handle = ctx.add_request("abc", PARAMS)
    handle.future.add_done_callback(lambda f: 1 / 0)
    assert handle.result(60).text == "defghijklm"
    assert ctx.add_request("xyz", PARAMS).result(60).finish_reason == "length"


def test_close_from_a_done_callback_on_the_loop_thread(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(autostart=True)
    first = ctx.add_request("abc", PARAMS)
    closed = threading.Event()
    first.future.add_done_callback(lambda f: (ctx.close(), closed.set()))
    assert first.result(60).finish_reason == "length"
    assert closed.wait(60)
    deadline = time.monotonic() + 60
    while not backend.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.closed


def test_numpy_token_ids_and_arrays_are_accepted(make_fake: MakeFake) -> None:
    import numpy as np

    ctx, _ = make_fake()
    ids = [98, 99, 100]
    expected = ctx.add_request(ids, PARAMS).result().token_ids
    for prompt in ([np.int32(t) for t in ids], np.array(ids, dtype=np.int64), tuple(ids)):
        assert ctx.add_request(prompt, PARAMS).result().token_ids == expected
    for bad in (np.array([[1, 2]]), np.array([1.0, 2.0]), [1, True], [np.float32(1)]):
        with pytest.raises(llamax.InvalidRequestError):
            ctx.add_request(bad, PARAMS)  # type: ignore[arg-type]


def test_priority_must_be_an_int(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    for bad in ("high", 1.5, None, True):
        with pytest.raises(llamax.InvalidRequestError, match="priority"):
            ctx.add_request("abc", PARAMS, priority=bad)  # type: ignore[arg-type]


def test_completion_logprobs_shortcut(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    done = ctx.add_request("abc", llamax.SamplingParams(max_tokens=2, logprobs=2)).result()
    assert done.logprobs is not None and len(done.logprobs) == 2
    assert ctx.add_request("abc", PARAMS).result().logprobs is None


def test_prefill_progress_reports_the_prompt_chunk_by_chunk(make_fake: MakeFake) -> None:
    """``prefill_progress``: one event when the prompt is admitted (what the cache held),
    then one after each chunk, all before the reply's first token; none for a request
    that did not ask, nor for the second choice."""
    ctx, _ = make_fake(n_ctx=512, n_batch=16)
    asked = llamax.SamplingParams(max_tokens=2, temperature=0, prefill_progress=True, n=2)

    def progress_of(params: llamax.SamplingParams) -> list[llamax.TokenEvent]:
        handle = ctx.add_request("x" * 40, params)
        events = list(handle.stream(drive=ctx.process))
        assert handle.result(0).usage.completion_tokens == 2 * params.n
        shown = [e for e in events if e.progress is not None]
        assert all(e.text == "" and e.token_ids == () and e.index == 0 for e in shown)
        first_token = next(i for i, e in enumerate(events) if e.token_ids)
        assert all(events.index(e) < first_token for e in shown)
        return shown

    cold = [e.progress for e in progress_of(asked)]
    assert cold == [llamax.PrefillProgress(40, 0, n) for n in (0, 16, 32, 40)]
    warm = [e.progress for e in progress_of(asked)]  # the prefix cache holds all but one
    assert warm == [llamax.PrefillProgress(40, 39, 39), llamax.PrefillProgress(40, 39, 40)]
    assert progress_of(llamax.SamplingParams(max_tokens=2)) == []
    with pytest.raises(llamax.InvalidParameterError, match="prefill_progress"):
        llamax.SamplingParams(prefill_progress="yes")  # type: ignore[arg-type]


def test_unknown_context_options_raise_type_error() -> None:
    with pytest.raises(TypeError, match=r"'n_ctxx'.*did you mean 'n_ctx'"):
        llamax.Context(backend=FakeBackend(), n_ctxx=8)  # type: ignore[call-arg]
