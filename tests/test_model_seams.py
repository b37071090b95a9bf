"""The engine's seams under a real model: done-callbacks that call back into the context,
and ``stats()`` polled from another thread while bursts run and ``clear_cache()`` runs
between them (what a server's /metrics does under load)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

import llamax

pytestmark = pytest.mark.model

PARAMS = llamax.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
TIMEOUT = 120


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_bursts_with_clear_cache_between_them_while_stats_are_polled(
    real_ctx: llamax.Context,
) -> None:
    ctx = real_ctx
    stop = threading.Event()
    problems: list[str] = []
    polls = 0

    def poll() -> None:
        nonlocal polls
        while not stop.is_set():
            try:
                s = ctx.stats()
            except Exception as exc:
                problems.append(repr(exc))
                return
            polls += 1
            held = s.num_running + s.num_retained + s.num_sessions + s.num_free_seq_ids
            if held != ctx.n_seq_max or not 0 <= s.kv_cells_used <= s.kv_cells_total:
                problems.append(f"inconsistent snapshot: {s}")
                return
            # give the GIL up between polls: a loop that never does held the engine's
            # thread to a crawl (65 s for these 800 tokens on 2 cores), still polling
            # thousands of times a second
            time.sleep(0)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    done = 0
    try:
        for burst in range(6):
            handles = [
                ctx.add_request(f"Burst {burst % 2}. Question {i}: name a colour.", PARAMS)
                for i in range(16)
            ]
            done += sum(len(h.result(TIMEOUT).token_ids) == 4 for h in handles)
            ctx.clear_cache()
    finally:
        stop.set()
        poller.join(60)
    assert not problems, problems
    assert done == 96 and polls > 0


def test_done_callbacks_may_call_every_public_context_method(real_ctx: llamax.Context) -> None:
    ctx = real_ctx
    results: Future[list[object]] = Future()

    def callback(_future: object) -> None:
        try:
            seen: list[object] = [ctx.stats().state, ctx.clear_cache()]
            with ctx.session() as session:
                seen.append(session.token_ids)
            seen.append(ctx.add_request("Hello", PARAMS))
            try:
                seen[-1].result()  # type: ignore[attr-defined]
            except llamax.DeadlockError as exc:
                seen.append(exc)
            results.set_result(seen)
        except BaseException as exc:
            results.set_exception(exc)

    registered = threading.Event()

    def gate(_ids: object, _row: object) -> None:
        registered.wait(TIMEOUT)  # the request cannot end before its callback is added

    gated = llamax.SamplingParams(max_tokens=4, temperature=0, logits_processors=[gate])
    handle = ctx.add_request("Hi there", gated)
    handle.future.add_done_callback(callback)
    registered.set()
    state, _cleared, tokens, follow_up, deadlock = results.result(TIMEOUT)
    assert state == "running" and tokens == ()
    assert isinstance(deadlock, llamax.DeadlockError)
    assert isinstance(follow_up, llamax.RequestHandle)
    assert len(follow_up.result(TIMEOUT).token_ids) == 4
