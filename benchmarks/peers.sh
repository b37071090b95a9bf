#!/usr/bin/env bash
# Build llama.cpp's llama-server as a benchmark peer and print the path of the binary.
#
# The source is the llama.cpp that llama-cpp-python's sdist vendors (vendor/llama.cpp), so
# the peer runs the same llama.cpp version as llamax. The CMake flags come from
# scripts/cmake_flags.sh: GGML_NATIVE=OFF plus the SIMD extensions this CPU reports, never
# AMX (the native build segfaults in ggml_backend_amx_mul_mat on some AMX machines). Only
# the llama-server target is built, statically linked, without libcurl.
#
# Idempotent: the binary is kept in ~/.cache/llamax/llama-server/<key>/, keyed by version
# and flags; a second run prints its path at once. Not part of the test suite.
#
# Environment:
#   LLAMAX_CMAKE_ARGS   extra CMake flags for llama.cpp (also part of the key)
#   LLAMAX_SERVER_DIR   where built binaries are kept (default: ~/.cache/llamax/llama-server)
#   PYTHON              interpreter whose pip downloads the sdist (default: python3)
#   CMAKE_BUILD_PARALLEL_LEVEL  build jobs (default: nproc)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
llama_version=0.3.36

log() { printf '[peers] %s\n' "$*" >&2; }

cmake_args=$(bash "$repo/scripts/cmake_flags.sh")
cmake_args=$(echo "$cmake_args ${LLAMAX_CMAKE_ARGS:-}" | xargs)
key=$(printf 'llama-server|%s|%s|%s' "$llama_version" "$cmake_args" "$(uname -m)" | sha256sum | cut -c1-16)
out_dir=${LLAMAX_SERVER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llamax/llama-server}/$key
binary=$out_dir/llama-server

if [ -x "$binary" ]; then
  printf '%s\n' "$binary"
  exit 0
fi

mkdir -p "$out_dir"
work=$(mktemp -d "$out_dir/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

log "downloading the llama-cpp-python $llama_version sdist"
# --no-binary for llama-cpp-python only: its build dependencies (needed to read the sdist's
# metadata) may come as wheels, which is much faster than building them from source too.
"$python" -m pip --disable-pip-version-check download --quiet --no-binary llama-cpp-python --no-deps \
  "llama-cpp-python==$llama_version" -d "$work/sdist"
tar -xzf "$work"/sdist/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
[ -f "$src/CMakeLists.txt" ] || { log "no vendor/llama.cpp in the sdist"; exit 1; }

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
log "configuring llama-server with: $cmake_args"
# shellcheck disable=SC2086  # cmake_args is a list of flags
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON $cmake_args >&2
log "building llama-server (several minutes on 2 cores)"
cmake --build "$work/build" --target llama-server \
  --parallel "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}" >&2

cp "$work/build/bin/llama-server" "$binary.tmp"
printf '%s\n' "$cmake_args" > "$out_dir/CMAKE_ARGS"
mv "$binary.tmp" "$binary"
log "built $binary"
printf '%s\n' "$binary"
