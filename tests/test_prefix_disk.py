"""The disk prefix tier (llamax.engine.kv.prefix_disk) against the fake backend: prefixes the
RAM tier drops (or, with no RAM tier, KV evictions) are written to files within a byte
budget, restored instead of recomputed (by the next context on the directory too), and a
file that lies is deleted and the prompt recomputed."""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from adversaries import deadline

import llamax
from llamax.engine.kv import disk_files, prefix_disk
from llamax.engine.kv.disk_files import MAGIC
from llamax.engine.kv.prefix_disk import MAX_DEFAULT_BYTES, PrefixDiskTier, default_disk_budget
from llamax.engine.kv.prefix_tier import PrefixHit
from llamax.flags import option_values
from llamax.testing import FakeBackend, assert_idle

GREEDY = llamax.SamplingParams(max_tokens=6, temperature=0)
MB = 1 << 20


def system(i: int) -> str:
    """A ~90-token system prompt (one fake token per byte) sharing not even its first token
    with another's."""
    return (
        f"{'ABCDEFGHIJ'[i]}) You are assistant number {i}. " + "Answer briefly and politely. " * 2
    )


Make = Callable[..., llamax.Context]


@pytest.fixture(params=["unified", "streams"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """A Context (one sequence id per ``n_seq_max``) with a disk tier in ``tmp_path`` and,
    by default, no RAM tier; each is leak-checked (tiers included) and closed after the
    test."""
    layout = str(request.param)
    made: list[llamax.Context] = []

    def build(
        *,
        n_seq_max: int = 1,
        prefix_ram_bytes: int = 0,
        prefix_disk_bytes: int | None = MB,
        directory: Path = tmp_path,
        **options: Any,
    ) -> llamax.Context:
        n_ctx = 512 * n_seq_max if layout == "streams" else 512
        backend = FakeBackend(n_ctx=n_ctx, n_seq_max=n_seq_max, kv_layout=layout, **options)
        ctx = llamax.Context(
            backend=backend,
            autostart=False,
            prefix_ram_bytes=prefix_ram_bytes,
            prefix_disk_dir=str(directory),
            prefix_disk_bytes=prefix_disk_bytes,
        )
        made.append(ctx)
        return ctx

    yield build
    for ctx in made:
        if not ctx.closed:
            assert_idle(ctx)
        ctx.close()


def complete(ctx: llamax.Context, prompt: str) -> llamax.Completion:
    handle = ctx.add_request(prompt, GREEDY)
    while ctx.has_work():
        ctx.process()
    return handle.result(0)


def cold(prompt: str) -> llamax.Completion:
    ctx = llamax.Context(
        backend=FakeBackend(n_ctx=2048, n_seq_max=1), autostart=False, prefix_ram_bytes=0
    )
    try:
        return complete(ctx, prompt)
    finally:
        ctx.close()


def computed(ctx: llamax.Context, prompt: str) -> tuple[llamax.Completion, int]:
    """Run ``prompt``; return it and the prompt tokens computed for it."""
    before = ctx.stats().num_prefill_tokens
    done = complete(ctx, prompt)
    return done, ctx.stats().num_prefill_tokens - before


def files(directory: Path) -> list[Path]:
    """The entries' files under ``directory`` (in its model-key folder)."""
    return sorted(directory.glob("*/*.kv"))


def disk_tier(ctx: llamax.Context) -> PrefixDiskTier:
    tier = ctx._engine.scheduler.prefix.disk
    assert tier is not None
    return tier


# ---------------------------------------------------------------------- engine
def test_an_evicted_prefix_goes_to_disk_and_is_restored(make: Make, tmp_path: Path) -> None:
    ctx = make()
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")  # takes the only sequence id: system(0) goes to disk
    stats = ctx.stats()
    assert (stats.prefix_disk_entries, stats.num_prefix_disk_stores) == (1, 1)
    assert stats.prefix_disk_bytes == sum(f.stat().st_size for f in files(tmp_path))
    assert 0 < stats.prefix_disk_bytes <= stats.prefix_disk_budget_bytes == MB
    done, num = computed(ctx, system(0) + "C3?")
    assert num == 3  # only "C3?"
    assert done.usage.cached_tokens == len(system(0))
    assert done.token_ids == cold(system(0) + "C3?").token_ids
    stats = ctx.stats()
    assert (stats.num_prefix_disk_hits, stats.num_prefix_disk_restores) == (1, 1)
    assert stats.num_prefix_disk_refused == 0
    assert stats.num_prefix_disk_tokens == len(system(0))
    assert stats.prefix_disk_restore_seconds > 0
    # the restored file stays (a cache); system(1) was evicted to disk to make room
    assert stats.prefix_disk_entries == 2 == len(files(tmp_path))
    assert ctx.audit() == []


def test_a_restore_from_disk_gives_what_a_kv_hit_gives(make: Make, tmp_path: Path) -> None:
    kv = make(n_seq_max=2, directory=tmp_path / "kv")
    complete(kv, system(0) + "A1?")
    hit = complete(kv, system(0) + "C3?")  # a KV hit
    assert kv.stats().num_prefix_disk_hits == 0
    disk = make(directory=tmp_path / "disk")
    complete(disk, system(0) + "A1?")
    complete(disk, system(1) + "B2?")
    restored = complete(disk, system(0) + "C3?")
    assert disk.stats().num_prefix_disk_restores == 1
    assert restored.token_ids == hit.token_ids
    assert restored.usage.cached_tokens == hit.usage.cached_tokens == len(system(0))


def test_the_ram_tiers_drops_go_to_disk(make: Make, tmp_path: Path) -> None:
    ctx = make(prefix_ram_bytes=700)  # room for one entry in RAM
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")  # system(0) to RAM
    assert ctx.stats().prefix_ram_entries == 1 and ctx.stats().prefix_disk_entries == 0
    complete(ctx, system(2) + "C3?")  # system(1) to RAM, pushing system(0) out to disk
    stats = ctx.stats()
    assert stats.prefix_ram_entries == 1 and stats.prefix_disk_entries == 1
    _, num = computed(ctx, system(0) + "D4?")
    assert num == 3
    assert ctx.stats().num_prefix_disk_restores == 1


def test_a_longer_prefix_in_ram_wins_over_disk(make: Make) -> None:
    ctx = make(prefix_ram_bytes=700)
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    complete(ctx, system(2) + "C3?")  # system(0) on disk, system(1) in RAM
    _, num = computed(ctx, system(1) + "E5?")
    assert num == 3
    stats = ctx.stats()
    assert stats.num_prefix_ram_restores == 1 and stats.num_prefix_disk_hits == 0


def test_a_tier_that_fails_a_restore_falls_back_to_the_next(make: Make, tmp_path: Path) -> None:
    """RAM and disk each hold a copy of system(0) (a restored file stays on disk); the RAM
    copy, tried first, is refused by the memory: the disk's copy is restored instead of
    the prefix being computed again."""
    ctx = make(prefix_ram_bytes=700)  # room for one entry in RAM
    for prompt in ("A1?", "B2?", "C3?"):
        complete(ctx, system("ABC".index(prompt[0])) + prompt)  # system(0) to disk
    complete(ctx, system(0) + "D4?")  # restored from disk (the file stays)
    complete(ctx, system(1) + "E5?")  # system(0) + "D4?" evicted to RAM
    before = ctx.stats()
    assert before.prefix_ram_entries == 1 and before.num_prefix_disk_restores == 2
    assert len(files(tmp_path)) == before.prefix_disk_entries
    backend = ctx._backend
    assert isinstance(backend, FakeBackend)
    faults = iter([1])  # the first state load fails, the next ones work
    backend.fault = lambda where: next(faults, None) if where == "state_seq_set" else None
    done, num = computed(ctx, system(0) + "F6?")
    backend.fault = None
    assert num == 3  # only "F6?": the disk's copy gave system(0)
    assert done.token_ids == cold(system(0) + "F6?").token_ids
    after = ctx.stats()
    assert (after.num_prefix_ram_hits, after.num_prefix_ram_refused) == (1, 1)
    assert after.num_prefix_disk_restores == before.num_prefix_disk_restores + 1
    assert ctx.audit() == []


def test_the_next_context_on_the_directory_restores_from_disk(make: Make, tmp_path: Path) -> None:
    first = make()
    complete(first, system(0) + "A1?")
    complete(first, system(1) + "B2?")
    first.close()
    assert len(files(tmp_path)) == 1  # what KV held at close is not written
    second = make()
    assert second.stats().prefix_disk_entries == 1
    done, num = computed(second, system(0) + "C3?")
    assert num == 3
    assert done.token_ids == cold(system(0) + "C3?").token_ids


def test_entries_stay_within_the_byte_budget_least_recently_used_out(
    make: Make, tmp_path: Path
) -> None:
    ctx = make(prefix_disk_bytes=2000)  # two entries (~900 bytes each)
    for i in range(4):
        complete(ctx, system(i) + "?")
    stats = ctx.stats()
    assert stats.num_prefix_disk_stores == 3
    assert stats.prefix_disk_entries == 2 == len(files(tmp_path))
    assert stats.prefix_disk_bytes <= 2000
    _, num = computed(ctx, system(0) + "!")  # the oldest went first
    assert num == len(system(0)) + 1
    _, num = computed(ctx, system(2) + "!")
    assert num == 1


def test_adapter_states_are_not_written(tmp_path: Path) -> None:
    tier = PrefixDiskTier(str(tmp_path), MB)
    try:
        assert not tier.store(list(range(40)), b"x" * 10, adapters=(("a", 1.0),))
        assert tier.store(list(range(40)), b"x" * 10)
        assert tier.lookup([*range(40), 1], (("a", 1.0),)) is None
        assert tier.lookup([*range(40), 1]) is not None
    finally:
        tier.close()


# ---------------------------------------------------------------------- files that lie
def _rewrite(path: Path, tokens: list[int], data: bytes, **header: Any) -> None:
    fields = {"tokens": tokens, "size": len(data), "crc32": zlib.crc32(data), **header}
    raw = json.dumps(fields).encode()
    path.write_bytes(struct.pack("<8sII", MAGIC, 1, len(raw)) + raw + data)


def _fields(path: Path) -> tuple[list[int], bytes]:
    blob = path.read_bytes()
    (length,) = struct.unpack("<I", blob[12:16])
    header = json.loads(blob[16 : 16 + length])
    return header["tokens"], blob[16 + length :]


def _flip_last(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[-2] ^= 0x01
    path.write_bytes(bytes(blob))


def _short_state(path: Path) -> None:
    tokens, data = _fields(path)
    _rewrite(path, tokens, json.dumps(json.loads(data)[:-1]).encode())


def _as_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(b"x")


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-5]),
    "bad magic": lambda p: p.write_bytes(b"NOTLLAMA" + p.read_bytes()[8:]),
    "bad version": lambda p: p.write_bytes(p.read_bytes()[:8] + b"\x09" + p.read_bytes()[9:]),
    "bad crc": _flip_last,
    "size lies": lambda p: _rewrite(p, *_fields(p), size=len(_fields(p)[1]) + 1),
    "tokens lie": lambda p: _rewrite(p, [t + 1 for t in _fields(p)[0]], _fields(p)[1]),
    "state short of its tokens": _short_state,
    "extra header field": lambda p: _rewrite(p, *_fields(p), extra=1),
    "random bytes": lambda p: p.write_bytes(os.urandom(900)),
    "empty": lambda p: p.write_bytes(b""),
    "a directory": _as_directory,
}


