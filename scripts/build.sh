#!/usr/bin/env bash
# Configures and builds switchyard in build/ (Release, warnings as errors), -j2, with the Python
# module built for the project's venv (scripts/env.sh; its folder is passed in, or made here).
# Usage: scripts/build.sh [cmake targets...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/toolchain.sh
venv=${SWITCHYARD_VENV:-$(bash scripts/env.sh)}
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DSWITCHYARD_WERROR=ON \
      -DPython3_EXECUTABLE="$venv/bin/python" \
      -Dpybind11_DIR="$("$venv/bin/python" -m pybind11 --cmakedir)" >build-configure.log ||
  { cat build-configure.log; exit 1; }
if (($#)); then
  cmake --build build -j"${SY_JOBS:-2}" --target "$@"
else
  cmake --build build -j"${SY_JOBS:-2}"
fi
