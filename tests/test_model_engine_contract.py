"""The engine's contract on the real model (SmolLM2-135M-Instruct), through the public API.

Batching invariance, a cancel storm from many threads, stop strings and stop tokens,
multi-byte streaming, chunked prefill next to running streams, KV pressure with
preemption, asyncio, the manual loop, cancellation at each stage, and typed errors.

``real_ctx`` is the session's shared context (n_ctx=4096, n_seq_max=16), asserted idle
before and after each test; ``make_real`` builds extra contexts, leak-checked and closed.
"Alone" below means on an otherwise idle context with the prefix cache cleared, so the
prompt is computed afresh and nothing else sits in the KV cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

import llamax
from llamax.testing import assert_idle

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]
GREEDY_32 = llamax.SamplingParams(max_tokens=32, temperature=0.0)
RESULT_TIMEOUT = 180.0
TERMINAL = {llamax.FinishReason.STOP, llamax.FinishReason.LENGTH}

EIGHT_PROMPTS = (
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox",
    "List three colors:",
    "In 1492, Columbus",
    "Water boils at",
    "My favourite food is",
)


# ---------------------------------------------------------------------- helpers
def chat(user: str) -> str:
    """A one-turn ChatML prompt (SmolLM2's template)."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def run_alone(
    ctx: llamax.Context, prompt: str | Sequence[int], params: llamax.SamplingParams
) -> llamax.Completion:
    """One request on an idle context whose prefix cache was cleared first."""
    ctx.clear_cache()
    return ctx.add_request(prompt, params).result(timeout=RESULT_TIMEOUT)


def drive(ctx: llamax.Context) -> int:
    """Run a manual (autostart=False) context until it has no work; return the steps taken."""
    steps = 0
    while ctx.has_work():
        ctx.process()
        steps += 1
        assert steps < 10_000, "the manual loop does not terminate"
    return steps


def stream(handle: llamax.RequestHandle) -> tuple[list[llamax.TokenEvent], llamax.Completion]:
    """Consume a handle's events, then its completion."""
    events = list(handle)
    return events, handle.result(timeout=RESULT_TIMEOUT)


def assert_serves(ctx: llamax.Context) -> None:
    """The context still answers a normal request."""
    params = llamax.SamplingParams(max_tokens=3, temperature=0.0)
    completion = ctx.add_request("Hello", params).result(timeout=RESULT_TIMEOUT)
    assert completion.finish_reason in TERMINAL


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def divergence_note(
    ctx: llamax.Context,
    prompt: str | Sequence[int],
    params: llamax.SamplingParams,
    alone: Sequence[int],
    other: Sequence[int],
) -> str:
    """Where two greedy outputs part, with the alone run's top log-probabilities there.

    A margin of a few hundredths of a nat between the two picks means the outputs differ by
    floating-point rounding of near-tied logits, not by wrong KV contents.
    """
    i = first_divergence(alone, other)
    prefix = ctx.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    probe_params = dataclasses.replace(params, max_tokens=1, logprobs=5, stop=(), stop_token_ids=())
    probe = run_alone(ctx, prefix + list(alone[:i]), probe_params)
    logprobs = probe.choices[0].logprobs or ()
    top = [(t.token_id, round(t.logprob, 4)) for t in logprobs[0].top_logprobs] if logprobs else []
    return (
        f"diverges at generated token {i}: alone {alone[i : i + 1]} vs {other[i : i + 1]}; "
        f"alone top logprobs there {top}"
    )


def stream_problems(
    events: Sequence[llamax.TokenEvent], completion: llamax.Completion
) -> list[str]:
    """The streaming invariants every request must keep; returns the violations."""
    problems = []
    for event in events:
        if not isinstance(event.text, str):
            problems.append(f"delta {event.text!r} is not a str")
        elif "\ufffd" in event.text:
            problems.append(f"delta {event.text!r} holds U+FFFD")
    joined = "".join(e.text for e in events)
    if joined != completion.text:
        problems.append(f"joined deltas {joined!r} != completion text {completion.text!r}")
    if "\ufffd" in completion.text:
        problems.append(f"completion text {completion.text!r} holds U+FFFD")
    if not events or events[-1].finish_reason != completion.finish_reason:
        problems.append("the last event does not carry the finish reason")
    if any(e.finish_reason is not None for e in events[:-1]):
        problems.append("a finish reason before the last event")
    return problems


