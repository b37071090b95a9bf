"""Logits processors, the batch hook, logprobs and grammar checks, against the fake backend."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import llamax
from llamax.testing import FakeBackend

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]
Row = npt.NDArray[np.float32]


def run(ctx: llamax.Context) -> None:
    while ctx.has_work():
        ctx.process()


def test_banning_processor_never_sees_banned_tokens_sampled(make_fake: MakeFake) -> None:
    banned = [ord(c) + 1 for c in "bcdefghij"]
    seen: list[bool] = []

    def ban(token_ids: npt.NDArray[np.int32], logits: Row) -> None:
        seen.append(logits.flags.writeable and logits.dtype == np.float32)
        logits[banned] = -np.inf

    ctx, _ = make_fake()
    params = llamax.SamplingParams(max_tokens=20, temperature=0, logits_processors=[ban])
    done = ctx.add_request("a", params)
    run(ctx)
    assert not set(done.result(0).token_ids) & set(banned)
    assert seen and all(seen)


def test_forcing_processor_yields_exactly_its_text(make_fake: MakeFake) -> None:
    forced = [b + 1 for b in b"forced text!"]

    def force(token_ids: npt.NDArray[np.int32], logits: Row) -> Row:
        out = np.full_like(logits, -np.inf)
        out[forced[len(token_ids) - 3]] = 0.0  # prompt "abc" has 3 tokens
        return out

    ctx, _ = make_fake()
    params = llamax.SamplingParams(
        max_tokens=len(forced), temperature=0.9, logits_processors=[force]
    )
    handle = ctx.add_request("abc", params)
    run(ctx)
    assert handle.result(0).text == "forced text!"


def test_processor_sees_prompt_and_generated_tokens(make_fake: MakeFake) -> None:
    histories: list[list[int]] = []

    def record(token_ids: npt.NDArray[np.int32], logits: Row) -> None:
        assert token_ids.dtype == np.int32
        histories.append(token_ids.tolist())

    ctx, _ = make_fake()
    handle = ctx.add_request(
        "ab", llamax.SamplingParams(max_tokens=3, temperature=0, logits_processors=[record])
    )
    run(ctx)
    generated = list(handle.result(0).token_ids)
    assert histories == [[98, 99], [98, 99, generated[0]], [98, 99, *generated[:2]]]


@pytest.mark.parametrize(
    "bad",
    [
        lambda ids, logits: 1 / 0,
        lambda ids, logits: np.zeros(3, np.float32),
        lambda ids, logits: np.zeros(logits.shape, np.float64),
        lambda ids, logits: "nope",
    ],
)
def test_faulty_processor_fails_only_its_request(make_fake: MakeFake, bad: Any) -> None:
    ctx, _ = make_fake(n_seq_max=16, n_ctx=1024)
    params = llamax.SamplingParams(max_tokens=6, temperature=0)
    good = [ctx.add_request(f"p{i}", params) for i in range(15)]
    faulty = ctx.add_request("x", llamax.SamplingParams(max_tokens=6, logits_processors=[bad]))
    run(ctx)
    with pytest.raises(llamax.RequestFailedError, match="logits processor") as info:
        faulty.result(0)
    if isinstance(info.value.__cause__, ZeroDivisionError):
        assert "ZeroDivisionError" in str(info.value)
    with pytest.raises(llamax.RequestFailedError):
        list(faulty)
    assert all(h.result(0).finish_reason == "length" for h in good)


def test_a_sampler_that_cannot_be_built_fails_only_its_request(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx, backend = make_fake(n_seq_max=4, n_ctx=512)
    build = backend.new_sampler

    def new_sampler(params: llamax.SamplingParams, *args: Any, **kwargs: Any) -> Any:
        if params.top_k == 7:
            raise OSError("native sampler init returned NULL")
        return build(params, *args, **kwargs)

    monkeypatch.setattr(backend, "new_sampler", new_sampler)
    good = [ctx.add_request(f"p{i}", llamax.SamplingParams(max_tokens=5)) for i in range(3)]
    bad = ctx.add_request("x", llamax.SamplingParams(max_tokens=5, top_k=7))
    run(ctx)
    with pytest.raises(llamax.RequestFailedError, match="native sampler") as info:
        bad.result(0)
    assert isinstance(info.value.__cause__, OSError)
    assert all(h.result(0).finish_reason == "length" for h in good)
    assert ctx.add_request("y", llamax.SamplingParams(max_tokens=2)).result is not None
    run(ctx)


def test_batch_hook_sees_every_row_once_per_step() -> None:
    calls: list[tuple[list[str], tuple[int, ...]]] = []

    def hook(rows: Sequence[llamax.LogitsRow], logits: Row) -> None:
        calls.append(([r.request_id for r in rows], logits.shape))
        logits[:, ord("z") + 1] = 100.0  # vectorised: every sequence says "z"

    backend = FakeBackend()
    ctx = llamax.Context(backend=backend, autostart=False, batch_logits_processor=hook)
    handles = [
        ctx.add_request(p, llamax.SamplingParams(max_tokens=3, temperature=0), request_id=f"r{i}")
        for i, p in enumerate(["ab", "cd"])
    ]
    run(ctx)
    assert all(h.result(0).text == "zzz" for h in handles)
    assert calls[0] == (["r0", "r1"], (2, backend.facts.n_vocab))
    ctx.close()


def test_greedy_logprobs_match_the_chosen_token(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    handle = ctx.add_request("abc", llamax.SamplingParams(max_tokens=5, temperature=0, logprobs=5))
    run(ctx)
    done = handle.result(0)
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and len(logprobs) == len(done.token_ids)
    for token, lp in zip(done.token_ids, logprobs, strict=True):
        assert lp.token_id == token == lp.top_logprobs[0].token_id
        assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob)
        values = [t.logprob for t in lp.top_logprobs]
        assert values == sorted(values, reverse=True) and len(values) == 5
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
        assert lp.bytes == bytes([token - 1]) and lp.token == chr(token - 1)
    streamed = [lp for e in handle for lp in e.logprobs]
    assert streamed == list(logprobs)


def test_logprobs_zero_reports_only_the_token(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    handle = ctx.add_request("abc", llamax.SamplingParams(max_tokens=2, temperature=0, logprobs=0))
    run(ctx)
    logprobs = handle.result(0).choices[0].logprobs
    assert logprobs is not None and all(lp.top_logprobs == () for lp in logprobs)
    assert ctx.add_request("abc", llamax.SamplingParams(max_tokens=1)).future is not None
    run(ctx)


def test_logprobs_after_sampling_report_the_distribution_the_sampler_drew_from(
    make_fake: MakeFake,
) -> None:
    """llama-server's ``post_sampling_probs``: at temperature 1 the fake's chain keeps the
    model's distribution (its probabilities equal the model's); at 0.5 it is sharper; greedy
    is the token alone with probability 1. The tokens drawn are the same either way."""
    ctx, _ = make_fake()

    def sample(temperature: float, after: bool) -> llamax.Completion:
        params = llamax.SamplingParams(max_tokens=6, temperature=temperature, logprobs=4,
                                       seed=7, logprobs_after_sampling=after)  # fmt: skip
        handle = ctx.add_request("abc", params)
        run(ctx)
        return handle.result(0)

    model, same = sample(1.0, False), sample(1.0, True)
    assert same.token_ids == model.token_ids
    assert same.logprobs is not None and model.logprobs is not None
    for a, b in zip(same.logprobs, model.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
    sharp, wide = sample(0.5, True), sample(0.5, False)
    assert sharp.token_ids == wide.token_ids and sharp.logprobs and wide.logprobs
    for a, b in zip(sharp.logprobs, wide.logprobs, strict=True):
        assert a.top_logprobs[0].logprob > b.top_logprobs[0].logprob  # the top is likelier
        assert all(t.logprob > -math.inf for t in a.top_logprobs)
    greedy = sample(0, True)
    assert greedy.logprobs is not None
    for token, lp in zip(greedy.token_ids, greedy.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob == 0.0
        assert [(t.token_id, t.logprob) for t in lp.top_logprobs] == [(token, 0.0)]
    with pytest.raises(llamax.InvalidParameterError, match="needs logprobs"):
        llamax.SamplingParams(logprobs_after_sampling=True)
    with pytest.raises(llamax.InvalidParameterError, match="logprobs_after_sampling"):
        llamax.SamplingParams(logprobs=1, logprobs_after_sampling=1)  # type: ignore[arg-type]


def test_invalid_grammar_and_schema_are_refused_at_submission(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    with pytest.raises(llamax.GrammarError, match="invalid grammar"):
        ctx.add_request("abc", llamax.SamplingParams(grammar='root ::= "INVALID'))
    with pytest.raises(llamax.GrammarError, match="JSON schema"):
        ctx.add_request("abc", llamax.SamplingParams(json_schema={"type": "no-such-type"}))
    with pytest.raises(llamax.InvalidParameterError, match="both"):
        llamax.SamplingParams(grammar="root ::= x", json_schema={})
    with pytest.raises(llamax.InvalidParameterError, match="logprobs"):
        llamax.SamplingParams(logprobs=21)
    ok = ctx.add_request("abc", llamax.SamplingParams(max_tokens=2, json_schema={"type": "object"}))
    run(ctx)
    assert ok.result(0).finish_reason == "length"


@pytest.mark.parametrize("grammar", ['root ::= "a"{2,1}', 'root ::= "a"{20000}'])
def test_runaway_repetitions_are_refused_before_llama_cpp_parses_them(
    make_fake: MakeFake, grammar: str
) -> None:
    ctx, _ = make_fake()
    with pytest.raises(llamax.GrammarError, match="repetition"):
        ctx.add_request("abc", llamax.SamplingParams(grammar=grammar))
