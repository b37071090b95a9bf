"""The disk prefix tier's files: their format, and how they are written, read and deleted.

File format: :data:`MAGIC`, the format version and the header's length (two little-endian
``u32``), the header (JSON: ``tokens``, ``size`` and ``crc32`` of the state, and
``"hinted": true`` for an entry a hint asked to keep longer; an unhinted entry's header has
no such key, so its file is the one earlier versions wrote), the state.
Files that lie (another magic or version, an unreadable header, a length or checksum that
does not match) are deleted when found and never reach the backend.

Files are input, and they hold a conversation's tokens in clear. The tier's folder is made
``0700`` and its files ``0600`` (set explicitly, whatever the umask). A file is opened
without following a link and without blocking (a FIFO put in its place answers nothing),
and refused unless it is a regular file of exactly the size the index recorded, before a
byte of it is read; then exactly that many bytes are read. ``clear`` deletes every file in
the tier's folder and raises :class:`~llamax.errors.CacheClearError` naming those that
stay (a read-only filesystem): they would be found again by the next context's scan, so
reporting success would be a lie.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from ...backend.vision.chunks import placeholder_problem

__all__ = [
    "LOCK",
    "MAGIC",
    "VERSION",
    "DiskEntry",
    "encode",
    "make_private_dir",
    "open_private",
    "read_state",
    "remove",
    "scan",
    "write_entry",
]

MAGIC = b"LLAMAXKV"
"""The first 8 bytes of every entry's file."""
VERSION = 1
"""The file format's version."""
LOCK = ".lock"
"""The lock file's name in the tier's folder (held by the context that uses it)."""

_PREAMBLE = struct.Struct("<8sII")  # magic, version, header length
_MAX_HEADER = 64 << 20
_SUFFIX = ".kv"
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _open_for_reading(path: str, flags: int) -> int:
    """An ``open`` opener: never follows a link, never blocks on a FIFO or device."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)


def open_private(path: str, flags: int) -> int:
    """An ``open`` opener for a new file: ``0600`` whatever the umask, never through a
    link."""
    fd = os.open(path, flags | os.O_NOFOLLOW | _CLOEXEC, _FILE_MODE)
    try:
        os.fchmod(fd, _FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def make_private_dir(path: str) -> None:
    """Create ``path`` (and missing parents) with mode ``0700``; an existing folder is
    set to ``0700`` too. A link in its place is refused.

    Raises:
        OSError: it cannot be made, is not a folder, or is a link.
    """
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
        os.chmod(parent, _DIR_MODE)  # made by us: nobody else needs to list it
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, _DIR_MODE)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder (or a link)", path)
    if stat.S_IMODE(info.st_mode) != _DIR_MODE:
        os.chmod(path, _DIR_MODE)


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """One evicted prefix's state in a file."""

    tokens: tuple[int, ...]
    """The tokens the state holds, at positions ``0 .. len(tokens) - 1``."""
    path: str
    """The file."""
    num_bytes: int
    """The file's size (header and state)."""
    hinted: bool = False
    """Whether a hint asked to keep it longer (its header says so: it outlives the context)."""
    owner: str | None = None
    """The ``fair_key`` of the request that hinted it, while this process runs (a file
    read at start has none: client keys are not written to disk)."""


_KEYS = frozenset({"tokens", "size", "crc32"})


def encode(tokens: Sequence[int], data: bytes, *, hinted: bool = False) -> bytes:
    """The preamble and header of a file holding ``data``, the state of ``tokens``."""
    fields: dict[str, object] = {
        "tokens": list(tokens),
        "size": len(data),
        "crc32": zlib.crc32(data),
    }
    if hinted:
        fields["hinted"] = True
    header = json.dumps(fields, separators=(",", ":")).encode()
    return _PREAMBLE.pack(MAGIC, VERSION, len(header)) + header


def _valid_tokens(tokens: object, images: bool) -> bool:
    """Whether a header's ``tokens`` can be an entry's: token ids, and with ``images``
    also well-formed runs of image placeholder ids."""
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        return False
    if min(tokens) >= 0:
        return True
    return images and placeholder_problem(tokens) is None


