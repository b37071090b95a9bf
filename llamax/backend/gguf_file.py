"""A GGUF file's header, read in pure Python: its metadata and its tensor table (names,
shapes, ggml types and where each tensor's data lies). Nothing is loaded.

Layout (little-endian; llama.cpp's ``gguf.cpp`` reads the same)::

    "GGUF" | u32 version (2, 3) | u64 n_tensors | u64 n_kv
    n_kv x      (string key | u32 type | value)
    n_tensors x (string name | u32 n_dims | n_dims x u64 ne | u32 ggml type | u64 offset)
    padding to general.alignment (default 32) | tensor data

where a string is ``u64 length | bytes`` and an array value is ``u32 element type | u64
count | elements``. The whole header is read into memory and parsed with bounds checks, so
a file that lies about its counts or lengths is refused with a ValueError, never read past
its end. Used to fingerprint a model's weights (:mod:`llamax.backend.fingerprint`) and to
check a LoRA adapter before llama.cpp sees it (:mod:`llamax.backend.lora_file`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

__all__ = [
    "GGML_TYPES",
    "GGML_TYPE_NAMES",
    "GGUFArray",
    "GGUFHeader",
    "GGUFTensor",
    "KVType",
    "read_header",
]

MAGIC = b"GGUF"
_MAX_HEADER = 1 << 30  # no real header comes near: a tokenizer of 256k tokens is ~10 MiB
_FIRST_READ = 4 << 20


class KVType:
    """GGUF metadata value types (``enum gguf_type``)."""

    UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL = 0, 1, 2, 3, 4, 5, 6, 7
    STRING, ARRAY, UINT64, INT64, FLOAT64 = 8, 9, 10, 11, 12


_SCALARS: dict[int, struct.Struct] = {
    KVType.UINT8: struct.Struct("<B"),
    KVType.INT8: struct.Struct("<b"),
    KVType.UINT16: struct.Struct("<H"),
    KVType.INT16: struct.Struct("<h"),
    KVType.UINT32: struct.Struct("<I"),
    KVType.INT32: struct.Struct("<i"),
    KVType.FLOAT32: struct.Struct("<f"),
    KVType.BOOL: struct.Struct("<?"),
    KVType.UINT64: struct.Struct("<Q"),
    KVType.INT64: struct.Struct("<q"),
    KVType.FLOAT64: struct.Struct("<d"),
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

GGML_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0", 42: "Q2_0",
}  # fmt: skip
"""ggml's tensor types by number (``enum ggml_type`` of llama.cpp as vendored by
llama-cpp-python 0.3.36)."""
GGML_TYPES: dict[str, int] = {name.lower(): number for number, name in GGML_TYPE_NAMES.items()}
"""ggml's type numbers by lower-case name, the names ``kv_type`` takes (``"q8_0"``: 8)."""


