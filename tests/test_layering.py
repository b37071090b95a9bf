"""The layers of docs/architecture.md, checked on the package's static import graph.

The graph has one node per module of ``llamax`` (a package is its ``__init__``) and an edge
for every import that runs when the module is imported: the module-level statements,
including those under a plain ``if``/``try``, but not imports inside a function (lazy
imports) nor those under ``if TYPE_CHECKING:`` (annotations
only). Importing ``a.b.c`` also runs ``a.b``: that parent is an edge too, except the root
``llamax``, which Python has always started before any of its modules, so only an explicit
``import llamax`` / ``from llamax import X`` is an edge to it.

The facade (``llamax.context`` and ``llamax.session``) sits below the layers built on its
public API, so neither may reach them at import time, nor climb into them lazily, and no
import cycle may pass through it. Chat preparation and the OpenAI shapes
(``llamax.openai``, ``llamax.tools``, ``llamax.chat_stream``) sit below the facade: they
work on the template binding the facade hands down and never name ``Context``. The dialects
(``llamax.dialects``: the request-field tables of every API) are pure codecs: they reach
neither the facade nor the server nor a web framework, at import time or lazily.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

import llamax

PACKAGE = Path(llamax.__file__).resolve().parent
ROOT = "llamax"
FACADE = ("llamax.context", "llamax.session")
# Built on the public API (docs/architecture.md): nothing the facade imports may be here.
ABOVE_THE_FACADE = (
    "llamax.anthropic",
    "llamax.server",
    "llamax.ray",
    "llamax.cli",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level(
    body: list[ast.stmt], *, typing: bool = False
) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when a module with this body is imported (with
    ``typing``, also those a type checker reads under ``if TYPE_CHECKING:``)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if typing or not _is_type_checking(node.test):
                yield from _module_level(node.body, typing=typing)
            yield from _module_level(node.orelse, typing=typing)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _module_level(block, typing=typing)
            for handler in node.handlers:
                yield from _module_level(handler.body, typing=typing)
        elif isinstance(node, (ast.With, ast.ClassDef)):  # a class body runs at import
            yield from _module_level(node.body, typing=typing)


def _with_parents(name: str) -> set[str]:
    """``name`` and the packages Python imports first, but not the root (see above)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts) + 1)} | {name}


