"""The minimal install (issue 57, item 3): ``scripts/newcomer.sh`` builds llamax's wheel,
installs it in a fresh venv with only its runtime dependencies (the llama-cpp-python wheel
bootstrap built, nothing rebuilt), and runs the Quickstart's core with that venv's Python;
the ``server`` extra then adds the server and nothing from the dev extras."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import llamax

REPO = Path(__file__).resolve().parent.parent
DEV_ONLY = {"fastapi", "uvicorn", "pytest", "mypy", "ruff", "ray", "playwright", "openai"}

pytestmark = pytest.mark.integration


def _installed(python: Path) -> set[str]:
    listing = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; "
         "print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {name.lower().replace("_", "-") for name in listing.split()}


def test_a_fresh_venv_runs_the_quickstart_with_only_runtime_dependencies(
    tmp_path: Path,
) -> None:
    model = Path(os.environ.get("LLAMAX_MODEL") or llamax.default_model_path())
    if not model.is_file():
        pytest.skip("the default model is not installed")
    venv = tmp_path / "venv"
    env = os.environ | {
        "LLAMAX_MODEL": str(model),
        "PYTHON": sys.executable,
        "LLAMAX_REQUIRE_BUILT_WHEEL": "1",  # reuse bootstrap's llama-cpp-python wheel
        "LLAMAX_DIST": str(tmp_path / "dist"),
    }
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "newcomer.sh"), str(venv)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if run.returncode == 3:
        pytest.skip("no llama-cpp-python wheel built by scripts/bootstrap.sh to reuse")
    assert run.returncode == 0, run.stderr[-3000:]
    chat = [line for line in run.stdout.splitlines() if line.startswith("chat: ")]
    assert chat and chat[0].removeprefix("chat: ").strip(), run.stdout
    assert f"llamax {venv}" in run.stdout  # the installed copy, not the clone
    python = venv / "bin" / "python"
    installed = _installed(python)
    assert {"llamax", "llama-cpp-python", "numpy", "jinja2"} <= installed
    assert not installed & DEV_ONLY, installed & DEV_ONLY

    missing = subprocess.run([str(python), "-c", "import llamax.server"],
                             capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert missing.returncode != 0 and "pip install '.[server]'" in missing.stderr

    (wheel,) = (tmp_path / "dist").glob("llamax-*.whl")
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"{wheel}[server]"],
                   check=True, capture_output=True)  # fmt: skip
    assert {"fastapi", "uvicorn", "prometheus-client"} <= _installed(python)
    assert not _installed(python) & (DEV_ONLY - {"fastapi", "uvicorn"})
    serve = subprocess.run([str(venv / "bin" / "llamax"), "serve", "--help"],
                           capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert serve.returncode == 0 and "--shutdown-timeout" in serve.stdout, serve.stderr
