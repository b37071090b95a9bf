"""The disk tier below the host-RAM prefix tier. Pure Python (files, no native calls).

Prefixes the RAM tier (:mod:`llamax.engine.kv.prefix_ram`) drops to stay within its budget
are written here, one file per entry, within a byte budget; with the RAM tier disabled,
prefixes evicted from KV come here directly. A prompt whose longest stored prefix is on
disk gets that state restored into a fresh slot, as from RAM.

Design note: a restored entry's file stays (the disk is a cache; the KV slot holds the
prefix too, and when that slot is evicted again the same tokens' file is only marked
recently used, not written again). Entries are keyed by their tokens alone: only states
computed without LoRA adapters are stored, since an adapter's name is not a stable
identity across restarts. Files live in ``<directory>/<model key>/``, the key a short hash
of the model's identity, so another model never reads them. Writes go to a temporary file
renamed into place (atomic); nothing is fsynced, so a crash may lose recent entries, never
leave a half-written one under an entry's name.

File format: :data:`MAGIC`, the format version and the header's length (two little-endian
``u32``), the header (JSON: ``tokens``, ``size`` and ``crc32`` of the state), the state.
Files that lie (another magic or version, an unreadable header, a length or checksum that
does not match) are deleted when found and never reach the backend.

One context uses a directory at a time: it holds an exclusive ``flock`` on
``<model key>/.lock`` until it closes.

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
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from ...adapters import NO_ADAPTERS, AdapterSet
from ...errors import CacheClearError, InvalidParameterError
from .prefix_tier import MIN_STORED_TOKENS, ByteLRU, PrefixHit, TierCounters, TierStats, best_prefix

__all__ = [
    "MAGIC",
    "MAX_DEFAULT_BYTES",
    "VERSION",
    "DiskEntry",
    "PrefixDiskTier",
    "default_disk_budget",
]

_log = logging.getLogger("llamax")

MAGIC = b"LLAMAXKV"
"""The first 8 bytes of every entry's file."""
VERSION = 1
"""The file format's version."""
MAX_DEFAULT_BYTES = 8 << 30
"""The default budget (at most half the free space of the directory's filesystem)."""

_PREAMBLE = struct.Struct("<8sII")  # magic, version, header length
_MAX_HEADER = 64 << 20
_SUFFIX = ".kv"
_LOCK = ".lock"
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _open_for_reading(path: str, flags: int) -> int:
    """An ``open`` opener: never follows a link, never blocks on a FIFO or device."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)


def _open_private(path: str, flags: int) -> int:
    """An ``open`` opener for a new file: ``0600`` whatever the umask, never through a
    link."""
    fd = os.open(path, flags | os.O_NOFOLLOW | _CLOEXEC, _FILE_MODE)
    try:
        os.fchmod(fd, _FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def _make_private_dir(path: str) -> None:
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


def default_disk_budget(directory: str) -> int:
    """The default byte budget for ``directory``: :data:`MAX_DEFAULT_BYTES`, at most half
    the free space of its filesystem now (0 when that cannot be read)."""
    path = directory
    while not os.path.exists(path):  # the directory is created later: ask its parent
        parent = os.path.dirname(os.path.abspath(path))
        if parent == path:
            break
        path = parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return 0
    return max(0, min(free // 2, MAX_DEFAULT_BYTES))


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """One evicted prefix's state in a file."""

    tokens: tuple[int, ...]
    """The tokens the state holds, at positions ``0 .. len(tokens) - 1``."""
    path: str
    """The file."""
    num_bytes: int
    """The file's size (header and state)."""


def _encode(tokens: Sequence[int], data: bytes) -> bytes:
    header = json.dumps(
        {"tokens": list(tokens), "size": len(data), "crc32": zlib.crc32(data)},
        separators=(",", ":"),
    ).encode()
    return _PREAMBLE.pack(MAGIC, VERSION, len(header)) + header


def _read_header(file: IO[bytes]) -> tuple[tuple[int, ...], int, int, int] | None:
    """``(tokens, size, crc32, offset of the state)`` from an open file, or None if the
    preamble or header is not exactly what :func:`_encode` writes."""
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
    if not isinstance(header, dict) or set(header) != {"tokens", "size", "crc32"}:
        return None
    tokens, size, crc = header["tokens"], header["size"], header["crc32"]
    if not (
        isinstance(tokens, list)
        and tokens
        and all(type(t) is int and t >= 0 for t in tokens)
        and type(size) is int
        and size > 0
        and type(crc) is int
        and 0 <= crc < 1 << 32
    ):
        return None
    return tuple(tokens), size, crc, _PREAMBLE.size + length


def _remove(path: str) -> OSError | None:
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


def _read_entry(path: str) -> tuple[float, DiskEntry] | None:
    """``(mtime, entry)`` of the file at ``path`` from its header alone, or None if it is
    not a regular file whose header says what its size is."""
    try:
        with open(path, "rb", opener=_open_for_reading) as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                return None
            header = _read_header(file)
    except OSError:
        return None
    if header is None or header[3] + header[1] != info.st_size:
        return None
    return info.st_mtime, DiskEntry(header[0], path, info.st_size)


