"""The repository's ``scripts/*.py`` as modules, for the tests that write test models with
them. Each is loaded once per process and registered in ``sys.modules`` (their dataclasses
look their module up)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).parent.parent / "scripts"


def load_script(name: str) -> Any:
    """``scripts/{name}.py`` as a module."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
