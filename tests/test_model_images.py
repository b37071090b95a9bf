"""Images in prompts through the public API on SmolLM2 and the random projectors of
scripts/make_vision_model.py (Gemma 3's non-causal one, Janus-Pro's causal one), issue 42.

Outputs are compared only at the same batch composition (see tests/near_tie.py): a
request beside others is run twice the same way, never against a solo run."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vision_files
from vision_files import pixels, png

import llamax
from llamax.errors import ProjectorError
from llamax.testing import assert_idle

pytestmark = pytest.mark.model
GREEDY = llamax.SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module", params=["gemma3", "janus_pro"])
def vision_ctx(request: Any, model_path: Path) -> Iterator[llamax.Context]:
    path = vision_files.script().cached_vision_model(projector=request.param)
    ctx = llamax.Context(
        model_path, mmproj=str(path), n_ctx=2048, n_seq_max=8, n_batch=256, n_threads=2
    )
    yield ctx
    ctx.close()


@pytest.fixture
def ctx(vision_ctx: llamax.Context) -> Iterator[llamax.Context]:
    vision_ctx.clear_cache()
    yield vision_ctx
    assert_idle(vision_ctx, timeout=60)
    assert vision_ctx.audit() == []


def image(seed: int) -> llamax.Image:
    return llamax.Image(png(pixels(seed, 48, 64)))


def prompt(seed: int, question: str = " What is in the picture?") -> list[Any]:
    return ["<|im_start|>user\n", image(seed), question + "<|im_end|>\n<|im_start|>assistant\n"]


def first_logprobs(out: llamax.Completion) -> list[tuple[int, float]]:
    lp = out.choices[0].logprobs
    assert lp
    return [(t.token_id, t.logprob) for t in lp[0].top_logprobs]


def test_a_context_with_a_projector_sees_images(ctx: llamax.Context) -> None:
    assert ctx.sees_images


def test_sees_images_answers_after_close(model_path: Path) -> None:
    """A fact known at load, like ``fim_tokens``: it answers after close (the first version
    asked the freed projector and raised ContextClosedError)."""
    path = vision_files.script().cached_vision_model(projector="janus_pro")
    ctx = llamax.Context(model_path, mmproj=str(path), n_ctx=512, n_seq_max=1)
    ctx.close()
    assert ctx.sees_images


def test_a_projector_that_is_no_projector_is_a_typed_error(model_path: Path) -> None:
    with pytest.raises(ProjectorError):
        llamax.Context(model_path, mmproj=str(model_path), n_ctx=256)


def test_the_same_image_twice_is_a_prefix_hit_equal_to_the_cold_run(ctx: llamax.Context) -> None:
    cold = ctx.add_request(prompt(1), GREEDY).result()
    warm = ctx.add_request(prompt(1), GREEDY).result()
    assert warm.usage.cached_tokens > 0
    assert warm.choices[0].token_ids == cold.choices[0].token_ids


def test_two_images_with_the_same_text_give_different_outputs(ctx: llamax.Context) -> None:
    first = dataclasses.replace(GREEDY, max_tokens=1)  # only the first logprobs are compared
    a = ctx.add_request(prompt(1), first).result()
    b = ctx.add_request(prompt(2), first).result()
    assert first_logprobs(a) != first_logprobs(b)


def test_an_image_beside_text_requests_is_the_same_at_the_same_composition(
    ctx: llamax.Context,
) -> None:
    def run() -> list[llamax.Completion]:
        ctx.clear_cache()
        handles = [
            ctx.add_request("Tell me a story about a cat.", GREEDY),
            ctx.add_request(prompt(3), GREEDY),
            ctx.add_request("The capital of France is", GREEDY),
        ]
        return [h.result() for h in handles]

    first, second = run(), run()
    for a, b in zip(first, second, strict=True):
        assert a.choices[0].token_ids == b.choices[0].token_ids
        assert first_logprobs(a) == first_logprobs(b)


def test_n4_with_an_image_encodes_it_once(ctx: llamax.Context) -> None:
    before = ctx._images.num_encoded
    params = llamax.SamplingParams(max_tokens=4, n=4, temperature=1.0, seed=1)
    out = ctx.add_request(prompt(4), params).result()
    assert len(out.choices) == 4
    assert ctx._images.num_encoded == before + 1
