#!/usr/bin/env bash
# Print the CMake flags that build llama.cpp safely for this CPU, on one line.
#
# ggml's native x86 build (GGML_NATIVE=ON) enables the AMX matmul path, which segfaults on
# CPUs (notably VMs) that advertise AMX without usable tile state, and a hard-coded SIMD
# flag the CPU lacks (e.g. -DGGML_AVX_VNNI=ON on an AMD CPU) dies with SIGILL. So on Linux
# x86_64 we build with GGML_NATIVE=OFF and turn on exactly the SIMD extensions that
# /proc/cpuinfo reports, never AMX. Elsewhere we print nothing (ggml's defaults apply).
#
# Used by scripts/bootstrap.sh (llama-cpp-python wheel) and benchmarks/peers.sh
# (llama-server). The output is part of bootstrap's wheel key: keep it stable.
set -euo pipefail

cmake_args=""
if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ] && [ -r /proc/cpuinfo ]; then
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  cmake_args="-DGGML_NATIVE=OFF"
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512_vnni:AVX512_VNNI \
              avx512_bf16:AVX512_BF16 avx512vbmi:AVX512_VBMI avx_vnni:AVX_VNNI; do
    case "$flags" in *" ${pair%%:*} "*) cmake_args="$cmake_args -DGGML_${pair#*:}=ON" ;; esac
  done
fi
printf '%s\n' "$cmake_args"
