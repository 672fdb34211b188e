#!/usr/bin/env bash
# Bounded fuzz runs: builds every fuzz/fuzz_*.cpp libFuzzer target with clang (library instrumented,
# ASan + UBSan, no MPI, no tests) in build-fuzz/, then runs each for SY_FUZZ_SECONDS (default 8) on a
# scratch copy of its seeds in fuzz/corpus/<target>/ (the repository's seeds are never modified).
# A crash leaves its input in fuzz-out/<target>/crash-* and fails the stage; turn it into a
# regression test (tests/unit/test_fuzz_regressions.cpp) and, once fixed, a seed.
# Usage: scripts/fuzz.sh [target...]   (default: every target)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
secs=${SY_FUZZ_SECONDS:-8}
jobs=${SY_JOBS:-2}
cc=${SY_FUZZ_CC:-clang-14}
cxx=${SY_FUZZ_CXX:-clang++-14}

targets=("$@")
if ((${#targets[@]} == 0)); then
  for f in fuzz/fuzz_*.cpp; do targets+=("$(basename "$f" .cpp)"); done
fi

start=$(date +%s)
CC=$cc CXX=$cxx cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSWITCHYARD_BUILD_FUZZ=ON \
  -DSWITCHYARD_SANITIZE=ON -DSWITCHYARD_WERROR=ON -DSWITCHYARD_MPI=OFF -DSWITCHYARD_BUILD_TESTS=OFF \
  -DSWITCHYARD_BUILD_BENCHMARKS=OFF -DSWITCHYARD_BUILD_PYTHON=OFF -DSWITCHYARD_BUILD_TOOLS=OFF \
  >build-fuzz-configure.log 2>&1 || { cat build-fuzz-configure.log; exit 1; }
cmake --build build-fuzz -j"$jobs" --target "${targets[@]}" || exit 1
echo "fuzz build: $(($(date +%s) - start)) s"

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
status=0
for t in "${targets[@]}"; do
  out=$root/fuzz-out/$t
  rm -rf "$out"; mkdir -p "$out/corpus"
  [ -d "fuzz/corpus/$t" ] && cp -r "fuzz/corpus/$t/." "$out/corpus/"
  # -rss_limit_mb / -malloc_limit_mb: a parser asked to allocate gigabytes by a few bytes of input is
  # a finding too. Seeds are run first, so a regression on a kept seed fails at once.
  dict=(); [ -f "fuzz/$t.dict" ] && dict=(-dict="$root/fuzz/$t.dict")
  if "$root"/build-fuzz/fuzz/"$t" "${dict[@]}" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
       -print_final_stats=1 -artifact_prefix="$out/" "$out/corpus" >"$out/log" 2>&1; then
    echo "fuzz $t: ok ($(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$out/log" | grep -o '[0-9]*$') runs)"
  else
    echo "fuzz $t: FAILED (see $out/log, input in $out/)"; tail -40 "$out/log"; status=1
  fi
done
echo "fuzz stage: $(($(date +%s) - start)) s"
exit $status
