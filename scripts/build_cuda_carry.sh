#!/usr/bin/env bash
# Build llama.cpp for CUDA (sm_90: H100/H200) HERE, on a machine without a GPU, into
# .gpu_carry/build, so a lent GPU machine spends none of its short device time compiling.
#
#   PYTHON=.venv/bin/python bash scripts/build_cuda_carry.sh [--jobs N]
#
# Needs: nvcc (CUDA 13, the device image's version), CMake, ninja, network to the package
# index (once), and .gpu_carry/ (scripts/carry_llama_cpp.sh). What this machine lacks and
# how it is made up for:
#   - cuBLAS and its headers: the `nvidia-cublas` 13.0 and `nvidia-cuda-runtime` wheels
#     from the package index, unpacked into $LLAMAX_CUDA_WHEELS (default /tmp/llamax-cuda);
#     linked against here, loaded there from the device image's own CUDA 13 libraries
#     (gpu_check.sh puts their folders on LD_LIBRARY_PATH);
#   - libcuda.so (the driver, whose stub the toolkit here does not ship): a stub library
#     with the soname libcuda.so.1 and no symbols, so the ggml-cuda library links with its
#     driver symbols left for the real driver to supply at load time (llama-server links
#     with --allow-shlib-undefined for the same reason).
# The CPU part of the build is portable x86-64 (AVX2, FMA, F16C; no -march=native): the
# device's processor is not this one.
#
# The result: .gpu_carry/build/bin with libllama.so, libggml*.so, libmtmd.so and
# llama-server, stripped. gpu_check.sh uses it when it is there (no build phase on the
# device); name .gpu_carry/build/bin in the device call's carry (docs/gpu.md).
# Measured on this workplace's 2-core machine (beside other work): see docs/gpu.md.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
carry=$repo/.gpu_carry
src=$carry/llama-cpp-python/vendor/llama.cpp
build=$carry/build
wheels=${LLAMAX_CUDA_WHEELS:-/tmp/llamax-cuda}
jobs=$(nproc 2>/dev/null || echo 2)
[ "${1:-}" = --jobs ] && jobs=$2

log() { printf '[build_cuda_carry %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

[ -f "$src/CMakeLists.txt" ] || { log "no $src: run scripts/carry_llama_cpp.sh first"; exit 1; }
command -v nvcc >/dev/null || { log "no nvcc on PATH"; exit 1; }

cu=$wheels/nvidia/cu13
if [ ! -f "$cu/lib/libcublas.so.13" ]; then
  log "downloading cuBLAS 13.0 and the CUDA 13.0 runtime wheels (~420 MB)"
  mkdir -p "$wheels"
  "$python" -m pip --disable-pip-version-check download --quiet --no-deps --only-binary=:all: \
    'nvidia-cublas==13.0.*' 'nvidia-cuda-runtime==13.0.*' -d "$wheels"
  for wheel in "$wheels"/*.whl; do
    "$python" -m zipfile -e "$wheel" "$wheels"
  done
  for lib in cublas cublasLt cudart; do
    ln -sf "lib$lib.so.13" "$cu/lib/lib$lib.so"
  done
fi
stub=$wheels/stub
if [ ! -f "$stub/libcuda.so" ]; then
  mkdir -p "$stub"
  printf 'void llamax_libcuda_stub(void) {}\n' >"$stub/stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so" "$stub/stub.c"
fi

if [ ! -f "$build/build.ninja" ]; then
  log "configuring into $build"
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CCACHE=OFF \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    "-DCUDA_cublas_LIBRARY=$cu/lib/libcublas.so.13" \
    "-DCUDA_cublasLt_LIBRARY=$cu/lib/libcublasLt.so.13" \
    "-DCMAKE_CUDA_FLAGS=-I$cu/include" "-DCMAKE_CXX_FLAGS=-I$cu/include" \
    "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined" \
    "-DCUDA_cuda_driver_LIBRARY=$stub/libcuda.so" >"$build.configure.log" 2>&1 \
    || { tail -30 "$build.configure.log"; exit 1; }
fi
start=$SECONDS
log "building llama, mtmd and llama-server with $jobs jobs"
cmake --build "$build" --target llama mtmd llama-server --parallel "$jobs"
strip --strip-unneeded "$build"/bin/*.so "$build/bin/llama-server"
log "done in $((SECONDS - start)) s: $(du -sh "$build/bin" | cut -f1) in $build/bin"
ls -la "$build/bin"
