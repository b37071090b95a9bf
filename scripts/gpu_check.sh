#!/usr/bin/env bash
# Build llama.cpp for CUDA from the source llama-cpp-python 0.3.36 vendors, run the GPU test
# tier and the GPU benchmark: on a lent GPU machine (no network), from the repo's root, with
# .gpu_carry carried (scripts/carry_llama_cpp.sh makes it; docs/gpu.md has the calls).
#
#   bash scripts/gpu_check.sh [--cpu] [probe] [build] [models] [test] [bench] [bench-quick]
#
# Phases (default: build models test bench), in the order given:
#   probe        what the machine has: GPU, nvcc, cuBLAS, Python packages
#   build        cmake + ninja, targets llama and llama-server, every core, into
#                $LLAMAX_GPU_BUILD (default: .gpu_carry/build when scripts/build_cuda_carry.sh
#                made it here and it was carried, else /tmp/llamax-gpu-build); skipped when
#                libllama.so and llama-server are already there
#   models       scripts/make_random_model.py: tiny, 1b (F16) and 8b (Q8_0) into /tmp
#   diag         the tiny model loaded and run on the GPU in Python (cuda-gdb's stack on a
#                crash), into diag.log
#   save         the build's bin/ as bin.tar.xz.aa, .ab... (15 MB parts) under $OUT
#   test         pytest -m gpu on the random 1b, then on tiny (on a CPU: small, then tiny)
#   bench        benchmarks/gpu_throughput.py on 1b and tiny (LLAMAX_GPU_BENCH_SHAPES), llama-server
#                of this build; greedy unless LLAMAX_GPU_BENCH_MODES names more
#                ("greedy sampled sampled_penalty": about three times as long); each
#                result also as a share of the device's bandwidth bound
#                (LLAMAX_GPU_PEAK_GBS, else an H200's or H100's); each system with and
#                without backend sampling (LLAMAX_GPU_BENCH_BS: off, on, both, the default)
#   bench-8b     the same on 8b (128,256-token vocabulary; written first), its own report
#   bench-quick  the same as bench at N = 1 and 16, 32 tokens each (a smoke run)
# --cpu builds without CUDA (a dry run of every phase on a machine without a GPU).
#
# Everything the phases write comes back under $OUT (at most 8 files): build.log,
# pytest.log, junit.xml, junit_tiny.xml, gpu_throughput.json, gpu_throughput_8b.json,
# bench.log, probe.txt, summary.txt.
#
# llama-cpp-python's Python package is used from the carry (PYTHONPATH), its ctypes loader
# pointed at this build's libllama.so by LLAMA_CPP_LIB_PATH (llama_cpp/llama_cpp.py: it
# loads "$LLAMA_CPP_LIB_PATH/libllama.so"; libggml*.so come by the library's RUNPATH, and
# LD_LIBRARY_PATH names the same folder), so llamax and llama-server run the same build.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
carry=$repo/.gpu_carry
src=$carry/llama-cpp-python/vendor/llama.cpp
out=${OUT:-/tmp/llamax-gpu-out}
mkdir -p "$out"
models=${LLAMAX_GPU_MODELS:-/tmp/llamax-gpu-models}
python=${PYTHON:-python3}
cuda=ON
phases=()
for arg in "$@"; do
  case "$arg" in
    --cpu) cuda=OFF ;;
    probe | build | models | diag | save | test | bench | bench-8b | bench-quick) phases+=("$arg") ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
