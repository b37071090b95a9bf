"""An image's identity where a cached prefix is reused is its whole pixel hash (issue 54,
finding 4): two images whose hashes agree in their first 44 bits (what a placeholder id
carried before) but differ after are two images in the KV cache's retained slots, the RAM
tier, the disk tier and a loaded session. On the fake backend, with the fake projector's
pixel hash patched so that every image's hash starts with the same 44 bits."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vision_files import pixels, png

import llamax
import llamax.testing.vision as fake_vision
from llamax.testing import FakeBackend, assert_idle

GREEDY = llamax.SamplingParams(max_tokens=4, temperature=0.0)
N_IMAGE = 12
TEXT = "Shared system text before the picture: "
MB = 1 << 20


def colliding_id(width: int, height: int, data: bytes) -> str:
    """A pixel hash whose first 44 bits (11 hex digits) are every image's."""
    return "0" * 11 + hashlib.sha256(b"%dx%d:" % (width, height) + data).hexdigest()[11:]


@pytest.fixture(autouse=True)
def short_ids_collide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake_vision, "pixel_id", colliding_id)


@pytest.fixture
def contexts() -> Iterator[list[llamax.Context]]:
    made: list[llamax.Context] = []
    yield made
    for ctx in made:
        if not ctx.closed:
            assert_idle(ctx)
        ctx.close()


def context(made: list[llamax.Context], **options: Any) -> llamax.Context:
    backend = FakeBackend(n_ctx=512, n_seq_max=1, image_tokens=N_IMAGE)
    ctx = llamax.Context(backend=backend, autostart=False, **options)
    made.append(ctx)
    return ctx


def picture(seed: int) -> llamax.Image:
    return llamax.Image(png(pixels(seed, 4, 5)))


def complete(ctx: llamax.Context, parts: object) -> llamax.Completion:
    handle = ctx.add_request(parts, GREEDY)  # type: ignore[arg-type]
    while ctx.has_work():
        ctx.process()
    return handle.result(0)


def assert_other_image_missed(ctx: llamax.Context, done: llamax.Completion, cold: Any) -> None:
    """Y's prompt reused at most the text before its image, and answers as a cold run."""
    assert done.usage.cached_tokens <= len(TEXT)
    assert done.token_ids == cold
    assert ctx.audit() == []


def cold_answer(made: list[llamax.Context], parts: object) -> Any:
    return complete(context(made, prefix_cache=False), parts).token_ids


def test_the_patch_makes_two_images_collide_in_44_bits() -> None:
    a, b = (colliding_id(1, 1, bytes([i])) for i in (1, 2))
    assert a[:11] == b[:11] and a != b


def test_kv_cache_reuse_compares_the_whole_hash(contexts: list[llamax.Context]) -> None:
    ctx = context(contexts)
    x, y = [TEXT, picture(1), " what?"], [TEXT, picture(2), " what?"]
    first = complete(ctx, x)
    assert complete(ctx, x).usage.cached_tokens > len(TEXT) + N_IMAGE  # a real hit
    assert first.usage.cached_tokens == 0
    assert_other_image_missed(ctx, complete(ctx, y), cold_answer(contexts, y))


def test_ram_tier_reuse_compares_the_whole_hash(contexts: list[llamax.Context]) -> None:
    ctx = context(contexts, prefix_ram_bytes=MB)
    x, y = [TEXT, picture(1), " what?"], [TEXT, picture(2), " what?"]
    complete(ctx, x)
    complete(ctx, "Something else entirely, to take the only sequence id.")
    assert ctx.stats().prefix_ram_entries >= 1
    assert_other_image_missed(ctx, complete(ctx, y), cold_answer(contexts, y))


def test_disk_tier_reuse_compares_the_whole_hash(
    contexts: list[llamax.Context], tmp_path: Path
) -> None:
    options = {"prefix_ram_bytes": 0, "prefix_disk_dir": str(tmp_path), "prefix_disk_bytes": MB}
    ctx = context(contexts, **options)
    x, y = [TEXT, picture(1), " what?"], [TEXT, picture(2), " what?"]
    complete(ctx, x)
    complete(ctx, "Something else entirely, to take the only sequence id.")
    ctx.close()
    again = context(contexts, **options)  # the next context on the folder, too
    assert again.stats().prefix_disk_entries >= 1
    assert_other_image_missed(again, complete(again, y), cold_answer(contexts, y))


def test_a_loaded_session_compares_the_whole_hash(
    contexts: list[llamax.Context], tmp_path: Path
) -> None:
    ctx = context(contexts)
    text, question = ctx.tokenize(TEXT), ctx.tokenize(" what?")
    path = tmp_path / "x.llamax"
    with ctx.session() as session:
        session.add_request([*text, picture(1), *question], GREEDY).result()
        session.save(path)
    fresh = context(contexts)
    y = [*text, picture(2), *question]
    with fresh.load_session(path) as loaded:
        done = loaded.add_request(y, GREEDY).result()
    assert done.usage.cached_tokens <= len(text)
    assert done.token_ids == cold_answer(contexts, y)
    assert fresh.audit() == []