def _every_import(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, lazy and ``TYPE_CHECKING`` ones included."""
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node


def import_edges(
    name: str,
    path: Path,
    modules: dict[str, Path],
    *,
    lazy: bool = False,
    typing: bool = False,
) -> set[str]:
    """The modules of ``llamax`` that importing module ``name`` imports directly (with
    ``lazy``, also those it imports in functions or for type checking only; with
    ``typing``, also those it imports for type checking only)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    body = ast.parse(path.read_text()).body
    nodes = _every_import(body) if lazy else _module_level(body, typing=typing)
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            if target == ROOT:
                found.add(ROOT)
            elif target in modules:
                found |= _with_parents(target)
    return found - {name}


def import_graph(*, lazy: bool = False, typing: bool = False) -> dict[str, set[str]]:
    modules = package_modules()
    return {
        name: import_edges(name, path, modules, lazy=lazy, typing=typing)
        for name, path in modules.items()
    }


def _path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A shortest import chain from ``start`` to ``goal`` (breadth first), or None."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, ())):
            if nxt == goal:
                chain = [nxt, node]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return chain[::-1]
            if nxt not in came_from and nxt != start:
                came_from[nxt] = node
                queue.append(nxt)
    return None


def _above(name: str) -> bool:
    return name == ROOT or any(name == a or name.startswith(f"{a}.") for a in ABOVE_THE_FACADE)


def test_the_graph_sees_the_imports_it_should() -> None:
    """Guards the parser: a test that finds no edges would pass vacuously."""
    graph = import_graph()
    assert "llamax.engine.loop" in graph["llamax.context"]
    assert {"llamax.server", "llamax.ray.keys"} <= graph["llamax.ray.deployment"]
    assert ROOT in graph["llamax.server.app"]  # ``import llamax``
    assert "llamax.chat.handle" in graph["llamax.openai.requests"]  # relative, two levels
    assert "llamax.chat.call" in graph["llamax.chat.prepare"]  # relative, one level
    assert "llamax.templates" in graph["llamax.chat.prepare"]  # parent of templates.messages
    assert "llamax.conversation" in graph["llamax.context"]  # at module level (issue 58)


def test_no_import_cycle_passes_through_the_facade() -> None:
    graph = import_graph()
    for facade in FACADE:
        cycle = _path(graph, facade, facade)
        assert cycle is None, "import cycle through the facade: " + " -> ".join(cycle)


def test_no_module_imports_itself_back_even_for_type_checking() -> None:
    """Regression (issue 23): the static graph, ``TYPE_CHECKING`` imports included, had
    three cycles: ``session`` -> ``context`` (for ``Session.load``'s annotation) ->
    ``session``; ``session_table`` / ``audit`` -> ``scheduler`` -> ``session_table``; and
    ``optionspec`` -> ``params`` -> ``optionspec``. Lazy imports inside functions are the
    sanctioned way down (``Context.chat`` ...), so they do not count; nor does the edge from a
    module to its own parent package, which Python has started before the module. The root
    package is left out: the layers above import it as the public API by design, and the
    facade names their return types (``ChatCompletion``, ``Chat``) for annotations only."""
    graph = {
        name: {t for t in targets if t != ROOT and not name.startswith(f"{t}.")}
        for name, targets in import_graph(typing=True).items()
        if name != ROOT
    }
    for name in sorted(graph):
        for target in sorted(graph[name]):
            chain = _path(graph, target, name)
            assert chain is None, "import cycle: " + " -> ".join([name, *chain])


def test_the_facade_reaches_nothing_above_it_at_import_time() -> None:
    graph = import_graph()
    for facade in FACADE:
        for name in sorted(graph):
            if _above(name):
                chain = _path(graph, facade, name)
                assert chain is None, f"{facade} imports a layer above it: " + " -> ".join(chain)


def test_what_the_facade_imports_never_needs_the_facade_back() -> None:
    """The issue's cycle: ``Context`` inherited mixins (``llamax.openai.methods``,
    ``llamax.pipeline``) that imported ``Context`` back to cast ``self`` to it, under
    ``TYPE_CHECKING`` or lazily. Whatever the facade imports at import time is below it, so
    it needs neither ``llamax.context``/``llamax.session`` nor the package in any way."""
    graph, every = import_graph(), import_graph(lazy=True)
    wanted = {*FACADE, ROOT}
    for facade in FACADE:
        for name in sorted(graph):
            if name in wanted or not (every[name] & wanted):
                continue
            chain = _path(graph, facade, name)
            back = sorted(every[name] & wanted)
            assert chain is None, (
                f"import cycle through the facade: {' -> '.join(chain)} -> {back} "
                "(lazily or for type checking)"
            )


def _lazy_imports(path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The modules of ``llamax`` a module imports inside its functions, with a line each."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for func in ast.walk(ast.parse(path.read_text())):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target in modules or target == ROOT:
                    found.setdefault(target, node.lineno)
    return found


# Typed calls and their preparation, the OpenAI shapes, chats and batch generation: the
# facade imports them, so they never need it.
BELOW_THE_FACADE_CHAT = (
    "llamax.chat",
    "llamax.conversation",
    "llamax.openai",
    "llamax.tools",
    "llamax.chat_stream",
    "llamax.templates",
    "llamax.batch",
)


def _names_context(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Where a module of ``llamax`` names the facade: an import of ``Context`` (from
    ``llamax`` or ``llamax.context``) or of the facade's modules, wherever it sits
    (``TYPE_CHECKING`` and functions included), or ``llamax.Context`` in code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "Context":
            if isinstance(node.value, ast.Name) and node.value.id == ROOT:
                found.append(f"line {node.lineno}: llamax.Context")
        elif isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {a.name}" for a in node.names if a.name in FACADE
            ]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = {base} | {f"{base}.{alias.name}" for alias in node.names}
            if targets & {*FACADE, f"{ROOT}.Context"}:
                found.append(f"line {node.lineno}: from {base} import ...")
    return found


# Lazy climbs the facade still makes: none since issue 58 (``Context.chat`` hands itself
# down to a ``Chat`` as a ``ChatHost``, as ``generate`` hands down a ``BatchHost``); the
# set may only stay empty.
LAZY_CLIMBS_LEFT: set[tuple[str, str]] = set()


def test_the_facade_makes_no_lazy_import_into_a_layer_above_it() -> None:
    """Regression (issue 39): ``Context.chat_completion`` and its three twins imported
    ``llamax.openai.api`` when called, which called back into the context (the chat
    prompt, the end-of-turn ids, ``n_ctx_seq``, ``add_request``, the model's name and a
    detokenize) six times per chat. Preparation now runs below the facade on the template
    binding the context hands down, and the context submits the prepared request itself.
    A module counts as above the facade when its layer is, or when it names ``Context``."""
    modules = package_modules()
    climbs = set()
    for facade in FACADE:
        for target, line in sorted(_lazy_imports(modules[facade], modules).items()):
            # above: a layer built on the public API, or any module that names the facade
            if _above(target) or _names_context(target, modules[target], modules):
                climbs.add((facade, target))
                assert (facade, target) in LAZY_CLIMBS_LEFT, (
                    f"{facade} line {line} imports {target}, a layer above the facade"
                )
    assert climbs == LAZY_CLIMBS_LEFT, (
        f"gone from the code, drop from the list: {LAZY_CLIMBS_LEFT - climbs}"
    )


def test_chat_preparation_never_refers_to_the_context() -> None:
    """Regression (issue 39): ``llamax.openai`` (``api``, ``requests``, ``responses_api``)
    and ``llamax.tools.prompt`` took a ``Context`` and called back into it. They now work
    on small typed interfaces the facade hands down (``ChatModel``, ``PromptRenderer``;
    ``CallHost`` for the Responses API, ``ChatHost`` for a ``Chat``), and name no
    ``Context``."""
    modules = package_modules()
    for name, path in sorted(modules.items()):
        if _within(name, BELOW_THE_FACADE_CHAT):
            found = _names_context(name, path, modules)
            assert not found, f"{name} refers to Context: {found}"
    # guards the check: ``llamax.Context`` in code
    assert _names_context("llamax.server.state", modules["llamax.server.state"], modules)


# The modules of the package root that hold plain values (errors, options, results, text
# helpers): the engine may import these and nothing else from above it.
VALUE_MODULES = (
    "llamax.adapters",
    "llamax.checks",
    "llamax.config",
    "llamax.errors",
    "llamax.facts",
    "llamax.params",
    "llamax.optionspec",
    "llamax.drafting",
    "llamax.results",
    "llamax.stats",
    "llamax.tokens",
    "llamax.text",
)
# What the layers built on the public API (server, Ray, the CLI) may import: the package
# itself (``llamax.X`` of ``llamax.__all__``), the modules docs/api.md lists as public under
# their own names, and the public subpackages.
PUBLIC_MODULES = (
    "llamax.batch",
    "llamax.embeddings",
    "llamax.info",
    "llamax.cli",
    "llamax.drafting",
    "llamax.flags",
    "llamax.chat",
    "llamax.stats",
    "llamax.openai",
    "llamax.anthropic",
    "llamax.dialects",
    "llamax.tools",
    "llamax.server",
    "llamax.ray",
)


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def test_the_engine_imports_only_value_modules_from_the_package_root() -> None:
    """Regression (issue 39): ``engine.sequence`` named the facade's ``RequestHandle`` (for
    its annotations); the engine now asks for a ``Receiver`` protocol of its own. Every
    import counts here, lazy and ``TYPE_CHECKING`` ones included."""
    graph = import_graph(lazy=True)
    below = ("llamax.engine", "llamax.backend")
    for name in sorted(graph):
        if not _within(name, ("llamax.engine",)):
            continue
        for target in sorted(graph[name]):
            assert _within(target, below + VALUE_MODULES), (
                f"{name} imports {target}: the engine imports only the value modules "
                f"{VALUE_MODULES} from above it"
            )


ENGINE_WINGS = ("kv", "spec", "timing", "sched")
"""The engine's subpackages (docs/architecture.md); its root holds the loop and the
vocabulary every wing shares (``sequence``, ``plan``, ``phase``)."""


def test_the_engine_wings_import_each_other_downhill() -> None:
    """Issue 39: the engine's wings form no cycle at import time (``sched`` may use
    ``kv``, ``spec`` and ``timing``; ``timing`` may use ``spec``; ``spec`` may use ``kv``),
    and no wing imports the loop. A wing imports another if any of its modules does."""
    graph = import_graph()
    wings: dict[str, set[str]] = {wing: set() for wing in ENGINE_WINGS}
    for name in sorted(graph):
        for wing in ENGINE_WINGS:
            if not _within(name, (f"llamax.engine.{wing}",)):
                continue
            for target in graph[name]:
                assert target != "llamax.engine.loop", f"{name} imports the loop"
                wings[wing] |= {
                    other
                    for other in ENGINE_WINGS
                    if other != wing and _within(target, (f"llamax.engine.{other}",))
                }
    for wing in ENGINE_WINGS:
        chain = _path(
            {f"w.{k}": {f"w.{t}" for t in v} for k, v in wings.items()}, f"w.{wing}", f"w.{wing}"
        )
        assert chain is None, "the engine's wings import each other back: " + " -> ".join(chain)


def test_params_and_config_import_nothing_from_the_engine() -> None:
    """Regression (issue 39): ``params`` imported ``engine.speculative`` for
    ``PromptLookup``, the one arrow that ran back up at runtime; the drafting methods now
    live in ``llamax.drafting``, below the engine."""
    graph = import_graph(lazy=True)
    for name in (
        "llamax.params",
        "llamax.checks",
        "llamax.config",
        "llamax.optionspec",
        "llamax.drafting",
    ):
        for target in sorted(graph[name]):
            assert not _within(target, ("llamax.engine", "llamax.backend")), (
                f"{name} imports {target}"
            )


def test_server_ray_and_cli_import_only_the_public_api() -> None:
    """Regression (issue 39): ``server.cli``, ``ray.__main__`` and ``cli`` imported flag
    building from ``optionspec``, ``ray.builder`` ``ContextOptions`` from ``params``,
    ``server.errors`` the template errors from ``templates``. Flags now have a public home
    (``llamax.flags``) and the errors are top-level names."""
    graph = import_graph(lazy=True)
    for layer in ("llamax.server", "llamax.ray", "llamax.cli"):
        for name in sorted(graph):
            if not _within(name, (layer,)):
                continue
            for target in sorted(graph[name]):
                assert target == ROOT or _within(target, (layer, *PUBLIC_MODULES)), (
                    f"{name} imports {target}, which is not public API"
                )


# The dialects (issue 58): pure codecs, below the facade and the server.
DIALECTS = "llamax.dialects"
NOT_FOR_DIALECTS = (*FACADE, ROOT, "llamax.server")
"""What no module of the dialects may reach: the facade, the package root (which imports
the facade) and the server."""
WEB_FRAMEWORKS = frozenset({"starlette", "fastapi", "pydantic"})
"""The server extra's packages (pyproject's ``server``: a web framework, and pydantic under
it): a codec checks its JSON on its own, so the core needs none of them."""


def _third_party(path: Path, *, lazy: bool) -> set[str]:
    """The top-level packages outside ``llamax`` a module imports (at import time; with
    ``lazy``, anywhere in it)."""
    body = ast.parse(path.read_text()).body
    found: set[str] = set()
    for node in _every_import(body) if lazy else _module_level(body):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {ROOT}


def dialect_violations(modules: dict[str, Path]) -> list[str]:
    """Where the dialects break their rule: a chain from a module of ``llamax.dialects`` to
    the facade, the root or the server (the dialects' own imports counted wherever they sit,
    lazy and ``TYPE_CHECKING`` ones included, then what those import at import time), a
    ``Context`` named in them, or Starlette/FastAPI/pydantic imported by any module on the
    way."""
    graph = {
        name: import_edges(name, path, modules, lazy=_within(name, (DIALECTS,)))
        for name, path in modules.items()
    }
    found: list[str] = []
    for name in sorted(n for n in modules if _within(n, (DIALECTS,))):
        for goal in NOT_FOR_DIALECTS:
            chain = _path(graph, name, goal)
            if chain is not None:
                found.append(" -> ".join(chain))
        found += [f"{name} {where}" for where in _names_context(name, modules[name], modules)]
        reached, queue = {name}, deque([name])
        while queue:
            for nxt in graph.get(queue.popleft(), ()):
                if nxt not in reached and nxt in modules:
                    reached.add(nxt)
                    queue.append(nxt)
        for module in sorted(reached):
            lazy = _within(module, (DIALECTS,))
            for framework in sorted(_third_party(modules[module], lazy=lazy) & WEB_FRAMEWORKS):
                found.append(f"{name} reaches {framework} through {module}")
    return found


def test_the_dialects_reach_neither_the_facade_nor_the_server() -> None:
    """Issue 58: ``llamax.dialects`` holds pure codecs (the field tables and their
    policy); the server and the facade build on them, never the other way round."""
    modules = package_modules()
    assert _within("llamax.dialects.fields", tuple(modules))  # the package is there
    assert dialect_violations(modules) == []


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("import llamax\n", "llamax.dialects.fake -> llamax"),
        ("from llamax import Context\n", "line 1: from llamax import"),
        ("def f():\n    from ..server import app\n", "-> llamax.server"),
        ("def f():\n    from ..session import Session\n", "-> llamax.session"),
        ("if TYPE_CHECKING:\n    from llamax.context import Context\n", "-> llamax.context"),
        ("from ..chat.options import one_of\nimport starlette.responses\n", "starlette"),
        ("def f():\n    from fastapi import Request\n", "fastapi"),
        ("from pydantic import BaseModel\n", "pydantic"),
    ],
)
def test_the_dialect_rule_catches_a_violation(tmp_path: Path, source: str, flagged: str) -> None:
    """Guards the checker: a synthetic module of the dialects that imports what the rule
    forbids (at import time, lazily, for type checking only, or a web framework) is
    flagged."""
    fake = tmp_path / "fake.py"
    fake.write_text(source)
    modules = package_modules() | {"llamax.dialects.fake": fake}
    found = dialect_violations(modules)
    assert any(flagged in line for line in found), found