# ---------------------------------------------------------------------- batching invariance
@pytest.mark.timeout(900)  # seconds on an idle machine; generous for a loaded one
def test_greedy_batch_equals_alone_for_eight_prompts(real_ctx: llamax.Context) -> None:
    alone = [run_alone(real_ctx, p, GREEDY_32) for p in EIGHT_PROMPTS]
    real_ctx.clear_cache()  # the batch computes its prompts instead of reusing the solo runs
    handles = [real_ctx.add_request(p, GREEDY_32) for p in EIGHT_PROMPTS]
    together = [h.result(timeout=RESULT_TIMEOUT) for h in handles]

    mismatches = []
    for prompt, a, b in zip(EIGHT_PROMPTS, alone, together, strict=True):
        assert a.finish_reason in TERMINAL and b.finish_reason in TERMINAL
        if a.token_ids != b.token_ids:
            note = divergence_note(real_ctx, prompt, GREEDY_32, a.token_ids, b.token_ids)
            mismatches.append(f"{prompt!r}: {note}: alone {a.text!r} vs batched {b.text!r}")
        elif a.text != b.text:
            mismatches.append(f"{prompt!r}: same tokens, different text")
    assert not mismatches, "batched greedy output differs from alone:\n" + "\n".join(mismatches)


def test_greedy_output_does_not_depend_on_when_a_request_joins(make_real: MakeReal) -> None:
    """Deterministic form of the batching check: a manual loop fixes the batch layout.

    Seven requests start; "The quick brown fox" joins two steps later, so its prompt is
    prefilled next to seven decoding tokens and its cells land after theirs in the cache.
    """
    ctx = make_real(n_ctx=4096, n_seq_max=16, n_batch=512, autostart=False)
    late = EIGHT_PROMPTS[3]
    alone_handle = ctx.add_request(late, GREEDY_32)
    drive(ctx)
    alone = alone_handle.result(timeout=0)
    ctx.clear_cache()

    others = [ctx.add_request(p, GREEDY_32) for p in EIGHT_PROMPTS if p != late]
    ctx.process()
    ctx.process()
    joined_late = ctx.add_request(late, GREEDY_32)
    drive(ctx)
    for h in others:
        assert h.result(timeout=0).finish_reason in TERMINAL
    batched = joined_late.result(timeout=0)
    if batched.token_ids != alone.token_ids:
        probe = make_real(n_ctx=4096, n_seq_max=16, n_batch=512)
        note = divergence_note(probe, late, GREEDY_32, alone.token_ids, batched.token_ids)
        pytest.fail(
            f"greedy output changed when the request joined a running batch: {note}: "
            f"alone {alone.text!r} vs joined {batched.text!r}"
        )


