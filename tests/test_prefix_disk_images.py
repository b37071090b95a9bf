"""Prefixes with images in the disk prefix tier, on the fake backend (issue 42): an evicted
prefix holding an image is written and restored (by the next context on the directory too),
only a context with the same projector ever reads it, and a file that claims image cells
in a folder of no projector lies."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vision_files import pixels, png

import llamax
from llamax.testing import FakeBackend, assert_idle

GREEDY = llamax.SamplingParams(max_tokens=6, temperature=0)
MB = 1 << 20
IMAGE_TOKENS = 20

Make = Callable[..., llamax.Context]


def image(seed: int) -> llamax.Image:
    return llamax.Image(png(pixels(seed, 4, 5)))


def system(i: int) -> str:
    """A ~60-token text (one fake token per byte) sharing not even its first token with
    another's."""
    return f"{'ABCDEFGHIJ'[i]}) You are assistant number {i}. " + "Describe it briefly. "


def prompt(i: int, seed: int, question: str) -> list[object]:
    return [system(i), image(seed), question]


@pytest.fixture(params=["unified", "streams"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """A Context on one sequence id with a disk tier in ``tmp_path`` and no RAM tier, whose
    fake projector writes ``IMAGE_TOKENS`` rows an image (``image_tokens=0``: no projector);
    each is leak-checked and closed after the test."""
    layout = str(request.param)
    made: list[llamax.Context] = []

    def build(*, image_tokens: int = IMAGE_TOKENS, **options: Any) -> llamax.Context:
        n_ctx = 512
        if image_tokens:
            options["image_tokens"] = image_tokens
        backend = FakeBackend(n_ctx=n_ctx, n_seq_max=1, kv_layout=layout, **options)
        ctx = llamax.Context(
            backend=backend,
            autostart=False,
            prefix_ram_bytes=0,
            prefix_disk_dir=str(tmp_path),
            prefix_disk_bytes=MB,
        )
        made.append(ctx)
        return ctx

    yield build
    for ctx in made:
        if not ctx.closed:
            assert_idle(ctx)
        ctx.close()


def complete(ctx: llamax.Context, parts: object) -> llamax.Completion:
    handle = ctx.add_request(parts, GREEDY)  # type: ignore[arg-type]
    while ctx.has_work():
        ctx.process()
    return handle.result(0)


def computed(ctx: llamax.Context, parts: object) -> tuple[llamax.Completion, int]:
    """Run ``parts``; return the completion and the prompt positions computed for it."""
    before = ctx.stats().num_prefill_tokens
    done = complete(ctx, parts)
    return done, ctx.stats().num_prefill_tokens - before


def cold(parts: object, **options: Any) -> llamax.Completion:
    backend = FakeBackend(n_ctx=2048, n_seq_max=1, image_tokens=IMAGE_TOKENS, **options)
    ctx = llamax.Context(backend=backend, autostart=False, prefix_ram_bytes=0)
    try:
        return complete(ctx, parts)
    finally:
        ctx.close()


def folders(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_dir())


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.kv"))


def evict_image_prefix(ctx: llamax.Context) -> None:
    """Run the image prompt, then another that takes the only sequence id: the image
    prefix goes to disk."""
    complete(ctx, prompt(0, 1, " A?"))
    complete(ctx, system(1) + "B2?")


def test_an_image_prefix_goes_to_disk_and_is_restored(make: Make, tmp_path: Path) -> None:
    ctx = make()
    evict_image_prefix(ctx)
    assert ctx.stats().num_prefix_disk_stores == 1
    done, num = computed(ctx, prompt(0, 1, " C?"))
    assert num == 2  # only "C?": the text, the image's rows and " " came from the file
    assert done.usage.cached_tokens == len(system(0)) + IMAGE_TOKENS + 1
    assert done.token_ids == cold(prompt(0, 1, " C?")).token_ids
    assert ctx.stats().num_prefix_disk_restores == 1
    assert ctx.audit() == []


def test_the_next_context_with_the_projector_restores_it(make: Make, tmp_path: Path) -> None:
    first = make()
    evict_image_prefix(first)
    first.close()
    (folder,) = folders(tmp_path)
    assert len(files(folder)) == 1
    second = make()
    assert second.stats().prefix_disk_entries == 1
    done, num = computed(second, prompt(0, 1, " C?"))
    assert num == 2
    assert done.token_ids == cold(prompt(0, 1, " C?")).token_ids


def test_another_image_reuses_only_the_text_before_it(make: Make) -> None:
    ctx = make()
    evict_image_prefix(ctx)
    done, num = computed(ctx, prompt(0, 2, " A?"))
    assert num >= IMAGE_TOKENS + 3  # the other image's rows are computed, never restored
    assert done.usage.cached_tokens <= len(system(0))
    assert done.token_ids == cold(prompt(0, 2, " A?")).token_ids
    assert ctx.audit() == []


def test_another_projector_never_reads_the_files(make: Make, tmp_path: Path) -> None:
    first = make()
    evict_image_prefix(first)
    first.close()
    # the same model and pixels through another projector: other cells, another folder
    other = make(image_tokens=IMAGE_TOKENS, non_causal_images=True)
    assert other.stats().prefix_disk_entries == 0
    done, num = computed(other, prompt(0, 1, " C?"))
    assert num == len(system(0)) + IMAGE_TOKENS + 3
    assert done.token_ids == cold(prompt(0, 1, " C?"), non_causal_images=True).token_ids
    assert len(folders(tmp_path)) == 2  # each projector's files stay for it


def test_image_cells_in_a_folder_of_no_projector_are_a_lie(make: Make, tmp_path: Path) -> None:
    first = make()
    evict_image_prefix(first)
    first.close()
    (projector_folder,) = folders(tmp_path)
    (entry,) = files(projector_folder)
    # a context of the same model without a projector: its folder is the plain model's
    plain = make(image_tokens=0)
    complete(plain, system(2) + "Q?")
    complete(plain, system(1) + "B2?")  # system(2) goes to disk: the plain folder exists
    plain.close()
    plain_folder = next(f for f in folders(tmp_path) if f != projector_folder)
    planted = plain_folder / entry.name
    shutil.copyfile(entry, planted)
    again = make(image_tokens=0)
    assert not planted.exists()  # deleted at the scan, never offered to the backend
    assert again.stats().prefix_disk_entries == 1  # system(2)'s
    assert again.audit() == []
