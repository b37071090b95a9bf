"""Run llama.cpp's own server tests (``tools/server/tests``) against ``llamax serve`` and
against ``llama-server``, on the same model with equivalent flags, and compare.

Not part of the default test run: it needs the vendored llama.cpp source (the
llama-cpp-python 0.3.36 sdist) and a ``llama-server`` built from it
(``benchmarks/peers.sh``). Usage::

    python scripts/llama_server_suite.py [--files test_basic.py ...] [--only llamax]

The suite is copied to a scratch directory and patched so that it runs against an
already-running server (``DEBUG_EXTERNAL=1``, ``PORT``) and downloads nothing: ``wget`` is
not imported and ``ServerPreset.load_all`` does nothing. For each test file both servers
are started fresh with the flags of the file's preset (``tinyllama2``: 512 cells over 2
slots, 64 tokens per reply, temperature 0.8, seed 42), since an external server ignores
the flags a test sets on its ``ServerProcess``. It prints pass/fail counts per file for
both servers, then each test that passes on llama-server and fails on llamax.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SDIST = Path(os.environ.get("LLAMA_CPP_SDIST", "/tmp/sdist/llama_cpp_python-0.3.36"))
VENDOR = SDIST / "vendor" / "llama.cpp"
QUIET = Path("/work/notes/QUIET")
DEFAULT_FILES = (
    "test_basic.py",
    "test_chat_completion.py",
    "test_completion.py",
    "test_tokenize.py",
    "test_security.py",
    "test_compat_anthropic.py",
    "test_compat_oai_responses.py",
    "test_template.py",
)


@dataclass(frozen=True)
class Preset:
    """The server flags of a test file's preset (what its ``ServerProcess`` would pass)."""

    n_ctx: int = 512
    n_slots: int = 2
    n_batch: int = 32
    n_predict: int | None = 64
    alias: str = "tinyllama-2"


PRESETS: dict[str, Preset] = {
    "test_compat_anthropic.py": Preset(
        n_ctx=8192, n_slots=1, n_batch=2048, alias="tinyllama-2-anthropic"
    ),
}


@dataclass
class Outcome:
    """One server's results on one file: test id -> passed, failed, error or skipped."""

    results: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)

    def count(self, kind: str) -> int:
        return sum(1 for r in self.results.values() if r == kind)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_llama_server() -> Path | None:
    built = sorted((Path.home() / ".cache" / "llamax" / "llama-server").glob("*/llama-server"))
    found = shutil.which("llama-server")
    return built[-1] if built else (Path(found) if found else None)


def default_model() -> Path:
    sys.path.insert(0, str(ROOT))
    import llamax

    return Path(os.environ.get("LLAMAX_MODEL") or llamax.default_model_path())


def copy_suite(scratch: Path) -> Path:
    """The suite under ``scratch/tools/server/tests`` (``../../../models`` still resolves),
    patched to run against an external server without downloads."""
    tests = scratch / "tools" / "server" / "tests"
    shutil.copytree(VENDOR / "tools" / "server" / "tests", tests)
    (scratch / "models").symlink_to(VENDOR / "models")
    utils = tests / "utils.py"
    text = utils.read_text()
    text = text.replace("import wget\n", "wget = None  # patched: no downloads\n")
    text = text.replace(
        "    def load_all() -> None:\n",
        "    def load_all() -> None:\n        return  # patched: external server, no downloads\n",
    )
    utils.write_text(text)
    return tests


def start_llama_server(
    binary: Path, model: Path, preset: Preset, port: int, log: Path
) -> subprocess.Popen[bytes]:
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-c", str(preset.n_ctx), "-np", str(preset.n_slots), "-b", str(preset.n_batch),
            "--temp", "0.8", "--seed", "42", "--alias", preset.alias, "-t", "2",
            "--no-slots", "--jinja"]  # fmt: skip
    if preset.n_predict is not None:
        argv += ["--n-predict", str(preset.n_predict)]
    return _spawn(argv, log)


def start_llamax(
    model: Path, preset: Preset, port: int, log: Path, root: Path
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "llamax.cli", "serve", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n-ctx", str(preset.n_ctx),
            "--n-seq-max", str(preset.n_slots),
            "--n-ctx-seq", str(preset.n_ctx // preset.n_slots),
            "--n-batch", str(max(preset.n_batch, preset.n_slots)), "--n-threads", "2",
            "--no-calibrate", "--seed", "42", "--alias", preset.alias]  # fmt: skip
    if preset.n_predict is not None:
        argv += ["--n-predict", str(preset.n_predict)]
    return _spawn(argv, log, root)


def _spawn(argv: list[str], log: Path, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        return subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)  # fmt: skip


def wait_healthy(process: subprocess.Popen[bytes], port: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}); see its log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError("the server did not become healthy")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_file(tests: Path, name: str, port: int, report: Path, log: Path, timeout: int) -> Outcome:
    env = os.environ | {"DEBUG_EXTERNAL": "1", "PORT": str(port)}
    argv = [sys.executable, "-m", "pytest", f"unit/{name}", "-p", "no:cacheprovider", "-q",
            f"--junitxml={report}", "-o", "junit_family=xunit1", f"--timeout={timeout}",
            "-m", "not slow"]  # fmt: skip
    with log.open("ab") as out:
        subprocess.run(argv, cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT)
    return parse_report(report)


