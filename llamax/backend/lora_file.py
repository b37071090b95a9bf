"""Checks a LoRA adapter GGUF passes before llama.cpp loads it. Pure Python and numpy.

``llama_adapter_lora_init`` checks an adapter's names and shapes against the model, not
its types or values, and some of what it lets through kills the process later:

- a ``lora_a``/``lora_b`` tensor of a type ggml cannot multiply (``I8``, ``I32``, ``F64``
  ...) loads, and the first decode under the adapter crashes in ``llama_decode``;
- a metadata value of another type than llama.cpp reads (``adapter.lora.alpha`` not an
  ``f32``, ``general.type`` not a string) fails an assertion that aborts the process;
- a NaN or infinite weight or alpha loads and turns every logit into NaN (empty output).

So the adapter's header is read here first and its weights scanned. Accepted tensor types
are those whose every value can be checked: F32, F16 and BF16 (what llama.cpp's own
``convert_lora_to_gguf.py`` writes, with Q8_0), and the legacy and K quantizations, whose
only floats are the f16 scales of each block. The rest (``IQ*``, ``TQ*``, ``MXFP4`` ...)
are refused: nobody writes adapters in them, and their values are not checked. Tensors
llama.cpp skips (``*_norm.weight``) are not read. Scanning costs one pass over the
adapter's weights (docs/lora.md gives the time measured).
"""

from __future__ import annotations

import math
import os
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from .gguf_file import GGML_TYPE_NAMES, GGUFHeader, GGUFTensor, KVType, read_header

__all__ = ["LORA_TENSOR_TYPES", "check_lora_file"]

_F32, _F16, _BF16 = 0, 1, 30
# a quantized block: (values, bytes, offsets of its f16 scales); its other bytes are
# integers, so the scales are the only values that can be NaN (ggml-common.h's structs)
_BLOCKS: dict[int, tuple[int, int, tuple[int, ...]]] = {
    2: (32, 18, (0,)),  # Q4_0: d, 16 bytes of nibbles
    3: (32, 20, (0, 2)),  # Q4_1: d, m, nibbles
    6: (32, 22, (0,)),  # Q5_0: d, qh[4], nibbles
    7: (32, 24, (0, 2)),  # Q5_1: d, m, qh[4], nibbles
    8: (32, 34, (0,)),  # Q8_0: d, 32 int8
    10: (256, 84, (80, 82)),  # Q2_K: scales[16], qs[64], d, dmin
    11: (256, 110, (108,)),  # Q3_K: hmask[32], qs[64], scales[12], d
    12: (256, 144, (0, 2)),  # Q4_K: d, dmin, scales[12], qs[128]
    13: (256, 176, (0, 2)),  # Q5_K: d, dmin, scales[12], qh[32], qs[128]
    14: (256, 210, (208,)),  # Q6_K: ql[128], qh[64], scales[16] (int8), d
}
_FLOATS: dict[int, np.dtype[np.generic]] = {
    _F32: np.dtype("<f4"),
    _F16: np.dtype("<u2"),  # 16-bit floats: their exponent bits are checked (a NaN or an
    _BF16: np.dtype("<u2"),  # infinity has them all set), 4x faster than numpy's f16
}
_EXPONENTS = {_F16: 0x7C00, _BF16: 0x7F80}
LORA_TENSOR_TYPES: dict[int, str] = {t: GGML_TYPE_NAMES[t] for t in [*_FLOATS, *_BLOCKS]}
"""The ggml types a ``lora_a``/``lora_b`` tensor may have: the float types and the
quantizations whose every float (a block's f16 scales) is checked here."""
_STRING_KEYS = ("general.type", "general.architecture", "adapter.type")
_ALPHA = "adapter.lora.alpha"
_SCAN = 1 << 22  # values checked at a time


def check_lora_file(path: str | os.PathLike[str]) -> None:
    """Check that llama.cpp can load and run the LoRA adapter at ``path``: its header reads
    as GGUF, the metadata llama.cpp reads has the types it reads, ``adapter.lora.alpha`` is
    finite, and every ``lora_a``/``lora_b`` tensor has a type of
    :data:`LORA_TENSOR_TYPES`, lies within the file and holds only finite values.

    Raises:
        ValueError: the first check that fails, naming the key or tensor.
        OSError: the file cannot be read.
    """
    header = read_header(path)
    _check_metadata(header)
    with open(path, "rb") as file:
        for tensor in header.tensors:
            if tensor.name.endswith((".lora_a", ".lora_b")):
                _check_tensor(file, header, tensor)


def _check_metadata(header: GGUFHeader) -> None:
    for key in _STRING_KEYS:
        if key in header.metadata and header.metadata[key][0] != KVType.STRING:
            raise ValueError(f"metadata {key!r} is not a string")
    if _ALPHA in header.metadata:
        kind, alpha = header.metadata[_ALPHA]
        if kind != KVType.FLOAT32 or not isinstance(alpha, float):
            raise ValueError(f"metadata {_ALPHA!r} is not an f32 (GGUF type {kind})")
        if not math.isfinite(alpha):
            raise ValueError(f"metadata {_ALPHA!r} is {alpha}, not a finite number")


def _check_tensor(file: BinaryIO, header: GGUFHeader, tensor: GGUFTensor) -> None:
    if tensor.type in _FLOATS:
        per_item, dtype = 1, _FLOATS[tensor.type]
    elif tensor.type in _BLOCKS:
        per_item, size, scales = _BLOCKS[tensor.type]
        dtype = np.dtype(
            {
                "names": [f"scale{i}" for i in range(len(scales))],
                "formats": ["<f2"] * len(scales),
                "offsets": list(scales),
                "itemsize": size,
            }
        )
    else:
        allowed = ", ".join(LORA_TENSOR_TYPES.values())
        raise ValueError(
            f"tensor {tensor.name!r} is {tensor.type_name}; a LoRA tensor must be one of {allowed}"
        )
    if tensor.shape[0] % per_item:
        raise ValueError(
            f"tensor {tensor.name!r}: a {tensor.type_name} row must be whole blocks of "
            f"{per_item} values"
        )
    count = tensor.num_elements // per_item
    start = header.data_offset + tensor.offset
    if start + count * dtype.itemsize > header.file_size:
        raise ValueError(f"tensor {tensor.name!r} runs past the end of the file")
    if not count:
        return
    values = np.memmap(file, dtype, "r", start, (count,))
    for at in range(0, count, _SCAN):  # bounded temporaries, whatever the tensor's size
        if not _all_finite(values[at : at + _SCAN], tensor.type):
            raise ValueError(f"tensor {tensor.name!r} holds NaN or infinite values")


def _all_finite(values: npt.NDArray[Any], kind: int) -> bool:
    if kind in _BLOCKS:
        return all(bool(np.isfinite(values[name]).all()) for name in values.dtype.names or ())
    if kind in _EXPONENTS:
        exponent = _EXPONENTS[kind]
        return not bool(((values & exponent) == exponent).any())
    return bool(np.isfinite(values).all())
