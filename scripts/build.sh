#!/usr/bin/env bash
# Configures and builds switchyard in build/ (Release, warnings as errors), -j2.
# Usage: scripts/build.sh [cmake targets...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DSWITCHYARD_WERROR=ON \
      -DPython3_EXECUTABLE=/usr/bin/python3 >build-configure.log || { cat build-configure.log; exit 1; }
if (($#)); then
  cmake --build build -j2 --target "$@"
else
  cmake --build build -j2
fi
