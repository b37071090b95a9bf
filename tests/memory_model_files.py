"""The random recurrent, hybrid and sliding-window models of ``scripts/make_memory_model.py``,
for the tests of checkpoints (issue 40)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


def script() -> Any:
    """``scripts/make_memory_model.py`` as a module."""
    path = Path(__file__).parent.parent / "scripts" / "make_memory_model.py"
    spec = importlib.util.spec_from_file_location("make_memory_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def write(folder: Path, kind: str, tokenizer_from: Path) -> Path:
    """Write the model of memory ``kind`` into ``folder``."""
    path: Path = script().write_memory_model(
        folder / f"{kind}.gguf", kind=kind, tokenizer_from=tokenizer_from
    )
    return path
