"""What reading an image may cost (issue 54, findings 7 and 8): a PNG whose data inflates
past what its IHDR implies and a BMP without its pixels are refused before native code
runs (the native decoder is a stub that fails the test if it is reached); counting an
image's positions keeps no decoded pixels. The checks themselves and the decode budget:
test_image_decode_budget.py."""

from __future__ import annotations

import gc
import struct
import weakref
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vision_files import pixels, png

import llamax
from llamax.backend.vision import Projector, RgbImage
from llamax.backend.vision.image_file import read_image_header
from llamax.errors import ImageError
from llamax.testing import FakeBackend

Make = Callable[..., tuple[llamax.Context, FakeBackend]]
BOMB_BYTES = 512 << 20


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_of(width: int, height: int, idat: bytes, *, colour: int = 2, interlace: int = 0) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, interlace)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def png_bomb() -> bytes:
    """A whole, valid-looking 1x1 PNG whose IDAT is 512 MiB of zeros deflated (~0.5 MB)."""
    deflater = zlib.compressobj(9)
    zeros = bytes(1 << 20)
    idat = b"".join(deflater.compress(zeros) for _ in range(BOMB_BYTES >> 20)) + deflater.flush()
    return png_of(1, 1, idat)


def bmp_header_only(width: int = 4096, height: int = 4096) -> bytes:
    """A 54-byte BMP whose headers declare ``width`` x ``height`` 24-bit pixels it lacks."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 54, 0, 0, 54) + info


class NoNative:
    """An ``mtmd`` binding whose every call fails the test: nothing may reach it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"native code reached: {name}")


@pytest.fixture
def projector() -> Projector:
    made = Projector(NoNative(), object(), Path("stub-mmproj.gguf"), 4)
    yield made
    made.ptr = None


# ---------------------------------------------------------------------- finding 7
def test_a_png_bomb_is_refused_before_native_decode(projector: Projector) -> None:
    bomb = png_bomb()
    assert len(bomb) < 1 << 20 and read_image_header(bomb).width == 1  # the header is fine
    with pytest.raises(ImageError, match="inflates to more than the 4 bytes"):
        projector.decode_image(bomb)


def test_a_header_only_bmp_is_refused_before_native_decode(projector: Projector) -> None:
    with pytest.raises(ImageError, match="truncated BMP: its 4096x4096 pixels need"):
        projector.decode_image(bmp_header_only())
    whole = bmp_header_only(4, 2) + bytes(12 * 2)  # 4 pixels of 24 bits: 12 bytes a row
    assert read_image_header(whole).height == 2


# ---------------------------------------------------------------------- finding 8
def test_counting_an_images_positions_keeps_no_decoded_pixels(make_fake: Make) -> None:
    ctx, backend = make_fake(image_tokens=8)
    live: list[weakref.ref[RgbImage]] = []
    read = backend.read_image

    class Tracked(RgbImage):  # a subclass, so a weak reference can watch it
        pass

    def tracked(data: bytes) -> RgbImage:
        rgb = read(data)
        out = Tracked(rgb.width, rgb.height, rgb.pixels, rgb.image_id)
        live.append(weakref.ref(out))
        return out

    backend.read_image = tracked  # type: ignore[method-assign]
    picture = llamax.Image(png(pixels(4, 4, 5)))
    parts = [*ctx.tokenize("look: "), picture, *ctx.tokenize(" what?")]
    num = ctx.prompt_positions(parts)
    assert num == len(ctx.prompt_token_ids(parts)) == 6 + 8 + 6
    gc.collect()
    assert live and all(ref() is None for ref in live)  # nothing holds the pixels
    reads = len(live)
    assert ctx.prompt_positions(parts) == num and len(live) == reads  # not read again
    copy = [*parts[:6], llamax.Image(bytes(picture.source)), *parts[7:]]  # type: ignore[arg-type]
    assert ctx.prompt_positions(copy) == num and len(live) == reads  # nor another request's
    out = ctx.add_request(parts, llamax.SamplingParams(max_tokens=2, temperature=0)).result()
    assert out.usage.prompt_tokens == num
    gc.collect()
    assert all(ref() is None for ref in live)