# ---------------------------------------------------------------------- concurrency and cancel
@pytest.mark.timeout(900)
def test_256_requests_from_64_threads_with_random_cancels(real_ctx: llamax.Context) -> None:
    num_threads, per_thread = 64, 4
    words = ["alpha", "beta", "gamma", "delta", "river", "mountain", "cloud", "stone", "garden"]
    lock = threading.Lock()
    records: list[dict[str, object]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(num_threads)

    def worker(index: int) -> None:
        rng = random.Random(1000 + index)
        try:
            barrier.wait(timeout=60)
            jobs = []
            for j in range(per_thread):
                if rng.random() < 0.2:  # a long prompt, prefilled in chunks next to the others
                    prompt = " ".join(rng.choice(words) for _ in range(rng.randint(100, 300)))
                else:
                    prompt = f"Request {index}-{j}: tell me about " + " ".join(rng.sample(words, 3))
                max_tokens = rng.randint(8, 16)
                mode = "none"
                if rng.random() < 0.25:
                    mode = rng.choice(["immediate", "sleep", "stream"])
                params = llamax.SamplingParams(
                    max_tokens=max_tokens, temperature=0.7, seed=rng.randrange(2**32)
                )
                handle = real_ctx.add_request(prompt, params, request_id=f"t{index}-{j}")
                record: dict[str, object] = {"handle": handle, "mode": mode, "max": max_tokens}
                if mode == "immediate":  # most likely still queued
                    record["cancel_returned"] = handle.cancel()
                jobs.append(record)
            for record in jobs:
                handle, mode = record["handle"], record["mode"]
                assert isinstance(handle, llamax.RequestHandle)
                events: list[llamax.TokenEvent] | None = None
                if mode == "sleep":  # queued, mid-prefill or mid-decode, whichever it is by then
                    time.sleep(rng.uniform(0.0, 0.4))
                    record["cancel_returned"] = handle.cancel()
                elif mode == "stream":  # mid-decode: after a few streamed tokens
                    events = []
                    want = rng.randint(1, 3)
                    iterator = iter(handle)
                    for event in iterator:
                        events.append(event)
                        if len(events) >= want or event.finish_reason is not None:
                            break
                    record["cancel_returned"] = handle.cancel()
                    events.extend(iterator)
                record["events"] = events
                record["completion"] = handle.result(timeout=600)
                with lock:
                    records.append(record)
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=700)
    assert not any(t.is_alive() for t in threads), "some submitter threads hung"
    assert not errors, f"{len(errors)} threads failed, first: {errors[0]!r}"
    assert len(records) == num_threads * per_thread

    cancelled = natural = mid_decode = 0
    immediate = sum(1 for r in records if r["mode"] == "immediate")
    for record in records:
        completion, handle, max_tokens = record["completion"], record["handle"], record["max"]
        assert isinstance(completion, llamax.Completion)
        assert isinstance(handle, llamax.RequestHandle)
        assert isinstance(max_tokens, int)
        name = handle.request_id
        assert completion.request_id == name
        assert len(completion.token_ids) <= max_tokens
        reason = completion.finish_reason
        if record["mode"] == "immediate":
            assert record["cancel_returned"] is True
            assert reason == "cancelled", f"{name} was cancelled at once but ended {reason}"
        if reason == "cancelled":
            assert record["mode"] != "none", f"{name} was never cancelled but ended cancelled"
            cancelled += 1
            mid_decode += 0 < len(completion.token_ids) < max_tokens
        else:
            assert reason in TERMINAL
            if reason == "length":
                assert len(completion.token_ids) == max_tokens
            natural += 1
        events = record["events"]
        if events is not None:
            assert isinstance(events, list)
            assert "".join(e.text for e in events) == completion.text
            assert events[-1].finish_reason == reason
    assert immediate >= 5 and cancelled >= immediate
    assert mid_decode >= 1, "no request was cancelled mid-decode"
    assert natural >= 150
    assert_idle(real_ctx, timeout=60)  # every seq_pos_max is -1 once the cache is cleared
    stats = real_ctx.stats()
    assert stats.num_waiting == stats.num_running == stats.num_retained == 0
    assert stats.kv_cells_used == 0
    assert stats.num_free_seq_ids == real_ctx.n_seq_max


@pytest.mark.parametrize("stage", ["queued", "queued_behind_other", "prefill", "decode"])
def test_cancel_frees_kv_at_next_step(make_real: MakeReal, stage: str) -> None:
    ctx = make_real(n_ctx=1024, n_seq_max=1, n_batch=64, autostart=False)
    params = llamax.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    long_prompt = " ".join(f"item {i} is a red apple;" for i in range(50))
    num_prompt = len(ctx.tokenize(long_prompt))
    assert 200 < num_prompt < 1000

    other = None
    if stage == "queued_behind_other":
        other = ctx.add_request("Count to ten:", params)
    handle = ctx.add_request(long_prompt, params)
    expected_tokens = 0
    if stage == "queued_behind_other":
        ctx.process()  # `other` holds the only sequence id; `handle` waits
        stats = ctx.stats()
        assert stats.num_running == 1 and stats.num_waiting == 1
    elif stage == "prefill":
        ctx.process()
        ctx.process()
        stats = ctx.stats()
        assert stats.num_running == 1 and stats.kv_cells_used == 128  # two 64-token chunks
        assert not handle.done()
    elif stage == "decode":
        for _ in range(math.ceil(num_prompt / 64) + 3):
            ctx.process()
        expected_tokens = 4  # one from the last prefill chunk, then one per step
        assert ctx.stats().kv_cells_used == num_prompt + 3

    assert handle.cancel() is True
    ctx.process()
    assert handle.done(), "a cancelled request must settle at the next step"
    if other is None:
        stats = ctx.stats()
        assert stats.kv_cells_used == 0 and stats.num_retained == 0  # freed, not retained
        assert_idle(ctx, timeout=1)
    events, completion = stream(handle)
    assert completion.finish_reason == "cancelled"
    assert len(completion.token_ids) == expected_tokens
    assert completion.usage.prompt_tokens == num_prompt
    assert not stream_problems(events, completion)
    assert handle.cancel() is False  # already ended

    if other is not None:
        assert not other.done()
        drive(ctx)
        assert other.result(timeout=0).finish_reason == "length"
    assert_idle(ctx, timeout=1)
    assert ctx.stats().kv_cells_used == 0


