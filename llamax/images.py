"""Images in prompts, at the facade: :class:`Image` and what ``add_request`` does with it.

A prompt may be a sequence of parts: ``str`` and :class:`Image`, or token ids (``int``)
and :class:`Image` (what a chat template renders: ``Context.chat_prompt_parts``). On the
caller's thread, before anything reaches the engine, :class:`ImagePrompts` decodes each
image (the file's header checked first), tokenizes the text with the projector's marker
where each image goes (token ids stay as they are; each image is tokenized alone, with
the marker text the projector puts around it), and encodes each image into embeddings.
Embeddings are kept by the image's pixel hash in an LRU bounded in bytes, so a burst of
requests with one image, or ``n > 1``, encodes it once. The engine gets token ids with
each image's positions as its placeholder ids, and the embeddings for those positions
(:mod:`llamax.engine.images`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .backend.base import ComputeThreads, ImageHost
from .backend.vision import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGE_SIDE,
    ImageChunk,
    RgbImage,
    TextChunk,
    rgb_image,
)
from .engine.images import PromptImage
from .errors import ContextLengthError, ImageError, InvalidRequestError, RequestFailedError

__all__ = ["EMBEDDING_CACHE_BYTES", "Image", "ImagePrompts", "is_parts"]

EMBEDDING_CACHE_BYTES = 256 * 2**20
"""How many bytes of image embeddings a context keeps for reuse."""
_MAX_IMAGES_KEPT = 4096  # images whose chunks (tokenized alone) are kept


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class Image:
    """An image in a prompt (``add_request(["What is this?", Image(path)])``), or in a user
    message's content list, beside text parts
    (``[{"type": "text", "text": "What is this?"}, Image(path)]``).

    ``source`` is the bytes of a PNG, JPEG, GIF or BMP file, a path to one (``str`` or
    ``os.PathLike``), or an ``(height, width, 3)`` ``uint8`` RGB array.
    """

    source: bytes | str | os.PathLike[str] | npt.NDArray[np.uint8] = field(repr=False)

    @classmethod
    def from_data_url(cls, url: str) -> Image:
        """The image of a ``data:`` URL (``data:image/png;base64,...``), as OpenAI's
        ``image_url`` parts carry one. Only the base64 is decoded here; the image itself is
        read when a request holds it.

        Raises:
            ImageError: not a base64 ``data:image/...`` URL, or its base64 is damaged.
        """
        if not isinstance(url, str) or not url.startswith("data:"):
            raise ImageError("an image URL must be a data: URL (data:image/png;base64,...)")
        header, comma, data = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ImageError("an image data: URL must be base64 (data:image/png;base64,...)")
        return cls.from_base64(data, header[5:].split(";")[0])

    @classmethod
    def from_base64(cls, data: str, media_type: str = "image/png") -> Image:
        """The image whose file is ``data`` in base64 (Anthropic's ``base64`` image source);
        ``media_type`` must be an ``image/`` type (the file's own header decides the format).

        Raises:
            ImageError: ``media_type`` is not an image type, or the base64 is damaged.
        """
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise ImageError(f"a media type of {media_type or 'none'!r} is not an image type")
        if not isinstance(data, str):
            raise ImageError(f"image data must be a base64 string, got {type(data).__name__}")
        try:
            return cls(base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"the image's base64 is damaged: {exc}") from None

    @property
    def num_bytes(self) -> int:
        """The bytes ``source`` holds (a path's: its length)."""
        source = self.source
        if isinstance(source, np.ndarray):
            return int(source.nbytes)
        if isinstance(source, (bytes, bytearray, memoryview)):
            return len(source)
        return len(os.fspath(source))


def is_parts(prompt: object) -> bool:
    """Whether ``prompt`` is a list or tuple of parts (it holds an :class:`Image`), rather
    than token ids."""
    return isinstance(prompt, (list, tuple)) and any(isinstance(part, Image) for part in prompt)


class ImagePrompts:
    """Turns prompts of parts into token ids and :class:`PromptImage` s; any thread.

    Args:
        host: The backend's projector role, when a projector that encodes images is
            loaded (``facts.sees_images``); ``None``: a prompt with an image raises.
        cache_bytes: The embeddings kept, by image id, for reuse.
    """

    def __init__(self, host: ImageHost | None, *, cache_bytes: int = EMBEDDING_CACHE_BYTES):
        self._host = host
        self._cache_bytes = cache_bytes
        self._cache: OrderedDict[str, npt.NDArray[np.float32]] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()  # one encode at a time; held across get-or-encode
        # the pixel hash of each image file counted, by the file's SHA-256, and each
        # image's chunks: counting an image again (this request's, or a later request's
        # copy of it) reads nothing. No decoded pixels are kept: a stored conversation's
        # images would pin them (48 MiB a 4096x4096 image)
        self._ids_by_file: OrderedDict[bytes, str] = OrderedDict()
        self._layouts: OrderedDict[str, tuple[TextChunk | ImageChunk, ...]] = OrderedDict()
        self._read_lock = threading.Lock()
        self.num_encoded = 0
        """Images encoded so far (a cache hit encodes nothing)."""

    def prompt(
        self, parts: Sequence[object], n_ctx: int
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """Token ids (placeholder ids at each image's positions) and the images.

        ``parts`` are ``str`` and :class:`Image`, or ``int`` token ids (already checked
        against the vocabulary) and :class:`Image`.

        Raises:
            ImageError: the context has no projector, or an image cannot be read.
            InvalidRequestError: a part that is neither ``str``, ``int`` nor :class:`Image`
                (or both ``str`` and ``int``), a prompt that does not end with text, or an
                image too large for the batch settings.
            ContextLengthError: the prompt leaves no room for a reply.
            RequestFailedError: the encoder failed (its error is chained).
        """
        host = self._projector()
        if any(isinstance(part, int) for part in parts):
            chunks = self._token_chunks(host, parts)
        else:
            chunks = self._text_chunks(host, parts)
        try:
            return self._lay_out(host, chunks, n_ctx)
        finally:
            for chunk in chunks:
                if isinstance(chunk, ImageChunk):
                    chunk.release()

    def num_positions(self, parts: Sequence[int | Image]) -> int:
        """The positions a prompt of token ids and images takes in a sequence: one per
        token id, and for each image its embeddings and the marker tokens the projector
        puts around it. Images are read and tokenized (not encoded); their pixels are
        dropped at once. An image file counted again (the same bytes in any
        :class:`Image`) is not read again: its pixel hash and layout are kept, by the
        file's SHA-256 (a few hundred bytes an image, for the last 4096 images).

        Raises:
            ImageError: the context has no projector, or an image cannot be read.
        """
        return len(self.token_ids(parts))

    def token_ids(self, parts: Sequence[int | Image]) -> list[int]:
        """The ids a prompt of token ids and images is in a sequence (what a session's
        ``token_ids`` hold): each image as the marker tokens around it and its placeholder
        ids. Images are read and tokenized, as for :meth:`num_positions`.

        Raises:
            ImageError: the context has no projector, or an image cannot be read.
        """
        ids: list[int] = []
        for part in parts:
            if isinstance(part, Image):
                ids.extend(self._image_ids(self._projector(), part))
            else:
                ids.append(part)
        return ids

    def _projector(self) -> ImageHost:
        host = self._host
        if host is None:
            raise ImageError(
                "image input is not supported: this model does not take images "
                "(no projector, mmproj, is loaded)"
            )
        return host

    def _text_chunks(self, host: ImageHost, parts: Sequence[object]) -> Sequence[Any]:
        marker = host.image_marker
        texts: list[str] = []
        images: list[RgbImage] = []
        for part in parts:
            if isinstance(part, str):
                if marker in part:
                    raise InvalidRequestError(
                        f"prompt text may not hold the image marker {marker!r}", param="prompt"
                    )
                texts.append(part)
            elif isinstance(part, Image):
                texts.append(marker)
                images.append(_decode(host, _source_of(part)))
            else:
                raise InvalidRequestError(
                    "a prompt's parts must be str or llamax.Image, or token ids and "
                    f"llamax.Image, got {type(part).__name__}",
                    param="prompt",
                )
        return host.tokenize_images("".join(texts), images)

    def _token_chunks(self, host: ImageHost, parts: Sequence[object]) -> Sequence[Any]:
        """Runs of token ids as they are; each image tokenized alone, without BOS."""
        chunks: list[Any] = []
        run: list[int] = []
        try:
            for part in parts:
                if isinstance(part, int) and not isinstance(part, bool):
                    run.append(part)
                    continue
                if not isinstance(part, Image):
                    raise InvalidRequestError(
                        "a prompt's parts must be str or llamax.Image, or token ids and "
                        f"llamax.Image (not both text and ids), got {type(part).__name__}",
                        param="prompt",
                    )
                if run:
                    chunks.append(TextChunk(tuple(run)))
                    run = []
                image = _decode(host, _source_of(part))
                chunks.extend(host.tokenize_images(host.image_marker, [image], add_special=False))
        except BaseException:
            for chunk in chunks:
                if isinstance(chunk, ImageChunk):
                    chunk.release()
            raise
        if run:
            chunks.append(TextChunk(tuple(run)))
        return chunks

    def _image_ids(self, host: ImageHost, image: Image) -> list[int]:
        """An image tokenized alone (no BOS): its marker tokens and placeholder ids."""
        source = _source_of(image)
        key = hashlib.sha256(source).digest() if isinstance(source, bytes) else None
        with self._read_lock:
            image_id = self._ids_by_file.get(key) if key is not None else None
            if key is not None and image_id is not None:
                self._ids_by_file.move_to_end(key)
            layout = self._layouts.get(image_id) if image_id is not None else None
        if layout is None:
            rgb = _decode(host, source)  # its pixels go when this returns
            layout = self._layout_of(host, rgb)
            if key is not None:
                with self._read_lock:
                    self._ids_by_file[key] = rgb.image_id
                    if len(self._ids_by_file) > _MAX_IMAGES_KEPT:
                        self._ids_by_file.popitem(last=False)
        ids: list[int] = []
        for chunk in layout:
            ids.extend(
                chunk.placeholder_ids() if isinstance(chunk, ImageChunk) else chunk.token_ids
            )
        return ids

    def _layout_of(self, host: ImageHost, rgb: RgbImage) -> tuple[TextChunk | ImageChunk, ...]:
        """``rgb`` tokenized alone, kept by its pixel hash without the native chunks."""
        with self._read_lock:
            layout = self._layouts.get(rgb.image_id)
        if layout is not None:
            return layout
        chunks = host.tokenize_images(host.image_marker, [rgb], add_special=False)
        for chunk in chunks:
            if isinstance(chunk, ImageChunk):
                chunk.release()
        # kept without their native part: the ids are all that is read again
        layout = tuple(
            replace(chunk, native=None) if isinstance(chunk, ImageChunk) else chunk
            for chunk in chunks
        )
        with self._read_lock:
            self._layouts[rgb.image_id] = layout
            if len(self._layouts) > _MAX_IMAGES_KEPT:
                self._layouts.popitem(last=False)
        return layout

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
                "a prompt with images must end with text after its last image", param="prompt"
            )
        return tokens, tuple(placed)

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
            finally:  # a request's thread: its compute workers must not slow the engine's
                if isinstance(host, ComputeThreads):
                    host.release_compute_threads()
            embeddings.setflags(write=False)  # shared by every request that sends it
            self.num_encoded += 1
            self._cache[chunk.image_id] = embeddings
            self._num_bytes += embeddings.nbytes
            while self._num_bytes > self._cache_bytes and len(self._cache) > 1:
                _, dropped = self._cache.popitem(last=False)
                self._num_bytes -= dropped.nbytes
            return embeddings


def _source_of(image: Image) -> bytes | npt.NDArray[np.uint8]:
    """An image's file bytes (a path's read now), or its array.

    Raises:
        ImageError: the file cannot be read, or ``source`` is of another type.
    """
    source = image.source
    if isinstance(source, np.ndarray):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            return path.read_bytes()
        except OSError as exc:
            raise ImageError(f"cannot read the image file {path}: {exc}") from exc
    if not isinstance(source, (bytes, bytearray, memoryview)):
        raise ImageError(
            "llamax.Image takes file bytes, a path or an (height, width, 3) uint8 array, "
            f"got {type(source).__name__}"
        )
    return bytes(source)


def _decode(host: ImageHost, source: bytes | npt.NDArray[np.uint8]) -> RgbImage:
    """An image's pixels, decoded now; nothing here keeps them."""
    if isinstance(source, np.ndarray):
        return rgb_image(source, max_side=MAX_IMAGE_SIDE, max_pixels=MAX_IMAGE_PIXELS)
    return host.read_image(source)
