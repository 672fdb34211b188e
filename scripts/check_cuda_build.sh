#!/usr/bin/env bash
# The CUDA build compiles and links: configures build-cuda/ with -DSWITCHYARD_CUDA=ON (nvcc with
# the build's g++ as host compiler, warnings as errors), builds the library and the device unit
# test, and runs that test, which needs no GPU (without one it checks that CUDA allocation fails
# with the runtime's named error and that every op says it has no CUDA kernel yet; with one it
# also round-trips memory through the device). Skips with a message, successfully, where nvcc is
# not installed. Usage: scripts/check_cuda_build.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/toolchain.sh
nvcc=${CUDACXX:-$(command -v nvcc || true)}
[ -n "$nvcc" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || nvcc=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc" ]; then
  echo "[cuda-build] skipped: no nvcc (not on PATH, no CUDACXX, no /usr/local/cuda/bin/nvcc)"
  exit 0
fi
if [ -n "${CMAKE_CXX_COMPILER_LAUNCHER:-}" ]; then export CMAKE_CUDA_COMPILER_LAUNCHER=ccache; fi
start=$SECONDS
mkdir -p build-cuda
log=build-cuda/configure.log
cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DSWITCHYARD_CUDA=ON \
      -DCMAKE_CUDA_COMPILER="$nvcc" -DSWITCHYARD_WERROR=ON -DSWITCHYARD_BUILD_PYTHON=OFF \
      -DSWITCHYARD_BUILD_BENCHMARKS=OFF -DSWITCHYARD_BUILD_TOOLS=OFF >"$log" ||
  { cat "$log"; exit 1; }
cmake --build build-cuda -j"${SY_JOBS:-2}" --target switchyard test_device
build-cuda/tests/test_device --gtest_brief=1
echo "[cuda-build] $("$nvcc" --version | tail -1 | sed 's/^Build //'), host $(c++ --version | head -1):" \
     "library and test_device built against cudart, test passed, $((SECONDS - start)) s"
