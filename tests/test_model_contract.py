"""The engine's contract on the real model (SmolLM2-135M-Instruct), through the public API.

Stricter companions of test_model_engine.py: joining a running batch, cancellation at each
stage with exact KV accounting, stop strings and stop tokens, multi-byte streaming and
max_tokens cutting a character, a sequence that fills the context, asyncio without
blocking the event loop, the manual loop's step count, and typed errors for bad input.

``real_ctx`` is the session's shared context (n_ctx=4096, n_seq_max=16), asserted idle
before and after each test; ``make_real`` builds extra contexts, leak-checked and closed.
"Alone" below means on an otherwise idle context with the prefix cache cleared, so the
prompt is computed afresh and nothing else sits in the KV cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

import llamax
from llamax.testing import assert_idle

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]
GREEDY_32 = llamax.SamplingParams(max_tokens=32, temperature=0.0)
GREEDY_12 = llamax.SamplingParams(max_tokens=12, temperature=0.0)
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


NEAR_TIE_NATS = 0.1
"""Two greedy picks closer than this (in log-probability) are a floating-point near tie."""


def divergence(
    ctx: llamax.Context,
    prompt: str | Sequence[int],
    params: llamax.SamplingParams,
    alone: Sequence[int],
    other: Sequence[int],
) -> tuple[float | None, str]:
    """Where two greedy outputs part: the alone run's margin between the two picks there
    (None when the other pick is not among its top 5), and a note for the failure message.

    A margin of a few hundredths of a nat means the outputs differ by floating-point
    rounding of near-tied logits (batch shapes change llama.cpp's summation order), not by
    wrong KV contents, which would put a clearly worse token first.
    """
    i = first_divergence(alone, other)
    prefix = ctx.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    probe_params = dataclasses.replace(params, max_tokens=1, logprobs=5, stop=(), stop_token_ids=())
    probe = run_alone(ctx, prefix + list(alone[:i]), probe_params)
    logprobs = probe.choices[0].logprobs or ()
    top = {t.token_id: t.logprob for t in logprobs[0].top_logprobs} if logprobs else {}
    picks = (alone[i : i + 1], other[i : i + 1])
    margin = None
    if picks[0] and picks[1] and picks[0][0] in top and picks[1][0] in top:
        margin = abs(top[picks[0][0]] - top[picks[1][0]])
    rounded = [(t, round(lp, 4)) for t, lp in top.items()]
    note = (
        f"diverges at generated token {i}: alone {picks[0]} vs {picks[1]}; top logprobs {rounded}"
    )
    return margin, note


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


def test_greedy_output_does_not_depend_on_when_a_request_joins(make_real: MakeReal) -> None:
    """Deterministic form of the batching check: a manual loop fixes the batch layout.

    Seven requests start; "The quick brown fox" joins two steps later, so its prompt is
    prefilled next to seven decoding tokens and its cells land after theirs in the cache.
    Its output must equal the alone run, or part from it only at a near tie: measured, it
    follows the alone run for 31 tokens, then picks the second of two tokens 0.06 nats apart.
    Twelve tokens each: the join, two steps in, is what is forced, not the length.
    """
    ctx = make_real(n_ctx=4096, n_seq_max=16, n_batch=512, autostart=False)
    late = EIGHT_PROMPTS[3]
    alone_handle = ctx.add_request(late, GREEDY_12)
    drive(ctx)
    alone = alone_handle.result(timeout=0)
    ctx.clear_cache()

    others = [ctx.add_request(p, GREEDY_12) for p in EIGHT_PROMPTS if p != late]
    ctx.process()
    ctx.process()
    assert ctx.stats().num_running == len(others)  # still decoding when the late one joins
    joined_late = ctx.add_request(late, GREEDY_12)
    drive(ctx)
    for h in others:
        assert h.result(timeout=0).finish_reason in TERMINAL
    batched = joined_late.result(timeout=0)
    if batched.token_ids != alone.token_ids:
        probe = make_real(n_ctx=4096, n_seq_max=16, n_batch=512)
        margin, note = divergence(probe, late, GREEDY_12, alone.token_ids, batched.token_ids)
        assert margin is not None and margin < NEAR_TIE_NATS, (
            f"greedy output changed when the request joined a running batch, not at a near "
            f"tie: {note}: alone {alone.text!r} vs joined {batched.text!r}"
        )


# ---------------------------------------------------------------------- concurrency and cancel


@pytest.mark.parametrize("stage", ["queued", "queued_behind_other", "prefill", "decode"])
@pytest.mark.integration
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


@pytest.mark.integration
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
    num_past = len(completion.token_ids) + 4  # past the end-of-generation token
    params = llamax.SamplingParams(max_tokens=num_past, temperature=0.0, ignore_eos=True)
    forced = run_alone(real_ctx, prompt, params)
    assert forced.finish_reason == "length"
    assert len(forced.token_ids) == num_past


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


@pytest.mark.integration
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


# ---------------------------------------------------------------------- KV pressure
@pytest.mark.integration
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
    params = llamax.SamplingParams(max_tokens=6, temperature=0.0)
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
    background = run_alone(real_ctx, prompt, GREEDY_12)
    ctx = make_real(n_ctx=1024, n_seq_max=4, autostart=False)
    assert ctx.process() is False  # nothing to do
    handle = ctx.add_request(prompt, GREEDY_12)
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
def test_bad_sampling_params(field: str, value: object) -> None:
    """Refused when the params are built, before any context sees them: no context here
    (each case once asked the shared context for a reply it could not have changed)."""
    with pytest.raises(ValueError, match=field):
        llamax.SamplingParams(**{field: value})  # type: ignore[arg-type]


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
