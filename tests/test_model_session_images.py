"""Sessions and Chat with images through the public API on SmolLM2 and the random
projectors of scripts/make_vision_model.py (Gemma 3's non-causal one, Janus-Pro's causal
one), issue 42: a 3-turn Chat whose first turn holds an image reuses it and agrees with a
cold run of the whole conversation (tests/near_tie.py: a turn computes only its new part,
a cold run the whole prompt, so their logits may differ in the last bits); a session saved
with an image and loaded again answers exactly as the session it was saved from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vision_files
from near_tie import assert_greedy_agrees
from vision_files import pixels, png

import llamax
from llamax.testing import assert_idle

pytestmark = pytest.mark.model
GREEDY = llamax.SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
LOGPROB_NATS = 0.05  # a chunked prefill against a whole one (llama.cpp is not batch-invariant)


@pytest.fixture(scope="module", params=["gemma3", "janus_pro"])
def projector(request: Any) -> Path:
    path: Path = vision_files.script().cached_vision_model(projector=request.param)
    return path


@pytest.fixture(scope="module")
def vision_ctx(projector: Path, model_path: Path) -> Iterator[llamax.Context]:
    ctx = llamax.Context(
        model_path, mmproj=str(projector), n_ctx=2048, n_seq_max=4, n_batch=256, n_threads=2
    )
    yield ctx
    ctx.close()


@pytest.fixture
def ctx(vision_ctx: llamax.Context) -> Iterator[llamax.Context]:
    vision_ctx.clear_cache()
    yield vision_ctx
    assert_idle(vision_ctx, timeout=60)
    assert vision_ctx.audit() == []


@pytest.fixture(scope="module")
def probe(projector: Path, model_path: Path) -> Iterator[llamax.Context]:
    """A context with nothing cached, ever (near_tie's probe, and the cold runs)."""
    ctx = llamax.Context(
        model_path,
        mmproj=str(projector),
        n_ctx=2048,
        n_seq_max=1,
        n_batch=256,
        n_threads=2,
        prefix_cache=False,
    )
    yield ctx
    ctx.close()


def image(seed: int) -> llamax.Image:
    return llamax.Image(png(pixels(seed, 48, 64)))


def first_logprobs(out: llamax.Completion) -> dict[int, float]:
    lp = out.choices[0].logprobs
    assert lp
    return {t.token_id: t.logprob for t in lp[0].top_logprobs}


@pytest.mark.integration
def test_a_three_turn_chat_with_an_image_agrees_with_a_cold_run(
    ctx: llamax.Context, probe: llamax.Context
) -> None:
    """A user's path end to end, with a cold probe context: integration. The default run
    keeps an image's reuse (test_model_images.py's prefix hit equal to the cold run) and a
    session holding one (the saved session below)."""
    positions = ctx.prompt_positions([image(1)])
    with ctx.chat(params=GREEDY) as chat:
        chat.send([{"type": "text", "text": "What is in this picture?"}, image(1)])
        first = chat.session.token_ids
        chat.send("Describe its colours.")
        assert chat.last_turn is not None
        assert chat.last_turn.reused_tokens == len(first) > positions  # the image kept
        held = chat.session.token_ids
        third = chat.send("Thanks. In one word?")
        assert chat.last_turn.reused_tokens == third.usage.cached_tokens == len(held)
        assert third.usage.prompt_tokens - third.usage.cached_tokens < len(held) - positions
        conversation = chat.messages[:-1]
    parts = probe.chat_prompt_parts(conversation)
    assert probe.prompt_positions(parts) == third.usage.prompt_tokens
    cold = probe.add_request(parts, GREEDY).result(timeout=120)
    assert cold.usage.cached_tokens == 0
    assert_greedy_agrees(probe, parts, cold.choices[0].token_ids, third.choices[0].token_ids)
    warm, fresh = first_logprobs(third), first_logprobs(cold)
    for token in warm.keys() & fresh.keys():
        assert abs(warm[token] - fresh[token]) < LOGPROB_NATS, (warm, fresh)


def test_a_saved_session_with_an_image_loads_and_answers_the_same(
    ctx: llamax.Context, tmp_path: Path
) -> None:
    path = tmp_path / "vision.llamax"
    head = ["<|im_start|>user\n", image(2), " What is in the picture?<|im_end|>\n"]
    first = [*head, "<|im_start|>assistant\n"]
    with ctx.session() as session:
        out1 = session.add_request(first, GREEDY).result(timeout=120)
        session.save(path)
        held = session.token_ids
        follow = [
            *head,
            "<|im_start|>assistant\n" + out1.text + "<|im_end|>\n<|im_start|>user\nMore?"
            "<|im_end|>\n<|im_start|>assistant\n",
        ]
        original = session.add_request(follow, GREEDY).result(timeout=120)
    with ctx.load_session(path) as loaded:
        assert loaded.token_ids == held
        again = loaded.add_request(follow, GREEDY).result(timeout=120)
    assert original.usage.cached_tokens == again.usage.cached_tokens > len(held) // 2
    assert again.choices[0].token_ids == original.choices[0].token_ids
    assert again.choices[0].logprobs == original.choices[0].logprobs
