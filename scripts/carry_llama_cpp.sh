#!/usr/bin/env bash
# Build .gpu_carry/: what a lent GPU machine (no network) needs beside the repo to run
# scripts/gpu_check.sh. Run it here, where pip reaches the package index; then name
# .gpu_carry in the device call's `carry` list (docs/gpu.md).
#
#   .gpu_carry/llama-cpp-python/  the llama-cpp-python 0.3.36 sdist, stripped: the Python
#                                 package llama_cpp/ and vendor/llama.cpp without models,
#                                 docs, examples, tests, benches, the web UI's sources and
#                                 the ggml backends a CUDA build does not use
#   .gpu_carry/wheels/            pure-Python wheels the device image lacks: gguf (the
#                                 random-model writer) and diskcache (llama_cpp.llama
#                                 imports it); numpy, pyyaml, jinja2, pytest... are there
#   .gpu_carry/smollm2-tokenizer.gguf
#                                 SmolLM2's tokenizer without weights (~1.8 MB), for
#                                 scripts/make_random_model.py --tokenizer-from (SmolLM2
#                                 itself, 93 MB, does not fit); needs $PYTHON to have
#                                 gguf, llamax and the default model (bootstrap's venv)
#   .gpu_carry/SIZES              the measured sizes
#
# The sdist is 76.6 MB packed and ~180 MB unpacked; the carry must stay well under the
# 64 MiB a device call sends (repo included). Idempotent: an existing .gpu_carry is kept
# unless --force is given.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
llama_version=0.3.36
carry=$repo/.gpu_carry

log() { printf '[carry] %s\n' "$*" >&2; }

if [ "${1:-}" = --force ]; then
  rm -rf "$carry"
fi
if [ -f "$carry/SIZES" ]; then
  cat "$carry/SIZES"
  exit 0
fi

# git ignores the carry (it is not part of the project) through a .gitignore of its own,
# so neither the repo's .gitignore nor .git/info/exclude (shared by every worktree) changes;
# the device tool sends ignored paths only when a call names them in `carry`
mkdir -p "$carry"
printf '*\n' >"$carry/.gitignore"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log "downloading the llama-cpp-python $llama_version sdist (76.6 MB)"
"$python" -m pip --disable-pip-version-check download --quiet --no-binary :all: --no-deps \
  "llama-cpp-python==$llama_version" -d "$work/sdist"
tar -xzf "$work"/sdist/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*)
lcpp=$src/vendor/llama.cpp
[ -f "$lcpp/CMakeLists.txt" ] || { log "no vendor/llama.cpp in the sdist"; exit 1; }

log "stripping"
# the sdist ships a 40 MB .git of llama-cpp-python; no .git*, no CI anywhere
find "$src" -name '.git*' -prune -exec rm -rf {} +
# the sdist around the package: keep llama_cpp/, vendor/, the build files and the license
rm -rf "$src"/{docs,examples,tests,docker,scripts,.github,mkdocs.yml,Makefile,CHANGELOG.md,CONTRIBUTING.md}
# llama.cpp: no models (vocab files), docs, examples, tests, benches, CI, converters
rm -rf "$lcpp"/{models,docs,examples,tests,benches,media,gguf-py,pocs,skills,ci,conversion,requirements}
rm -rf "$lcpp"/{.github,.devops,convert_*.py,requirements.txt,flake.nix,build-xcframework.sh}
# scripts/: CMake includes only ui-assets.cmake (the web UI) and build-info.sh
find "$lcpp/scripts" -mindepth 1 -maxdepth 1 ! -name ui-assets.cmake ! -name build-info.sh \
  -exec rm -rf {} +
# the web UI's sources (its CMake stays: with LLAMA_BUILD_UI=OFF and
# LLAMA_USE_PREBUILT_UI=OFF it embeds no assets; llama-server still answers the API)
rm -rf "$lcpp"/tools/ui/{src,tests,package-lock.json,static}
# ggml backends: CMake adds a backend's folder only when GGML_<NAME>=ON; keep CPU, CUDA,
# BLAS, RPC and Metal (the macOS build path of docs/install.md)
for backend in cann et hexagon hip musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do
  rm -rf "$lcpp/ggml/src/ggml-$backend"
done

mv "$src" "$carry/llama-cpp-python"

log "downloading wheels for the device (Python 3.12, manylinux x86_64)"
"$python" -m pip --disable-pip-version-check download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$carry/wheels" "gguf==${GGUF_VERSION:-0.19.0}" "diskcache==5.6.3"

log "writing SmolLM2's tokenizer (no weights)"
PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} "$python" "$repo/scripts/make_random_model.py" \
  "$carry/smollm2-tokenizer.gguf" --tokenizer-only >&2

{
  printf 'llama-cpp-python (stripped) %s bytes\n' "$(du -sb "$carry/llama-cpp-python" | cut -f1)"
  printf 'wheels %s bytes\n' "$(du -sb "$carry/wheels" | cut -f1)"
  printf 'carry total %s bytes\n' "$(du -sb "$carry" | cut -f1)"
  printf 'repo tracked files %s bytes\n' \
    "$(git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 du -cb 2>/dev/null) | tail -1 | cut -f1)"
} | tee "$carry/SIZES"
