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

Usage (``nice -n 10``: the machine is shared; the c548be1 baseline: a 41-minute map with
``--jobs 2`` on a loaded 2-core machine)::

    py=/work/main/.venv/bin/python   # with pytest-cov installed
    $py scripts/mutants.py generate --source c548be1 --seed 55 --per-area 18 \\
        --out /tmp/i55/mutants.json
    $py scripts/mutants.py covermap --selection old --jobs 2 \\
        --durations /tmp/i55/before.xml --out /tmp/i55/covmap-old.json
    $py scripts/mutants.py run --selection old --mutants /tmp/i55/mutants.json \\
        --map /tmp/i55/covmap-old.json --durations /tmp/i55/before.xml --jobs 2 \\
        --cap 150 --test-timeout 90 --out /tmp/i55/mutants-old.json
    # the same for a later tests tree (REV), then the two side by side:
    $py scripts/mutants.py covermap --selection new --tests REV --jobs 2 \\
        --out /tmp/i55/covmap-new.json
    $py scripts/mutants.py run --selection new --tests REV --mutants /tmp/i55/mutants.json \\
        --map /tmp/i55/covmap-new.json --jobs 2 --cap 150 --test-timeout 90 \\
        --out /tmp/i55/mutants-new.json
    $py scripts/mutants.py compare /tmp/i55/mutants-old.json /tmp/i55/mutants-new.json
    $py scripts/mutants.py report /tmp/i55/mutants-new.json --md /tmp/i55/mutants-new.md

``run --resume`` keeps the outcomes already in ``--out`` and runs the rest (after a
``--budget`` stop, say).

``--selection old`` is what ``scripts/test.sh`` ran at c548be1 (its ``tests/`` and
``-m 'not cluster and not soak and not gpu'``); ``--selection new`` takes ``--tests REV``
and ``--markers EXPR`` (default: the tree's own ``addopts``). A mutant is *killed* when
pytest exits non-zero (a failure, an error, a per-test timeout), *survived* when every
candidate passed, *timeout* when the per-mutant cap (``--cap``) ended the run first, and
*flaky* when the test that killed it also fails on the unmutated tree.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from mutants_gen import AREAS, Mutant, apply, generate, runs_at_import
from mutants_map import (
    build_map,
    junit_key,
    junit_results,
    make_tree,
    nodeid_key,
    package_sources,
    resolve,
)

OLD_TESTS = "c548be1"
OLD_MARKERS = "not cluster and not soak and not gpu"


@dataclass(slots=True)
class Outcome:
    """What one mutant's run found."""

    id: str
    area: str
    status: str  # killed | survived | timeout | flaky | no_tests | error | stale
    killer: str | None
    seconds: float
    num_candidates: int
    num_run: int
    covered_by: str  # line | file | none
    rc: int | None


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
    tree: Path, tests: list[str], markers: str | None, cap: float, log: Path, per_test: float
) -> tuple[int | None, str | None, int, float]:
    """Run ``tests`` in ``tree`` with ``-x``: ``(rc or None at the cap, first failing test,
    tests run, seconds)``. A test past ``per_test`` seconds fails (pytest-timeout): a
    mutant that makes a test hang is killed, not left to the cap."""
    argsfile, junit = log.with_suffix(".args"), log.with_suffix(".xml")
    argsfile.write_text("\n".join(tests) + "\n")
    junit.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", "-rfE",
        f"--timeout={per_test:.0f}", f"--junitxml={junit}",
        *(["-m", markers] if markers else []), f"@{argsfile}",
    ]
    env = test_env(tree)
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
                killer = junit_key(case.get("classname", ""), case.get("name", ""))
    if not junit.exists():  # stopped at the cap: count the progress characters
        progress = re.findall(r"^[.sxXEF]+(?:\s+\[\s*\d+%\])?$", log.read_text(), re.MULTILINE)
        num_run = sum(len(line.split()[0]) for line in progress)
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
    try:
        mutated = apply(original, mutant)
    except ValueError:  # --source is not the commit the mutants were drawn from
        return Outcome(mutant.id, mutant.area, "stale", None, 0.0, len(tests), 0, kind, None)
    _forget_bytecode(target)
    target.write_text(mutated)
    try:
        ordered = fastest_first(tests, durations)
        slowest = max(durations.get(nodeid_key(test), 1.0) for test in ordered)
        per_test = min(args.cap, max(args.test_timeout, 3 * slowest))
        log = logs / f"{mutant.id}.log"
        rc, killer, num_run, seconds = run_pytest(tree, ordered, markers, args.cap, log, per_test)
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


