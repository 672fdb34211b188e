#!/usr/bin/env bash
# The test command: installs what is missing, builds everything and runs every test
# (unit, MPI at 1-4 ranks, Python), then the sanitizer build and the bounded fuzz runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/deps.sh
bash scripts/build.sh
cd build
ctest --output-on-failure -j2 --timeout 900
