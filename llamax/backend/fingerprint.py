"""A fingerprint of a GGUF file's weights: what tells apart two models whose metadata (name,
description, sizes, vocabulary) is the same, such as a fine-tune or a requantization of
one model. Part of the model's identity (``model_identity``), so a saved session or a
disk-tier entry computed by one is never restored into the other. Pure Python.

Design note: hashing a whole model at every load reads every byte (SHA-256 runs at about
1-2 GB/s on one core: seconds for a multi-GB model, before the first request). The
fingerprint is a SHA-256 of

- the header, whole: the metadata and the tensor table (names, shapes, ggml types and
  offsets), so a requantization (other types, other sizes) always shows;
- the file's size;
- a sample of every tensor's data: the whole tensor up to 64 KiB, else 16 chunks of 4 KiB
  at fixed offsets spread evenly over it, the first and the last included. A fine-tune
  changes (nearly) every weight of a tensor it trains, so each such tensor shows it.

Its cost follows the number of tensors, not the file's size (about 4 MiB read for a model
of 300 tensors; docs/kv-cache.md gives the time measured on SmolLM2). What it does not see:
a change confined to bytes between the samples (one weight edited by hand). A split model
(``NAME-00001-of-00003.gguf``) is fingerprinted part by part; a file whose header cannot be
read as GGUF is sampled as a whole (its first MiB and 256 chunks spread over it).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator

from .gguf_file import GGUFHeader, KVType, read_header

__all__ = ["weights_fingerprint"]

_VERSION = b"llamax weights fingerprint 1\0"
_CHUNK = 4096
_SAMPLES = 16
_WHOLE = _CHUNK * _SAMPLES  # a tensor up to this size is hashed whole
_FALLBACK_HEAD = 1 << 20
_FALLBACK_SAMPLES = 256
_SPLIT = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def weights_fingerprint(path: str | os.PathLike[str]) -> str:
    """The fingerprint of the GGUF model at ``path`` (with every part of a split model):
    32 hex digits.

    Raises:
        OSError: a file cannot be read.
    """
    path = os.fspath(path)
    digest = hashlib.sha256(_VERSION)
    header = _header_or_none(path)
    digest.update(_file_digest(path, header))
    for part in _other_parts(path, header):
        digest.update(_file_digest(part, _header_or_none(part)))
    return digest.hexdigest()[:32]


def _header_or_none(path: str) -> GGUFHeader | None:
    try:
        return read_header(path)
    except ValueError:
        return None


def _other_parts(path: str, header: GGUFHeader | None) -> list[str]:
    """The other parts of a split model whose first part is ``path`` (llama.cpp's naming:
    ``PREFIX-00001-of-00003.gguf``, with ``split.count`` in its header)."""
    match = _SPLIT.match(path)
    if header is None or match is None or match["index"] != "00001":
        return []
    kind, value = header.metadata.get("split.count", (KVType.UINT16, 1))
    count = value if isinstance(value, int) and kind != KVType.BOOL else 1
    if count != int(match["count"]):
        return []
    return [f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(2, count + 1)]


def _file_digest(path: str, header: GGUFHeader | None) -> bytes:
    with open(path, "rb") as file:
        fd = file.fileno()
        size = os.fstat(fd).st_size
        digest = hashlib.sha256(size.to_bytes(8, "little"))
        if header is None or header.file_size != size or header.data_offset > size:
            spans = [(0, min(size, _FALLBACK_HEAD)), *_samples(0, size, _FALLBACK_SAMPLES)]
        else:
            spans = [(0, header.data_offset)]
            for start, end in _extents(header):
                spans.extend(
                    [(start, end - start)] if end - start <= _WHOLE else _samples(start, end)
                )
        for offset, length in spans:
            digest.update(os.pread(fd, length, offset))
    return digest.digest()


def _extents(header: GGUFHeader) -> list[tuple[int, int]]:
    """Each tensor's bytes in the file, ``[start, end)``: from its offset to the next
    tensor's (padding included), the last to the end of the file."""
    base, size = header.data_offset, header.file_size
    starts = sorted({min(base + t.offset, size) for t in header.tensors})
    return list(zip(starts, [*starts[1:], size], strict=True))


def _samples(start: int, end: int, count: int = _SAMPLES) -> Iterator[tuple[int, int]]:
    """``count`` chunks of :data:`_CHUNK` bytes spread evenly over ``[start, end)``."""
    length = end - start
    if length <= _CHUNK * count:
        yield start, length
        return
    room = length - _CHUNK
    for k in range(count):
        yield start + room * k // (count - 1), _CHUNK