def parse_report(report: Path) -> Outcome:
    outcome = Outcome()
    if not report.exists():
        return outcome
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = case.get("name", "?")
        kind, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                kind, message = "failed", child.get("message", "")
            elif child.tag == "skipped":
                kind, message = "skipped", child.get("message", "")
        outcome.results[test_id] = kind
        outcome.messages[test_id] = message.splitlines()[0][:200] if message else ""
    return outcome


def run_server(kind: str, name: str, tests: Path, out: Path, args: argparse.Namespace) -> Outcome:
    preset = PRESETS.get(name, Preset())
    port = free_port()
    log = out / f"{kind}-{name}.log"
    if kind == "llama-server":
        process = start_llama_server(args.llama_server, args.model, preset, port, log)
    else:
        process = start_llamax(args.model, preset, port, log, args.llamax_root)
    try:
        wait_healthy(process, port)
        return run_file(tests, name, port, out / f"{kind}-{name}.xml", log, args.timeout)
    finally:
        stop(process)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES))
    parser.add_argument("--only", choices=["llamax", "llama-server"])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--llama-server", type=Path, default=default_llama_server())
    parser.add_argument(
        "--out", type=Path, default=None, help="logs and reports (default: a temp dir)"
    )
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--llamax-root",
        type=Path,
        default=ROOT,
        help="the llamax checkout to serve from (a baseline: an old worktree)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="take llama-server's results from this --json of an earlier run",
    )
    args = parser.parse_args()
    args.model = args.model or default_model()
    kinds = [args.only] if args.only else ["llama-server", "llamax"]
    if args.baseline and not args.only:
        kinds = ["llama-server", "llamax"]
    if "llama-server" in kinds and args.llama_server is None:
        parser.error(
            "no llama-server found: build it with benchmarks/peers.sh or pass --llama-server"
        )
    scratch = Path(tempfile.mkdtemp(prefix="llama-suite-"))
    out = args.out or scratch / "out"
    out.mkdir(parents=True, exist_ok=True)
    tests = copy_suite(scratch)
    print(f"model {args.model}; logs and reports in {out}", flush=True)
    earlier = json.loads(args.baseline.read_text()) if args.baseline else {}
    results: dict[str, dict[str, Outcome]] = {}
    for name in args.files:
        results[name] = {}
        for kind in kinds:
            if kind == "llama-server" and kind in earlier.get(name, {}):
                outcome = Outcome(**earlier[name][kind])
            else:
                while QUIET.exists():  # another developer is timing benchmarks
                    time.sleep(15)
                outcome = run_server(kind, name, tests, out, args)
            results[name][kind] = outcome
            save(args.json, results)
            counts = "  ".join(f"{k} {outcome.count(k):3}" for k in ("passed", "failed", "skipped"))
            print(f"{name:32} {kind:13} {counts}", flush=True)
    print_summary(results, kinds)
    return 0


def save(path: Path | None, results: dict[str, dict[str, Outcome]]) -> None:
    if path is not None:
        path.write_text(json.dumps(
            {f: {k: {"results": o.results, "messages": o.messages} for k, o in by.items()}
             for f, by in results.items()}, indent=1))  # fmt: skip


def print_summary(results: dict[str, dict[str, Outcome]], kinds: list[str]) -> None:
    print("\nfile                             " + "".join(f"{k + ' pass/run':>24}" for k in kinds))
    for name, by in results.items():
        cells = []
        for kind in kinds:
            o = by[kind]
            cells.append(f"{o.count('passed'):>3}/{o.count('passed') + o.count('failed'):<3}")
        print(f"{name:32} " + "".join(f"{c:>24}" for c in cells))
    if len(kinds) < 2:
        return
    print("\npass on llama-server, fail on llamax:")
    for name, by in results.items():
        for test_id, result in by["llama-server"].results.items():
            if result == "passed" and by["llamax"].results.get(test_id) != "passed":
                print(f"  {name}::{test_id}: {by['llamax'].messages.get(test_id, '')}")


if __name__ == "__main__":
    sys.exit(main())