def test_close_cancels_pending_requests(make_real: MakeReal) -> None:
    ctx = make_real(n_ctx=1024, n_seq_max=4)
    params = llamax.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    handles = [ctx.add_request(f"Story {i}: once upon a time", params) for i in range(3)]
    next(iter(handles[0]))  # generation is under way
    ctx.close()
    for h in handles:
        completion = h.result(timeout=RESULT_TIMEOUT)
        assert completion.finish_reason == "cancelled"
        assert len(completion.token_ids) < 400
    with pytest.raises(llamax.ContextClosedError):
        ctx.add_request("Hello")


# ---------------------------------------------------------------------- stops
def test_stop_string_spanning_tokens(real_ctx: llamax.Context) -> None:
    prompt = "The capital of France is"
    full = run_alone(real_ctx, prompt, GREEDY_32)
    pieces = [real_ctx.detokenize([t]) for t in full.token_ids]
    assert "".join(pieces) == full.text

    # A stop string that starts inside one token, covers the next and ends inside a third.
    chosen = None
    offset = 0
    for k, piece in enumerate(pieces[:-2]):
        nxt, third = pieces[k + 1], pieces[k + 2]
        usable = len(piece) >= 3 and nxt.strip() and len(third) >= 2
        if k >= 2 and usable and (piece + nxt + third).isascii():
            stop = piece[-2:] + nxt + third[:1]
            idx = offset + len(piece) - 2
            if full.text.find(stop) == idx:
                chosen = (k, stop, idx)
                break
        offset += len(piece)
    assert chosen is not None, f"no multi-token stop candidate in {full.text!r}"
    k, stop, idx = chosen

    params = llamax.SamplingParams(max_tokens=32, temperature=0.0, stop=[stop])
    events, completion = stream(real_ctx.add_request(prompt, params))
    assert completion.finish_reason == "stop"
    assert completion.text == full.text[:idx], (stop, completion.text)
    assert not stream_problems(events, completion)
    released = ""
    for event in events:
        released += event.text
        assert full.text[:idx].startswith(released), f"a delta ran past the stop {stop!r}"
        assert stop not in event.text
    # Generation is unchanged up to the stop, and the tokens that spelled it are kept.
    assert completion.token_ids == full.token_ids[: k + 3]
    assert completion.usage.completion_tokens == k + 3


def test_stop_strings_first_match_wins_and_absent_stop_is_harmless(
    real_ctx: llamax.Context,
) -> None:
    prompt = "def fibonacci(n):"
    full = run_alone(real_ctx, prompt, GREEDY_32)
    text = full.text
    assert "return" in text
    late, early = "return", text.strip()[:3]
    cut = min(text.find(late), text.find(early))
    params = llamax.SamplingParams(max_tokens=32, temperature=0.0, stop=[late, early])
    events, completion = stream(real_ctx.add_request(prompt, params))
    assert completion.finish_reason == "stop"
    assert completion.text == text[:cut]
    assert not stream_problems(events, completion)

    params = llamax.SamplingParams(max_tokens=32, temperature=0.0, stop=["\u2603 never"])
    events, completion = stream(real_ctx.add_request(prompt, params))
    assert completion.token_ids == full.token_ids
    assert completion.text == text
    assert completion.finish_reason == full.finish_reason
    assert not stream_problems(events, completion)


