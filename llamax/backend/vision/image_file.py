"""What an image file says about itself, read from its bytes before any decoder runs.

``mtmd``'s decoder (stb_image, through ``mtmd_helper_bitmap_init_from_buf``) allocates
whatever a header asks for, decodes a truncated JPEG into half an image without a word,
and, when it cannot read the bytes at all, hands them to ``ffprobe``/``ffmpeg`` as a
video. So llamax reads the header first, in pure Python: the format must be one stb_image
decodes (PNG, JPEG, GIF, BMP), the file must be whole (PNG's ``IEND`` and chunk CRCs,
JPEG's end-of-image marker after its scan, GIF's trailer, BMP's declared size), and its
dimensions must be within the caller's limits. Only then do the bytes reach native code.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from ...errors import ImageError

__all__ = ["ImageHeader", "check_image_size", "read_image_header"]

_PNG = b"\x89PNG\r\n\x1a\n"
_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"
# JPEG start-of-frame markers: C0-CF except DHT (C4), JPG (C8) and DAC (CC)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_NO_LENGTH = frozenset([0x01, *range(0xD0, 0xD9)])  # TEM, RST0-7, SOI


@dataclass(frozen=True, slots=True)
class ImageHeader:
    """An image file's format and size, as its header declares them."""

    format: str
    """``"png"``, ``"jpeg"``, ``"gif"`` or ``"bmp"``."""
    width: int
    height: int


def read_image_header(data: bytes) -> ImageHeader:
    """The format and size ``data`` declares, once it is known to be a whole image file.

    Raises:
        ImageError: not an image in a format llamax reads (WebP, audio, text ...), a
            damaged header, or a file cut short.
    """
    if data.startswith(_PNG):
        header = _png(data)
    elif data.startswith(b"\xff\xd8\xff"):
        header = _jpeg(data)
    elif data[:6] in (b"GIF87a", b"GIF89a"):
        header = _gif(data)
    elif data.startswith(b"BM") and len(data) >= 26:
        header = _bmp(data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        raise ImageError("WebP images are not supported: send PNG, JPEG, GIF or BMP")
    else:
        raise ImageError(
            f"not an image llamax can read ({len(data)} bytes starting {data[:8]!r}): "
            "send PNG, JPEG, GIF or BMP"
        )
    if header.width <= 0 or header.height <= 0:
        raise ImageError(f"the {header.format} header declares {header.width}x{header.height}")
    return header


def check_image_size(header: ImageHeader, *, max_side: int, max_pixels: int) -> None:
    """Refuse an image larger than the limits before anything allocates its pixels.

    Raises:
        ImageError: a side over ``max_side`` or an area over ``max_pixels``.
    """
    w, h = header.width, header.height
    if max(w, h) > max_side or w * h > max_pixels:
        raise ImageError(
            f"the image is {w}x{h}; the limit is {max_side} pixels a side and "
            f"{max_pixels} pixels in all"
        )


def _png(data: bytes) -> ImageHeader:
    if len(data) < 33 or data[12:16] != b"IHDR":
        raise ImageError("damaged PNG: no IHDR chunk after the signature")
    width, height = struct.unpack(">II", data[16:24])
    if not data.endswith(_PNG_END):
        raise ImageError("truncated PNG: the file does not end with an IEND chunk")
    i = len(_PNG)
    while i < len(data):  # every chunk whole and its CRC right: stb_image checks neither
        (length,) = struct.unpack(">I", data[i : i + 4])
        end = i + 8 + length
        if end + 4 > len(data):
            raise ImageError(f"damaged PNG: the chunk at byte {i} runs past the end")
        if zlib.crc32(data[i + 4 : end]) != struct.unpack(">I", data[end : end + 4])[0]:
            raise ImageError(f"damaged PNG: the CRC of the {data[i + 4 : i + 8]!r} chunk is wrong")
        i = end + 4
    return ImageHeader("png", width, height)


def _jpeg(data: bytes) -> ImageHeader:
    size: tuple[int, int] | None = None
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            raise ImageError(f"damaged JPEG: no marker at byte {i}")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _NO_LENGTH:
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker in _SOF and i + 9 <= len(data):
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            size = (width, height)
        if marker == 0xDA:  # start of scan: the entropy-coded data follows
            if size is None:
                raise ImageError("damaged JPEG: a scan before any frame header")
            if data.rfind(b"\xff\xd9") < i + 2 + length:
                raise ImageError("truncated JPEG: no end-of-image marker after the scan")
            return ImageHeader("jpeg", *size)
        i += 2 + length
    raise ImageError("truncated JPEG: the file ends before its first scan")


def _gif(data: bytes) -> ImageHeader:
    if len(data) < 14:
        raise ImageError("truncated GIF: shorter than its header")
    width, height = struct.unpack("<HH", data[6:10])
    if not data.rstrip(b"\x00").endswith(b";"):
        raise ImageError("truncated GIF: the file does not end with the trailer byte")
    return ImageHeader("gif", width, height)


def _bmp(data: bytes) -> ImageHeader:
    (declared,) = struct.unpack("<I", data[2:6])
    width, height = struct.unpack("<ii", data[18:26])
    if declared > len(data):
        raise ImageError(f"truncated BMP: {len(data)} of the {declared} bytes it declares")
    return ImageHeader("bmp", width, abs(height))  # negative: rows stored top-down
