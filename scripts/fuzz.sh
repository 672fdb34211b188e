#!/usr/bin/env bash
# Bounded libFuzzer runs of the route file reader and the importers (clang, ASan + UBSan).
# Usage: scripts/fuzz.sh [seconds per target, default $SY_FUZZ_SECONDS or 10]. Runs every
# fuzz/fuzz_*.cpp target (with fuzz/<target>.dict and fuzz/<target>.options when there are).
# Exits nonzero when a target finds a crash (the reproducer is left in
# build-fuzz/findings/<target>/). Paths are absolute: a target may chdir (fuzz_cli_args works in
# its own temporary directory).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
secs=${1:-${SY_FUZZ_SECONDS:-10}}
mkdir -p build-fuzz
targets=()
for f in fuzz/fuzz_*.cpp; do targets+=("$(basename "$f" .cpp)"); done
# SY_FUZZ_BUILD_DIR: a clang build configured with -DSWITCHYARD_BUILD_FUZZ=ON elsewhere (test.sh's
# sanitizer build) whose targets are used; otherwise build-fuzz/ is configured and built here.
bdir=${SY_FUZZ_BUILD_DIR:-build-fuzz}
if [ "$bdir" = build-fuzz ]; then
  mkdir -p build-fuzz
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DSWITCHYARD_BUILD_FUZZ=ON -DSWITCHYARD_BUILD_TESTS=OFF -DSWITCHYARD_BUILD_BENCHMARKS=OFF \
    -DSWITCHYARD_BUILD_PYTHON=OFF -DSWITCHYARD_BUILD_TOOLS=ON >build-fuzz/configure.log \
    || { cat build-fuzz/configure.log; exit 1; }
fi
cmake --build "$bdir" -j2 --target "${targets[@]}"
bdir=$(cd "$bdir" && pwd)
status=0
for t in "${targets[@]}"; do
  work="$root/build-fuzz/corpus/$t"       # new inputs go here; the committed seeds stay untouched
  findings="$root/build-fuzz/findings/$t"
  dict=(); [ -f "fuzz/$t.dict" ] && dict=(-dict="$root/fuzz/$t.dict")
  # fuzz/<target>.options: extra libFuzzer flags of one target (fuzz_route_sizes: a malloc cap).
  opts=(); [ -f "fuzz/$t.options" ] && read -r -a opts <"fuzz/$t.options"
  mkdir -p "$work" "$findings"
  echo "[fuzz] $t for ${secs}s"
  # allocator_may_return_null: an allocation the machine cannot hold fails as it does without
  # ASan (std::bad_alloc, which the CLI reports), instead of aborting.
  if ! ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 \
       "$bdir/fuzz/$t" "${dict[@]}" "${opts[@]}" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
       -artifact_prefix="$findings/" -print_final_stats=1 "$work" "$root/fuzz/corpus/$t" \
       >"build-fuzz/$t.log" 2>&1; then
    echo "[fuzz] $t FOUND A PROBLEM (log: build-fuzz/$t.log, reproducer in $findings/)"
    tail -40 "build-fuzz/$t.log"
    status=1
  else
    grep -E "stat::number_of_executed_units|Done" "build-fuzz/$t.log" | tail -2 || true
  fi
done
exit $status
