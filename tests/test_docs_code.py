"""The README's and the docs' Python blocks run as written, like a notebook per page.

Every ```` ```python ```` block in README.md and docs/**/*.md is a script a reader may
paste: each page's blocks run in order in one namespace (a later block may use a name an
earlier one defined), on the default model, in a scratch directory. A block that cannot
run as-is (it needs a running server, Ray, an RPC server, a GPU, a model file the reader
brings) says so in the Markdown, on the line right before its fence::

    <!-- fragment: needs a running server -->
    <!-- async-fragment: inside a running event loop (Jupyter) -->

and is then only compiled (``async-fragment`` allows top-level ``await``). Nothing is
skipped: a block is run or compiled. The compile check needs no model, so a Quickstart
with a top-level ``await`` fails even where the model tests do not run.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from script_modules import load_script

import llamax
import llamax.config
import llamax.embeddings
from llamax.testing import assert_idle

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
KINDS = ("run", "fragment", "async-fragment")
_FENCE = re.compile(r"^```python\s*$")
_MARKER = re.compile(r"^<!--\s*(?P<kind>[a-z-]+)\s*:\s*(?P<reason>.*?)\s*-->\s*$")


@dataclass(frozen=True, slots=True)
class Block:
    """One ```` ```python ```` block of a Markdown page."""

    page: str
    """The page, relative to the repository root."""
    line: int
    """The 1-based line of the block's first line of code."""
    source: str
    kind: str
    """``run``, or the marker's kind: ``fragment`` or ``async-fragment``."""
    reason: str
    """Why a fragment cannot run as-is (empty for ``run``)."""

    @property
    def where(self) -> str:
        """``page:line``, the file name its tracebacks show."""
        return f"{self.page}:{self.line}"


def parse_blocks(text: str, page: str) -> list[Block]:
    """The ``python`` blocks of ``text``, each with the marker on the line before it.

    Raises:
        ValueError: a marker of an unknown kind or without a reason, or an unclosed block.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if not _FENCE.match(lines[i]):
            i += 1
            continue
        kind, reason = _marker_before(lines, i, page)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: the python block is never closed")
        source = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(page, i + 2, source, kind, reason))
        i = end + 1
    return blocks


def _marker_before(lines: list[str], fence: int, page: str) -> tuple[str, str]:
    """The (kind, reason) of the marker on the nearest non-blank line before ``fence``."""
    j = fence - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    match = _MARKER.match(lines[j].strip()) if j >= 0 else None
    if match is None or "fragment" not in match["kind"]:  # another comment: not a marker
        return "run", ""
    if match["kind"] not in KINDS[1:]:
        raise ValueError(f"{page}:{j + 1}: unknown block marker {match['kind']!r} ({KINDS[1:]})")
    if not match["reason"]:
        raise ValueError(f"{page}:{j + 1}: a {match['kind']} marker must say why")
    return match["kind"], match["reason"]


def compile_block(block: Block) -> Any:
    """Compile ``block`` as a script (top-level ``await`` only for an ``async-fragment``)."""
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT if block.kind == "async-fragment" else 0
    return compile(block.source, block.where, "exec", flags=flags, dont_inherit=True)


def _page_blocks() -> dict[str, list[Block]]:
    return {
        str(path.relative_to(REPO)): parse_blocks(path.read_text(), str(path.relative_to(REPO)))
        for path in PAGES
    }


BLOCKS = _page_blocks()
RUNNABLE = sorted(page for page, blocks in BLOCKS.items() if any(b.kind == "run" for b in blocks))


@pytest.mark.parametrize("page", sorted(page for page, blocks in BLOCKS.items() if blocks))
def test_docs_blocks_compile(page: str) -> None:
    """Every block is valid Python as written: a script, or a marked fragment."""
    errors = []
    for block in BLOCKS[page]:
        try:
            compile_block(block)
        except SyntaxError as error:
            hint = "" if block.kind != "run" else " (a block that is no script needs a marker)"
            errors.append(f"{block.page}:{block.line + (error.lineno or 1) - 1}: {error.msg}{hint}")
    assert not errors, "\n".join(errors)


def test_readme_quickstart_is_a_script() -> None:
    """The README's first block is the Quickstart, and it runs (not only compiles)."""
    blocks = BLOCKS["README.md"]
    assert blocks and blocks[0].kind == "run", "the README's Quickstart must run as written"
    assert "chat_completion" in blocks[0].source, "a newcomer sees a chat call first"


def test_parse_blocks_markers() -> None:
    """Markers bind to the next block only; unknown or unexplained markers are errors."""
    text = (
        "x\n```python\na = 1\n```\n<!-- fragment: needs a server -->\n\n```python\nb\n```\n"
        "<!-- a comment -->\n```python\nc = 2\n```\n"
    )
    kinds = [(b.kind, b.reason, b.line) for b in parse_blocks(text, "p.md")]
    assert kinds == [("run", "", 3), ("fragment", "needs a server", 8), ("run", "", 12)]
    with pytest.raises(ValueError, match="unknown block marker"):
        parse_blocks("<!-- async-fragments: x -->\n```python\nx\n```\n", "p.md")
    with pytest.raises(ValueError, match="must say why"):
        parse_blocks("<!-- fragment: -->\n```python\nx\n```\n", "p.md")
    with pytest.raises(ValueError, match="never closed"):
        parse_blocks("```python\nx\n", "p.md")


@contextlib.contextmanager
def _in_directory(path: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def _close_contexts(namespace: dict[str, Any]) -> None:
    """Check each context a page left open is idle, then close it (pages should use ``with``)."""
    for value in list(namespace.values()):
        if isinstance(value, llamax.Context) and not value.closed:
            assert_idle(value, timeout=60)
            value.close()


@pytest.mark.model
@pytest.mark.integration
@pytest.mark.parametrize("page", RUNNABLE)
def test_docs_blocks_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a page's blocks in order in one namespace, on the default model.

    Contexts the pages make compute with one thread unless a block says otherwise: the
    pages check that the code runs, and beside a busy process a two-thread step waits on
    its slower thread (measured on 2 busy cores: the README took 49 s with two threads,
    4 s with one).
    """
    monkeypatch.setattr(llamax.config, "_default_threads", lambda: 1)
    monkeypatch.setattr(llamax.embeddings, "_default_threads", lambda: 1)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    with _in_directory(tmp_path):
        try:
            for block in BLOCKS[page]:
                code = compile_block(block)
                if block.kind == "run":
                    exec(code, namespace)
        finally:
            _close_contexts(namespace)


def test_mkdocs_links_into_the_repository_point_at_site_copies() -> None:
    """A docs link to a repository file (it 404s on the site) is pointed at the hook's copy
    under ``repo/``; a link to no file is left for ``mkdocs --strict`` to report."""
    hooks = load_script("mkdocs_hooks")
    config = {"docs_dir": str(REPO / "docs")}

    def rewrite(text: str, page_uri: str) -> str:
        page = SimpleNamespace(file=SimpleNamespace(src_uri=page_uri))
        return str(hooks.on_page_markdown(text, page, config, None))

    text = "[a](../examples/server_client.py#L3), [b](../nope.py), [c](chat.md)"
    assert rewrite(text, "server.md") == (
        "[a](repo/examples/server_client.py#L3), [b](../nope.py), [c](chat.md)"
    )
    nested = rewrite("[a](../../examples/server_client.py)", "reference/x.md")
    assert nested == "[a](../repo/examples/server_client.py)"
