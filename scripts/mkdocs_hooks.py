"""mkdocs hook: warn (so ``mkdocs build --strict`` fails) on a public name without a docstring.

Checked: every name in ``llamax.__all__`` and the public members of the documented
modules; for classes, their public methods and properties too.
"""

from __future__ import annotations

import logging
from typing import Any

import griffe

log = logging.getLogger("mkdocs.hooks.docstrings")

MODULES = ["llamax.batch", "llamax.embeddings", "llamax.info", "llamax.errors", "llamax.testing"]


def _is_callable(obj: Any) -> bool:
    return bool(obj.is_function or obj.is_class or "property" in obj.labels)


def _missing(obj: Any) -> list[str]:
    """Paths of ``obj`` and of its public callable members that have no docstring."""
    if obj.is_alias:
        obj = obj.final_target
    missing = [] if obj.docstring else [obj.path]
    if obj.is_class:
        for name, member in obj.members.items():
            if name.startswith("_") or member.is_alias or not _is_callable(member):
                continue
            if not member.docstring:
                missing.append(member.path)
    return missing


def on_pre_build(config: Any) -> None:
    """Load llamax with griffe and warn once per undocumented public name."""
    package = griffe.load("llamax", search_paths=["."], resolve_aliases=True)
    targets = [package[name] for name in package.exports or () if name != "__version__"]
    for module_path in MODULES:
        module = package[module_path.removeprefix("llamax.")]
        names = module.exports if module.exports is not None else list(module.members)
        targets.extend(module[name] for name in names if not name.startswith("_"))
    for obj in targets:
        if obj.is_alias and not obj.resolved:
            continue
        if not _is_callable(obj.final_target if obj.is_alias else obj):
            continue
        for path in _missing(obj):
            log.warning("public name without a docstring: %s", path)
