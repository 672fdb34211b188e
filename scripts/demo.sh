#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs `switchyard demo` on its embedded default.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/deps.sh
bash scripts/build.sh switchyard_cli
./build/tools/switchyard demo "$@"
