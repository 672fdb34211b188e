#!/usr/bin/env bash
# The C++ package works for a downstream project: `cmake --install` of build/ into a temporary
# prefix, then tests/package (find_package(switchyard) + switchyard::switchyard) is configured,
# built and run against it. Needs a configured and built build/ (scripts/build.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$root/build" --prefix "$work/prefix" >"$work/install.log"
test -f "$work/prefix/lib/cmake/switchyard/switchyardConfig.cmake"
test -x "$work/prefix/bin/switchyard"
cmake -S "$root/tests/package" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release >"$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer" -j"${SY_JOBS:-2}" >"$work/build.log" || { cat "$work/build.log"; exit 1; }
"$work/consumer/consumer"
"$work/prefix/bin/switchyard" --help >/dev/null
echo "[cmake-package] find_package(switchyard) consumer built and ran against the installed tree"
