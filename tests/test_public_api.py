"""The public API is pinned: exported names, their docstrings, the version, the layering."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
from pathlib import Path

import pytest

import llamax

PACKAGE = Path(llamax.__file__).resolve().parent

EXPECTED_ALL = [
    "BatchLogitsProcessor",
    "Chat",
    "Choice",
    "Completion",
    "Context",
    "ContextClosedError",
    "ContextConfig",
    "ContextLengthError",
    "ContextOptions",
    "ContextStats",
    "DeadlockError",
    "DefaultModelNotInstalledError",
    "Embedder",
    "EmptyPromptError",
    "EngineError",
    "FinishReason",
    "GrammarError",
    "InvalidParameterError",
    "InvalidRequestError",
    "LlamaxError",
    "LogitsProcessor",
    "LogitsRow",
    "LoopOwnershipError",
    "ModelInfo",
    "ModelLoadError",
    "PromptLookup",
    "KVCapacityError",
    "RequestFailedError",
    "RequestHandle",
    "SamplingParams",
    "Session",
    "SessionBusyError",
    "SessionError",
    "SessionLoadError",
    "TokenEvent",
    "TokenLogprob",
    "TopLogprob",
    "TurnStats",
    "Usage",
    "__version__",
    "default_model_path",
    "model_info",
]

PUBLIC_MODULES = {
    "llamax.batch": ["Prompt", "agenerate", "generate"],
    "llamax.embeddings": ["Embedder", "Pooling"],
    "llamax.info": ["ModelInfo", "model_info"],
    "llamax.cli": ["main"],
}


def test_top_level_names_are_pinned() -> None:
    assert sorted(llamax.__all__) == sorted(EXPECTED_ALL)
    assert len(set(llamax.__all__)) == len(llamax.__all__)
    for name in llamax.__all__:
        obj = getattr(llamax, name)
        assert name == "__version__" or obj.__doc__, f"llamax.{name} has no docstring"


@pytest.mark.parametrize("module_name", sorted(PUBLIC_MODULES))
def test_public_modules_are_pinned(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert sorted(module.__all__) == sorted(PUBLIC_MODULES[module_name])
    assert module.__doc__
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):  # not type aliases
            assert obj.__doc__, f"{module_name}.{name} has no docstring"


def test_version_is_the_installed_distribution_version() -> None:
    assert isinstance(llamax.__version__, str)
    assert llamax.__version__ == importlib.metadata.version("llamax")


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "llamax" if node.level else ""  # relative imports resolve inside llamax
            found.add(f"{base}.{node.module}" if base and node.module else node.module or base)
    return found


def test_layers_above_the_core_use_only_the_public_api() -> None:
    allowed = {"llamax", *PUBLIC_MODULES, "llamax.server"}
    for layer in ("cli.py",):
        used = {m for m in _imported_modules(PACKAGE / layer) if m.startswith("llamax")}
        assert used <= allowed, f"{layer} imports internals: {sorted(used - allowed)}"


def test_the_core_never_imports_the_layers_above() -> None:
    above = {"llamax.cli", "llamax.server", "llamax.ray"}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if path.name == "cli.py" or {"server", "ray"} & set(parts):
            continue
        assert not _imported_modules(path) & above, f"{path} imports a layer above the core"


def test_only_the_backend_touches_ctypes() -> None:
    for path in PACKAGE.rglob("*.py"):
        if "backend" in path.relative_to(PACKAGE).parts:
            continue
        assert "ctypes" not in _imported_modules(path), f"{path} imports ctypes"