def _read_state(entry: DiskEntry) -> bytes | None:
    """The state in ``entry``'s file, or None if the file is not a regular file of
    ``entry.num_bytes`` bytes (checked before reading), or does not hold what its header
    says (``entry``'s tokens, its state's size and checksum)."""
    try:
        with open(entry.path, "rb", opener=_open_for_reading) as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size != entry.num_bytes:
                return None
            header = _read_header(file)
            if header is None or header[3] + header[1] != entry.num_bytes:
                return None
            data = file.read(header[1])
    except OSError:
        return None
    tokens, size, crc, _ = header
    if tokens != entry.tokens or len(data) != size or zlib.crc32(data) != crc:
        return None
    return data


class PrefixDiskTier:
    """Evicted prefixes' states in files, least recently used first out, by bytes.

    Args:
        directory: Where the files go (``<directory>/<model key>/``; created if missing).
        budget_bytes: The most bytes of files kept (0 disables the tier).
        model: The identity of the model every entry was computed with.
        min_tokens: Shorter prefixes are not stored.

    Raises:
        InvalidParameterError: the directory cannot be created or opened, or another
            context uses it.
    """

    name = "disk"

    def __init__(
        self,
        directory: str,
        budget_bytes: int,
        *,
        model: str = "",
        min_tokens: int = MIN_STORED_TOKENS,
    ) -> None:
        self.model = model
        self.min_tokens = min_tokens
        key = hashlib.sha256(model.encode()).hexdigest()[:16]
        self.directory = os.path.join(os.path.abspath(directory), key)
        self._lru: ByteLRU[tuple[int, ...], DiskEntry] = ByteLRU(
            budget_bytes,
            size=lambda e: e.num_bytes,
            key=lambda e: e.tokens,
            on_drop=self._dropped,
            label="the disk tier",
        )
        self._has_warned = False
        self._lock_fd: int | None = None
        self.counters = TierCounters()
        """``num_stored``: files written (dropped from RAM, or evicted from KV with no RAM
        tier); ``num_dropped``: files deleted to stay within the budget;
        ``num_refused``: files that did not read back as written, or states the memory
        refused."""
        try:
            _make_private_dir(self.directory)
            lock = _open_private(os.path.join(self.directory, _LOCK), os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise InvalidParameterError(
                f"prefix_disk_dir {directory!r} cannot be used: {exc}"
            ) from exc
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise InvalidParameterError(
                    f"prefix_disk_dir {directory!r} is in use by another context "
                    "(one context per directory and model)"
                ) from None
            raise InvalidParameterError(
                f"prefix_disk_dir {directory!r} cannot be locked: {exc}"
            ) from exc
        self._lock_fd = lock
        self._scan()

    @property
    def budget_bytes(self) -> int:
        """The most bytes of files kept."""
        return self._lru.budget_bytes

    @property
    def is_enabled(self) -> bool:
        """Whether anything may be stored."""
        return self.budget_bytes > 0 and self._lock_fd is not None

    @property
    def num_bytes(self) -> int:
        """Bytes of files held."""
        return self._lru.num_bytes

    @property
    def num_entries(self) -> int:
        """Entries held."""
        return len(self._lru)

    def entries(self) -> list[DiskEntry]:
        """Entries, least recently used first."""
        return list(self._lru)

    def stats(self) -> TierStats:
        """Counters and sizes, frozen."""
        return self.counters.stats(
            num_bytes=self.num_bytes, budget_bytes=self.budget_bytes, num_entries=self.num_entries
        )

    def close(self) -> None:
        """Release the directory (the files stay for the next context). Idempotent."""
        lock, self._lock_fd = self._lock_fd, None
        if lock is not None:
            os.close(lock)  # closing the descriptor releases the flock

    # ------------------------------------------------------------------ changes
    def wants(self, num_tokens: int, adapters: AdapterSet = NO_ADAPTERS) -> bool:
        """Whether a prefix of ``num_tokens`` tokens computed under ``adapters`` would be
        stored (before saving it)."""
        return self.is_enabled and adapters == () and num_tokens >= self.min_tokens

    def store(self, tokens: Sequence[int], data: bytes, adapters: AdapterSet = NO_ADAPTERS) -> bool:
        """Write ``data`` (the state of ``tokens``) as the most recently used entry,
        deleting the least recently used files beyond the budget. False if it is not
        wanted, alone exceeds the budget, or cannot be written (the entry is lost, logged
        once); a file already holding these tokens is only marked recently used."""
        key = tuple(tokens)
        if not self.wants(len(key), adapters) or not data:
            return False
        if self._lru.get(key) is not None:
            self._lru.touch(key)
            return True
        head = _encode(key, data)
        size = len(head) + len(data)
        if size > self.budget_bytes:
            return False
        self._lru.make_room(size)
        name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32] + _SUFFIX
        path = os.path.join(self.directory, name)
        temp = os.path.join(self.directory, f".tmp-{os.getpid()}-{name}")
        try:
            with open(temp, "wb", opener=_open_private) as file:
                file.write(head)
                file.write(data)
            os.replace(temp, path)
        except OSError as exc:
            _remove(temp)
            self.counters.num_store_failures += 1
            if not self._has_warned:
                self._has_warned = True
                _log.warning("could not keep an evicted prefix on disk (%s): %s", path, exc)
            return False
        self._lru.put(DiskEntry(key, path, size))
        self.counters.num_stored += 1
        return True

    def _dropped(self, entry: DiskEntry) -> None:
        _remove(entry.path)
        self.counters.num_dropped += 1

    def _forget(self, entry: DiskEntry) -> None:
        """Forget ``entry`` and delete its file."""
        if self._lru.get(entry.tokens) is entry:
            self._lru.pop(entry.tokens)
        _remove(entry.path)

    def hold(self, hit: PrefixHit[DiskEntry]) -> None:
        """Mark the entry as just used (counted as a hit), so the evictions that make room
        for it push other files out first; the file stays after the restore (the disk is
        a cache)."""
        self._lru.touch(hit.entry.tokens)
        self.counters.num_hits += 1

    def read(self, hit: PrefixHit[DiskEntry]) -> bytes | None:
        """The state in the entry's file. None if the entry is gone, or its file does not
        read back as written (deleted, counted refused): not a regular file, or not of the
        size recorded (checked before reading; then only that many bytes are read), or
        another header, length or checksum."""
        entry = hit.entry
        if self._lru.get(entry.tokens) is not entry:
            return None
        data = _read_state(entry)
        if data is None:
            self._forget(entry)
            self.counters.num_refused += 1
            return None
        self._lru.touch(entry.tokens)
        return data

    def release(self, hit: PrefixHit[DiskEntry], *, refused: bool) -> None:
        """The restore did not happen: for want of room (the file stays), or the memory
        refused the state (the file is deleted, counted refused)."""
        if refused:
            self._forget(hit.entry)
            self.counters.num_refused += 1

    def record_restore(self, num_tokens: int, seconds: float) -> None:
        """A restore gave ``num_tokens`` prompt tokens (0: none) in ``seconds``."""
        self.counters.record_restore(num_tokens, seconds)

    def clear(self) -> int:
        """Forget every entry and delete every file in the tier's folder (the lock's
        aside); return how many entries there were.

        Raises:
            CacheClearError: some files could not be deleted (a read-only filesystem);
                the message names how many and the first error. They are forgotten here
                but stay on disk, where the next context would find them again.
        """
        count = self._lru.clear()
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return count
        except OSError as exc:
            raise CacheClearError(
                f"the disk prefix tier {self.directory} could not be listed to clear it: {exc}"
            ) from exc
        failures = [
            error
            for name in names
            if name != _LOCK and (error := _remove(os.path.join(self.directory, name)))
        ]
        if failures:
            raise CacheClearError(
                f"{len(failures)} of {len(names) - (_LOCK in names)} files of the disk prefix "
                f"tier could not be deleted and stay in {self.directory} (the next context "
                f"would use them again; delete them by hand): {failures[0]}"
            )
        return count

    def _scan(self) -> None:
        """Index the valid files already in the directory (headers only), oldest first;
        delete the others and those beyond the budget."""
        found: list[tuple[float, DiskEntry]] = []  # (mtime, entry)
        try:
            names = os.listdir(self.directory)
        except OSError:
            names = []
        for name in names:
            if name == _LOCK:
                continue
            path = os.path.join(self.directory, name)
            is_entry = name.endswith(_SUFFIX) and not name.startswith(".")  # not a temp file
            read = _read_entry(path) if is_entry else None
            if read is None:
                _remove(path)
                continue
            found.append(read)
        newest: dict[tuple[int, ...], DiskEntry] = {}
        for _, entry in sorted(found, key=lambda pair: pair[0]):
            held = newest.pop(entry.tokens, None)  # the same tokens twice: the newer
            if held is not None:
                _remove(held.path)
            newest[entry.tokens] = entry
        self._lru.fill(newest.values())

    # ------------------------------------------------------------------ queries
    def lookup(
        self,
        prompt: Sequence[int],
        adapters: AdapterSet = NO_ADAPTERS,
        *,
        longer_than: int = 0,
        max_tokens: int | None = None,
    ) -> PrefixHit[DiskEntry] | None:
        """The entry giving the most of ``prompt`` (all but its last token), if it gives
        more than ``longer_than`` tokens and at least :attr:`min_tokens`; among equals the
        shortest entry. Only a prompt without adapters matches (see the module's note)."""
        if adapters != ():
            return None
        found = best_prefix(
            self._lru,
            prompt,
            longer_than=longer_than,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
        )
        return None if found is None else PrefixHit(self, *found)

    def audit(self) -> list[str]:
        """Inconsistencies in the tier's bookkeeping, as sentences."""
        return self._lru.audit()
