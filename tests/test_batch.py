"""llamax.batch.generate / agenerate against the fake backend, plus one real-model batch."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import pytest

import llamax
from llamax import batch, progress
from llamax.testing import FakeBackend, alphabet_model, assert_idle

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]
PARAMS = llamax.SamplingParams(max_tokens=5, temperature=0)


def failing(_ids: Sequence[int], _logits: npt.NDArray[np.float32]) -> None:
    raise ValueError("boom")


def slow_alphabet(history: Sequence[int]) -> int:
    time.sleep(0.01)
    return alphabet_model(history)


FAILING = llamax.SamplingParams(max_tokens=5, temperature=0, logits_processors=(failing,))


@pytest.mark.parametrize("autostart", [False, True])
def test_results_in_input_order_from_one_batch(make_fake: MakeFake, autostart: bool) -> None:
    # slow tokens: the background loop cannot finish "a" before "p" has been submitted
    ctx, backend = make_fake(autostart=autostart, n_seq_max=4, next_token=slow_alphabet)
    prompts = ["a", "e", "k", "p"]
    done = batch.generate(ctx, prompts, PARAMS, progress=False)
    assert [c.text for c in done] == ["bcdef", "fghij", "lmnop", "qrstu"]
    assert max(len(items) for items in backend.decode_log) == 4  # all four ran together
    if not autostart:
        assert len(backend.decode_log[0]) == 4  # submitted before the first step


def test_one_params_per_prompt_and_token_prompts(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    params = [llamax.SamplingParams(max_tokens=n, temperature=0) for n in (1, 3, 2)]
    done = batch.generate(ctx, ["a", [ord("c") + 1], "x"], params, progress=False)
    assert [c.text for c in done] == ["b", "def", "yz"]
    assert batch.generate(ctx, [], PARAMS) == []


def test_bad_arguments_raise_typed_errors(make_fake: MakeFake) -> None:
    ctx, _ = make_fake()
    with pytest.raises(llamax.InvalidParameterError, match="2 entries for 3 prompts"):
        batch.generate(ctx, ["a", "b", "c"], [PARAMS, PARAMS])
    with pytest.raises(llamax.InvalidRequestError, match="list of prompts"):
        batch.generate(ctx, "abc")
    with pytest.raises(llamax.InvalidRequestError, match=r"params\[1\]"):
        batch.generate(ctx, ["a", "b"], [PARAMS, {"max_tokens": 3}])  # type: ignore[list-item]
    assert not ctx.has_work()


def test_return_exceptions_keeps_each_error_in_place(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_ctx=64)
    prompts = ["a", "x" * 100, "c", "d"]
    params = [PARAMS, PARAMS, FAILING, PARAMS]
    done = batch.generate(ctx, prompts, params, progress=False, return_exceptions=True)
    assert isinstance(done[0], llamax.Completion) and done[0].text == "bcdef"
    assert isinstance(done[1], llamax.ContextLengthError)
    assert isinstance(done[2], llamax.RequestFailedError)
    assert isinstance(done[3], llamax.Completion) and done[3].text == "efghi"


def test_first_error_cancels_the_rest_and_raises(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(n_seq_max=2)
    long = llamax.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with pytest.raises(llamax.RequestFailedError):
        batch.generate(ctx, ["a", "b", "c"], [long, FAILING, long], progress=False)
    assert_idle(ctx, timeout=0)
    with pytest.raises(llamax.ContextLengthError):
        batch.generate(ctx, ["a", "x" * 1000], PARAMS)
    assert_idle(ctx, timeout=0)


@pytest.mark.parametrize("autostart", [False, True])
def test_agenerate(make_fake: MakeFake, autostart: bool) -> None:
    ctx, _ = make_fake(autostart=autostart)

    async def main() -> list[llamax.Completion | BaseException]:
        return await batch.agenerate(
            ctx, ["a", "b", "c"], [PARAMS, FAILING, PARAMS], return_exceptions=True
        )

    done = asyncio.run(main())
    assert isinstance(done[0], llamax.Completion) and done[0].text == "bcdef"
    assert isinstance(done[1], llamax.RequestFailedError)
    assert isinstance(done[2], llamax.Completion) and done[2].text == "defgh"


def test_cancelling_agenerate_cancels_the_requests(make_fake: MakeFake) -> None:
    ctx, _ = make_fake(autostart=True, n_seq_max=1, next_token=slow_alphabet)
    endless = llamax.SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)

    async def main() -> None:
        task = asyncio.create_task(batch.agenerate(ctx, ["a", "b"], endless))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert_idle(ctx)


def test_progress_bar(make_fake: MakeFake, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    ctx, _ = make_fake()
    batch.generate(ctx, ["a", "b"], PARAMS, progress=True)
    assert "generate: 100%" in capsys.readouterr().err
    batch.generate(ctx, ["a", "b"], PARAMS)  # quick: no bar by default
    assert capsys.readouterr().err == ""


def test_progress_bar_appears_for_slow_batches(
    make_fake: MakeFake, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tqdm")
    monkeypatch.setattr(progress, "PROGRESS_DELAY_S", 0.0)
    ctx, _ = make_fake(n_seq_max=1)
    batch.generate(ctx, ["a", "b", "c"], PARAMS)
    assert "generate: 100%" in capsys.readouterr().err


def test_progress_true_without_tqdm(make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    ctx, _ = make_fake()
    with pytest.raises(llamax.InvalidParameterError, match="tqdm"):
        batch.generate(ctx, ["a"], PARAMS, progress=True)
    assert batch.generate(ctx, ["a"], PARAMS)[0].text == "bcdef"  # optional by default


@pytest.mark.model
def test_real_batch_keeps_input_order(real_ctx: llamax.Context) -> None:
    prompts = [
        real_ctx.detokenize(real_ctx.chat_prompt([{"role": "user", "content": f"Count to {n}"}]))
        for n in range(8)
    ]
    params = [
        llamax.SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True) for n in range(8)
    ]
    done = batch.generate(real_ctx, prompts, params, progress=False)
    assert [c.usage.completion_tokens for c in done] == list(range(1, 9))
    assert all(c.finish_reason == "length" for c in done)
