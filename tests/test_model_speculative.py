"""Speculative prompt-lookup decoding on SmolLM2, through the public API.

A verification batch has other shapes than a plain decode, and llama.cpp on a CPU is not
batch-invariant, so a greedy speculative run may part from a plain run where two tokens
are nearly tied. Where they part, the plain run's own logprobs must show a near tie
(< 0.1 nats); before that, every token and its logprob must agree.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable

import pytest

import llamax

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]
TIMEOUT = 240.0
NEAR_TIE_NATS = 0.1
LOGPROB_ATOL = 0.6
"""How far one token's logprob may move between a plain run and a speculative one.

Measured on this AVX2 CPU with SmolLM2 Q4_1 (flash attention on, llama.cpp's default
here): the logprobs are bit-identical until the first decode after rejected draft cells
were removed and reused (the KV cells then sit in another order, and the CPU attention
sums in that order), then drift by a median of 0 and at most 0.43 nats at single tokens,
while every token stays the same. The raw loop fed the same tokens in blocks of 4 or 11
without removals is bit-identical to one token at a time. (With flash attention off a
multi-token batch alone moves single low-probability tokens by up to 1.9 nats.) 0.05
nats was the most seen on an AVX-512 machine. The median over a reply must stay tiny."""
LOGPROB_MEDIAN_ATOL = 0.02

CODE = """def parse(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, _, value = line.partition("=")
            rows.append((name.strip(), value.strip()))
    return dict(rows)


def merge(first, second):
    result = dict(first)
    for key, value in second.items():
        if key not in result:
            result[key] = value
    return result
"""
PASSAGE = (
    "The lighthouse keeper climbed the one hundred and twelve steps every evening at dusk. "
    "He trimmed the wick, polished the great lens, and wound the clockwork that turned the "
    "light. Ships passing the headland saw the beam sweep across the water every ten "
    "seconds, and they knew they were safe from the rocks below."
)


def chatml(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


COPY_PROMPTS = [
    chatml("Repeat this Python code exactly, without any comment:\n\n" + CODE),
    chatml("Copy this passage word for word:\n\n" + PASSAGE),
]
GREEDY = llamax.SamplingParams(max_tokens=160, temperature=0.0, logprobs=5)


def parting(plain: llamax.Completion, spec: llamax.Completion) -> tuple[int, float | None]:
    """Where the outputs part (or their length) and the plain run's margin there."""
    a, b = plain.token_ids, spec.token_ids
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if i is None:
        return min(len(a), len(b)), 0.0
    top = {t.token_id: t.logprob for t in (plain.logprobs or ())[i].top_logprobs}
    margin = abs(top[a[i]] - top[b[i]]) if a[i] in top and b[i] in top else None
    return i, margin


def check_agrees(plain: llamax.Completion, spec: llamax.Completion) -> None:
    """Equal outputs, or a parting at a near tie with equal tokens and logprobs before it."""
    i, margin = parting(plain, spec)
    note = f"part at token {i}: plain {plain.text!r} vs speculative {spec.text!r}"
    if plain.token_ids != spec.token_ids:
        assert margin is not None and margin < NEAR_TIE_NATS, note
    gaps = []
    for x, y in zip((plain.logprobs or ())[:i], (spec.logprobs or ())[:i], strict=True):
        assert x.token_id == y.token_id
        assert x.logprob == pytest.approx(y.logprob, abs=LOGPROB_ATOL), note
        gaps.append(abs(x.logprob - y.logprob))
    assert not gaps or statistics.median(gaps) < LOGPROB_MEDIAN_ATOL, (gaps, note)


def drafting(ctx: llamax.Context) -> llamax.Context:
    """``ctx`` with every proposed draft verified: these tests are of what drafts do, so
    they must not depend on whether the measured-cost pricing finds that drafts pay on this
    machine at this moment (under load it may find they do not, and nothing is drafted).
    The pricing has its own tests on given cost curves (tests/test_policy_drafts.py)."""
    ctx._engine.scheduler.drafts.priced = False
    return ctx


def solo(ctx: llamax.Context, prompt: str, params: llamax.SamplingParams) -> llamax.Completion:
    done = ctx.add_request(prompt, params).result(timeout=TIMEOUT)
    ctx.clear_cache()
    return done


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["unified", "streams"])
def test_greedy_copy_heavy_equals_plain_and_drafts_are_accepted(
    make_real: MakeReal, layout: str
) -> None:
    ctx = drafting(
        make_real(n_ctx=4096, n_seq_max=4, n_threads=2, kv_layout=layout, n_ctx_seq=1024)
    )
    for prompt in COPY_PROMPTS:
        plain = solo(ctx, prompt, GREEDY)
        spec = solo(ctx, prompt, dataclasses.replace(GREEDY, speculative=True))
        check_agrees(plain, spec)
        assert plain.usage.drafted_tokens == 0
        # every proposal is verified (unpriced), so this is the drafter's own rate: 92/253
        # on the merge prompt (priced, it was 78/135 to 90/211, by the machine's measured
        # step costs). A quarter still fails a verifier that rejects good drafts.
        assert spec.usage.accepted_tokens > 0.25 * spec.usage.drafted_tokens > 0, spec.usage
    stats = ctx.stats()
    assert stats.num_accepted_tokens > 40