def test_stop_token_id(real_ctx: llamax.Context) -> None:
    prompt = "Once upon a time"
    full = run_alone(real_ctx, prompt, GREEDY_32)
    ids = full.token_ids
    j = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    params = llamax.SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=[ids[j]])
    events, completion = stream(real_ctx.add_request(prompt, params))
    assert completion.finish_reason == "stop"
    assert completion.token_ids == ids[:j]  # the stop token itself is not part of the output
    assert completion.text == real_ctx.detokenize(ids[:j])
    assert not stream_problems(events, completion)


def test_end_of_generation_token_stops(real_ctx: llamax.Context) -> None:
    prompt = chat("What is the capital of France?")
    params = llamax.SamplingParams(max_tokens=128, temperature=0.0)
    completion = run_alone(real_ctx, prompt, params)
    assert completion.finish_reason == "stop"
    assert 0 < len(completion.token_ids) < 128
    assert "Paris" in completion.text
    assert "<|im_end|>" not in completion.text
    params = llamax.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    forced = run_alone(real_ctx, prompt, params)
    assert forced.finish_reason == "length"
    assert len(forced.token_ids) == 40


# ---------------------------------------------------------------------- multi-byte text
MULTIBYTE_PROMPTS = (  # (prompt, the greedy reply must hold non-ASCII characters)
    ("Translate to Chinese: hello ->", True),
    ("😀😃😄😁😆", True),
    ("Emoji list: 😀😃😄😁😆😅😂🤣", True),
    ("中文\uff1a你好\uff0c世界。我爱", True),
    ("日本語: こんにちは、世界", True),
    ("1. 🍎\n2. 🍌\n3. 🍇\n4.", True),
    (chat("Translate 'thank you' into Chinese characters."), True),
    ("Fruits: 🍎 apple, 🍌 banana, 🍇 grapes, 🍓", False),
)


def test_streaming_emoji_and_cjk(real_ctx: llamax.Context) -> None:
    params = llamax.SamplingParams(max_tokens=24, temperature=0.0)
    handles = [(p, must, real_ctx.add_request(p, params)) for p, must in MULTIBYTE_PROMPTS]
    problems = []
    held_back = 0
    for prompt, must_be_non_ascii, handle in handles:
        events, completion = stream(handle)
        problems += [f"{prompt!r}: {p}" for p in stream_problems(events, completion)]
        if must_be_non_ascii and completion.text.isascii():
            problems.append(f"{prompt!r}: expected non-ASCII output, got {completion.text!r}")
        held_back += sum(1 for e in events if e.text == "" and e.finish_reason is None)
        for event in events:  # whole characters only: each delta survives a UTF-8 round trip
            assert event.text.encode("utf-8").decode("utf-8") == event.text
    assert held_back > 0, "no token ended mid-character; the hold-back path was not exercised"
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("max_tokens", [1, 2, 4])
def test_max_tokens_ending_mid_character_yields_no_replacement_char(
    real_ctx: llamax.Context, max_tokens: int
) -> None:
    """Each emoji of this reply takes three byte-level tokens, so these lengths cut one."""
    prompt = "😀😃😄😁😆"
    full = run_alone(real_ctx, prompt, llamax.SamplingParams(max_tokens=9, temperature=0.0))
    assert "\ufffd" not in full.text and not full.text.isascii()
    params = llamax.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    events, completion = stream(real_ctx.add_request(prompt, params))
    assert completion.finish_reason == "length"
    assert completion.token_ids == full.token_ids[:max_tokens]
    assert not stream_problems(events, completion), stream_problems(events, completion)
    assert full.text.startswith(completion.text), (completion.text, full.text)