[ ${#phases[@]} -gt 0 ] || phases=(build models test bench)
if [ "$cuda" = ON ]; then
  # a build made beforehand without a GPU (scripts/build_cuda_carry.sh) and carried, if any
  if [ -f "$carry/build/bin/libllama.so" ]; then
    build=${LLAMAX_GPU_BUILD:-$carry/build}
  else
    build=${LLAMAX_GPU_BUILD:-/tmp/llamax-gpu-build}
  fi
else
  build=${LLAMAX_GPU_BUILD:-/tmp/llamax-cpu-build}
fi
lib_dir=$build/bin
# the shapes the bench phase runs on a GPU, in order (a short device session: "1b")
bench_shapes=${LLAMAX_GPU_BENCH_SHAPES:-1b tiny}
bench_modes=${LLAMAX_GPU_BENCH_MODES:-greedy}
# llamax's backend_sampling and llama-server's --backend-sampling: off, on or both
bench_bs=${LLAMAX_GPU_BENCH_BS:-both}
jobs=$(nproc 2>/dev/null || echo 2)

log() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$out/summary.txt" >&2; }

setup_python() {
  # the carry's wheels (gguf, diskcache) and llama_cpp package; pip needs no network here
  local site=/tmp/llamax-gpu-site
  if [ ! -d "$site/gguf" ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$carry"/wheels/*.whl || exit 1
  fi
  export PYTHONPATH=$repo:$repo/benchmarks:$carry/llama-cpp-python:$site${PYTHONPATH:+:$PYTHONPATH}
  export LLAMA_CPP_LIB_PATH=$lib_dir
  export LD_LIBRARY_PATH=$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  [ "$cuda" = ON ] && cuda_runtime_path
  export PYTHONUNBUFFERED=1
  # CPU threads of llamax, the raw loop and llama-server alike (benchmarks/_common.py)
  if [ "$cuda" = ON ]; then
    export LLAMAX_BENCH_THREADS=${LLAMAX_BENCH_THREADS:-8}
  else
    export LLAMAX_BENCH_THREADS=${LLAMAX_BENCH_THREADS:-2}
  fi
}

cuda_runtime_path() {
  # a build made elsewhere (build_cuda_carry.sh) loads the CUDA 13 runtime and cuBLAS from
  # this machine: the toolkit's folders, else the pip packages PyTorch brings
  local name found
  for name in libcudart.so.13 libcublas.so.13 libcublasLt.so.13; do
    found=$(find /usr/local /opt /usr/lib -name "$name" 2>/dev/null | sort | head -1)
    if [ -n "$found" ]; then
      case ":$LD_LIBRARY_PATH:" in
        *":$(dirname "$found"):"*) ;;
        *) export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$found") ;;
      esac
    else
      log "setup: no $name on this machine"
    fi
  done
}

cuda_fallbacks() {
  # Images whose CUDA toolkit has nvcc but no cuBLAS or no libcuda stub (this workplace's
  # CPU machines have such a toolkit): take cuBLAS and its headers from wherever they are
  # (PyTorch's pip packages), and libcuda from the driver's folders.
  local toolkit lib inc drv libdir
  toolkit=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  local -a roots=("$toolkit" /usr/local/cuda /usr/local/cuda-*)
  if ! ls "${roots[@]/%//lib64/libcublas.so}" "${roots[@]/%//targets/x86_64-linux/lib/libcublas.so}" \
    >/dev/null 2>&1; then
    lib=$(find / -xdev -name 'libcublas.so*' -not -path '/proc/*' 2>/dev/null | sort | head -1)
    inc=$(find / -xdev -name cublas_v2.h -not -path '/proc/*' 2>/dev/null | head -1)
    log "build: no cuBLAS in ${roots[*]}; using $lib and $inc"
    [ -n "$lib" ] && [ -n "$inc" ] || { log "build: no cuBLAS anywhere"; exit 1; }
    libdir=$(dirname "$lib")
    cmake_extra+=(
      "-DCUDA_cublas_LIBRARY=$lib"
      "-DCUDA_cublasLt_LIBRARY=$(ls "$libdir"/libcublasLt.so* | head -1)"
      "-DCMAKE_CUDA_FLAGS=-I$(dirname "$inc")"
      "-DCMAKE_CXX_FLAGS=-I$(dirname "$inc")"
    )
    export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  if ! ls "${roots[@]/%//lib64/stubs/libcuda.so}" \
    "${roots[@]/%//targets/x86_64-linux/lib/stubs/libcuda.so}" >/dev/null 2>&1; then
    drv=$(find /usr/local/nvidia /usr/lib /usr/lib64 -name 'libcuda.so*' 2>/dev/null | sort | head -1)
    log "build: no libcuda stub in ${roots[*]}; using ${drv:-none (GGML_CUDA_NO_VMM=ON)}"
    if [ -n "$drv" ]; then
      cmake_extra+=("-DCUDA_cuda_driver_LIBRARY=$drv")
    else
      cmake_extra+=(-DGGML_CUDA_NO_VMM=ON)
    fi
  fi
}

peak_gbs() {
  # the device's memory bandwidth bound in GB/s (the report's share of it): as
  # LLAMAX_GPU_PEAK_GBS says, else for the devices we know, else none
  if [ -n "${LLAMAX_GPU_PEAK_GBS:-}" ]; then
    echo "$LLAMAX_GPU_PEAK_GBS"
    return
  fi
  local name
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case "$name" in
    *H200*) echo 4800 ;;
    *H100*PCIe*) echo 2000 ;;
    *H100*) echo 3350 ;;
  esac
}

