"""The values a prompt with images becomes: decoded pixels, and the text and image chunks
``mtmd`` tokenizes them into. Pure Python (no ctypes), so a fake backend and the
scheduler can build and read them without a model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from ...errors import ImageError

__all__ = [
    "MAX_PLACEHOLDER_DIGITS",
    "ImageChunk",
    "MediaPrompt",
    "RgbImage",
    "TextChunk",
    "placeholder_offset",
    "placeholder_problem",
    "rgb_image",
]

# A placeholder id carries the image's whole pixel hash (all 256 bits of its SHA-256) above
# its position in the image. The prefix cache's radix matching, the RAM and disk tiers and
# session files all decide reuse by comparing ids, so the id *is* the image's identity
# there: a shorter one (44 bits before issue 54) let two images whose prefixes collide
# share cells. Python ints have no width; ids go to JSON headers, never to native code.
_HASH_BITS = 256  # the pixel hash, whole, in a placeholder id
_OFFSET_BITS = 18  # an image's position, in a placeholder id: 2**18 positions
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
_MAX_PLACEHOLDER = 1 << (_HASH_BITS + _OFFSET_BITS)  # -id - 1 stays below this
MAX_PLACEHOLDER_DIGITS = len(str(-_MAX_PLACEHOLDER))
"""The most characters a placeholder id takes as JSON (``-`` and its digits)."""


@dataclass(frozen=True, slots=True, eq=False)
class RgbImage:
    """Decoded pixels: ``height`` rows of ``width`` RGB triples, 8 bits each."""

    width: int
    height: int
    pixels: bytes = field(repr=False)
    image_id: str
    """SHA-256 (hex) of the size and the pixels: what the prefix cache keys an image by, so
    one picture sent as PNG and as JPEG-decoded-identically, or as an array, is one key."""


def pixel_id(width: int, height: int, pixels: bytes) -> str:
    """The :attr:`RgbImage.image_id` of these pixels."""
    return hashlib.sha256(b"%dx%d:" % (width, height) + pixels).hexdigest()


def rgb_image(array: npt.ArrayLike, *, max_side: int, max_pixels: int) -> RgbImage:
    """An :class:`RgbImage` from an ``(height, width, 3)`` array of ``uint8``.

    Raises:
        ImageError: another shape or type, an empty image, or one over the limits.
    """
    pixels = np.asarray(array)
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ImageError(
            f"an image array must be (height, width, 3) uint8 RGB; got shape "
            f"{pixels.shape} of {pixels.dtype}"
        )
    height, width = int(pixels.shape[0]), int(pixels.shape[1])
    if not width or not height:
        raise ImageError(f"the image array is empty ({width}x{height})")
    if max(width, height) > max_side or width * height > max_pixels:
        raise ImageError(
            f"the image is {width}x{height}; the limit is {max_side} pixels a side and "
            f"{max_pixels} pixels in all"
        )
    data = np.ascontiguousarray(pixels).tobytes()
    return RgbImage(width, height, data, pixel_id(width, height, data))


@dataclass(frozen=True, slots=True)
class TextChunk:
    """Text tokens between images (marker text such as Gemma 3's ``<start_of_image>``
    included, since ``mtmd`` adds it)."""

    token_ids: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        """Tokens, each one position."""
        return len(self.token_ids)

    @property
    def n_pos(self) -> int:
        """Positions it takes in the sequence."""
        return len(self.token_ids)


@dataclass(frozen=True, slots=True, eq=False)
class ImageChunk:
    """One image of a prompt, preprocessed and ready to encode.

    ``native`` owns the ``mtmd_input_chunk`` (None in a fake): it is freed by
    :meth:`release`, or when collected. It needs no projector to be freed, so a chunk may
    outlive the context that made it. One owner at a time: release it only when no
    thread is encoding it.
    """

    image_id: str
    """The image's :attr:`RgbImage.image_id`: equal ids, equal embeddings."""
    n_tokens: int
    """Embeddings the encoder writes (rows of the decode)."""
    n_pos: int
    """Positions it takes in the sequence (``n_tokens`` unless the model uses M-RoPE)."""
    is_non_causal: bool
    """Its embeddings must be decoded with non-causal attention, all in one micro-batch
    (``mtmd_decode_use_non_causal``: Gemma 3)."""
    native: Any = field(default=None, repr=False, compare=False)

    def release(self) -> None:
        """Free the native chunk (its preprocessed pixels) now; idempotent. Encoding it
        afterwards raises."""
        if self.native is not None:
            self.native.close()

    def placeholder_ids(self) -> tuple[int, ...]:
        """``n_pos`` negative ids holding all of :attr:`image_id` and the position, one per
        position: a stand-in for the image in a radix tree over token ids (never a real
        token). Two images share a run of them only if their pixel hashes are equal."""
        digest = int(self.image_id, 16)
        if not 0 <= digest < 1 << _HASH_BITS:
            raise ValueError(f"an image id is a {_HASH_BITS}-bit hex hash: {self.image_id!r}")
        base = digest << _OFFSET_BITS
        return tuple(-(1 + base + i) for i in range(self.n_pos))


def placeholder_offset(token_id: int) -> int | None:
    """Where a placeholder id (:meth:`ImageChunk.placeholder_ids`) sits in its image (0:
    the image's first position); None for a token id (not negative)."""
    return None if token_id >= 0 else (-token_id - 1) & _OFFSET_MASK


def placeholder_problem(token_ids: Sequence[int]) -> str | None:
    """Why ``token_ids`` (a sequence's history: token ids, and placeholder ids where
    images sit) cannot be one, or None: each image's placeholder ids must be in range, start
    at the image's first position and follow each other (an image may be cut short at the
    end, as a rewind leaves it, but never begin in its middle)."""
    previous = 0
    for pos, token in enumerate(token_ids):
        if token < 0:
            if -token - 1 >= _MAX_PLACEHOLDER:
                return f"position {pos} holds {token}, not a placeholder id"
            if placeholder_offset(token) != 0 and token != previous - 1:
                return f"position {pos} holds an image's position without the ones before it"
        previous = token
    return None


MediaPrompt: TypeAlias = tuple[TextChunk | ImageChunk, ...]
"""A tokenized prompt with images: its chunks in order."""
