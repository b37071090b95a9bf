"""What an image file says about itself, read from its bytes before any decoder runs.

``mtmd``'s decoder (stb_image, through ``mtmd_helper_bitmap_init_from_buf``) allocates
whatever a header asks for, decodes a truncated JPEG into half an image without a word,
and, when it cannot read the bytes at all, hands them to ``ffprobe``/``ffmpeg`` as a
video. So llamax reads the header first, in pure Python: the format must be one stb_image
decodes (PNG, JPEG, GIF, BMP), the file must be whole (PNG's ``IEND`` and chunk CRCs,
JPEG's end-of-image marker after its scan, GIF's trailer, BMP's declared size), and its
dimensions must be within the caller's limits. Only then do the bytes reach native code.

The size a header declares is not all a decoder allocates: stb_image inflates a PNG's
``IDAT`` whole (a 0.5 MB file of zeros inflates to 512 MiB whatever its IHDR says) and
allocates a BMP's declared pixels whether the file holds them or not. So
:func:`check_image` also inflates a PNG's data here, incrementally and never past what the
IHDR implies (each row's filter byte and its packed samples, per Adam7 pass when
interlaced), and refuses a BMP whose pixel rows are not all in the file.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from ...errors import ImageError

__all__ = [
    "ImageHeader",
    "check_image",
    "check_image_data",
    "check_image_size",
    "png_inflated_size",
    "read_image_header",
]

_PNG = b"\x89PNG\r\n\x1a\n"
_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"
# JPEG start-of-frame markers: C0-CF except DHT (C4), JPG (C8) and DAC (CC)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_NO_LENGTH = frozenset([0x01, *range(0xD0, 0xD9)])  # TEM, RST0-7, SOI
# PNG colour type: (samples a pixel, the bit depths allowed)
_PNG_COLOURS = {
    0: (1, (1, 2, 4, 8, 16)),
    2: (3, (8, 16)),
    3: (1, (1, 2, 4, 8)),
    4: (2, (8, 16)),
    6: (4, (8, 16)),
}
# Adam7's passes: (first column, first row, column step, row step)
_ADAM7 = (
    (0, 0, 8, 8),
    (4, 0, 8, 8),
    (0, 4, 4, 8),
    (2, 0, 4, 4),
    (0, 2, 2, 4),
    (1, 0, 2, 2),
    (0, 1, 1, 2),
)
_INFLATE_STEP = 1 << 20  # bytes inflated at a time, and dropped: only their count is kept
_BMP_COMPRESSIONS = (0, 3)  # BI_RGB and BI_BITFIELDS: what stb_image reads


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


def check_image(data: bytes, *, max_side: int, max_pixels: int) -> ImageHeader:
    """:func:`read_image_header`, :func:`check_image_size` and :func:`check_image_data`:
    everything llamax checks before an image's bytes reach a decoder.

    Raises:
        ImageError: as those three.
    """
    header = read_image_header(data)
    check_image_size(header, max_side=max_side, max_pixels=max_pixels)
    check_image_data(data, header)
    return header


def check_image_data(data: bytes, header: ImageHeader) -> None:
    """Refuse a file whose pixel data is not what its header implies, where a decoder
    would otherwise allocate for it anyway: a PNG whose ``IDAT`` inflates to more (a
    decompression bomb) or less than its IHDR implies, or a BMP without all its rows.
    Call it after :func:`check_image_size` (a PNG's data is inflated here, bounded by the
    size its header declares).

    Raises:
        ImageError: naming what the header implies and what the file holds.
    """
    if header.format == "png":
        _check_png_data(data, header)
    elif header.format == "bmp":
        _check_bmp_data(data, header)


def png_inflated_size(header: ImageHeader, bit_depth: int, colour: int, interlaced: bool) -> int:
    """The bytes a PNG's ``IDAT`` inflate to: each row's filter byte and packed samples.

    Raises:
        ImageError: a colour type or bit depth PNG does not define.
    """
    samples, depths = _PNG_COLOURS.get(colour, (0, ()))
    if bit_depth not in depths:
        raise ImageError(f"damaged PNG: colour type {colour} with bit depth {bit_depth}")
    bits = samples * bit_depth

    def rows(width: int, height: int) -> int:
        return height * (1 + (width * bits + 7) // 8) if width and height else 0

    w, h = header.width, header.height
    if not interlaced:
        return rows(w, h)
    return sum(rows((w - x + dx - 1) // dx, (h - y + dy - 1) // dy) for x, y, dx, dy in _ADAM7)


def _check_png_data(data: bytes, header: ImageHeader) -> None:
    bit_depth, colour, _, _, interlace = data[24:29]
    if interlace not in (0, 1):
        raise ImageError(f"damaged PNG: interlace method {interlace}")
    expected = png_inflated_size(header, bit_depth, colour, interlace == 1)
    inflater = zlib.decompressobj()
    total = 0
    try:
        for chunk in _png_chunks(data, b"IDAT"):
            pending = chunk
            while pending:  # at most _INFLATE_STEP bytes out at a time, never all at once
                step = min(_INFLATE_STEP, expected + 1 - total)  # one byte past: refused
                total += len(inflater.decompress(pending, step))
                _refuse_png_bomb(total, expected, header)
                pending = inflater.unconsumed_tail
        while not inflater.eof:  # what the last step left buffered
            out = inflater.decompress(b"", min(_INFLATE_STEP, expected + 1 - total))
            if not out:
                break
            total += len(out)
            _refuse_png_bomb(total, expected, header)
    except zlib.error as exc:
        raise ImageError(f"damaged PNG: its pixel data does not inflate ({exc})") from None
    if total != expected:
        raise ImageError(
            f"damaged PNG: its pixel data inflates to {total} bytes; its "
            f"{header.width}x{header.height} header implies {expected}"
        )


def _refuse_png_bomb(total: int, expected: int, header: ImageHeader) -> None:
    if total > expected:
        raise ImageError(
            f"PNG data inflates to more than the {expected} bytes its "
            f"{header.width}x{header.height} header implies (a decompression bomb?)"
        )


def _png_chunks(data: bytes, kind: bytes) -> list[bytes]:
    """The bodies of the chunks of ``kind``, in order (the file's layout already checked)."""
    found, i = [], len(_PNG)
    while i + 8 <= len(data):
        (length,) = struct.unpack(">I", data[i : i + 4])
        if data[i + 4 : i + 8] == kind:
            found.append(data[i + 8 : i + 8 + length])
        i += 12 + length
    return found


def _check_bmp_data(data: bytes, header: ImageHeader) -> None:
    (offset,) = struct.unpack("<I", data[10:14])
    (info_size,) = struct.unpack("<I", data[14:18])
    if info_size == 12:  # BITMAPCOREHEADER: 16-bit sides, no compression field
        (bits,), compression = struct.unpack("<H", data[24:26]), 0
    elif len(data) >= 34:
        (bits,) = struct.unpack("<H", data[28:30])
        (compression,) = struct.unpack("<I", data[30:34])
    else:
        raise ImageError("truncated BMP: shorter than its info header")
    if compression not in _BMP_COMPRESSIONS:
        raise ImageError(f"compressed BMPs (compression {compression}) are not supported")
    if bits not in (1, 4, 8, 16, 24, 32):
        raise ImageError(f"damaged BMP: {bits} bits a pixel")
    row = (header.width * bits + 31) // 32 * 4
    needed = offset + row * header.height
    if needed > len(data):
        raise ImageError(
            f"truncated BMP: its {header.width}x{header.height} pixels need {needed} bytes, "
            f"the file has {len(data)}"
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
    if data[14:18] == b"\x0c\x00\x00\x00":  # BITMAPCOREHEADER: 16-bit sides
        width, height = struct.unpack("<HH", data[18:22])
    else:
        width, height = struct.unpack("<ii", data[18:26])
    if declared > len(data):
        raise ImageError(f"truncated BMP: {len(data)} of the {declared} bytes it declares")
    return ImageHeader("bmp", width, abs(height))  # negative: rows stored top-down