# ---------------------------------------------------------------------- chunked prefill
def test_long_prompt_does_not_stall_running_streams(make_real: MakeReal) -> None:
    n_batch = 256
    ctx = make_real(n_ctx=4096, n_seq_max=8, n_batch=n_batch)
    sentences = (
        f"Sentence number {i} talks about apples, rivers and mountains." for i in range(115)
    )
    long_prompt = " ".join(sentences)
    num_long = len(ctx.tokenize(long_prompt))
    assert 1300 <= num_long <= 1700

    # How long one full chunk takes on this machine right now.
    chunk_prompt = " ".join(["river"] * (n_batch - 8))
    assert len(ctx.tokenize(chunk_prompt)) < n_batch
    t0 = time.monotonic()
    run_alone(ctx, chunk_prompt, llamax.SamplingParams(max_tokens=1, temperature=0.0))
    chunk_time = time.monotonic() - t0

    params = llamax.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    streams = [ctx.add_request(f"Story {i}: the little robot", params) for i in range(4)]
    stamps: list[list[float]] = [[] for _ in streams]
    done: list[llamax.Completion | None] = [None] * len(streams)

    def consume(i: int) -> None:
        for _event in streams[i]:
            stamps[i].append(time.monotonic())
        done[i] = streams[i].result(timeout=RESULT_TIMEOUT)

    consumers = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(4)]
    for c in consumers:
        c.start()
    deadline = time.monotonic() + 120
    while min(len(s) for s in stamps) < 3:
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.005)

    steps_before = ctx.stats().num_steps
    t_submit = time.monotonic()
    long_handle = ctx.add_request(long_prompt, llamax.SamplingParams(max_tokens=4, temperature=0))
    first_long_event = next(iter(long_handle))
    t_first = time.monotonic()
    steps_prefill = ctx.stats().num_steps - steps_before
    long_completion = long_handle.result(timeout=RESULT_TIMEOUT)
    for c in consumers:
        c.join(timeout=RESULT_TIMEOUT)

    assert first_long_event.token_ids
    assert long_completion.usage.prompt_tokens == num_long
    for completion in done:
        assert completion is not None and completion.finish_reason == "length"
        assert len(completion.token_ids) == 48
    min_chunks = math.ceil(num_long / n_batch)
    assert steps_prefill >= min_chunks, f"{num_long} prompt tokens prefilled in {steps_prefill}"

    prefill_time = t_first - t_submit
    bound = max(5.0, 3 * chunk_time)
    for i, s in enumerate(stamps):
        during = [t for t in s if t_submit <= t <= t_first]
        assert len(during) >= min_chunks - 2, (
            f"stream {i} got {len(during)} tokens while a {num_long}-token prompt prefilled "
            f"({prefill_time:.2f}s, one chunk {chunk_time:.2f}s)"
        )
        window = [t for t in s if t <= t_first]
        gaps = [b - a for a, b in itertools.pairwise(window) if b >= t_submit]
        worst = max(gaps)
        assert worst < bound, f"stream {i} stalled {worst:.2f}s (one chunk: {chunk_time:.2f}s)"
        assert worst < prefill_time / 2, "one step held most of the long prefill"


# ---------------------------------------------------------------------- KV pressure
TOPICS = ["sea", "sky", "moon", "forest", "desert", "city"]
TOPICS += ["river", "snow", "train", "garden", "library", "bridge"]
PRESSURE_PROMPTS = tuple(
    f"Question {i}: write a short note about the {topic}, please." for i, topic in enumerate(TOPICS)
)


def test_small_context_preempts_and_matches_roomy_context(
    real_ctx: llamax.Context, make_real: MakeReal
) -> None:
    params = llamax.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    small = make_real(n_ctx=256, n_seq_max=8)
    assert small.n_ctx == 256
    lengths = [len(small.tokenize(p)) for p in PRESSURE_PROMPTS]
    assert all(12 <= n <= 30 for n in lengths)
    assert sum(n + 60 for n in lengths) > 2 * small.n_ctx

    handles = [small.add_request(p, params) for p in PRESSURE_PROMPTS]
    results = [h.result(timeout=RESULT_TIMEOUT) for h in handles]
    preemptions = small.stats().num_preemptions
    reference = [run_alone(real_ctx, p, params) for p in PRESSURE_PROMPTS]

    assert preemptions > 0, "the pressure test never preempted"
    mismatches = []
    for prompt, got, want in zip(PRESSURE_PROMPTS, results, reference, strict=True):
        assert got.finish_reason == "length"
        assert len(got.token_ids) == 60
        if got.token_ids != want.token_ids:
            note = divergence_note(real_ctx, prompt, params, want.token_ids, got.token_ids)
            mismatches.append(f"{prompt!r}: {note}")
        assert got.text == small.detokenize(got.token_ids)
    assert not mismatches, f"{preemptions} preemptions; outputs changed:\n" + "\n".join(mismatches)


