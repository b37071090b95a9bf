"""The fake backend's projector: images read, tokenized and encoded in pure Python, and
embeddings whose rows *are* their placeholder ids, so the fake memory's provenance of an
image's cells derives from the embeddings it was given (a wrong image's rows store another
image's ids, and the next read of those cells fails the KV-integrity check).

An image file is any file :func:`~llamax.backend.vision.check_image` accepts; its "pixels"
are its bytes (so two files are two images). An image takes
``n_tokens`` positions; its embeddings are ``(n_tokens, FAKE_N_EMBD)`` float32, each row
its placeholder id's magnitude (the whole pixel hash and the position) in 16-bit pieces
(exact in float32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from ..backend.vision import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGE_SIDE,
    ImageChunk,
    MediaPrompt,
    RgbImage,
    TextChunk,
    check_image,
)
from ..backend.vision.chunks import pixel_id
from ..errors import ImageError, InvalidRequestError

__all__ = ["FAKE_N_EMBD", "FakeVision", "ids_of_rows"]

FAKE_N_EMBD = 18
"""The fake's embedding width: 16 bits a column hold a placeholder id (274 bits)."""
_SHIFTS = tuple(16 * i for i in reversed(range(FAKE_N_EMBD)))
MARKER = "<__image__>"


def rows_of_ids(ids: Sequence[int]) -> npt.NDArray[np.float32]:
    """Embedding rows that encode placeholder ids (negative)."""
    rows = [[(-i >> s) & 0xFFFF for s in _SHIFTS] for i in ids]
    return np.array(rows, dtype=np.float32).reshape(len(rows), FAKE_N_EMBD)


def ids_of_rows(rows: npt.NDArray[np.float32]) -> list[int]:
    """The placeholder ids that :func:`rows_of_ids` encoded."""
    parts = rows.astype(np.int64).tolist()
    return [-sum(int(p) << s for p, s in zip(row, _SHIFTS, strict=True)) for row in parts]


class FakeVision:
    """Reads, tokenizes and encodes images for :class:`~llamax.testing.FakeBackend`.

    Args:
        n_tokens: Positions (and embedding rows) of every image.
        non_causal: Whether images are decoded non-causally, whole (Gemma 3's way).
        tokenize: The text tokenizer.
    """

    def __init__(
        self, n_tokens: int, non_causal: bool, tokenize: Callable[[str], list[int]]
    ) -> None:
        self.n_tokens, self.non_causal, self._tokenize = n_tokens, non_causal, tokenize
        self.marker = MARKER

    def read(self, data: bytes) -> RgbImage:
        """An image file's bytes as one row of "pixels" (its header, declared size and
        pixel data checked, as the real projector checks them)."""
        check_image(data, max_side=MAX_IMAGE_SIDE, max_pixels=MAX_IMAGE_PIXELS)
        pixels = data + b"\0" * (-len(data) % 3)
        width = len(pixels) // 3
        return RgbImage(width, 1, pixels, pixel_id(width, 1, pixels))

    def tokenize(self, text: str, images: Sequence[RgbImage]) -> MediaPrompt:
        """Text chunks between image chunks, as ``mtmd_tokenize`` splits them."""
        pieces = text.split(self.marker)
        if len(pieces) != len(images) + 1:
            raise InvalidRequestError(
                f"the prompt has {len(pieces) - 1} image markers for {len(images)} images"
            )
        chunks: list[TextChunk | ImageChunk] = []
        for i, piece in enumerate(pieces):
            if piece:
                chunks.append(TextChunk(tuple(self._tokenize(piece))))
            if i < len(images):
                image_id = images[i].image_id
                chunks.append(ImageChunk(image_id, self.n_tokens, self.n_tokens, self.non_causal))
        return tuple(chunks)

    def encode(self, chunk: ImageChunk) -> npt.NDArray[np.float32]:
        """Rows that are the chunk's placeholder ids."""
        if not isinstance(chunk, ImageChunk):
            raise ImageError(f"not an image chunk: {chunk!r}")
        return rows_of_ids(chunk.placeholder_ids())
