"""The random recurrent, hybrid and sliding-window models of ``scripts/make_memory_model.py``,
for the tests of checkpoints (issue 40)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from script_modules import load_script


def script() -> Any:
    """``scripts/make_memory_model.py`` as a module."""
    return load_script("make_memory_model")


def write(folder: Path, kind: str, tokenizer_from: Path) -> Path:
    """Write the model of memory ``kind`` into ``folder``."""
    path: Path = script().write_memory_model(
        folder / f"{kind}.gguf", kind=kind, tokenizer_from=tokenizer_from
    )
    return path


_SHARED: dict[tuple[str, Path], Path] = {}


def shared(tmp_path_factory: Any, kind: str, tokenizer_from: Path) -> Path:
    """The model of memory ``kind``, written once per test session and shared by every
    module that only reads it (writing one takes seconds: the tokenizer is copied)."""
    key = (kind, tokenizer_from)
    if key not in _SHARED:
        _SHARED[key] = write(tmp_path_factory.mktemp(f"memory_{kind}"), kind, tokenizer_from)
    return _SHARED[key]
