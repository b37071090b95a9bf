"""The pixel-data checks and the decode budget (issue 54, finding 7): a PNG's data must
inflate to exactly what its IHDR implies (interlaced too), a BMP must hold every row it
declares, and native decodes in flight share one byte budget."""

from __future__ import annotations

import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
from test_image_bounds import NoNative, bmp_header_only, png_of
from vision_files import pixels, png

from llamax.backend.vision import (
    DECODE_BUDGET,
    DecodeBudget,
    ImageHeader,
    Projector,
    check_image,
)
from llamax.backend.vision.image_file import png_inflated_size
from llamax.errors import ImageError

LIMITS = {"max_side": 8192, "max_pixels": 4096 * 4096}


def test_png_data_must_inflate_to_what_ihdr_implies() -> None:
    rows = b"".join(b"\0" + bytes(3 * 5) for _ in range(4))  # 5x4 RGB: a filter byte a row
    assert check_image(png_of(5, 4, zlib.compress(rows)), **LIMITS).width == 5
    with pytest.raises(ImageError, match=r"inflates to 48 bytes.*implies 64"):
        check_image(png_of(5, 4, zlib.compress(rows[:-16])), **LIMITS)
    with pytest.raises(ImageError, match="inflates to more"):
        check_image(png_of(5, 4, zlib.compress(rows + b"\0")), **LIMITS)
    with pytest.raises(ImageError, match="does not inflate"):
        check_image(png_of(5, 4, b"not zlib at all"), **LIMITS)
    with pytest.raises(ImageError, match="bit depth"):
        check_image(png_of(5, 4, zlib.compress(rows), colour=5), **LIMITS)


def test_interlaced_and_real_pngs_pass() -> None:
    header = ImageHeader("png", 5, 4)
    # Adam7 passes of 5x4 at 24 bits: 1x1, 1x1, 0, 1x1, 3x1, 2x2, 5x2
    expected = sum(h * (1 + 3 * w) for w, h in ((1, 1), (1, 1), (1, 1), (3, 1), (2, 2), (5, 2)))
    assert png_inflated_size(header, 8, 2, True) == expected
    rows = bytes(expected)
    assert check_image(png_of(5, 4, zlib.compress(rows), interlace=1), **LIMITS).height == 4
    data = png(pixels(3, 17, 9))  # the test images' writer
    assert check_image(data, **LIMITS).width == 9


def test_a_bmp_must_hold_every_row_it_declares() -> None:
    whole = bmp_header_only(4, 2) + bytes(12 * 2)  # 4 pixels of 24 bits: 12 bytes a row
    assert check_image(whole, **LIMITS).height == 2
    with pytest.raises(ImageError, match="need 78 bytes, the file has 77"):
        check_image(whole[:-1], **LIMITS)
    rle = bytearray(whole)
    rle[30] = 1  # BI_RLE8: stb_image reads none
    with pytest.raises(ImageError, match="compression 1"):
        check_image(bytes(rle), **LIMITS)


def test_decodes_in_flight_share_a_byte_budget() -> None:
    budget = DecodeBudget(100)
    first_in, second_in, release = threading.Event(), threading.Event(), threading.Event()

    def decode(num: int, entered: threading.Event) -> None:
        with budget.held(num):
            entered.set()
            release.wait(30)

    first = threading.Thread(target=decode, args=(80, first_in))
    second = threading.Thread(target=decode, args=(80, second_in))
    first.start()
    assert first_in.wait(30)
    second.start()
    for _ in range(10_000):  # until it waits (counted, not timed)
        if budget.num_waiting == 1:
            break
        threading.Event().wait(0.001)
    assert budget.num_waiting == 1 and not second_in.is_set() and budget.num_bytes == 80
    release.set()
    first.join(30)
    second.join(30)
    assert second_in.is_set() and budget.num_bytes == 0
    with budget.held(10**12):  # larger than the budget: runs alone, takes it all
        assert budget.num_bytes == 100


def test_a_native_decode_holds_its_bytes_of_the_budget() -> None:
    held: list[int] = []
    projector = Projector(NoNative(), object(), Path("stub-mmproj.gguf"), 4)

    class Refuses:
        def mtmd_helper_init_opt_default(self) -> Any:
            held.append(DECODE_BUDGET.num_bytes)
            raise ImageError("stub: decoded nothing")

    projector.M = Refuses()
    with pytest.raises(ImageError, match="stub"):
        projector.decode_image(png(pixels(3, 4, 5)))
    projector.ptr = None
    assert held and held[0] >= 16 * 4 * 5 and DECODE_BUDGET.num_bytes == 0
