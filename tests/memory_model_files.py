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
