"""Images in prompts, through llama.cpp's ``mtmd``: the backend's vision wing.

- :mod:`.image_file`: an image file's format, size and wholeness, read before decoding;
- :mod:`.decode_budget`: the bytes of decodes in flight, process-wide;
- :mod:`.chunks`: the pure values (decoded pixels, text and image chunks) that the engine,
  the prefix cache and a fake backend share;
- :mod:`.projector`: the ``mtmd_context`` (decode files, tokenize, encode);
- :mod:`.embd_batch`: decoding embeddings into sequences with ``llama_decode``.
"""

from .chunks import ImageChunk, MediaPrompt, RgbImage, TextChunk, rgb_image
from .decode_budget import DECODE_BUDGET, DecodeBudget
from .embd_batch import EmbeddingItem, NativeEmbdBatch, decode_embeddings, decode_image
from .image_file import (
    ImageHeader,
    check_image,
    check_image_data,
    check_image_size,
    read_image_header,
)
from .projector import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, Projector

__all__ = [
    "DECODE_BUDGET",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "DecodeBudget",
    "EmbeddingItem",
    "ImageChunk",
    "ImageHeader",
    "MediaPrompt",
    "NativeEmbdBatch",
    "Projector",
    "RgbImage",
    "TextChunk",
    "check_image",
    "check_image_data",
    "check_image_size",
    "decode_embeddings",
    "decode_image",
    "read_image_header",
    "rgb_image",
]
