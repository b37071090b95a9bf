"""scripts/mutants.py's mutants: the areas, the operators, and a seeded draw. Pure ``ast``.

A mutant is one textual change at an ``ast`` position (a comparison, ``and``/``or``, a
``not``, an ``if``/``while`` condition, an int constant, ``True``/``False``, ``+``/``-``),
kept only when the changed source parses to a different tree. Docstrings, logging calls,
``__repr__``, annotations, ``assert`` statements and f-strings are left alone.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import random
import re
from dataclasses import dataclass

# The KV tiers: the prefix cache and the tiers under it (the seam, host RAM, disk).
TIER_FILES = (
    "llamax/engine/kv/prefix.py",
    "llamax/engine/kv/prefix_tier.py",
    "llamax/engine/kv/prefix_ram.py",
    "llamax/engine/kv/prefix_disk.py",
    "llamax/engine/kv/disk_files.py",
)
# The dialects: the OpenAI and Anthropic codecs, the server's dialect objects and the
# llama-server native API (llamax/server/llama/).
DIALECT_DIRS = ("llamax/openai/", "llamax/anthropic/", "llamax/server/llama/")
DIALECT_FILES = ("llamax/server/dialects.py",)
AREAS = ("engine", "tiers", "dialects", "grammar")

LOG_METHODS = frozenset({"debug", "info", "warning", "error", "exception", "critical", "log"})
FLIPS: dict[type[ast.cmpop], tuple[str, str]] = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
}
OP_PATTERNS = {
    "<": r"<(?!=)",
    "<=": r"<=",
    ">": r">(?!=)",
    ">=": r">=",
    "==": r"==",
    "!=": r"!=",
    "is": r"\bis\b(?!\s+not\b)",
    "is not": r"\bis\s+not\b",
    "in": r"(?<!not )\bin\b",
    "not in": r"\bnot\s+in\b",
    "and": r"\band\b",
    "or": r"\bor\b",
}


def area_of(path: str) -> str | None:
    """The area a package-relative path (``llamax/...``) belongs to, or None."""
    if path in TIER_FILES:
        return "tiers"
    if path.startswith("llamax/engine/"):
        return "engine"
    if path.startswith(DIALECT_DIRS) or path in DIALECT_FILES:
        return "dialects"
    if re.fullmatch(r"llamax/grammar[a-z_]*\.py", path) or path.startswith(
        "llamax/grammar_numbers/"
    ):
        return "grammar"
    return None


@dataclass(frozen=True, slots=True)
class Mutant:
    """One textual change to one file; ``line``/``col`` are 1-based/0-based, like ``ast``."""

    id: str
    area: str
    file: str
    line: int
    col: int
    end_line: int
    end_col: int
    operator: str
    original: str
    replacement: str


class _Offsets:
    """Character offsets of ``ast`` positions (lines 1-based, columns in UTF-8 bytes)."""

    def __init__(self, source: str) -> None:
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, line: int, col: int) -> int:
        text = self.lines[line - 1].encode()[:col].decode(errors="replace")
        return self.starts[line - 1] + len(text)

    def position(self, offset: int) -> tuple[int, int]:
        line = min(bisect.bisect_right(self.starts, offset), len(self.lines))
        col = len(self.lines[line - 1][: offset - self.starts[line - 1]].encode())
        return line, col


def _is_logging_call(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    owner = node.func.value
    name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
    return node.func.attr in LOG_METHODS and ("log" in name.lower())


class _Finder(ast.NodeVisitor):
    """Collects ``(start, end, operator, original, replacement)`` character spans."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.at = _Offsets(source)
        self.found: list[tuple[int, int, str, str, str]] = []

    def start(self, node: ast.AST) -> int:
        return self.at.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self.at.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def add_between(self, left: ast.AST, right: ast.AST, text: str, new: str, op: str) -> None:
        """The operator ``text`` between two operands (parentheses may sit around it)."""
        lo, hi = self.end(left), self.start(right)
        match = re.search(OP_PATTERNS.get(text, re.escape(text)), self.source[lo:hi])
        if match is not None:
            self.found.append((lo + match.start(), lo + match.end(), op, match.group(), new))

    def skip(self, node: ast.AST) -> None:
        """Visit nothing below ``node``."""

    visit_Assert = skip
    visit_JoinedStr = skip

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if node.name == "__repr__":
            return
        for dec in node.decorator_list:
            self.visit(dec)
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        self.body(node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for item in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(item)
        self.body(node.body)

    def visit_Module(self, node: ast.Module) -> None:
        self.body(node.body)

    def body(self, stmts: list[ast.stmt]) -> None:
        """A body without its docstring."""
        first = stmts[0] if stmts else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            stmts = stmts[1:]
        for stmt in stmts:
            self.visit(stmt)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    def visit_Call(self, node: ast.Call) -> None:
        if not _is_logging_call(node):
            self.generic_visit(node)

    def visit_If(self, node: ast.If | ast.While) -> None:
        test = ast.unparse(node.test)
        if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING", "__name__ == '__main__'"):
            return
        lo, hi = self.start(node.test), self.end(node.test)
        original = self.source[lo:hi]
        self.found.append((lo, hi, "negate_condition", original, f"not ({original})"))
        self.generic_visit(node)

    visit_While = visit_If

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            old, new = FLIPS[type(op)]
            self.add_between(operands[i], operands[i + 1], old, new, "compare")
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        for left, right in zip(node.values, node.values[1:], strict=False):
            self.add_between(left, right, old, new, "and_or")
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            lo = self.start(node)
            match = re.match(r"not\b\s*", self.source[lo : self.start(node.operand)])
            if match is not None:
                self.found.append((lo, lo + match.end(), "drop_not", match.group(), ""))
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        texts = {ast.Add: ("+", "-"), ast.Sub: ("-", "+")}.get(type(node.op))
        strings = (ast.JoinedStr, ast.List, ast.Tuple)
        is_text = any(
            isinstance(side, strings)
            or (isinstance(side, ast.Constant) and not isinstance(side.value, int | float))
            for side in (node.left, node.right)
        )
        if texts is not None and not is_text:
            self.add_between(node.left, node.right, texts[0], texts[1], "add_sub")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        texts = {ast.Add: ("+=", "-="), ast.Sub: ("-=", "+=")}.get(type(node.op))
        if texts is not None:
            self.add_between(node.target, node.value, texts[0], texts[1], "add_sub")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        lo, hi = self.start(node), self.end(node)
        if isinstance(node.value, bool):
            new = "False" if node.value else "True"
            self.found.append((lo, hi, "bool", self.source[lo:hi], new))
        elif isinstance(node.value, int):
            self.found.append((lo, hi, "int", self.source[lo:hi], str(node.value + 1)))


def apply(source: str, mutant: Mutant) -> str:
    """``source`` with ``mutant`` applied; ValueError if its text is not where it says."""
    at = _Offsets(source)
    lo, hi = at.offset(mutant.line, mutant.col), at.offset(mutant.end_line, mutant.end_col)
    if source[lo:hi] != mutant.original:
        raise ValueError(f"{mutant.id}: {mutant.file}:{mutant.line} does not hold the original")
    return source[:lo] + mutant.replacement + source[hi:]


def find_mutants(source: str, file: str, area: str) -> list[Mutant]:
    """Every mutant of one file's source that compiles and changes its syntax tree."""
    finder = _Finder(source)
    tree = ast.parse(source)
    finder.visit(tree)
    before = ast.dump(tree)
    mutants: list[Mutant] = []
    for lo, hi, operator, original, replacement in sorted(set(finder.found)):
        line, col = finder.at.position(lo)
        end_line, end_col = finder.at.position(hi)
        key = f"{file}:{line}:{col}:{operator}:{replacement}"
        digest = hashlib.sha1(key.encode()).hexdigest()[:10]
        mutant = Mutant(
            digest, area, file, line, col, end_line, end_col, operator, original, replacement
        )
        try:
            changed = ast.dump(ast.parse(apply(source, mutant)))
        except (SyntaxError, ValueError):
            continue
        if changed != before:
            mutants.append(mutant)
    return mutants


def generate(sources: dict[str, str], seed: int, per_area: int) -> list[Mutant]:
    """``per_area`` mutants of each area, drawn with ``seed`` (the same draw every time)."""
    pools: dict[str, list[Mutant]] = {area: [] for area in AREAS}
    for file in sorted(sources):
        area = area_of(file)
        if area is not None:
            pools[area].extend(find_mutants(sources[file], file, area))
    chosen: list[Mutant] = []
    for area in AREAS:
        pool = pools[area]
        rng = random.Random(f"{seed}:{area}")
        chosen.extend(sorted(rng.sample(pool, min(per_area, len(pool))), key=_order))
    return chosen


def _order(mutant: Mutant) -> tuple[str, int, int, str]:
    return mutant.file, mutant.line, mutant.col, mutant.operator


def runs_at_import(source: str, mutant: Mutant) -> bool:
    """Whether ``mutant`` sits outside every function body (module and class level,
    defaults, decorators): such a line runs once, at import, under whichever test (or
    collection) imported the module first."""
    at = (mutant.line, mutant.col)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            body = node.body if isinstance(node.body, list) else [node.body]
            start = (body[0].lineno, body[0].col_offset)
            end = (body[-1].end_lineno or 0, body[-1].end_col_offset or 0)
            if start <= at < end:
                return False
    return True