phase_probe() {
  {
    nvidia-smi || true
    grep -m1 '^model name' /proc/cpuinfo
    grep -m1 '^flags' /proc/cpuinfo | grep -oE 'avx512[a-z_0-9]*|amx[a-z_0-9]*|avx2' | sort -u | xargs
    command -v nvcc && nvcc --version
    cmake --version | head -1
    ninja --version
    "$python" --version
    find / -xdev \( -name 'libcublas.so*' -o -name cublas_v2.h \) 2>/dev/null | head
    "$python" -m pip list 2>/dev/null | grep -iE '^(numpy|jinja2|pytest|pyyaml|typing.ext|hypothesis) '
    df -h /tmp
  } >"$out/probe.txt" 2>&1
  cat "$out/probe.txt"
}

check_libstdcxx() {
  # each library should load the one shared libstdc++, or keep a static copy to itself
  local lib
  for lib in "$lib_dir"/libllama.so "$lib_dir"/libggml*.so; do
    if ! readelf -d "$lib" | grep -q 'libstdc++' \
      && nm -D --defined-only "$lib" | grep -q '_ZNKSt.*codecvt'; then
      log "build: WARNING: $(basename "$lib") exports a static libstdc++ (expect crashes)"
    fi
  done
}

phase_build() {
  if [ -f "$lib_dir/libllama.so" ] && [ -x "$lib_dir/llama-server" ]; then
    log "build: $build is there, skipped"
    return
  fi
  [ -f "$src/CMakeLists.txt" ] || { log "no $src: carry .gpu_carry"; exit 1; }
  local -a cmake_extra=()
  if [ "$cuda" = ON ]; then
    cmake_extra+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
    # the CPU part as bootstrap builds it: this CPU's SIMD flags, never -march=native (a
    # native build turns on ggml's AMX path, which crashes where AMX is advertised but
    # unusable; the first device run's native build segfaulted at model load)
    # shellcheck disable=SC2207  # a list of flags
    cmake_extra+=($(bash "$repo/scripts/cmake_flags.sh"))
    # The device image's default compiler (/opt/gcc/bin/g++) links libstdc++ statically into
    # every library and exports it: libllama's std::regex then ran on libggml-cuda's copy of
    # the locale facets and segfaulted at the first tokenization (the second device run,
    # cuda-gdb's stack in docs/gpu.md). The system's g++ links the one shared libstdc++; the
    # linker flag keeps any static copy private to its library.
    if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then
      cmake_extra+=(-DCMAKE_C_COMPILER=/usr/bin/gcc -DCMAKE_CXX_COMPILER=/usr/bin/g++
        -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++)
    fi
    cmake_extra+=("-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL")
    cuda_fallbacks
  else
    # shellcheck disable=SC2207  # a list of flags
    cmake_extra+=($(bash "$repo/scripts/cmake_flags.sh"))
  fi
  log "build: configuring (GGML_CUDA=$cuda) into $build"
  local start=$SECONDS
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CCACHE=OFF \
    "${cmake_extra[@]}" >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  log "build: ninja -j$jobs llama llama-server"
  cmake --build "$build" --target llama llama-server --parallel "$jobs" >>"$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; exit 1; }
  log "build: done in $((SECONDS - start)) s: $(cd "$lib_dir" && ls libllama.so libggml*.so llama-server | xargs)"
  check_libstdcxx
}

