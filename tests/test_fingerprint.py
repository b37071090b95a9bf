"""The weights' fingerprint in a model's identity (issue 36, item 3), on small GGUF files
written with the ``gguf`` package: two files with the same metadata and other weights get
other fingerprints, wherever in a tensor the change is; copies get the same one.
tests/test_model_identity.py shows a session file and a disk-tier entry refused by a
SmolLM2 whose weights differ."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from llamax.backend.fingerprint import weights_fingerprint
from llamax.backend.gguf_file import read_header

gguf = pytest.importorskip("gguf")


def _write(path: Path, *, big: int = 300_000) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("same name")
    writer.add_tensor("small.weight", np.arange(64, dtype="f4"))
    writer.add_tensor("big.weight", np.arange(big, dtype="f4"))
    writer.add_tensor("last.weight", np.arange(1000, dtype="f2"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _poke(path: Path, tensor: str, element: int, value: float) -> None:
    header = read_header(path)
    (info,) = [t for t in header.tensors if t.name == tensor]
    dtype = np.dtype("f4" if info.type == 0 else "f2")
    data = np.memmap(path, dtype, "r+", header.data_offset + info.offset, info.shape)
    data[element] = value
    data.flush()
    del data


def test_copies_agree_and_a_change_in_any_tensor_shows(tmp_path: Path) -> None:
    original = _write(tmp_path / "a.gguf")
    copy = tmp_path / "copy.gguf"
    shutil.copy(original, copy)
    print_ = weights_fingerprint(original)
    assert len(print_) == 32 and weights_fingerprint(copy) == print_
    changed = set()
    for tensor, element in [
        ("small.weight", 7),  # hashed whole
        ("big.weight", 0),  # first chunk
        ("big.weight", 299_999),  # last chunk
        ("last.weight", 999),  # the end of the file
    ]:
        shutil.copy(original, copy)
        _poke(copy, tensor, element, -1.5)
        changed.add(weights_fingerprint(copy))
    assert print_ not in changed and len(changed) == 4


def test_a_requantization_shows_in_the_tensor_table(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "llama")
    writer.add_name("same name")
    writer.add_tensor("small.weight", np.arange(64, dtype="f4"))
    writer.add_tensor("big.weight", np.arange(300_000, dtype="f2"))  # same values, f16
    writer.add_tensor("last.weight", np.arange(1000, dtype="f2"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert weights_fingerprint(a) != weights_fingerprint(tmp_path / "b.gguf")


def test_a_file_that_is_not_gguf_is_sampled_whole(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF junk" * 1000)
    first = weights_fingerprint(path)
    path.write_bytes(b"GGUF junk" * 999 + b"GGUF jank")
    assert weights_fingerprint(path) != first


def test_a_split_model_is_fingerprinted_part_by_part(tmp_path: Path) -> None:
    for i in (1, 2):
        writer = gguf.GGUFWriter(str(tmp_path / f"m-{i:05d}-of-00002.gguf"), "llama")
        writer.add_uint16("split.no", i - 1)
        writer.add_uint16("split.count", 2)
        writer.add_tensor(f"t{i}.weight", np.arange(64, dtype="f4"))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    first = tmp_path / "m-00001-of-00002.gguf"
    before = weights_fingerprint(first)
    _poke(tmp_path / "m-00002-of-00002.gguf", "t2.weight", 3, 9.0)
    assert weights_fingerprint(first) != before
