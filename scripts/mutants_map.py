"""scripts/mutants.py's trees and coverage map: a commit's tree with ``llamax/`` from
another, junit times, and the suite run once under coverage with one context per test.

Spawned Python processes are measured too: a ``sitecustomize`` at the tree's root (on their
``PYTHONPATH``) starts coverage in them with the spawning test's id as the context. A process
killed by SIGKILL, or started without the tree on its path (``tests/test_install.py``'s
fresh venv), records nothing: its test counts only through its own process's lines.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from mutants_gen import area_of

REPO = Path(__file__).resolve().parents[1]

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
        key = junit_key(case.get("classname", ""), case.get("name", ""))
        failed = any(case.find(tag) is not None for tag in ("failure", "error"))
        skipped = case.find("skipped") is not None
        seconds = float(case.get("time", "0") or 0)
        previous = results.get(key)
        passed = not failed and not skipped and (previous is None or previous[1])
        results[key] = ((previous[0] if previous else 0.0) + seconds, passed)
    return results


def junit_key(classname: str, name: str) -> str:
    return f"{classname}.{name}"


def nodeid_key(nodeid: str) -> str:
    """The junit key of a node id: ``tests/a.py::C::t[x]`` -> ``tests.a.C.t[x]``."""
    path, _, rest = nodeid.partition("::")
    module = path.removesuffix(".py").replace("/", ".")
    return ".".join([module, *rest.split("::")])


def build_map(args: argparse.Namespace, tests_rev: str, markers: str | None) -> None:
    """Run the selection's suite once under coverage; write ``{file: {line: tests}}``.

    With ``--jobs N`` the test files are split into N groups of about the same time (by
    ``--durations``, else by count), each run by its own pytest process in its own tree.
    """
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
    # At the tree's root: a child a test starts with PYTHONPATH set to the checkout (or its
    # working directory there) finds them too.
    (tree / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tree / "mutants_context.py").write_text(PLUGIN)
    # pytest-cov combines the .coverage.* files beside its own at the end, the spawned
    # processes' included (their contexts carry no "|run" suffix).
    env = os.environ | {
        "PYTHONPATH": str(tree),
        "COVERAGE_FILE": str(work / ".coverage"),
        "MUTANTS_COV_DIR": str(work),
    }
    command = [
        sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "mutants_context",
        "-p", "no:cacheprovider",
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