@dataclass(frozen=True, slots=True)
class GGUFArray:
    """An array value: its element type and length (the elements are not kept)."""

    type: int
    count: int


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One entry of the tensor table."""

    name: str
    shape: tuple[int, ...]
    """ggml's ``ne``: the fastest-moving dimension first."""
    type: int
    """ggml type number (:data:`GGML_TYPE_NAMES`)."""
    offset: int
    """Where its data starts, from the start of the tensor data
    (:attr:`GGUFHeader.data_offset`)."""

    @property
    def type_name(self) -> str:
        """The type's ggml name (``"F32"``, ``"Q8_0"`` ...), or ``"type N"``."""
        return GGML_TYPE_NAMES.get(self.type, f"type {self.type}")

    @property
    def num_elements(self) -> int:
        """The product of its dimensions."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What the header of one GGUF file says."""

    version: int
    metadata: dict[str, tuple[int, object]]
    """key -> (value type, value): a scalar, a str, or a :class:`GGUFArray`."""
    tensors: tuple[GGUFTensor, ...]
    data_offset: int
    """Where the tensor data starts (the header's end, padded to the alignment)."""
    file_size: int


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse the header of the GGUF file at ``path``.

    Raises:
        ValueError: not a GGUF file, or its header is truncated or inconsistent (the
            message says where).
        OSError: the file cannot be read.
    """
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        data = file.read(min(size, _FIRST_READ))
        parser = _Parser(data, size)
        while True:
            try:
                return parser.parse()
            except _NeedMore as more:
                want = min(size, _MAX_HEADER, max(more.end, 2 * len(data)))
                if want <= len(data):
                    raise ValueError(more.what) from None
                data += file.read(want - len(data))
                parser = _Parser(data, size)


class _NeedMore(Exception):
    def __init__(self, end: int, what: str) -> None:
        super().__init__(what)
        self.end = end
        self.what = what


class _Parser:
    def __init__(self, data: bytes, file_size: int) -> None:
        self._data = data
        self._size = file_size
        self._pos = 0

    def parse(self) -> GGUFHeader:
        if self._take(4, "the magic") != MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        version = self._unpack(_U32, "the version")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (llama.cpp reads 2 and 3)")
        n_tensors = self._count("the tensor count", 8)
        n_kv = self._count("the metadata count", 9)
        metadata: dict[str, tuple[int, object]] = {}
        for _ in range(n_kv):
            key = self._string("a metadata key")
            kind = self._unpack(_U32, f"the type of {key!r}")
            metadata[key] = (kind, self._value(kind, key))
        alignment = 32
        if "general.alignment" in metadata:
            kind, value = metadata["general.alignment"]
            if kind != KVType.UINT32 or not isinstance(value, int) or value <= 0:
                raise ValueError(f"general.alignment is not a positive u32: {value!r}")
            if value & (value - 1):
                raise ValueError(f"general.alignment {value} is not a power of 2")
            alignment = value
        tensors = tuple(self._tensor() for _ in range(n_tensors))
        data_offset = -(-self._pos // alignment) * alignment
        for tensor in tensors:
            if tensor.offset % alignment:
                raise ValueError(f"tensor {tensor.name!r} is not aligned to {alignment} bytes")
        return GGUFHeader(version, metadata, tensors, data_offset, self._size)

    # ------------------------------------------------------------------ pieces
    def _take(self, n: int, what: str) -> bytes:
        end = self._pos + n
        if end > self._size:
            raise ValueError(f"truncated at {what} (byte {self._pos} of {self._size})")
        if end > len(self._data):
            raise _NeedMore(end, f"a header larger than {_MAX_HEADER} bytes at {what}")
        out = self._data[self._pos : end]
        self._pos = end
        return out

    def _unpack(self, fmt: struct.Struct, what: str) -> int:
        (value,) = fmt.unpack(self._take(fmt.size, what))
        return int(value)

    def _count(self, what: str, min_bytes: int) -> int:
        n = self._unpack(_U64, what)
        if n * min_bytes > self._size:  # each item takes at least min_bytes of the file
            raise ValueError(f"{what} ({n}) is larger than the file allows")
        return n

    def _string(self, what: str) -> str:
        n = self._count(f"the length of {what}", 1)
        raw = self._take(n, what)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise ValueError(f"{what} at byte {self._pos - n} is not UTF-8") from None

    def _skip_strings(self, count: int, what: str) -> None:
        """Step over ``count`` strings (a vocabulary: a tight loop, checked at the end)."""
        data, pos, unpack = self._data, self._pos, _U64.unpack_from
        limit = len(data) - 8
        for _ in range(count):
            if pos > limit:
                break
            pos += 8 + unpack(data, pos)[0]
        else:
            if pos <= len(data):
                self._pos = pos
                return
        if pos > self._size:
            raise ValueError(f"truncated at {what} (byte {pos} of {self._size})")
        raise _NeedMore(pos + 8, f"a header larger than {_MAX_HEADER} bytes at {what}")

    def _value(self, kind: int, key: str) -> object:
        if kind == KVType.STRING:
            return self._string(f"the value of {key!r}")
        if kind == KVType.ARRAY:
            elem = self._unpack(_U32, f"the element type of {key!r}")
            count = self._count(f"the length of {key!r}", 1)
            if elem == KVType.STRING:
                self._skip_strings(count, f"the strings of {key!r}")
            elif elem in _SCALARS:
                self._take(count * _SCALARS[elem].size, f"the elements of {key!r}")
            else:
                raise ValueError(f"metadata {key!r} is an array of type {elem}")
            return GGUFArray(elem, count)
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"metadata {key!r} has unknown type {kind}")
        (value,) = fmt.unpack(self._take(fmt.size, f"the value of {key!r}"))
        return value

    def _tensor(self) -> GGUFTensor:
        name = self._string("a tensor name")
        n_dims = self._unpack(_U32, f"the rank of tensor {name!r}")
        if not 1 <= n_dims <= 4:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (ggml has 1 to 4)")
        shape = tuple(self._unpack(_U64, f"the shape of {name!r}") for _ in range(n_dims))
        kind = self._unpack(_U32, f"the type of tensor {name!r}")
        offset = self._unpack(_U64, f"the offset of tensor {name!r}")
        return GGUFTensor(name, shape, kind, offset)
