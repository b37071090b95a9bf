"""Image files read before any decoder runs (llamax.backend.vision.image_file) and the pure
values of a prompt with images (chunks.py): no model, no native code."""

from __future__ import annotations

import numpy as np
import pytest
from vision_files import jpeg, pil_bytes, pixels, png

from llamax.backend.vision import (
    ImageChunk,
    check_image_size,
    read_image_header,
    rgb_image,
)
from llamax.errors import ImageError, InvalidRequestError

LIMITS = {"max_side": 4096, "max_pixels": 1 << 22}


@pytest.mark.parametrize(
    ("fmt", "make"),
    [
        ("png", png),
        ("jpeg", jpeg),
        ("gif", lambda rgb: pil_bytes(rgb, "GIF")),
        ("bmp", lambda rgb: pil_bytes(rgb, "BMP")),
    ],
)
def test_a_whole_file_gives_its_format_and_size(fmt: str, make: object) -> None:
    header = read_image_header(make(pixels(0)))  # type: ignore[operator]
    assert (header.format, header.width, header.height) == (fmt, 50, 40)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "not an image"),
        (b"hello, world", "not an image"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt ", "not an image"),  # audio is refused too
        (b"\x89PNG\r\n\x1a\n", "damaged PNG"),
    ],
)
def test_bytes_that_are_no_image_are_refused(data: bytes, says: str) -> None:
    with pytest.raises(ImageError, match=says):
        read_image_header(data)
    assert issubclass(ImageError, InvalidRequestError)  # a 400 in every API


def test_webp_is_refused_by_name() -> None:
    with pytest.raises(ImageError, match="WebP"):
        read_image_header(pil_bytes(pixels(0), "WEBP"))


@pytest.mark.parametrize("make", [png, jpeg, lambda rgb: pil_bytes(rgb, "GIF")])
@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_a_file_cut_short_is_refused(make: object, keep: float) -> None:
    data = make(pixels(1))  # type: ignore[operator]
    with pytest.raises(ImageError, match=r"truncated|damaged"):
        read_image_header(data[: int(len(data) * keep)])


def test_a_bmp_shorter_than_it_declares_is_refused() -> None:
    data = pil_bytes(pixels(1), "BMP")
    with pytest.raises(ImageError, match="truncated BMP"):
        read_image_header(data[:-10])


def test_huge_dimensions_are_refused_from_the_header_alone() -> None:
    # 100000 x 100000 declared, a few bytes of pixels: nothing may allocate 30 GB
    header = read_image_header(png(pixels(2, 2, 2), width=100_000, height=100_000))
    assert (header.width, header.height) == (100_000, 100_000)
    with pytest.raises(ImageError, match="100000x100000"):
        check_image_size(header, **LIMITS)
    wide = read_image_header(png(pixels(2, 2, 2), width=5000, height=1))
    with pytest.raises(ImageError, match="4096 pixels a side"):
        check_image_size(wide, **LIMITS)


def test_zero_dimensions_are_refused() -> None:
    with pytest.raises(ImageError, match="0x40"):
        read_image_header(png(pixels(3), width=0))


def test_an_array_becomes_pixels_keyed_by_their_hash() -> None:
    a, b = rgb_image(pixels(4), **LIMITS), rgb_image(pixels(4).copy(), **LIMITS)
    assert (a.width, a.height, len(a.pixels)) == (50, 40, 50 * 40 * 3)
    assert a.image_id == b.image_id
    assert rgb_image(pixels(5), **LIMITS).image_id != a.image_id
    # same bytes, another shape: another image
    assert rgb_image(pixels(4).reshape(50, 40, 3), **LIMITS).image_id != a.image_id
    strided = rgb_image(pixels(4)[:, ::2], **LIMITS)  # a non-contiguous view is copied
    assert (strided.width, len(strided.pixels)) == (25, 25 * 40 * 3)


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((4, 4), np.uint8),
        np.zeros((4, 4, 4), np.uint8),
        np.zeros((4, 4, 3), np.float32),
        np.zeros((0, 4, 3), np.uint8),
    ],
)
def test_arrays_of_other_shapes_or_types_are_refused(array: np.ndarray) -> None:
    with pytest.raises(ImageError):
        rgb_image(array, **LIMITS)


def test_a_large_array_is_refused() -> None:
    with pytest.raises(ImageError, match="5000x1"):
        rgb_image(np.zeros((1, 5000, 3), np.uint8), **LIMITS)


def test_placeholder_ids_are_negative_and_differ_between_images() -> None:
    one = ImageChunk("ab" * 32, n_tokens=16, n_pos=16, is_non_causal=False)
    two = ImageChunk("cd" * 32, n_tokens=16, n_pos=16, is_non_causal=False)
    ids = one.placeholder_ids()
    assert len(ids) == 16 and len(set(ids)) == 16 and max(ids) < 0
    assert not set(ids) & set(two.placeholder_ids())
    assert ids == ImageChunk("ab" * 32, 16, 16, False).placeholder_ids()
    one.release()  # a fake's chunk has nothing to free