def test_sequence_fills_context(make_real: MakeReal) -> None:
    ctx = make_real(n_ctx=256, n_seq_max=2)
    prompt = [ctx.tokenize("Hello")[0]] * (ctx.n_ctx - 10)
    params = llamax.SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    completion = run_alone(ctx, prompt, params)
    assert completion.finish_reason == "length"
    assert completion.usage.prompt_tokens + completion.usage.completion_tokens == ctx.n_ctx
    params = llamax.SamplingParams(max_tokens=8, temperature=0.0)
    edge = run_alone(ctx, prompt[:1] * (ctx.n_ctx - 1), params)
    assert edge.finish_reason == "length" and len(edge.token_ids) == 1


# ---------------------------------------------------------------------- asyncio
def test_asyncio_api_inside_running_loop(real_ctx: llamax.Context) -> None:
    params = llamax.SamplingParams(max_tokens=16, temperature=0.0)
    prompts = ["The capital of France is", "Once upon a time", "Water boils at"]
    expected = [run_alone(real_ctx, p, params).text for p in prompts]

    async def streamed(prompt: str) -> tuple[str, llamax.Completion]:
        handle = real_ctx.add_request(prompt, params)
        parts = [event.text async for event in handle]
        return "".join(parts), await handle

    async def main() -> None:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        tick_task = asyncio.create_task(ticker())
        completion = await real_ctx.add_request(prompts[0], params)
        assert completion.text == expected[0]

        parts = []
        async for event in real_ctx.add_request(prompts[1], params):
            assert isinstance(event, llamax.TokenEvent)
            parts.append(event.text)
        assert "".join(parts) == expected[1]

        awaited = await asyncio.gather(*(real_ctx.add_request(p, params) for p in prompts))
        assert [c.text for c in awaited] == expected
        results = await asyncio.gather(*(streamed(p) for p in prompts))
        for (text, c), want in zip(results, expected, strict=True):
            assert text == c.text == want
        stop.set()
        await tick_task
        assert ticks > 5, "the event loop was blocked while awaiting requests"

    asyncio.run(main())


# ---------------------------------------------------------------------- manual loop
def test_manual_loop_matches_background_loop(real_ctx: llamax.Context, make_real: MakeReal) -> None:
    prompt = "The capital of France is"
    background = run_alone(real_ctx, prompt, GREEDY_32)
    ctx = make_real(n_ctx=1024, n_seq_max=4, autostart=False)
    assert ctx.process() is False  # nothing to do
    handle = ctx.add_request(prompt, GREEDY_32)
    assert not handle.done()
    steps = drive(ctx)
    assert steps == len(background.token_ids) + (background.finish_reason == "stop")
    manual = handle.result(timeout=0)
    assert manual.token_ids == background.token_ids
    assert manual.text == background.text
    assert manual.finish_reason == background.finish_reason
    assert ctx.process() is False


# ---------------------------------------------------------------------- errors
def test_prompt_longer_than_context(real_ctx: llamax.Context) -> None:
    text = "hello " * (real_ctx.n_ctx + 100)
    with pytest.raises(llamax.ContextLengthError) as info:
        real_ctx.add_request(text)
    assert info.value.n_ctx == real_ctx.n_ctx
    assert info.value.num_prompt_tokens >= real_ctx.n_ctx
    with pytest.raises(llamax.ContextLengthError):
        real_ctx.add_request([42] * real_ctx.n_ctx)  # no room left for a reply
    assert_serves(real_ctx)


def test_empty_prompt(real_ctx: llamax.Context) -> None:
    with pytest.raises(llamax.EmptyPromptError):
        real_ctx.add_request("")
    with pytest.raises(llamax.EmptyPromptError):
        real_ctx.add_request([])
    assert_serves(real_ctx)


