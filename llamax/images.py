"""Images in prompts, at the facade: :class:`Image` and what ``add_request`` does with it.

A prompt may be a sequence of parts, ``str`` and :class:`Image`. On the caller's thread,
before anything reaches the engine, :class:`ImagePrompts` decodes each image (the file's
header checked first), tokenizes the text with the projector's marker where each image
goes, and encodes each image into embeddings. Embeddings are kept by the image's pixel
hash in an LRU bounded in bytes, so a burst of requests with one image, or ``n > 1``,
encodes it once. The engine gets token ids with each image's positions as its
placeholder ids, and the embeddings for those positions (:mod:`llamax.engine.images`).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .backend.base import ImageHost
from .backend.vision import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, ImageChunk, RgbImage, rgb_image
from .engine.images import PromptImage
from .errors import ContextLengthError, ImageError, InvalidRequestError, RequestFailedError

__all__ = ["EMBEDDING_CACHE_BYTES", "Image", "ImagePrompts", "is_parts"]

EMBEDDING_CACHE_BYTES = 256 * 2**20
"""How many bytes of image embeddings a context keeps for reuse."""


@dataclass(frozen=True, slots=True, eq=False)
class Image:
    """An image in a prompt (``add_request(["What is this?", Image(path)])``).

    ``source`` is the bytes of a PNG, JPEG, GIF or BMP file, a path to one (``str`` or
    ``os.PathLike``), or an ``(height, width, 3)`` ``uint8`` RGB array.
    """

    source: bytes | str | os.PathLike[str] | npt.NDArray[np.uint8] = field(repr=False)


def is_parts(prompt: object) -> bool:
    """Whether ``prompt`` is a list or tuple of parts (it holds an :class:`Image`), rather
    than token ids."""
    return isinstance(prompt, (list, tuple)) and any(isinstance(part, Image) for part in prompt)


class ImagePrompts:
    """Turns prompts of parts into token ids and :class:`PromptImage` s; any thread.

    Args:
        host: The backend's projector role.
        cache_bytes: The embeddings kept, by image id, for reuse.
    """

    def __init__(self, host: ImageHost | None, *, cache_bytes: int = EMBEDDING_CACHE_BYTES):
        self._host = host
        self._cache_bytes = cache_bytes
        self._cache: OrderedDict[str, npt.NDArray[np.float32]] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()  # one encode at a time; held across get-or-encode
        self.num_encoded = 0
        """Images encoded so far (a cache hit encodes nothing)."""

    def prompt(
        self, parts: Sequence[object], n_ctx: int
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """Token ids (placeholder ids at each image's positions) and the images.

        Raises:
            ImageError: the context has no projector, or an image cannot be read.
            InvalidRequestError: a part that is neither ``str`` nor :class:`Image`, a prompt
                that does not end with text, or an image too large for the batch settings.
            ContextLengthError: the prompt leaves no room for a reply.
            RequestFailedError: the encoder failed (its error is chained).
        """
        host = self._host
        if host is None or not host.sees_images:
            raise ImageError("this context has no projector (mmproj): it cannot read images")
        marker = host.image_marker
        texts: list[str] = []
        images: list[RgbImage] = []
        for part in parts:
            if isinstance(part, str):
                if marker in part:
                    raise InvalidRequestError(
                        f"prompt text may not hold the image marker {marker!r}"
                    )
                texts.append(part)
            elif isinstance(part, Image):
                texts.append(marker)
                images.append(self._read(host, part))
            else:
                raise InvalidRequestError(
                    f"a prompt's parts must be str or llamax.Image, got {type(part).__name__}"
                )
        chunks = host.tokenize_images("".join(texts), images)
        try:
            return self._lay_out(host, chunks, n_ctx)
        finally:
            for chunk in chunks:
                if isinstance(chunk, ImageChunk):
                    chunk.release()

    def _lay_out(
        self, host: ImageHost, chunks: Sequence[Any], n_ctx: int
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        tokens: list[int] = []
        placed: list[PromptImage] = []
        for chunk in chunks:
            if not isinstance(chunk, ImageChunk):
                tokens.extend(chunk.token_ids)
                continue
            most = host.max_image_rows(True) if chunk.is_non_causal else chunk.n_tokens
            if chunk.n_tokens > most or chunk.n_pos != chunk.n_tokens:
                raise InvalidRequestError(  # a causal image is decoded in pieces: any size
                    f"an image of {chunk.n_tokens} embeddings does not fit one decode of "
                    f"{most} rows (raise n_ubatch and n_batch to at least {chunk.n_tokens})"
                )
            if len(tokens) + chunk.n_pos >= n_ctx:
                break  # the length check below says so
            embeddings = self._embeddings(host, chunk)
            placed.append(PromptImage(len(tokens), chunk.image_id, embeddings, chunk.is_non_causal))
            tokens.extend(chunk.placeholder_ids())
        if len(tokens) >= n_ctx or len(placed) < sum(isinstance(c, ImageChunk) for c in chunks):
            num = sum(c.n_pos if isinstance(c, ImageChunk) else c.n_tokens for c in chunks)
            raise ContextLengthError(
                f"the prompt has {num} positions (images included) but a sequence may hold "
                f"{n_ctx}; it must leave room for at least one generated token",
                num_prompt_tokens=num,
                n_ctx=n_ctx,
            )
        if not tokens or tokens[-1] < 0:
            raise InvalidRequestError(
                "a prompt with images must end with text after its last image"
            )
        return tokens, tuple(placed)

    def _read(self, host: ImageHost, image: Image) -> RgbImage:
        source = image.source
        if isinstance(source, np.ndarray):
            return rgb_image(source, max_side=MAX_IMAGE_SIDE, max_pixels=MAX_IMAGE_PIXELS)
        if isinstance(source, (str, os.PathLike)):
            path = Path(source)
            try:
                source = path.read_bytes()
            except OSError as exc:
                raise ImageError(f"cannot read the image file {path}: {exc}") from exc
        if not isinstance(source, (bytes, bytearray, memoryview)):
            raise ImageError(
                "llamax.Image takes file bytes, a path or an (height, width, 3) uint8 array, "
                f"got {type(source).__name__}"
            )
        return host.read_image(bytes(source))

    def _embeddings(self, host: ImageHost, chunk: ImageChunk) -> npt.NDArray[np.float32]:
        with self._lock:
            cached = self._cache.get(chunk.image_id)
            if cached is not None:
                self._cache.move_to_end(chunk.image_id)
                return cached
            try:
                embeddings = host.encode_image(chunk)
            except ImageError:
                raise
            except Exception as exc:
                raise RequestFailedError(f"encoding the image failed: {exc!r}") from exc
            embeddings.setflags(write=False)  # shared by every request that sends it
            self.num_encoded += 1
            self._cache[chunk.image_id] = embeddings
            self._num_bytes += embeddings.nbytes
            while self._num_bytes > self._cache_bytes and len(self._cache) > 1:
                _, dropped = self._cache.popitem(last=False)
                self._num_bytes -= dropped.nbytes
            return embeddings
