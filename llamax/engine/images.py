"""Images in a request's prompt, as the engine sees them: runs of positions whose inputs
are embeddings instead of token ids.

A prompt with images is a list of token ids in which each image's positions hold its
placeholder ids (negative, derived from the image's pixel hash:
:meth:`~llamax.backend.vision.ImageChunk.placeholder_ids`), so the prefix cache, the KV
bookkeeping and the fake backend's provenance treat an image like any run of tokens, and
two images never share a prefix. The request carries each image's embeddings
(:class:`PromptImage`); a step that feeds an image's positions gives the backend those
rows (:func:`image_rows`), decoded in a ``llama_decode`` of their own, since one batch
cannot mix token ids and embeddings.

The rules the scheduler keeps (pure functions on positions, tested on numbers):

- a prompt chunk never crosses a boundary between text and an image, or between two
  images (:func:`chunk_limit`), so a step's item is all text or all one image's rows;
- a non-causal image (Gemma 3: every row attends to every row of the image) is decoded
  whole in one decode, and a reused prefix never ends inside one (:func:`cut_reuse`);
- placeholder ids are never tokens: samplers, drafts and processors see
  :func:`text_only` histories;
- a session's history shift never moves part of an image (:func:`check_shift`): a cut
  short at the end, as a rewind leaves one, is recomputed whole by the next turn when it
  is non-causal, but an image whose first positions are gone would hold placeholder ids
  that no prompt gives again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..backend.vision.chunks import placeholder_offset
from ..errors import InvalidParameterError

__all__ = [
    "PromptImage",
    "check_shift",
    "chunk_limit",
    "cut_reuse",
    "image_at",
    "image_rows",
    "text_only",
]


@dataclass(frozen=True, slots=True, eq=False)
class PromptImage:
    """One image of a prompt: where its positions start and what is decoded there."""

    start: int
    """Its first position in the prompt."""
    image_id: str
    """The pixel hash its placeholder ids derive from."""
    embeddings: npt.NDArray[np.float32] = field(repr=False)
    """``(n_pos, n_embd)``: one row per position, read-only (shared by every request that
    sends this image)."""
    is_non_causal: bool = False
    """Decoded whole, in one decode, with non-causal attention."""

    @property
    def end(self) -> int:
        """The position after its last."""
        return self.start + len(self.embeddings)


def image_at(images: Sequence[PromptImage], pos: int) -> PromptImage | None:
    """The image whose positions hold ``pos``, or None (text)."""
    for image in images:
        if image.start <= pos < image.end:
            return image
    return None


def chunk_limit(images: Sequence[PromptImage], pos: int, limit: int) -> int:
    """At most ``limit`` positions from ``pos`` that stay within one image or one run of
    text. A non-causal image's chunk is the rest of the image, whatever ``limit`` says
    (the caller decides whether it fits the step)."""
    image = image_at(images, pos)
    if image is not None:
        rest = image.end - pos
        return rest if image.is_non_causal else min(limit, rest)
    following = [image.start for image in images if image.start > pos]
    return min(limit, min(following) - pos) if following else limit


def cut_reuse(images: Sequence[PromptImage], num: int, *, sliding_window: bool = False) -> int:
    """A reused prefix of ``num`` positions, cut back to the start of a non-causal image it
    would end inside (its cells were computed seeing rows the prefix does not hold).

    On a sliding-window model (``sliding_window``), back to the start of the first
    non-causal image it holds at all: a prefix restored past one there gave logits 3e-4
    off a cold run's (a random Gemma 3 with Gemma 3's projector; the same model with a
    causal projector, and hybrid and recurrent models with either, were exact), so such a
    prompt recomputes from the image on."""
    if sliding_window:
        starts = [i.start for i in images if i.is_non_causal and i.start < num]
        if starts:
            return min(starts)
    image = image_at(images, num)
    if image is not None and image.is_non_causal and image.start < num:
        return image.start
    return num


def image_rows(
    images: Sequence[PromptImage], start: int, end: int
) -> tuple[npt.NDArray[np.float32], bool] | None:
    """The embeddings of positions ``[start, end)`` and whether they are decoded
    non-causally, when they lie in one image; None when they are text.

    Raises:
        ValueError: the span mixes text and an image, or two images (the chunker never
            makes one), or cuts a non-causal image.
    """
    image = image_at(images, start)
    if image is None:
        if any(start < i.end and i.start < end for i in images):
            raise ValueError(f"positions [{start}, {end}) mix text and an image")
        return None
    if end > image.end:
        raise ValueError(f"positions [{start}, {end}) run past the image ending at {image.end}")
    if image.is_non_causal and (start, end) != (image.start, image.end):
        raise ValueError(
            f"positions [{start}, {end}) cut the non-causal image [{image.start}, {image.end})"
        )
    rows = image.embeddings[start - image.start : end - image.start]
    return rows, image.is_non_causal


def text_only(token_ids: Sequence[int]) -> list[int]:
    """``token_ids`` without image placeholders (what a sampler's penalties, a logits
    processor or a draft may see)."""
    return [t for t in token_ids if t >= 0]


def check_shift(token_ids: Sequence[int], start: int, end: int) -> None:
    """Refuse a history shift of ``[start, end)`` out of ``token_ids`` (a session's) that
    cuts through an image: ``start`` inside one, or ``end`` inside one whose later
    positions would move. A span out of range is left to the cache's own check.

    Raises:
        InvalidParameterError: naming the image's positions.
    """
    if not 0 <= start <= end < len(token_ids) or start == end:
        return  # nothing moves: a plain cut at ``start`` (a rewind), or nothing at all
    for pos in (start, end):
        offset = placeholder_offset(token_ids[pos])
        if offset:
            first = pos - offset
            last = first
            while last + 1 < len(token_ids) and token_ids[last + 1] == token_ids[last] - 1:
                last += 1
            raise InvalidParameterError(
                f"cannot shift out [{start}, {end}): it cuts through the image at positions "
                f"[{first}, {last + 1}); shift out whole images, or text only"
            )
