"""Image files and projectors for the vision tests: a PNG writer in pure Python (zlib), a
JPEG through Pillow (a test dependency: matplotlib's), and ``scripts/make_vision_model.py``
as a module."""

from __future__ import annotations

import importlib.util
import io
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt


def script() -> Any:
    """``scripts/make_vision_model.py`` as a module."""
    path = Path(__file__).parent.parent / "scripts" / "make_vision_model.py"
    spec = importlib.util.spec_from_file_location("make_vision_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def pixels(seed: int, height: int = 40, width: int = 50) -> npt.NDArray[np.uint8]:
    """Random RGB pixels."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))


def png(
    rgb: npt.NDArray[np.uint8], *, width: int | None = None, height: int | None = None
) -> bytes:
    """An RGB PNG of ``rgb``; ``width``/``height`` override what the header declares."""
    h, w = rgb.shape[:2]
    declared = (w if width is None else width, h if height is None else height)
    ihdr = struct.pack(">IIBBBBB", *declared, 8, 2, 0, 0, 0)
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(raw))
        + _chunk(b"IEND", b"")
    )


def jpeg(rgb: npt.NDArray[np.uint8]) -> bytes:
    """A JPEG of ``rgb`` (Pillow)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="JPEG", quality=90)
    return out.getvalue()


def pil_bytes(rgb: npt.NDArray[np.uint8], fmt: str) -> bytes:
    """``rgb`` saved by Pillow as ``fmt`` (``"GIF"``, ``"BMP"``, ``"WEBP"`` ...)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format=fmt)
    return out.getvalue()
