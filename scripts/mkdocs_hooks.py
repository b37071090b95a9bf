"""mkdocs hooks: docstrings checked, and the repository files the docs link to copied.

- Warn (so ``mkdocs build --strict`` fails) on a public name without a docstring. Checked:
  every name in ``llamax.__all__`` and the public members of the documented modules; for
  classes, their public methods and properties too.
- A page's relative link out of ``docs/`` to a file of the repository
  (``../examples/server_client.py``) works on GitHub but would 404 on the site: the file is
  copied into the site under ``repo/`` and the link rewritten to that copy. A link to a
  file that does not exist is left alone, so the build still warns about it.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

import griffe
from mkdocs.structure.files import File, Files

REPO_COPY = "repo"
"""Where the site holds the copies of repository files the docs link to."""
_LINK = re.compile(r"\]\((?P<target>(?:\.\./)+[^)#\s]+)(?P<anchor>#[^)\s]*)?\)")

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


def _repo_path(page_uri: str, target: str, docs_dir: Path) -> str | None:
    """The repository path a link from ``page_uri`` points to outside ``docs/``, if a file."""
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), target))
    if not joined.startswith("../") or joined.startswith("../../"):
        return None
    path = joined.removeprefix("../")
    return path if (docs_dir.parent / path).is_file() else None


def on_files(files: Files, config: Any) -> Files:
    """Add a copy, under ``repo/``, of each repository file a page links to."""
    docs_dir = Path(config["docs_dir"])
    wanted: set[str] = set()
    for page in files.documentation_pages():
        for match in _LINK.finditer(page.content_string):
            path = _repo_path(page.src_uri, match["target"], docs_dir)
            if path is not None:
                wanted.add(path)
    for path in sorted(wanted):
        files.append(File.generated(
            config, f"{REPO_COPY}/{path}", abs_src_path=str(docs_dir.parent / path)
        ))  # fmt: skip
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Point each link to a repository file at its copy in the site."""
    docs_dir = Path(config["docs_dir"])
    page_uri = page.file.src_uri

    def rewrite(match: re.Match[str]) -> str:
        path = _repo_path(page_uri, match["target"], docs_dir)
        if path is None:
            return match[0]
        copy = posixpath.relpath(f"{REPO_COPY}/{path}", posixpath.dirname(page_uri) or ".")
        return f"]({copy}{match['anchor'] or ''})"

    return _LINK.sub(rewrite, markdown)
