"""A mutation check for the test suite: do the tests notice small wrong changes to llamax?

Mutants are made with :mod:`ast` on ``llamax/`` at a fixed commit, in four areas (the
engine, the KV prefix tiers, the API dialects, the grammar converters; :data:`AREAS`). Each
flips one comparison (``<``/``<=``, ``==``/``!=``, ``is``/``is not``, ``in``/``not in``), one
``and``/``or``, drops a ``not``, negates an ``if``/``while`` condition, adds one to an int
constant, swaps ``True``/``False`` or ``+``/``-``. Docstrings, logging calls, ``__repr__``,
annotations, ``assert`` statements and f-strings are left alone.

A run puts a commit's whole tree (its ``tests/``, ``pyproject.toml``, docs...) in a work
directory, with ``llamax/`` taken from the mutants' commit, and runs pytest there with
``PYTHONPATH`` set to it, so the test process and every Python process it spawns import the
mutated copy. Each mutant runs only the tests that cover its line (a coverage map with one
context per test, built once per tests tree), fastest first, with ``-x``: the first failure
kills it. Spawned Python processes are measured too: a ``sitecustomize`` starts coverage in
them with the spawning test's id as the context (a process killed by SIGKILL, or started
with a ``PYTHONPATH`` of its own, records nothing; its test still counts through its own
process's lines). A mutant outside every function body (a module constant, a default) ran
at import, under whichever test imported its module first: it gets every test that covers a
line of its file.

Usage (``nice -n 10``: the machine is shared)::

    py=/work/main/.venv/bin/python   # with pytest-cov installed
    $py scripts/mutants.py generate --source c548be1 --seed 55 --per-area 18 \\
        --out /tmp/i55/mutants.json
    $py scripts/mutants.py covermap --selection old --out /tmp/i55/covmap-old.json
    $py scripts/mutants.py run --selection old --mutants /tmp/i55/mutants.json \\
        --map /tmp/i55/covmap-old.json --durations /tmp/i55/before.xml \\
        --out /tmp/i55/mutants-old.json
    # the same for a later tests tree, then the two side by side:
    $py scripts/mutants.py covermap --selection new --tests REV --out /tmp/i55/covmap-new.json
    $py scripts/mutants.py run --selection new --tests REV --mutants /tmp/i55/mutants.json \\
        --map /tmp/i55/covmap-new.json --out /tmp/i55/mutants-new.json
    $py scripts/mutants.py compare /tmp/i55/mutants-old.json /tmp/i55/mutants-new.json

``--selection old`` is what ``scripts/test.sh`` ran at c548be1 (its ``tests/`` and
``-m 'not cluster and not soak and not gpu'``); ``--selection new`` takes ``--tests REV``
and ``--markers EXPR`` (default: the tree's own ``addopts``). A mutant is *killed* when
pytest exits non-zero (a failure, an error, a per-test timeout), *survived* when every
candidate passed, *timeout* when the per-mutant cap (``--cap``) ended the run first, and
*flaky* when the test that killed it also fails on the unmutated tree.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import hashlib
import io
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OLD_TESTS = "c548be1"
OLD_MARKERS = "not cluster and not soak and not gpu"

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


# ---------------------------------------------------------------- generation


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


# ---------------------------------------------------------------- trees


def git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True).stdout


def package_sources(rev: str) -> dict[str, str]:
    """Every ``llamax/**.py`` file at ``rev``, by path."""
    sources: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(git("archive", rev, "llamax"))) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                data = tar.extractfile(member)
                if data is not None:
                    sources[member.name] = data.read().decode()
    return sources


def make_tree(dest: Path, tests_rev: str, source_rev: str) -> Path:
    """``tests_rev``'s whole tree in ``dest``, with ``llamax/`` from ``source_rev``."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(git("archive", tests_rev))) as tar:
        tar.extractall(dest, filter="data")
    if source_rev != tests_rev:
        shutil.rmtree(dest / "llamax")
        with tarfile.open(fileobj=io.BytesIO(git("archive", source_rev, "llamax"))) as tar:
            tar.extractall(dest, filter="data")
    return dest


def resolve(rev: str) -> str:
    return git("rev-parse", "--short=12", f"{rev}^{{commit}}").decode().strip()


# ---------------------------------------------------------------- coverage map

SITECUSTOMIZE = '''\
"""Coverage in processes the tests spawn, with the spawning test as the context."""
import os

if os.environ.get("MUTANTS_COV_CONTEXT") and os.environ.get("MUTANTS_COV_DIR"):
    import atexit

    import coverage

    _cov = coverage.Coverage(
        data_file=os.path.join(os.environ["MUTANTS_COV_DIR"], ".coverage.child"),
        data_suffix=True, source=["llamax"], config_file=False,
        context=os.environ["MUTANTS_COV_CONTEXT"],
    )
    _cov.set_option("run:sigterm", True)
    _cov.start()

    def _save() -> None:
        _cov.stop()
        _cov.save()

    atexit.register(_save)
'''

PLUGIN = '''\
"""Names the running test in MUTANTS_COV_CONTEXT, for the processes it spawns."""
import os

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    os.environ["MUTANTS_COV_CONTEXT"] = item.nodeid
    try:
        return (yield)
    finally:
        os.environ.pop("MUTANTS_COV_CONTEXT", None)
'''


def junit_results(path: Path) -> dict[str, tuple[float, bool]]:
    """``{nodeid: (seconds, passed)}`` from a pytest junit XML file."""
    results: dict[str, tuple[float, bool]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = _junit_key(case.get("classname", ""), case.get("name", ""))
        failed = any(case.find(tag) is not None for tag in ("failure", "error"))
        skipped = case.find("skipped") is not None
        seconds = float(case.get("time", "0") or 0)
        previous = results.get(key)
        passed = not failed and not skipped and (previous is None or previous[1])
        results[key] = ((previous[0] if previous else 0.0) + seconds, passed)
    return results


def _junit_key(classname: str, name: str) -> str:
    return f"{classname}.{name}"


def nodeid_key(nodeid: str) -> str:
    """The junit key of a node id: ``tests/a.py::C::t[x]`` -> ``tests.a.C.t[x]``."""
    path, _, rest = nodeid.partition("::")
    module = path.removesuffix(".py").replace("/", ".")
    return ".".join([module, *rest.split("::")])


def build_map(args: argparse.Namespace) -> None:
    """Run the selection's suite once under coverage; write ``{file: {line: tests}}``.

    With ``--jobs N`` the test files are split into N groups of about the same time (by
    ``--durations``, else by count), each run by its own pytest process in its own tree.
    """
    tests_rev, markers = selection(args)
    source_rev = resolve(args.source or tests_rev)
    work = Path(tempfile.mkdtemp(prefix="mutants-cov-", dir=args.workdir))
    groups: list[list[str]] = [list(args.pytest_args)]
    if args.jobs > 1:
        groups = split_files(make_tree(work / "files", tests_rev, source_rev), args)
    started = time.monotonic()
    procs: list[tuple[Path, subprocess.Popen[bytes]]] = []
    for i, group in enumerate(groups):
        procs.append(_start_coverage(work / f"g{i}", tests_rev, source_rev, markers, group))
    rcs = [proc.wait() for _, proc in procs]
    print(f"pytest exited {rcs} after {time.monotonic() - started:.0f} s", file=sys.stderr)
    tests, lines = read_contexts([d for d, _ in procs])
    results: dict[str, tuple[float, bool]] = {}
    for group_dir, _ in procs:
        if (group_dir / "junit.xml").exists():
            results |= junit_results(group_dir / "junit.xml")
    names = sorted(tests, key=tests.__getitem__)
    covmap = {
        "tests_rev": tests_rev,
        "source_rev": source_rev,
        "markers": markers,
        "pytest_rc": max(rcs),
        "seconds": round(time.monotonic() - started),
        "tests": names,
        "failed": sorted(t for t in names if not results.get(nodeid_key(t), (0.0, True))[1]),
        "durations": {key: round(value[0], 3) for key, value in results.items()},
        "lines": {
            file: {str(line): sorted(ids) for line, ids in sorted(by_line.items())}
            for file, by_line in sorted(lines.items())
        },
    }
    Path(args.out).write_text(json.dumps(covmap))
    print(f"{len(names)} tests cover {len(lines)} files; map in {args.out}", file=sys.stderr)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def split_files(tree: Path, args: argparse.Namespace) -> list[list[str]]:
    """The test files (``args.pytest_args``, else the tree's) in ``args.jobs`` groups, the
    longest first into the lightest."""
    files = list(args.pytest_args) or sorted(
        str(f.relative_to(tree)) for f in (tree / "tests").glob("test_*.py")
    )
    weight = dict.fromkeys(files, 1.0)
    if args.durations:
        for key, (seconds, _) in junit_results(Path(args.durations)).items():
            for file in files:
                if key.startswith(file.removesuffix(".py").replace("/", ".") + "."):
                    weight[file] += seconds
    groups: list[list[str]] = [[] for _ in range(args.jobs)]
    loads = [0.0] * args.jobs
    for file in sorted(files, key=lambda f: -weight[f]):
        lightest = loads.index(min(loads))
        groups[lightest].append(file)
        loads[lightest] += weight[file]
    return [sorted(group) for group in groups if group]


def _start_coverage(
    work: Path, tests_rev: str, source_rev: str, markers: str | None, pytest_args: list[str]
) -> tuple[Path, subprocess.Popen[bytes]]:
    tree = make_tree(work / "tree", tests_rev, source_rev)
    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (site / "mutants_context.py").write_text(PLUGIN)
    # pytest-cov combines the .coverage.* files beside its own at the end, the spawned
    # processes' included (their contexts carry no "|run" suffix).
    env = os.environ | {
        "PYTHONPATH": f"{tree}{os.pathsep}{site}",
        "COVERAGE_FILE": str(work / ".coverage"),
        "MUTANTS_COV_DIR": str(work),
    }
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "mutants_context", "-p", "no:cacheprovider",
        "--cov=llamax", "--cov-context=test", "--cov-report=",
        f"--junitxml={work / 'junit.xml'}", *(["-m", markers] if markers else []),
        *pytest_args,
    ]
    with (work / "pytest.log").open("w") as log:
        proc = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    return work, proc


def read_contexts(dirs: list[Path]) -> tuple[dict[str, int], dict[str, dict[int, set[int]]]]:
    """``(test -> index, {file: {line: test indices}})`` from the groups' coverage data."""
    from coverage import CoverageData  # only the map needs coverage

    tests: dict[str, int] = {}
    lines: dict[str, dict[int, set[int]]] = {}
    data_files = [f for d in dirs for f in [d / ".coverage", *d.glob(".coverage.*")]]
    for data_file in (f for f in data_files if f.exists()):
        data = CoverageData(str(data_file))
        data.read()
        for measured in data.measured_files():
            file = _package_path(measured)
            if file is None or area_of(file) is None:
                continue
            by_line = lines.setdefault(file, {})
            for line, contexts in data.contexts_by_lineno(measured).items():
                for context in contexts:
                    test = context.rpartition("|")[0] if "|" in context else context
                    if test:
                        by_line.setdefault(line, set()).add(tests.setdefault(test, len(tests)))
    return tests, lines


def _package_path(measured: str) -> str | None:
    parts = Path(measured).parts
    if "llamax" not in parts:
        return None
    index = len(parts) - 1 - parts[::-1].index("llamax")
    return "/".join(parts[index:])


# ---------------------------------------------------------------- running mutants


@dataclass(slots=True)
class Outcome:
    """What one mutant's run found."""

    id: str
    area: str
    status: str  # killed | survived | timeout | flaky | no_tests | error
    killer: str | None
    seconds: float
    num_candidates: int
    num_run: int
    covered_by: str  # line | file | none
    rc: int | None


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


def candidates(
    covmap: dict[str, Any], mutant: Mutant, at_import: bool = False
) -> tuple[list[str], str]:
    """The tests that cover ``mutant``'s lines; for a line that runs at import (or one no
    test context covers), every test that covers a line of its file."""
    by_line: dict[str, list[int]] = covmap["lines"].get(mutant.file, {})
    ids: set[int] = set()
    for line in range(mutant.line, mutant.end_line + 1):
        ids.update(by_line.get(str(line), ()))
    kind = "line"
    if at_import or not ids:
        kind = "file"
        for covering in by_line.values():
            ids.update(covering)
    failed = set(covmap["failed"])
    names = [covmap["tests"][i] for i in ids]
    return [name for name in names if name not in failed], kind if ids else "none"


def fastest_first(tests: list[str], durations: dict[str, float]) -> list[str]:
    return sorted(tests, key=lambda t: (durations.get(nodeid_key(t), 1.0), t))


def run_pytest(
    tree: Path, tests: list[str], markers: str | None, cap: float, log: Path
) -> tuple[int | None, str | None, int, float]:
    """Run ``tests`` in ``tree`` with ``-x``: ``(rc or None at the cap, first failing test,
    tests run, seconds)``."""
    argsfile, junit = log.with_suffix(".args"), log.with_suffix(".xml")
    argsfile.write_text("\n".join(tests) + "\n")
    junit.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE",
        f"--junitxml={junit}", *(["-m", markers] if markers else []), f"@{argsfile}",
    ]
    env = os.environ | {"PYTHONPATH": str(tree)}
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = time.monotonic() - started
    killer, num_run = None, 0
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            num_run += 1
            if killer is None and any(case.find(t) is not None for t in ("failure", "error")):
                killer = _junit_key(case.get("classname", ""), case.get("name", ""))
    if killer is None and rc is not None and rc != 0:
        match = re.search(r"^(?:FAILED|ERROR) (\S+)", log.read_text(), re.MULTILINE)
        killer = match.group(1) if match else None
    return rc, killer, num_run, seconds


def run_one(
    tree: Path, mutant: Mutant, covmap: dict[str, Any], durations: dict[str, float],
    args: argparse.Namespace, markers: str | None, logs: Path,
) -> Outcome:
    target = tree / mutant.file
    original = target.read_text()
    tests, kind = candidates(covmap, mutant, runs_at_import(original, mutant))
    if not tests:
        return Outcome(mutant.id, mutant.area, "no_tests", None, 0.0, 0, 0, kind, None)
    # A mutant often keeps the file's size, and its mtime may fall in the same second as
    # the original's: a cached .pyc would pass for either, so none is kept across the swap.
    _forget_bytecode(target)
    target.write_text(apply(original, mutant))
    try:
        rc, killer, num_run, seconds = run_pytest(
            tree, fastest_first(tests, durations), markers, args.cap, logs / f"{mutant.id}.log"
        )
    finally:
        target.write_text(original)
        _forget_bytecode(target)
    by_key = {nodeid_key(test): test for test in tests}
    killer = by_key.get(killer, killer) if killer else None
    if rc is None:
        status = "timeout"
    elif rc == 0:
        status = "survived"
    elif rc in (1, 2, 3):
        status = "killed"
    else:  # 4: usage (a node id not found), 5: nothing collected
        status = "error"
    return Outcome(
        mutant.id, mutant.area, status, killer, round(seconds, 1), len(tests), num_run, kind, rc
    )


def _forget_bytecode(source: Path) -> None:
    for cached in (source.parent / "__pycache__").glob(f"{source.stem}.*.pyc"):
        cached.unlink(missing_ok=True)


def verify_kills(tree: Path, outcomes: list[Outcome], markers: str | None, logs: Path) -> None:
    """A killing test that fails on the unmutated tree too makes its mutant ``flaky``."""
    killers = sorted({o.killer for o in outcomes if o.status == "killed" and o.killer})
    nodeids = [k for k in killers if "::" in k]
    if not nodeids:
        return
    junit, argsfile = logs / "verify.xml", logs / "verify.args"
    argsfile.write_text("\n".join(nodeids) + "\n")
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
        *(["-m", markers] if markers else []), f"@{argsfile}",
    ]
    env = os.environ | {"PYTHONPATH": str(tree)}
    with (logs / "verify.log").open("w") as out:
        subprocess.run(command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    if not junit.exists():
        return
    failing = {k for k, (_, passed) in junit_results(junit).items() if not passed}
    for outcome in outcomes:
        if outcome.status == "killed" and outcome.killer:
            key = nodeid_key(outcome.killer) if "::" in outcome.killer else outcome.killer
            if key in failing:
                outcome.status = "flaky"


def counts(outcomes: Sequence[Outcome]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for outcome in outcomes:
        for area in (outcome.area, "all"):
            row = table.setdefault(area, {})
            row[outcome.status] = row.get(outcome.status, 0) + 1
    return table


def run_mutants(args: argparse.Namespace) -> None:
    document = json.loads(Path(args.mutants).read_text())
    mutants = [Mutant(**m) for m in document["mutants"]]
    if args.only:
        mutants = [m for m in mutants if m.id in set(args.only)]
    tests_rev, markers = selection(args)
    source_rev = resolve(args.source or document["source_rev"])
    covmap = json.loads(Path(args.map).read_text())
    durations: dict[str, float] = dict(covmap["durations"])
    if args.durations:
        durations |= {k: v for k, (v, _) in junit_results(Path(args.durations)).items()}
    work = Path(tempfile.mkdtemp(prefix="mutants-run-", dir=args.workdir))
    trees: queue.Queue[Path] = queue.Queue()
    for i in range(max(1, args.jobs)):
        trees.put(make_tree(work / f"tree{i}", tests_rev, source_rev))
    tree = trees.queue[0]
    logs = work / "logs"
    logs.mkdir()
    started = time.monotonic()
    outcomes: list[Outcome] = []

    def one(mutant: Mutant) -> Outcome | None:
        if args.budget and time.monotonic() - started > args.budget:
            return None  # the budget is spent: not run
        mine = trees.get()
        try:
            outcome = run_one(mine, mutant, covmap, durations, args, markers, logs)
        finally:
            trees.put(mine)
        print(
            f"[{len(outcomes) + 1}/{len(mutants)} {time.monotonic() - started:.0f}s] "
            f"{mutant.id} {mutant.area} {mutant.file}:{mutant.line} "
            f"{mutant.original!r}->{mutant.replacement!r}: {outcome.status} "
            f"{outcome.killer or ''} ({outcome.num_run}/{outcome.num_candidates} tests, "
            f"{outcome.seconds}s)",
            file=sys.stderr, flush=True,
        )
        outcomes.append(outcome)
        return outcome

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        done = list(pool.map(one, round_robin(mutants)))
    if None in done:
        print(f"budget spent: {done.count(None)} mutants not run", file=sys.stderr)
    outcomes.sort(key=lambda o: [m.id for m in mutants].index(o.id))
    verify_kills(tree, outcomes, markers, logs)
    by_id = {m.id: m for m in mutants}
    result = {
        "selection": args.selection,
        "tests_rev": tests_rev,
        "source_rev": source_rev,
        "markers": markers,
        "cap_s": args.cap,
        "wall_s": round(time.monotonic() - started),
        "cpu": cpu_model(),
        "counts": counts(outcomes),
        "not_run": [m.id for m in mutants if m.id not in {o.id for o in outcomes}],
        "outcomes": [asdict(o) | asdict(by_id[o.id]) for o in outcomes],
        "logs": str(logs) if args.keep else None,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["counts"]), file=sys.stderr)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def round_robin(mutants: list[Mutant]) -> list[Mutant]:
    """One mutant of each area in turn, so that a spent budget leaves the areas even."""
    by_area = [[m for m in mutants if m.area == area] for area in AREAS]
    order: list[Mutant] = []
    for i in range(max((len(group) for group in by_area), default=0)):
        order.extend(group[i] for group in by_area if i < len(group))
    return order


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    models = re.findall(r"^model name\s*:\s*(.*)$", text, re.MULTILINE)
    return f"{models[0]} x{len(models)}" if models else "unknown"


def compare(args: argparse.Namespace) -> None:
    """Counts per area and selection, and the mutants one selection kills and one does not."""
    runs = [json.loads(Path(path).read_text()) for path in args.results]
    status = [{o["id"]: o["status"] for o in run["outcomes"]} for run in runs]
    shared = sorted(set(status[0]) & set(status[1]))
    labels = [str(run["selection"]) for run in runs]
    report = {
        "counts": {label: counts_of(run, shared) for label, run in zip(labels, runs, strict=True)},
        "mutants": len(shared),
        f"killed_by_{labels[0]}_only": [i for i in shared if _kills(status, i) == (True, False)],
        f"killed_by_{labels[1]}_only": [i for i in shared if _kills(status, i) == (False, True)],
    }
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


def counts_of(run: dict[str, Any], ids: list[str]) -> dict[str, dict[str, int]]:
    keep = set(ids)
    names = [field.name for field in fields(Outcome)]
    return counts(
        [Outcome(**{k: o[k] for k in names}) for o in run["outcomes"] if o["id"] in keep]
    )


def _kills(status: list[dict[str, str]], mutant: str) -> tuple[bool, bool]:
    return status[0][mutant] == "killed", status[1][mutant] == "killed"


# ---------------------------------------------------------------- command line


def selection(args: argparse.Namespace) -> tuple[str, str | None]:
    """``(tests commit, marker expression or None for the tree's addopts)``."""
    if args.selection == "old":
        return resolve(args.tests or OLD_TESTS), args.markers or OLD_MARKERS
    return resolve(args.tests or "HEAD"), args.markers


def write_mutants(args: argparse.Namespace) -> None:
    source_rev = resolve(args.source)
    mutants = generate(package_sources(source_rev), args.seed, args.per_area)
    document = {
        "source_rev": source_rev,
        "seed": args.seed,
        "per_area": args.per_area,
        "mutants": [asdict(m) for m in mutants],
    }
    Path(args.out).write_text(json.dumps(document, indent=1))
    print(f"{len(mutants)} mutants of {source_rev} in {args.out}", file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    commands = top.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="draw mutants from llamax/ at a commit")
    gen.add_argument("--source", default=OLD_TESTS)
    gen.add_argument("--seed", type=int, default=55)
    gen.add_argument("--per-area", type=int, default=18)
    gen.add_argument("--out", required=True)
    for name, help_text in (
        ("covermap", "run a selection under coverage, one context per test"),
        ("run", "run the mutants against a selection"),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--selection", choices=("old", "new"), required=True)
        sub.add_argument("--tests", help=f"the tests tree's commit (old: {OLD_TESTS})")
        sub.add_argument("--markers", help=f"-m expression (old: {OLD_MARKERS!r})")
        sub.add_argument("--source", help="llamax/'s commit (default: the mutants' own)")
        sub.add_argument("--out", required=True)
        sub.add_argument("--workdir", default=None, help="where the temporary trees go")
        sub.add_argument("--keep", action="store_true", help="keep the work directory")
    cov = commands.choices["covermap"]
    cov.add_argument("--jobs", type=int, default=1, help="pytest processes side by side")
    cov.add_argument("--durations", help="a junit XML whose times balance the groups")
    cov.add_argument("pytest_args", nargs="*", help="test files or node ids (after --)")
    run = commands.choices["run"]
    run.add_argument("--mutants", required=True)
    run.add_argument("--map", required=True)
    run.add_argument("--durations", help="a junit XML whose times order the tests")
    run.add_argument("--cap", type=float, default=240.0, help="seconds per mutant")
    run.add_argument("--budget", type=float, default=0.0, help="stop after this many seconds")
    run.add_argument("--only", nargs="*", help="run these mutant ids only")
    run.add_argument("--jobs", type=int, default=1, help="mutants run side by side")
    cmp = commands.add_parser("compare", help="two run results side by side")
    cmp.add_argument("results", nargs=2)
    cmp.add_argument("--out")
    return top


def main(argv: Iterator[str] | Sequence[str] | None = None) -> None:
    args = parser().parse_args(list(argv) if argv is not None else None)
    {"generate": write_mutants, "covermap": build_map, "run": run_mutants, "compare": compare}[
        args.command
    ](args)


if __name__ == "__main__":
    main()
