"""Images in prompts through the engine, on the fake backend (issue 42): the scheduler's
image chunks, KV integrity of image cells, cancel and failures, and the placeholder ids
that must never reach a sampler, a draft or a token decode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from vision_files import pixels, png

import llamax
from llamax.engine.images import PromptImage, chunk_limit, cut_reuse, image_rows
from llamax.errors import ContextLengthError, ImageError, InvalidRequestError, RequestFailedError
from llamax.testing import FakeBackend, assert_idle

Make = Callable[..., tuple[llamax.Context, FakeBackend]]
GREEDY = llamax.SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(params=["unified", "streams"])
def kv_layout(request: Any) -> str:
    return str(request.param)


def image(seed: int) -> llamax.Image:
    return llamax.Image(png(pixels(seed, 4, 5)))


def image_items(backend: FakeBackend) -> list[llamax.backend.base.BatchItem]:
    return [item for step in backend.decode_log for item in step if item.embeddings is not None]


# ---------------------------------------------------------------------- positions
def test_chunks_stay_within_one_image_or_one_run_of_text() -> None:
    rows = np.zeros((8, 4), np.float32)
    images = [PromptImage(3, "a", rows), PromptImage(11, "b", rows, is_non_causal=True)]
    assert chunk_limit(images, 0, 100) == 3  # text up to the first image
    assert chunk_limit(images, 3, 5) == 5  # a causal image may be chunked
    assert chunk_limit(images, 5, 100) == 6  # to its end
    assert chunk_limit(images, 11, 2) == 8  # a non-causal one only whole
    assert chunk_limit(images, 19, 100) == 100
    assert cut_reuse(images, 5) == 5  # inside a causal image: kept
    assert cut_reuse(images, 14) == 11  # inside a non-causal one: back to its start
    assert cut_reuse(images, 19) == 19
    with pytest.raises(ValueError, match="mix text"):
        image_rows(images, 2, 4)
    with pytest.raises(ValueError, match="cut the non-causal"):
        image_rows(images, 11, 15)


# ---------------------------------------------------------------------- requests
@pytest.mark.parametrize("non_causal", [False, True])
def test_an_image_request_decodes_its_rows_apart_from_text(
    make_fake: Make, non_causal: bool
) -> None:
    ctx, backend = make_fake(image_tokens=24, non_causal_images=non_causal, n_batch=16)
    if non_causal:
        with pytest.raises(InvalidRequestError, match="n_ubatch"):
            ctx.add_request(["see ", image(1), " now"], GREEDY)
        ctx, backend = make_fake(image_tokens=12, non_causal_images=True, n_batch=16)
    text = ctx.add_request("plain text prompt", GREEDY)
    handle = ctx.add_request(["see ", image(1), " now"], GREEDY)
    text.result()
    out = handle.result()
    assert out.usage.prompt_tokens == 4 + (24 if not non_causal else 12) + 4
    rows = image_items(backend)
    assert sum(len(i.token_ids) for i in rows) == (24 if not non_causal else 12)
    if non_causal:
        assert len(rows) == 1 and rows[0].non_causal and len(rows[0].token_ids) == 12
    else:
        assert all(len(i.token_ids) <= 16 for i in rows) and len(rows) >= 2
    for step in backend.decode_log:  # never ids and embeddings in one decode
        assert len({i.embeddings is None for i in step}) == 1
    assert ctx.audit() == []


def test_the_same_image_is_a_prefix_hit_with_the_cold_output(make_fake: Make) -> None:
    ctx, _ = make_fake(image_tokens=20)
    cold = ctx.add_request(["look: ", image(1), " what?"], GREEDY).result()
    warm = ctx.add_request(["look: ", image(1), " what?"], GREEDY).result()
    assert warm.usage.cached_tokens >= 6 + 20
    assert warm.choices[0].token_ids == cold.choices[0].token_ids
    other = ctx.add_request(["look: ", image(2), " what?"], GREEDY).result()
    assert other.usage.cached_tokens <= 6  # another image shares only the text before it
    assert ctx.audit() == []


def test_a_prefix_never_ends_inside_a_non_causal_image(make_fake: Make) -> None:
    ctx, backend = make_fake(image_tokens=10, non_causal_images=True, n_seq_max=2)
    ctx.add_request(["a: ", image(1), " b"], GREEDY).result()
    # a slot holding the text and part of the image: what a cut-short prefix looks like
    (slot,) = [s for s in ctx._engine.scheduler.kv.slots() if s.tokens]
    assert ctx._engine.scheduler.kv.truncate(slot, 3 + 5)
    out = ctx.add_request(["a: ", image(1), " c"], GREEDY).result()
    assert out.usage.cached_tokens == 3  # cut back to the image's start
    last = image_items(backend)[-1]
    assert (last.start_pos, len(last.token_ids)) == (3, 10)
    assert ctx.audit() == []


def test_n_choices_with_an_image_encode_it_once(make_fake: Make) -> None:
    ctx, backend = make_fake(image_tokens=8, n_seq_max=4)
    params = llamax.SamplingParams(max_tokens=3, n=4, temperature=1.0, seed=3)
    out = ctx.add_request(["q ", image(5), " a"], params).result()
    assert len(out.choices) == 4
    burst = [ctx.add_request(["q ", image(5), " b"], GREEDY) for _ in range(3)]
    for handle in burst:
        handle.result()
    assert backend.fault_calls["encode_image"] == 1
    assert sum(len(i.token_ids) for i in image_items(backend)) == 8  # decoded once too


def test_placeholders_reach_no_sampler_draft_or_token_decode(make_fake: Make) -> None:
    ctx, _ = make_fake(image_tokens=8, speculative=llamax.PromptLookup(max_draft=4))
    seen: list[Any] = []
    params = llamax.SamplingParams(
        max_tokens=12,
        temperature=0.0,
        repeat_penalty=1.2,
        logits_processors=[lambda ids, lg: seen.append(list(ids)) or lg],
    )
    out = ctx.add_request(["abc ", image(1), " abc ", image(1), " abc"], params).result()
    assert out.choices[0].text
    assert seen and all(min(ids) >= 0 for ids in seen)  # the fake asserts the rest


def test_bad_image_input_never_reaches_the_engine(make_fake: Make) -> None:
    ctx, backend = make_fake(image_tokens=8, n_ctx=32)
    with pytest.raises(ImageError, match="not an image"):
        ctx.add_request(["x", llamax.Image(b"hello"), "y"])
    with pytest.raises(InvalidRequestError, match="end with text"):
        ctx.add_request(["x", image(1)])
    with pytest.raises(InvalidRequestError, match="parts must be"):
        ctx.add_request(["x", image(1), 3])
    with pytest.raises(ContextLengthError):
        ctx.add_request(["x" * 30, image(1), "y"])
    with pytest.raises(ImageError, match="uint8"):
        ctx.add_request(["x", llamax.Image(np.zeros((2, 2), np.uint8)), "y"])
    session = ctx.session()  # a session's request is checked the same way
    with pytest.raises(ImageError, match="not an image"):
        session.add_request(["x", llamax.Image(b"hello"), "y"])
    with pytest.raises(InvalidRequestError, match="end with text"):
        session.add_request(["x", image(1)])
    session.close()
    plain, _ = make_fake()
    with pytest.raises(ImageError, match="no projector"):
        plain.add_request(["x", image(1), "y"])
    assert not plain.sees_images and ctx.sees_images
    assert not backend.decode_log and not ctx.has_work()


def test_an_array_image_is_the_same_image_as_its_png(make_fake: Make) -> None:
    ctx, backend = make_fake(image_tokens=8)
    arr = pixels(3, 2, 2)
    a = ctx.add_request(["x", llamax.Image(arr), "y"], GREEDY).result()
    b = ctx.add_request(["x", llamax.Image(arr.copy()), "y"], GREEDY).result()
    assert b.usage.cached_tokens >= 9 and a.choices[0].token_ids == b.choices[0].token_ids
    assert backend.fault_calls["encode_image"] == 1


# ---------------------------------------------------------------------- failures
def test_cancel_mid_image_prefill_frees_everything(make_fake: Make) -> None:
    ctx, backend = make_fake(image_tokens=40, n_batch=8)
    handle = ctx.add_request(["see ", image(1), " now"], GREEDY)
    for _ in range(3):
        ctx.process()
    assert image_items(backend), "the image is being prefilled"
    handle.cancel()
    ctx.process()
    assert handle.result().choices[0].finish_reason == "cancelled"
    assert_idle(ctx)


@pytest.mark.parametrize("how", ["raise", "status"])
def test_a_failing_image_decode_fails_that_request_alone(make_fake: Make, how: str) -> None:
    ctx, backend = make_fake(image_tokens=8)

    def fault(where: str) -> object:
        if where == "decode_embeddings":
            backend.fault = None
            if how == "raise":
                raise RuntimeError("boom")
            return -3
        return None

    text = ctx.add_request("a text prompt", GREEDY)
    backend.fault = fault
    doomed = ctx.add_request(["see ", image(1), " now"], GREEDY)
    with pytest.raises(RequestFailedError, match="decoding the image failed"):
        doomed.result()
    assert text.result().choices[0].finish_reason in ("stop", "length")
    again = ctx.add_request(["see ", image(1), " now"], GREEDY).result()
    assert again.choices[0].text
    assert ctx.audit() == []


def test_a_failing_encode_fails_at_add_request(make_fake: Make) -> None:
    ctx, backend = make_fake(image_tokens=8)

    def fault(where: str) -> object:
        if where == "encode_image":
            raise RuntimeError("encoder down")
        return None

    backend.fault = fault
    with pytest.raises(RequestFailedError, match="encoding the image failed"):
        ctx.add_request(["see ", image(1), " now"], GREEDY)
    backend.fault = None
    assert ctx.add_request(["see ", image(1), " now"], GREEDY).result().choices[0].text


def test_the_fake_catches_another_images_rows(make_fake: Make) -> None:
    """The provenance check covers images: rows that encode another image's ids make cells
    the sequence's next read refuses."""
    ctx, backend = make_fake(image_tokens=8)
    real = backend.decode_embeddings

    def swapped(items: Any, *, non_causal: bool) -> int:
        items = [
            llamax.backend.base.BatchItem(
                i.seq_id, i.token_ids, i.start_pos, (), i.embeddings + 1, i.non_causal
            )
            for i in items
        ]
        return real(items, non_causal=non_causal)

    backend.decode_embeddings = swapped  # type: ignore[method-assign]
    handle = ctx.add_request(["see ", image(1), " now"], GREEDY)
    with pytest.raises(llamax.errors.EngineError):
        handle.result()