phase_models() {
  # the shapes named (default: all a run of this kind uses); each written once
  mkdir -p "$models"
  local shapes=("$@")
  if [ ${#shapes[@]} -eq 0 ]; then
    shapes=(tiny 1b 8b)
    [ "$cuda" = OFF ] && shapes=(tiny small)
  fi
  for shape in "${shapes[@]}"; do
    if [ ! -f "$models/$shape.gguf" ]; then
      local start=$SECONDS
      # the 8B with Llama 3's vocabulary width (issue 62: reading and sampling a row costs
      # with its width)
      local -a vocab=()
      [ "$shape" = 8b ] && vocab=(--n-vocab 128256)
      # a file cut short by a call's time limit must not pass for a model next time
      "$python" scripts/make_random_model.py "$models/$shape.gguf.part" --shape "$shape" \
        "${vocab[@]}" --tokenizer-from "$carry/smollm2-tokenizer.gguf" >&2 || exit 1
      mv "$models/$shape.gguf.part" "$models/$shape.gguf"
      log "models: $shape.gguf $(du -h "$models/$shape.gguf" | cut -f1) in $((SECONDS - start)) s"
    fi
  done
}

phase_test() {
  # the tier on each model named (default: the random 1b; on a CPU the small one): the
  # first shape's junit goes to junit.xml, the others' to junit_SHAPE.xml
  local -a env_extra=()
  [ "$cuda" = OFF ] && env_extra=(LLAMAX_GPU_TIER_ON_CPU=1)
  local shape junit first=1 rc
  for shape in "$@"; do
    junit=$out/junit.xml
    [ $first = 1 ] || junit=$out/junit_$shape.xml
    log "test: pytest -m gpu on $models/$shape.gguf"
    # a hung run must not eat the session's device time (exit 124)
    timeout "${LLAMAX_GPU_TEST_TIMEOUT:-300}" \
      env "${env_extra[@]}" LLAMAX_GPU_MODEL="$models/$shape.gguf" "$python" -m pytest -m gpu \
      tests/test_gpu.py -q -rs -s -p no:cacheprovider --junitxml="$junit" -o addopts="" \
      >>"$out/pytest.log" 2>&1
    rc=$?
    tail -15 "$out/pytest.log"
    log "test: $shape: pytest exit $rc"
    first=0
  done
}

phase_diag() {
  # load the tiny model on the GPU in Python; on a crash, the native stack (cuda-gdb)
  local script="import faulthandler, sys; faulthandler.enable(); import llamax
with llamax.Context(sys.argv[1], n_gpu_layers=-1, n_ctx=256) as ctx:
    print('diag: generated', repr(ctx.add_request('Hello', llamax.SamplingParams(max_tokens=8, temperature=0)).result().text))"
  if "$python" -c "$script" "$models/tiny.gguf" >>"$out/diag.log" 2>&1; then
    log "diag: the tiny model loads and generates on the GPU"
  else
    log "diag: crashed; the native stack follows in diag.log"
    timeout 120 cuda-gdb -batch -ex run -ex bt --args "$python" -c "$script" "$models/tiny.gguf" \
      >>"$out/diag.log" 2>&1
  fi
  tail -30 "$out/diag.log"
}

phase_save() {
  # the build's bin/ back through $OUT (files of at most 15 MB), for a later carry
  tar -C "$build" -cf - bin | xz -T0 -6 | split -b 15m - "$out/bin.tar.xz."
  log "save: $(du -ch "$out"/bin.tar.xz.* | tail -1 | cut -f1) in $(ls "$out"/bin.tar.xz.* | wc -l) parts"
}

phase_bench() {
  # $1: quick (1) or not; $2: the report's file name; the rest: the shapes, in order
  local quick=$1 report=$2
  shift 2
  local -a args=(--llama-server "$lib_dir/llama-server" --json-out "$out/$report")
  # shellcheck disable=SC2206  # the modes are words
  args+=(--modes $bench_modes --backend-sampling "$bench_bs")
  local shape
  if [ "$cuda" = OFF ]; then
    args+=(--quick --cpu)
  elif [ "$quick" = 1 ]; then
    args+=(--quick)
  fi
  local peak
  peak=$(peak_gbs)
  [ -z "$peak" ] || args+=(--peak-gbs "$peak")
  # the report is rewritten after each shape: a run cut short keeps the shapes it finished
  for shape in "$@"; do
    args+=(--shape "$shape=$models/$shape.gguf")
  done
  log "bench: benchmarks/gpu_throughput.py ${args[*]}"
  "$python" benchmarks/gpu_throughput.py "${args[@]}" >/dev/null 2>>"$out/bench.log"
  local rc=$?
  tail -25 "$out/bench.log"
  log "bench: exit $rc"
}

setup_python
log "phases: ${phases[*]} (GGML_CUDA=$cuda, build $build, $jobs cores)"
for phase in "${phases[@]}"; do
  case "$phase" in
    probe) phase_probe ;;
    build) phase_build ;;
    models) phase_models ;;
    diag) phase_models tiny && phase_diag ;;
    save) phase_save ;;
    test) if [ "$cuda" = ON ]; then phase_models 1b tiny && phase_test 1b tiny; else
      phase_models small tiny && phase_test small tiny; fi ;;
    bench) if [ "$cuda" = ON ]; then
      # shellcheck disable=SC2086  # a list of shapes
      phase_models $bench_shapes && phase_bench 0 gpu_throughput.json $bench_shapes
      else phase_models tiny && phase_bench 0 gpu_throughput.json tiny; fi ;;
    bench-8b) phase_models 8b && phase_bench 0 gpu_throughput_8b.json 8b ;;
    bench-quick) phase_models 1b tiny && phase_bench 1 gpu_throughput.json 1b tiny ;;
  esac
done