def _read_header(
    file: IO[bytes], images: bool
) -> tuple[tuple[int, ...], int, int, int, bool] | None:
    """``(tokens, size, crc32, offset of the state, hinted)`` from an open file, or None if
    the preamble or header is not exactly what :func:`encode` writes (placeholder ids among
    the tokens only with ``images``)."""
    preamble = file.read(_PREAMBLE.size)
    if len(preamble) != _PREAMBLE.size:
        return None
    magic, version, length = _PREAMBLE.unpack(preamble)
    if magic != MAGIC or version != VERSION or not 0 < length <= _MAX_HEADER:
        return None
    raw = file.read(length)
    if len(raw) != length:
        return None
    try:
        header = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(header, dict) or set(header) not in (_KEYS, _KEYS | {"hinted"}):
        return None
    if header.get("hinted", True) is not True:  # written only as true
        return None
    tokens, size, crc = header["tokens"], header["size"], header["crc32"]
    if not (
        _valid_tokens(tokens, images)
        and type(size) is int
        and size > 0
        and type(crc) is int
        and 0 <= crc < 1 << 32
    ):
        return None
    return tuple(tokens), size, crc, _PREAMBLE.size + length, "hinted" in header


def remove(path: str) -> OSError | None:
    """Delete a file (or a directory in its place); never raises: the error, if any (a
    file already gone is no error)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc
    return None


def _read_entry(path: str, images: bool) -> tuple[float, DiskEntry] | None:
    """``(mtime, entry)`` of the file at ``path`` from its header alone, or None if it is
    not a regular file whose header says what its size is."""
    try:
        with open(path, "rb", opener=_open_for_reading) as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                return None
            header = _read_header(file, images)
    except OSError:
        return None
    if header is None or header[3] + header[1] != info.st_size:
        return None
    return info.st_mtime, DiskEntry(header[0], path, info.st_size, header[4])


def read_state(entry: DiskEntry, *, images: bool = False) -> bytes | None:
    """The state in ``entry``'s file, or None if the file is not a regular file of
    ``entry.num_bytes`` bytes (checked before reading), or does not hold what its header
    says (``entry``'s tokens, its state's size and checksum; ``images``: as
    :func:`scan`)."""
    try:
        with open(entry.path, "rb", opener=_open_for_reading) as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size != entry.num_bytes:
                return None
            header = _read_header(file, images)
            if header is None or header[3] + header[1] != entry.num_bytes:
                return None
            data = file.read(header[1])
    except OSError:
        return None
    tokens, size, crc, _, _ = header
    if tokens != entry.tokens or len(data) != size or zlib.crc32(data) != crc:
        return None
    return data


def write_entry(
    directory: str,
    tokens: tuple[int, ...],
    head: bytes,
    data: bytes,
    *,
    hinted: bool = False,
    owner: str | None = None,
) -> DiskEntry:
    """Write ``head`` (:func:`encode`'s, with the same ``hinted``) and ``data`` into the file
    of ``tokens`` in ``directory``, through a temporary file renamed into place (atomic).

    Raises:
        OSError: it could not be written (no file is left behind).
    """
    name = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:32] + _SUFFIX
    path = os.path.join(directory, name)
    temp = os.path.join(directory, f".tmp-{os.getpid()}-{name}")
    try:
        with open(temp, "wb", opener=open_private) as file:
            file.write(head)
            file.write(data)
        os.replace(temp, path)
    except OSError:
        remove(temp)
        raise
    return DiskEntry(tokens, path, len(head) + len(data), hinted, owner)


def scan(directory: str, *, images: bool = False) -> list[DiskEntry]:
    """The valid entries' files already in ``directory`` (headers only), oldest first,
    one per tokens (the newer); every other file is deleted (the lock's aside).
    ``images``: entries may hold image placeholder ids (the folder is a projector's);
    without it such a file lies."""
    found: list[tuple[float, DiskEntry]] = []  # (mtime, entry)
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    for name in names:
        if name == LOCK:
            continue
        path = os.path.join(directory, name)
        is_entry = name.endswith(_SUFFIX) and not name.startswith(".")  # not a temp file
        read = _read_entry(path, images) if is_entry else None
        if read is None:
            remove(path)
            continue
        found.append(read)
    newest: dict[tuple[int, ...], DiskEntry] = {}
    for _, entry in sorted(found, key=lambda pair: pair[0]):
        held = newest.pop(entry.tokens, None)  # the same tokens twice: the newer
        if held is not None:
            remove(held.path)
        newest[entry.tokens] = entry
    return list(newest.values())