def test_bad_prompt_token_ids(real_ctx: llamax.Context) -> None:
    for bad in ([1, -1], [1, 10**9], [1, "2"]):
        with pytest.raises(llamax.InvalidRequestError):
            real_ctx.add_request(bad)  # type: ignore[arg-type]
    with pytest.raises(llamax.InvalidParameterError, match="stop_token_ids"):
        real_ctx.add_request("Hi", llamax.SamplingParams(stop_token_ids=[10**9]))
    with pytest.raises(llamax.InvalidParameterError, match="logit_bias"):
        real_ctx.add_request("Hi", llamax.SamplingParams(logit_bias={10**9: -math.inf}))
    assert_serves(real_ctx)


def test_missing_model_file(tmp_path: Path, real_ctx: llamax.Context) -> None:
    with pytest.raises(llamax.ModelLoadError):
        llamax.Context(tmp_path / "does-not-exist.gguf")
    with pytest.raises(llamax.ModelLoadError):
        llamax.Context(tmp_path)  # a directory
    assert_serves(real_ctx)


def _model_head(size: int) -> bytes:
    with llamax.default_model_path().open("rb") as f:
        return f.read(size)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(lambda: os.urandom(4096), id="garbage"),
        pytest.param(lambda: b"GGUF" + os.urandom(4096), id="gguf-magic-then-garbage"),
        pytest.param(lambda: b"", id="empty"),
        pytest.param(lambda: b"GGUF", id="magic-only"),
        pytest.param(lambda: _model_head(1 << 20), id="truncated-model"),
    ],
)
def test_corrupt_model_file(
    tmp_path: Path, real_ctx: llamax.Context, content: Callable[[], bytes]
) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content())
    with pytest.raises(llamax.ModelLoadError):
        llamax.Context(path)
    assert_serves(real_ctx)


def test_add_request_and_process_after_close(make_real: MakeReal) -> None:
    ctx = make_real(n_ctx=512, n_seq_max=2)
    assert ctx.add_request("Hi", llamax.SamplingParams(max_tokens=2)).result(RESULT_TIMEOUT)
    ctx.close()
    assert ctx.closed
    with pytest.raises(llamax.ContextClosedError):
        ctx.add_request("Hi")
    ctx.close()  # idempotent

    manual = make_real(n_ctx=512, n_seq_max=2, autostart=False)
    manual.close()
    with pytest.raises(llamax.ContextClosedError):
        manual.process()
    with pytest.raises(llamax.ContextClosedError):
        manual.add_request("Hi")


def test_process_on_autostart_context(real_ctx: llamax.Context) -> None:
    with pytest.raises(llamax.LoopOwnershipError):
        real_ctx.process()
    assert_serves(real_ctx)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.5),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_k", 1.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("typical_p", 0.0),
        ("repeat_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("penalty_last_n", -2),
        ("penalty_last_n", 2.5),
        ("seed", -1),
        ("seed", 2**32),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("logit_bias", {-5: 1.0}),
    ],
)
def test_bad_sampling_params(real_ctx: llamax.Context, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        llamax.SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert_serves(real_ctx)


def test_penalty_sampling_does_not_break_the_context(make_real: MakeReal) -> None:
    """Penalties are valid SamplingParams; a request using them must be served."""
    ctx = make_real(n_ctx=512, n_seq_max=2)
    for params in (
        llamax.SamplingParams(max_tokens=8, temperature=0.0, repeat_penalty=1.3),
        llamax.SamplingParams(
            max_tokens=8, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5
        ),
    ):
        prompt = "Repeat after me: la la la la"
        completion = ctx.add_request(prompt, params).result(timeout=RESULT_TIMEOUT)
        assert completion.finish_reason in TERMINAL
    assert not ctx.closed
    assert_serves(ctx)


def test_seeded_sampling_is_reproducible(real_ctx: llamax.Context) -> None:
    params = llamax.SamplingParams(max_tokens=16, temperature=0.9, seed=1234)
    first = run_alone(real_ctx, "Once upon a time", params)
    second = run_alone(real_ctx, "Once upon a time", params)
    assert first.token_ids == second.token_ids