@pytest.mark.integration
def test_seeded_sampling_with_drafts_is_reproducible(make_real: MakeReal) -> None:
    ctx = drafting(make_real(n_ctx=4096, n_seq_max=4, n_threads=2))
    params = llamax.SamplingParams(max_tokens=120, temperature=0.7, seed=11, speculative=True)
    first = solo(ctx, COPY_PROMPTS[1], params)
    second = solo(ctx, COPY_PROMPTS[1], params)
    assert first.token_ids == second.token_ids and first.text == second.text
    assert first.usage.accepted_tokens > 0


def test_stop_string_inside_an_accepted_draft(make_real: MakeReal) -> None:
    ctx = drafting(make_real(n_ctx=4096, n_seq_max=4, n_threads=2))
    params = dataclasses.replace(GREEDY, stop=["great lens"])
    plain = solo(ctx, COPY_PROMPTS[1], params)
    spec = solo(ctx, COPY_PROMPTS[1], dataclasses.replace(params, speculative=True))
    assert plain.finish_reason == "stop" and "great lens" not in plain.text
    check_agrees(plain, spec)
    if spec.token_ids == plain.token_ids:
        assert spec.text == plain.text and spec.finish_reason == "stop"
    assert spec.usage.accepted_tokens > 0


@pytest.mark.integration
def test_grammar_constrained_request_with_drafts(make_real: MakeReal) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "items": {"type": "array"}},
        "required": ["name", "items"],
    }
    record = {"name": "clock", "items": ["pendulum", "escapement", "dial", "hands", "weights"]}
    prompt = chatml("Return exactly this JSON object:\n" + json.dumps(record))
    params = llamax.SamplingParams(max_tokens=120, temperature=0.0, json_schema=schema, logprobs=5)
    ctx = drafting(make_real(n_ctx=4096, n_seq_max=4, n_threads=2))
    plain = solo(ctx, prompt, params)
    spec = solo(ctx, prompt, dataclasses.replace(params, speculative=True))
    check_agrees(plain, spec)
    if spec.finish_reason == "stop":
        assert isinstance(json.loads(spec.text), dict)
    assert spec.usage.drafted_tokens > 0


@pytest.mark.integration
def test_concurrent_drafting_and_plain_requests(make_real: MakeReal) -> None:
    ctx = drafting(
        make_real(n_ctx=2048, n_seq_max=8, n_threads=2, speculative=llamax.PromptLookup())
    )
    params = llamax.SamplingParams(max_tokens=24, temperature=0.0)
    handles = [
        ctx.add_request(p, dataclasses.replace(params, speculative=spec))
        for p in COPY_PROMPTS * 2
        for spec in (None, False)
    ]
    done = [h.result(timeout=TIMEOUT) for h in handles]
    assert all(len(c.token_ids) > 0 for c in done)
    assert all(c.usage.drafted_tokens == 0 for c in done[1::2])
    assert all(c.usage.drafted_tokens > 0 for c in done[0::2]), [c.usage for c in done]
