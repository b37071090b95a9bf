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
    "CacheClearError",
    "Calibration",
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
    "FimTokens",
    "FinishReason",
    "GrammarError",
    "ImageError",
    "InsufficientMemoryError",
    "InvalidMessageError",
    "InvalidParameterError",
    "Image",
    "InvalidRequestError",
    "LlamaxError",
    "LogitsProcessor",
    "LogitsRow",
    "LoopOwnershipError",
    "MemoryPlan",
    "ModelFacts",
    "ModelInfo",
    "ModelLoadError",
    "NotFoundError",
    "PrefillProgress",
    "ProjectorError",
    "PromptLookup",
    "KVCapacityError",
    "RequestFailedError",
    "RequestHandle",
    "SamplingParams",
    "Session",
    "SessionBusyError",
    "SessionError",
    "SessionLoadError",
    "TemplateBudgetError",
    "TemplateError",
    "TemplateSecurityError",
    "TokenEvent",
    "TokenLogprob",
    "TopLogprob",
    "TurnStats",
    "Usage",
    "__version__",
    "default_model_path",
    "model_info",
    "plan_memory",
]

PUBLIC_MODULES = {
    "llamax.batch": ["BatchHost", "Prompt", "agenerate", "generate"],
    "llamax.embeddings": ["Embedder", "Pooling"],
    "llamax.info": [
        "MAX_PLANNED_CTX",
        "MemoryPlan",
        "ModelInfo",
        "max_cells",
        "model_info",
        "plan_memory",
    ],
    "llamax.cli": ["main"],
    "llamax.anthropic": ["REQUEST_FIELDS", "amessages", "count_tokens", "messages"],
    "llamax.dialects": ["TABLES"],
    "llamax.chat": [
        "CallHost",
        "ChatCall",
        "ChatHandle",
        "ChatModel",
        "ChatOptions",
        "CompletionOptions",
        "Prepared",
        "StreamOptions",
        "TextCall",
        "Truncate",
        "chat_prompt_tokens",
        "new_request_id",
        "prepare_chat",
        "prepare_text",
        "submit_in_worker",
    ],
    "llamax.openai": [
        "ChatCompletion",
        "ChatCompletionChunk",
        "ChatOptions",
        "CompletionOptions",
        "CompletionUsage",
        "EventBuilder",
        "OpenAIRequest",
        "RESPONSE_FIELDS",
        "ResponseStore",
        "StreamOptions",
        "TextCompletion",
        "acreate_response",
        "create_response",
        "response_input_tokens",
    ],
    "llamax.reasoning": [
        "CHANNEL",
        "THINK_CLOSE",
        "THINK_OPEN",
        "ReasoningFormat",
        "ReasoningSplitter",
        "check_reasoning_format",
        "opens_thinking",
        "split_reasoning",
    ],
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


def _module_of(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, wherever the import sits (functions and
    ``TYPE_CHECKING`` blocks too), relative imports resolved; ``from m import x`` yields
    ``m``, and ``m.x`` too when that is a module of the package."""
    package = _module_of(path)[:-1] if path.name != "__init__.py" else _module_of(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            found.add(base)
            found.update(
                f"{base}.{alias.name}"
                for alias in node.names
                if base.startswith("llamax") and _is_module(f"{base}.{alias.name}")
            )
    return found


# The layers of docs/architecture.md, top down: the apps (server, ray, cli); the layers built
# on the public API (anthropic, conversation, batch with its progress bar); the facade
# (context, session); typed calls and their preparation (chat, with the tools and the chat
# stream) and the OpenAI shapes (openai, on chat): below the facade, yet using only the
# public API's modules too; the dialects (pure codecs, no facade, no server: field tables
# and parsers on chat's calls, encoders of the chat stream's parts); templates;
# the engine and the backend.
UPPER_LAYERS = {
    # layer: (its modules, the upper layers below it that it may also use)
    "server": (
        {"llamax.server"},
        {"llamax.anthropic", "llamax.openai", "llamax.chat", "llamax.dialects"},
    ),
    "ray": ({"llamax.ray"}, {"llamax.server"}),
    "cli": ({"llamax.cli"}, {"llamax.server", "llamax.batch"}),
    "anthropic": (
        {"llamax.anthropic"},
        {"llamax.openai", "llamax.chat", "llamax.tools", "llamax.chat_stream", "llamax.dialects"},
    ),
    "openai": (
        {"llamax.openai"},
        {"llamax.chat", "llamax.tools", "llamax.chat_stream", "llamax.dialects"},
    ),
    "dialects": ({"llamax.dialects"}, {"llamax.chat", "llamax.tools", "llamax.chat_stream"}),
    "chat": ({"llamax.chat"}, {"llamax.tools", "llamax.chat_stream"}),
    "chat_stream": ({"llamax.chat_stream"}, {"llamax.tools"}),
    "tools": ({"llamax.tools"}, set()),
    "conversation": ({"llamax.conversation"}, set()),
    "batch": ({"llamax.batch", "llamax.progress"}, set()),
}
# The public API: the package itself (``llamax.Context``, ``llamax.Session`` ...) and the
# modules that define its public names or their helpers (errors, params, results, the
# ``Prompt`` type, chat messages and truncation, schema grammars ...). Not in it: the facade's
# modules (``llamax.context``, ``llamax.session``: use ``llamax.Context``), the engine and
# backend (``llamax.engine.*``, ``llamax.backend.*``), ``templates.binding`` (the template's
# glue to the backend) and ``llamax.testing``.
PUBLIC_API = {
    "llamax",
    "llamax.errors",
    "llamax.facts",
    "llamax.params",
    "llamax.config",
    "llamax.optionspec",
    "llamax.flags",
    "llamax.drafting",
    "llamax.adapters",
    "llamax.results",
    "llamax.handle",
    "llamax.stats",
    "llamax.prompts",
    "llamax.images",  # llamax.Image, which chat messages may hold (issue 42)
    "llamax.tokens",
    "llamax.grammar",
    "llamax.reasoning",
    "llamax.info",
    "llamax.models",
    "llamax.embeddings",
    "llamax.templates",
    "llamax.templates.messages",
    "llamax.templates.template",
    "llamax.templates.truncation",
}
# ``ctx._x``, ``self._ctx._x``, ``state.ctx._x`` ...: a private member of a context
_CONTEXT_NAMES = {"ctx", "_ctx", "context", "_context"}


def _in(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def _layer_files(modules: set[str]) -> list[Path]:
    files: list[Path] = []
    for module in sorted(modules):
        path = PACKAGE.parent.joinpath(*module.split("."))
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    return files


def _private_context_members(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "...")
        if node.attr in {"_engine", "_backend"} or (
            name in _CONTEXT_NAMES and not node.attr.startswith("__")
        ):
            found.append(f"line {node.lineno}: {name}.{node.attr}")
    return found


@pytest.mark.parametrize("layer", sorted(UPPER_LAYERS))
def test_layers_above_the_core_use_only_the_public_api(layer: str) -> None:
    """Every module of a layer built on the public API (server/, ray/, cli.py, anthropic/,
    conversation.py, batch.py; and openai/, dialects/, tools/, chat_stream.py, which sit
    below the facade but use nothing else) imports from ``llamax`` only: the public API
    (the package itself and the value modules in ``PUBLIC_API``), its own layer's modules,
    and the upper layers below it (ray uses ``llamax.server.create_app``, cli the server and
    batch, openai the tools and the chat stream). Every import counts, wherever it sits (a
    function, ``TYPE_CHECKING``), so it never imports ``llamax.engine.*``,
    ``llamax.backend.*``, ``llamax.context`` or ``llamax.session``; and it never touches a
    private member of a context (``ctx._engine``, ``self._ctx._submit``) nor any
    ``._engine`` / ``._backend``."""
    own, below = UPPER_LAYERS[layer]
    files = _layer_files(own)
    assert files
    for path in files:
        used = {m for m in _imported_modules(path) if _in(m, {"llamax"})}
        internal = sorted(m for m in used if m not in PUBLIC_API and not _in(m, own | below))
        assert not internal, f"{path.relative_to(PACKAGE)} imports internals: {internal}"
        private = _private_context_members(path)
        assert not private, f"{path.relative_to(PACKAGE)} uses private members: {private}"


def test_the_layering_check_sees_internals() -> None:
    """Guards the parser behind the layering test: relative imports resolve, and what the
    test must refuse is found."""
    tree = PACKAGE / "chat" / "prepare.py"
    assert {"llamax.chat.options", "llamax.tools", "llamax.errors"} <= _imported_modules(tree)
    assert "llamax.engine.loop" in _imported_modules(PACKAGE / "context.py")
    assert "llamax.server" in _imported_modules(PACKAGE / "ray" / "deployment.py")
    assert _private_context_members(PACKAGE / "context.py")  # the facade's own privates


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
