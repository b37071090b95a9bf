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

One context uses a directory at a time: it holds an exclusive ``flock`` on
``<model key>/.lock`` until it closes.

The files themselves (their format, and how they are written, read and deleted without
trusting what is on disk) are :mod:`llamax.engine.kv.disk_files`'s.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Sequence

from ...adapters import NO_ADAPTERS, AdapterSet
from ...errors import CacheClearError, InvalidParameterError
from .disk_files import (
    LOCK,
    DiskEntry,
    encode,
    make_private_dir,
    open_private,
    read_state,
    remove,
    scan,
    write_entry,
)
from .prefix_tier import MIN_STORED_TOKENS, ByteLRU, PrefixHit, StoredTier, best_prefix

__all__ = ["MAX_DEFAULT_BYTES", "PrefixDiskTier", "default_disk_budget"]

_log = logging.getLogger("llamax")

MAX_DEFAULT_BYTES = 8 << 30
"""The default budget (at most half the free space of the directory's filesystem)."""


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


class PrefixDiskTier(StoredTier[tuple[int, ...], DiskEntry]):
    """Evicted prefixes' states in files, least recently used first out, by bytes.

    Args:
        directory: Where the files go (``<directory>/<model key>/``; created if missing).
        budget_bytes: The most bytes of files kept (0 disables the tier).
        model: The identity of the model every entry was computed with (and of the
            projector, with ``images``).
        min_tokens: Shorter prefixes are not stored.
        images: Entries may hold images (placeholder ids): ``model`` names the projector
            that encoded them, so its folder is this projector's alone.

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
        images: bool = False,
    ) -> None:
        self.images = images
        key = hashlib.sha256(model.encode()).hexdigest()[:16]
        self.directory = os.path.join(os.path.abspath(directory), key)
        lru: ByteLRU[tuple[int, ...], DiskEntry] = ByteLRU(
            budget_bytes,
            size=lambda e: e.num_bytes,
            key=lambda e: e.tokens,
            on_drop=self._dropped,
            label="the disk tier",
            hinted=lambda e: e.hinted,
            owner=lambda e: e.owner,
        )
        # counts: num_stored files written (dropped from RAM, or evicted from KV with no
        # RAM tier); num_dropped deleted to stay within the budget; num_refused did not
        # read back as written, or the memory refused their state
        super().__init__(lru, model=model, min_tokens=min_tokens)
        self._has_warned = False
        self._lock_fd: int | None = None
        try:
            make_private_dir(self.directory)
            lock = open_private(os.path.join(self.directory, LOCK), os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise InvalidParameterError(
                f"prefix_disk_dir {directory!r} cannot be used: {exc}", param="prefix_disk_dir"
            ) from exc
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise InvalidParameterError(
                    f"prefix_disk_dir {directory!r} is in use by another context "
                    "(one context per directory and model)",
                    param="prefix_disk_dir",
                ) from None
            raise InvalidParameterError(
                f"prefix_disk_dir {directory!r} cannot be locked: {exc}", param="prefix_disk_dir"
            ) from exc
        self._lock_fd = lock
        self._lru.fill(scan(self.directory, images=images))  # what an earlier context left

    @property
    def is_enabled(self) -> bool:
        """Whether anything may be stored."""
        return self.budget_bytes > 0 and self._lock_fd is not None

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

    def store(
        self,
        tokens: Sequence[int],
        data: bytes,
        adapters: AdapterSet = NO_ADAPTERS,
        *,
        hinted: bool = False,
        owner: str | None = None,
    ) -> bool:
        """Write ``data`` (the state of ``tokens``) as the most recently used entry, marked
        ``hinted`` or not (in its header: the mark outlives the context), deleting files
        beyond the budget (unhinted ones first, least recently used first; hinted ones
        within ``owner``'s share: :class:`~llamax.engine.kv.prefix_tier.ByteLRU`). False
        if it is not wanted, alone exceeds the budget, would fit only by deleting hinted
        files within their owners' shares, or cannot be written (the entry is lost, logged
        once); a file already holding these tokens with the same mark is only marked
        recently used (with the other mark it is written again). A prefix with an image
        (placeholder ids) only in a projector's folder (``images``): its cells came from
        that projector."""
        key = tuple(tokens)
        if not self.wants(len(key), adapters) or not data or (min(key) < 0 and not self.images):
            return False
        held = self._lru.get(key)
        if held is not None and held.hinted == hinted:
            self._lru.touch(key)
            return True
        head = encode(key, data, hinted=hinted)
        size = len(head) + len(data)
        if not self._lru.make_room_for(DiskEntry(key, "", size, hinted, owner)):
            return False
        if held is not None:  # the other mark: written again (the same name) below
            self._lru.pop(key)
        try:
            entry = write_entry(self.directory, key, head, data, hinted=hinted, owner=owner)
        except OSError as exc:
            self.counts = self.counts.counted(num_store_failures=1)
            if not self._has_warned:
                self._has_warned = True
                _log.warning("could not keep an evicted prefix on disk: %s", exc)
            if held is not None and not self._lru.put(held):  # its file is still there
                remove(held.path)
            return False
        self._lru.put(entry)
        self.counts = self.counts.counted(num_stored=1)
        return True

    def _dropped(self, entry: DiskEntry) -> None:
        remove(entry.path)
        self.counts = self.counts.counted(num_dropped=1)

    def _forget(self, entry: DiskEntry) -> None:
        """Forget ``entry`` and delete its file."""
        if self._lru.get(entry.tokens) is entry:
            self._lru.pop(entry.tokens)
        remove(entry.path)

    def hold(self, hit: PrefixHit[DiskEntry]) -> None:
        """Mark the entry as just used (counted as a hit), so the evictions that make room
        for it push other files out first; the file stays after the restore (the disk is
        a cache)."""
        self._lru.touch(hit.entry.tokens)
        self.counts = self.counts.counted(num_hits=1)

    def read(self, hit: PrefixHit[DiskEntry]) -> bytes | None:
        """The state in the entry's file. None if the entry is gone, or its file does not
        read back as written (deleted, counted refused): not a regular file, or not of the
        size recorded (checked before reading; then only that many bytes are read), or
        another header, length or checksum."""
        entry = hit.entry
        if self._lru.get(entry.tokens) is not entry:
            return None
        data = read_state(entry, images=self.images)
        if data is None:
            self._forget(entry)
            self.counts = self.counts.counted(num_refused=1)
            return None
        self._lru.touch(entry.tokens)
        return data

    def release(self, hit: PrefixHit[DiskEntry], *, refused: bool) -> None:
        """The restore did not happen: for want of room (the file stays), or the memory
        refused the state (the file is deleted, counted refused)."""
        if refused:
            self._forget(hit.entry)
            self.counts = self.counts.counted(num_refused=1)

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
            if name != LOCK and (error := remove(os.path.join(self.directory, name)))
        ]
        if failures:
            raise CacheClearError(
                f"{len(failures)} of {len(names) - (LOCK in names)} files of the disk prefix "
                f"tier could not be deleted and stay in {self.directory} (the next context "
                f"would use them again; delete them by hand): {failures[0]}"
            )
        return count

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
