"""Image files and projectors for the vision tests: ``scripts/make_vision_model.py`` as a
module, its test images (random pixels, a PNG writer in pure Python), and JPEG, GIF, BMP...
files through Pillow (a test dependency: matplotlib's)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import numpy.typing as npt
from script_modules import load_script


def script() -> Any:
    """``scripts/make_vision_model.py`` as a module."""
    return load_script("make_vision_model")


pixels = load_script("make_vision_model").pixels
png = load_script("make_vision_model").png


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