def test_env(tree: Path) -> dict[str, str]:
    """The environment of a run in ``tree``: its ``llamax/`` first on the path, and bytecode
    cached (each run would compile the package again; the mutated module's own cache is
    dropped before and after, see :func:`run_one`)."""
    env = os.environ | {"PYTHONPATH": str(tree)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


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
        sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
        f"--junitxml={junit}",
        *(["-m", markers] if markers else []), f"@{argsfile}",
    ]
    env = test_env(tree)
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
    outcomes, earlier_s = resumed(Path(args.out)) if args.resume else ([], 0)
    to_run = [m for m in mutants if m.id not in {o.id for o in outcomes}]

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

    by_id = {m.id: m for m in mutants}

    def save() -> None:
        """The results so far (after each mutant, so a stopped run keeps them)."""
        ran = sorted(outcomes, key=lambda o: order.index(o.id))
        result = {
            "selection": args.selection,
            "tests_rev": tests_rev,
            "source_rev": source_rev,
            "markers": markers,
            "cap_s": args.cap,
            "wall_s": earlier_s + round(time.monotonic() - started),
            "cpu": cpu_model(),
            "counts": counts(ran),
            "not_run": [i for i in order if i not in {o.id for o in ran}],
            "outcomes": [asdict(o) | asdict(by_id[o.id]) for o in ran],
            "logs": str(logs) if args.keep else None,
        }
        Path(args.out).write_text(json.dumps(result, indent=1))

    order = [m.id for m in mutants]
    saving = threading.Lock()

    def run_and_save(mutant: Mutant) -> Outcome | None:
        outcome = one(mutant)
        with saving:
            save()
        return outcome

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        done = list(pool.map(run_and_save, round_robin(to_run)))
    if None in done:
        print(f"budget spent: {done.count(None)} mutants not run", file=sys.stderr)
    verify_kills(tree, outcomes, markers, logs)
    save()
    print(json.dumps(counts(outcomes)), file=sys.stderr)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def resumed(out: Path) -> tuple[list[Outcome], int]:
    """The outcomes an earlier run left in ``out`` (``--resume``), and its wall seconds."""
    if not out.exists():
        return [], 0
    earlier = json.loads(out.read_text())
    names = [field.name for field in fields(Outcome)]
    outcomes = [Outcome(**{k: o[k] for k in names}) for o in earlier["outcomes"]]
    return outcomes, int(earlier["wall_s"])


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
    if labels[0] == labels[1]:
        labels = [f"{label}_{i}" for i, label in enumerate(labels, 1)]
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


def report(args: argparse.Namespace) -> None:
    """A run's counts per area, and its survivors and timeouts one a line, as Markdown."""
    run = json.loads(Path(args.result).read_text())
    statuses = ("killed", "survived", "timeout", "flaky", "no_tests", "error", "stale")
    rows = [
        "| area | " + " | ".join(statuses) + " |",
        "|---" * (len(statuses) + 1) + "|",
    ]
    for area in [*AREAS, "all"]:
        row = run["counts"].get(area, {})
        rows.append(f"| {area} | " + " | ".join(str(row.get(s, 0)) for s in statuses) + " |")
    lines = [
        f"Selection `{run['selection']}`: tests of {run['tests_rev']}, `-m {run['markers']!r}`, "
        f"llamax/ of {run['source_rev']}; cap {run['cap_s']:.0f} s a mutant; "
        f"{run['wall_s']} s wall; {run['cpu']}.",
        "",
        *rows,
        "",
        "| mutant | status | area | where | change | tests (run/candidates, by) | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in run["outcomes"]:
        if o["status"] != "killed":
            change = f"`{o['original'][:40]}` → `{o['replacement'][:46]}`"
            lines.append(
                f"| {o['id']} | {o['status']} | {o['area']} | {o['file']}:{o['line']} | "
                f"{change} | {o['num_run']}/{o['num_candidates']} ({o['covered_by']}) | "
                f"{o['seconds']} |"
            )
    text = "\n".join(lines) + "\n"
    if args.md:
        Path(args.md).write_text(text)
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


def write_map(args: argparse.Namespace) -> None:
    build_map(args, *selection(args))


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
    run.add_argument(
        "--test-timeout", type=float, default=60.0,
        help="seconds per test (at least 3x its time in --durations)",
    )
    run.add_argument("--budget", type=float, default=0.0, help="stop after this many seconds")
    run.add_argument("--only", nargs="*", help="run these mutant ids only")
    run.add_argument(
        "--resume", action="store_true", help="keep the outcomes already in --out, run the rest"
    )
    run.add_argument("--jobs", type=int, default=1, help="mutants run side by side")
    rep = commands.add_parser("report", help="a run's counts and survivors as Markdown")
    rep.add_argument("result")
    rep.add_argument("--md")
    cmp = commands.add_parser("compare", help="two run results side by side")
    cmp.add_argument("results", nargs=2)
    cmp.add_argument("--out")
    return top


def main(argv: Iterator[str] | Sequence[str] | None = None) -> None:
    args = parser().parse_args(list(argv) if argv is not None else None)
    commands = {
        "generate": write_mutants,
        "covermap": write_map,
        "run": run_mutants,
        "compare": compare,
        "report": report,
    }
    commands[args.command](args)


if __name__ == "__main__":
    main()