@pytest.mark.parametrize("damage", list(DAMAGE.values()), ids=list(DAMAGE))
def test_a_file_that_lies_is_dropped_and_recomputed(
    make: Make, tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    ctx = make()
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    (path,) = files(tmp_path)
    damage(path)
    done, num = computed(ctx, system(0) + "C3?")
    assert num == len(system(0)) + 3
    assert done.token_ids == cold(system(0) + "C3?").token_ids
    stats = ctx.stats()
    assert stats.num_prefix_disk_restores == 0
    assert stats.num_prefix_disk_refused == 1  # and deleted
    assert files(tmp_path) == [] or stats.prefix_disk_entries == 1  # system(1)'s, not this
    assert ctx.audit() == []
    assert not ctx.closed


@pytest.mark.parametrize("damage", list(DAMAGE.values()), ids=list(DAMAGE))
def test_a_file_that_lies_is_deleted_when_the_next_context_scans(
    make: Make, tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    first = make()
    complete(first, system(0) + "A1?")
    complete(first, system(1) + "B2?")
    first.close()
    (path,) = files(tmp_path)
    damage(path)
    (path.parent / "stray.kv").write_bytes(b"LLAMAXKV")  # a stray half-file
    second = make()
    # the scan reads headers only: the state's checksum and contents are checked on restore
    valid = damage in (DAMAGE["tokens lie"], DAMAGE["state short of its tokens"], DAMAGE["bad crc"])
    assert second.stats().prefix_disk_entries == (1 if valid else 0)  # headers only are read
    assert not (path.parent / "stray.kv").exists()
    assert path.exists() == valid
    done, num = computed(second, system(0) + "C3?")
    assert num == len(system(0)) + 3
    assert done.token_ids == cold(system(0) + "C3?").token_ids


def test_the_scan_keeps_the_newest_files_within_the_budget(tmp_path: Path) -> None:
    tier = PrefixDiskTier(str(tmp_path), MB)
    for i in range(3):
        assert tier.store([i + 1] * 40, bytes([i]) * 100)
    paths = [e.path for e in tier.entries()]
    sizes = [e.num_bytes for e in tier.entries()]
    tier.close()
    for age, path in enumerate(paths):
        os.utime(path, (1000 + age, 1000 + age))
    small = PrefixDiskTier(str(tmp_path), sizes[1] + sizes[2])
    try:
        assert [e.path for e in small.entries()] == paths[1:]
        assert not os.path.exists(paths[0]) and small.audit() == []
        assert small.read(PrefixHit(small, small.entries()[0], 0)) == bytes([1]) * 100
    finally:
        small.close()


def test_the_scan_deletes_leftover_temporary_files_and_duplicates(tmp_path: Path) -> None:
    tier = PrefixDiskTier(str(tmp_path), MB)
    assert tier.store([7] * 40, b"s" * 100)
    (path,) = [Path(e.path) for e in tier.entries()]
    tier.close()
    temp = path.parent / f".tmp-1-{path.name}"  # a crash between the write and the rename
    temp.write_bytes(path.read_bytes())
    copy = path.parent / ("0" * 32 + ".kv")  # the same tokens under another name, older
    copy.write_bytes(path.read_bytes())
    os.utime(copy, (1000, 1000))
    again = PrefixDiskTier(str(tmp_path), MB)
    try:
        assert [Path(e.path) for e in again.entries()] == [path]
        assert not temp.exists() and not copy.exists() and again.audit() == []
    finally:
        again.close()


# ---------------------------------------------------------------------- disk errors
@pytest.mark.parametrize("where", ["open", "replace"])
def test_a_failed_write_loses_only_the_entry(
    make: Make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    ctx = make()

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "open":
        monkeypatch.setattr(disk_files, "open", fail, raising=False)
    else:
        monkeypatch.setattr(disk_files.os, "replace", fail)
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    complete(ctx, system(2) + "C3?")
    monkeypatch.undo()
    stats = ctx.stats()
    assert stats.num_prefix_disk_stores == 0 and stats.prefix_disk_entries == 0
    assert disk_tier(ctx).stats().num_store_failures == 2
    assert list(tmp_path.glob("*/.tmp-*")) == [] and files(tmp_path) == []
    _, num = computed(ctx, system(0) + "D4?")
    assert num == len(system(0)) + 3
    assert ctx.stats().num_prefix_disk_stores == 1  # writing works again: system(2)
    assert len(files(tmp_path)) == 1


def test_an_unreadable_file_is_refused(
    make: Make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = make()
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_files, "open", fail, raising=False)
    _, num = computed(ctx, system(0) + "C3?")
    monkeypatch.undo()
    assert num == len(system(0)) + 3
    assert ctx.stats().num_prefix_disk_refused == 1


def test_a_state_the_memory_refuses_is_deleted_and_recomputed(make: Make, tmp_path: Path) -> None:
    ctx = make()
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    backend = ctx._backend
    assert isinstance(backend, FakeBackend)
    backend.fault = lambda where: 1 if where == "state_seq_set" else None
    done, num = computed(ctx, system(0) + "C3?")
    backend.fault = None
    assert num == len(system(0)) + 3
    assert done.token_ids == cold(system(0) + "C3?").token_ids
    stats = ctx.stats()
    assert (stats.num_prefix_disk_hits, stats.num_prefix_disk_refused) == (1, 1)
    assert stats.prefix_disk_entries == 1 == len(files(tmp_path))  # system(1) only


# ---------------------------------------------------------------------- files are input
def test_a_fifo_in_an_entrys_place_is_refused_without_blocking(make: Make, tmp_path: Path) -> None:
    ctx = make()
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    (path,) = files(tmp_path)
    path.unlink()
    os.mkfifo(path)  # nobody ever writes to it: an open for reading would wait forever
    with deadline(30):  # an open that waits for a writer would wait forever
        done, num = computed(ctx, system(0) + "C3?")
    assert num == len(system(0)) + 3
    assert done.token_ids == cold(system(0) + "C3?").token_ids
    assert ctx.stats().num_prefix_disk_refused == 1
    assert not path.exists()  # deleted when refused


class _CountingFile:
    """A file whose reads are counted into ``read``."""

    def __init__(self, file: Any, read: list[int]) -> None:
        self._file, self._read = file, read

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(size)
        self._read.append(len(data))
        return bytes(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def test_a_file_larger_than_its_entry_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = PrefixDiskTier(str(tmp_path), 64 * MB)
    try:
        assert tier.store([5] * 40, b"s" * 1000)
        (entry,) = tier.entries()
        with open(entry.path, "ab") as file:
            file.write(b"\0" * (16 * MB))  # junk behind a valid header and state
        read: list[int] = []
        monkeypatch.setattr(
            disk_files,
            "open",
            lambda *a, **k: _CountingFile(open(*a, **k), read),  # noqa: SIM115
            raising=False,
        )
        assert tier.read(PrefixHit(tier, entry, 0)) is None
        assert sum(read) < 64 << 10, "the junk was read"
        assert tier.stats().num_refused == 1 and tier.entries() == []
        assert not os.path.exists(entry.path)
    finally:
        tier.close()


def test_a_restore_reads_only_the_entrys_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = PrefixDiskTier(str(tmp_path), MB)
    try:
        assert tier.store([5] * 40, b"s" * 1000)
        (entry,) = tier.entries()
        read: list[int] = []
        monkeypatch.setattr(
            disk_files,
            "open",
            lambda *a, **k: _CountingFile(open(*a, **k), read),  # noqa: SIM115
            raising=False,
        )
        assert tier.read(PrefixHit(tier, entry, 0)) == b"s" * 1000
        assert sum(read) == entry.num_bytes
    finally:
        tier.close()


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_files_and_folders_are_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    directory = tmp_path / "new" / "cache"
    previous = os.umask(umask)
    try:
        tier = PrefixDiskTier(str(directory), MB)
        try:
            assert tier.store([5] * 40, b"s" * 100)
            (entry,) = tier.entries()
            assert tier.read(PrefixHit(tier, entry, 0)) == b"s" * 100
        finally:
            tier.close()
    finally:
        os.umask(previous)
    mode = lambda p: stat.S_IMODE(os.lstat(p).st_mode)  # noqa: E731
    assert mode(directory) == 0o700  # made by the tier
    assert mode(tier.directory) == 0o700
    assert mode(entry.path) == 0o600
    assert mode(os.path.join(tier.directory, ".lock")) == 0o600


def test_an_existing_tier_folder_is_made_private(tmp_path: Path) -> None:
    tier = PrefixDiskTier(str(tmp_path), MB)
    folder = tier.directory
    tier.close()
    os.chmod(folder, 0o755)  # as an older llamax made it
    os.chmod(tmp_path, 0o751)
    again = PrefixDiskTier(str(tmp_path), MB)
    try:
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o751  # the user's folder: as is
    finally:
        again.close()


def _read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make deleting fail as on a read-only filesystem (chmod does not stop root)."""

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    for name in ("unlink", "remove", "rmdir"):
        monkeypatch.setattr(disk_files.os, name, refuse)


def test_clear_cache_on_a_read_only_filesystem_says_the_files_stay(
    make: Make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = make()
    for i in range(3):
        complete(ctx, system(i) + "?")
    kept = files(tmp_path)
    assert len(kept) == 2
    _read_only(monkeypatch)
    with pytest.raises(llamax.CacheClearError, match=r"2 of 2 files .* stay") as caught:
        ctx.clear_cache()
    monkeypatch.undo()
    assert "Read-only file system" in str(caught.value)
    assert files(tmp_path) == kept  # still there: so the call did not succeed
    stats = ctx.stats()
    assert (stats.num_retained, stats.prefix_disk_entries) == (0, 0)  # the rest was cleared
    _, num = computed(ctx, system(0) + "!")  # this context does not use them any more
    assert num == len(system(0)) + 1
    assert ctx.clear_cache() == 1  # writable again: a retry deletes what stayed
    assert files(tmp_path) == []
    ctx.close()
    again = make()
    assert again.stats().prefix_disk_entries == 0  # nothing comes back at the next start


def test_the_server_says_when_clearing_left_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    import httpx

    from llamax.server import create_app

    ctx = llamax.Context(
        backend=FakeBackend(n_ctx=512, n_seq_max=1),
        prefix_ram_bytes=0,
        prefix_disk_dir=str(tmp_path),
        prefix_disk_bytes=MB,
    )
    try:
        for i in range(2):
            ctx.add_request(system(i) + "?", GREEDY).result(60)

        async def reset() -> httpx.Response:
            transport = httpx.ASGITransport(app=create_app(ctx))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.post("/reset_prefix_cache")

        _read_only(monkeypatch)
        response = asyncio.run(reset())
        monkeypatch.undo()
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == "cache_clear_failed" and "stay" in error["message"]
        assert len(files(tmp_path)) == 1
        assert_idle(ctx)
    finally:
        ctx.close()


# ---------------------------------------------------------------------- lifecycle
def test_two_contexts_on_one_directory_is_a_typed_error(make: Make) -> None:
    first = make()
    with pytest.raises(llamax.InvalidParameterError, match="in use"):
        make()
    first.close()
    make()  # free again once the first is closed


def test_clear_cache_deletes_the_files(make: Make, tmp_path: Path) -> None:
    ctx = make()
    for i in range(3):
        complete(ctx, system(i) + "?")
    assert ctx.stats().prefix_disk_entries == 2 == len(files(tmp_path))
    assert ctx.clear_cache() == 1
    stats = ctx.stats()
    assert (stats.prefix_disk_entries, stats.prefix_disk_bytes) == (0, 0)
    assert files(tmp_path) == []
    _, num = computed(ctx, system(0) + "!")
    assert num == len(system(0)) + 1


def test_the_audit_checks_the_disk_tier(make: Make) -> None:
    ctx = make()
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    tier = disk_tier(ctx)
    tier._lru._num_bytes += 1
    assert any("disk tier accounts" in p for p in ctx.audit())
    tier._lru._num_bytes -= 1
    assert ctx.audit() == []


def test_a_zero_budget_means_no_disk_tier(make: Make, tmp_path: Path) -> None:
    ctx = make(prefix_disk_bytes=0)
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    assert ctx.stats().prefix_disk_budget_bytes == 0
    assert ctx._engine.scheduler.prefix.disk is None and list(tmp_path.iterdir()) == []


def test_without_prefix_sharing_nothing_is_written(make: Make, tmp_path: Path) -> None:
    ctx = make(can_share_prefix=False)
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    assert ctx.stats().prefix_disk_budget_bytes == 0 and files(tmp_path) == []


# ---------------------------------------------------------------------- options
@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_prefix_disk_bytes_is_a_typed_error(bad: object, tmp_path: Path) -> None:
    with pytest.raises(llamax.InvalidParameterError, match="prefix_disk_bytes"):
        llamax.Context(
            backend=FakeBackend(),
            autostart=False,
            prefix_disk_dir=str(tmp_path),
            prefix_disk_bytes=bad,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("bad", [5, "", b"dir"])
def test_bad_prefix_disk_dir_is_a_typed_error(bad: object) -> None:
    with pytest.raises(llamax.InvalidParameterError, match="prefix_disk_dir"):
        llamax.Context(backend=FakeBackend(), autostart=False, prefix_disk_dir=bad)  # type: ignore[arg-type]


def test_a_pathlib_path_is_taken_as_its_text(tmp_path: Path) -> None:
    # the disk tier's directory and the projector take a Path as the model does (both
    # were refused as "must be None or a ... path" when given a pathlib.Path)
    config = llamax.ContextConfig(
        model_path="m.gguf", prefix_disk_dir=tmp_path / "tier", mmproj=tmp_path / "p.gguf"
    )
    assert config.prefix_disk_dir == str(tmp_path / "tier")
    assert config.mmproj == str(tmp_path / "p.gguf")
    with llamax.Context(
        backend=FakeBackend(), autostart=False, prefix_disk_dir=tmp_path / "new"
    ) as ctx:
        assert ctx.stats().prefix_disk_budget_bytes > 0
    assert (tmp_path / "new").is_dir()


def test_a_directory_that_cannot_be_made_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(llamax.InvalidParameterError, match="cannot be used"):
        llamax.Context(
            backend=FakeBackend(), autostart=False, prefix_disk_dir=str(tmp_path / "file")
        )


def test_the_default_budget_is_capped_half_the_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with llamax.Context(
        backend=FakeBackend(), autostart=False, prefix_disk_dir=str(tmp_path / "new")
    ) as ctx:
        budget = ctx.stats().prefix_disk_budget_bytes
        assert 0 < budget <= MAX_DEFAULT_BYTES
    assert (tmp_path / "new").is_dir()

    class Usage:
        free = 6 << 30

    monkeypatch.setattr(prefix_disk.shutil, "disk_usage", lambda path: Usage())
    assert default_disk_budget(str(tmp_path / "not" / "yet")) == 3 << 30
    Usage.free = 100 << 30
    assert default_disk_budget(str(tmp_path)) == MAX_DEFAULT_BYTES


def test_the_flags_parse(tmp_path: Path) -> None:
    from llamax.server.cli import build_parser

    ns = build_parser().parse_args(
        ["m.gguf", "--prefix-disk-dir", str(tmp_path), "--prefix-disk-bytes", "2G"]
    )
    values = option_values(ns, llamax.ContextConfig)
    assert values["prefix_disk_dir"] == str(tmp_path)
    assert values["prefix_disk_bytes"] == 2 << 30
    bare = option_values(build_parser().parse_args(["m.gguf"]), llamax.ContextConfig)
    assert "prefix_disk_dir" not in bare and "prefix_disk_bytes" not in bare


def test_a_bad_flag_is_refused(capsys: Any) -> None:
    from llamax.server.cli import main

    assert main(["m.gguf", "--prefix-disk-bytes", "lots", "--log-level", "critical"]) == 2
    assert "--prefix-disk-bytes: not a byte size" in capsys.readouterr().err


# ---------------------------------------------------------------------- server
def test_the_server_clears_the_disk_tier_and_shows_it_in_metrics(tmp_path: Path) -> None:
    import asyncio

    import httpx

    from llamax.server import create_app

    async def call(app: Any, method: str, path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path)

    ctx = llamax.Context(
        backend=FakeBackend(n_ctx=512, n_seq_max=1),
        prefix_ram_bytes=0,
        prefix_disk_dir=str(tmp_path),
        prefix_disk_bytes=MB,
    )
    try:
        app = create_app(ctx)
        for i in range(3):
            ctx.add_request(system(i) + "?", GREEDY).result(60)
        ctx.add_request(system(0) + "!", GREEDY).result(60)  # a restore from disk
        metrics = asyncio.run(call(app, "GET", "/metrics")).text
        assert "llamax_prefix_disk_entries 3.0" in metrics
        assert "llamax_prefix_disk_restores_total 1.0" in metrics
        assert "llamax_prefix_disk_stores_total 3.0" in metrics
        assert "llamax_prefix_disk_budget_bytes 1.048576e+06" in metrics
        assert asyncio.run(call(app, "POST", "/reset_prefix_cache")).status_code == 200
        assert ctx.stats().prefix_disk_entries == 0 and files(tmp_path) == []
        assert_idle(ctx)
    finally:
        ctx.close()
